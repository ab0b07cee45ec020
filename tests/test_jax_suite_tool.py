"""Pure logic of tools/jax_suite.py: no JAX test suite is run here."""

import json
import os
import sys
import tomllib

import pytest

sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(
    os.path.abspath(__file__))), "tools"))
import jax_suite as js  # noqa: E402


JUNIT = """<?xml version="1.0" encoding="utf-8"?>
<testsuites><testsuite name="pytest" errors="1" failures="2" skipped="1" tests="6">
 <testcase classname="custom_api_test.CustomVJPTest" name="test_ok" time="0.1"/>
 <testcase classname="custom_api_test.CustomVJPTest" name="test_bad" time="0.1">
  <failure message="AssertionError: 1 != 2&#10;second line">long traceback</failure>
 </testcase>
 <testcase classname="custom_api_test.CustomVJPTest" name="test_nomsg" time="0.1">
  <failure message="">

E   KeyError: 'call_jaxpr'
more</failure>
 </testcase>
 <testcase classname="custom_api_test.CustomVJP3Test" name="test_err" time="0.1">
  <error message="failed on setup with &quot;boom&quot;">tb</error>
 </testcase>
 <testcase classname="custom_api_test.CustomVmapTest" name="test_skip" time="0.0">
  <skipped type="pytest.skip" message="TODO">skip</skipped>
 </testcase>
 <testcase classname="" name="custom_api_test" time="0.0">
  <error message="collection failure">ImportError</error>
 </testcase>
</testsuite></testsuites>
"""


def test_parse_junit(tmp_path):
  path = tmp_path / "r.xml"
  path.write_text(JUNIT)
  for source in (str(path), JUNIT):
    r = js.parse_junit(source)
    assert r["CustomVJPTest::test_ok"] == {"outcome": "passed", "message": ""}
    assert r["CustomVJPTest::test_bad"] == {
        "outcome": "failed", "message": "AssertionError: 1 != 2"}
    assert r["CustomVJPTest::test_nomsg"]["message"] == "E   KeyError: 'call_jaxpr'"
    assert r["CustomVJP3Test::test_err"]["outcome"] == "error"
    assert r["CustomVmapTest::test_skip"]["outcome"] == "skipped"
    assert r["custom_api_test"]["outcome"] == "error"
    assert js.counts(r) == {"passed": 1, "failed": 2, "error": 2, "skipped": 1}


def test_pass_problem_sees_collection_errors(tmp_path):
  log = tmp_path / "log"
  log.write_text("ok\n")
  run = {"returncode": 1, "log": str(log), "results": js.parse_junit(JUNIT)}
  assert "collection failure" in js.pass_problem(run)
  run["results"].pop("custom_api_test")
  assert js.pass_problem(run) is None
  log.write_text("line\nImportError: no module\n")
  run["returncode"] = 4
  assert "ImportError: no module" in js.pass_problem(run)


@pytest.mark.parametrize("version,tag", [
    ("0.10.0", "jax-v0.10.2"), ("0.10.2", "jax-v0.10.2"),
    ("0.11.2", "jax-v0.11.0"), ("0.12.0.1", "jax-main-2026-08-08"),
    ("0.12.1.dev20260801", "jax-main-2026-08-08"),
])
def test_pick_tag(version, tag):
  assert js.pick_tag(version) == tag


def test_pick_tag_unknown():
  with pytest.raises(js.SuiteError, match="--file-tag"):
    js.pick_tag("0.9.1")


def test_version_tuple():
  assert js.version_tuple("0.12.0.1") == (0, 12, 0, 1)
  assert js.version_tuple("0.12.1.dev2026") == (0, 12, 1)
  assert js.version_tuple("0.11.0rc1") == (0, 11, 0)


def _entry(pattern, jax=()):
  return js.Expected(pattern, "a", "why", tuple(jax))


def test_patterns():
  e = _entry("CustomVJP*Test::test_pretty_print")
  assert e.applies("CustomVJPTest::test_pretty_print", "0.10.2")
  assert e.applies("CustomVJP3Remat3Test::test_pretty_print", "0.10.2")
  assert not e.applies("CustomJVPTest::test_pretty_print", "0.10.2")
  assert not e.applies("CustomVJPTest::test_pretty_print_x", "0.10.2")
  full = _entry("custom_api_test.py::CustomVJPTest::test_dce")
  assert full.applies("CustomVJPTest::test_dce", "0.11.2")
  assert not full.applies("CustomVJP3Test::test_dce", "0.11.2")
  star = _entry("CustomVJPTest::test_jvp_error*")
  assert star.applies("CustomVJPTest::test_jvp_error_symbolic_zeros", "0.11.2")


def test_version_restriction():
  e = _entry("A::t", ["0.10", "0.11.2"])
  assert e.applies("A::t", "0.10.0") and e.applies("A::t", "0.10.2")
  assert e.applies("A::t", "0.11.2")
  assert not e.applies("A::t", "0.11.0")
  assert not e.applies("A::t", "0.12.0.1")
  assert not e.applies("A::t", "0.1")


def _results(**outcomes):
  return {k.replace("__", "::"): {"outcome": v, "message": f"msg {k}"}
          for k, v in outcomes.items()}


def test_classify():
  base = _results(A__ok="passed", A__exp="passed", A__bug="passed",
                  A__stale="passed", A__both="failed", A__gone="passed",
                  A__err="passed", A__skip="skipped")
  smart = _results(A__ok="passed", A__exp="failed", A__bug="failed",
                   A__stale="passed", A__both="failed", A__err="error",
                   A__skip="failed")
  expected = [_entry("A::exp"), _entry("A::stale"), _entry("A::old", ["0.9"]),
              _entry("A::unused")]
  comp = js.classify(base, smart, expected, "0.10.2")
  assert [t for t, _ in comp.expected] == ["A::exp"]
  assert comp.unexpected == [("A::bug", "msg A__bug"),
                             ("A::err", "msg A__err"),
                             ("A::gone", "not run in the SMART=1 pass")]
  assert [t for t, _ in comp.stale] == ["A::stale"]
  assert [e.pattern for e in comp.unused] == ["A::unused"]


def test_parse_expected_checks_entries():
  ok = {"expected": [{"pattern": "A::t", "category": "d", "reason": "r",
                      "jax": "0.10"}]}
  assert js.parse_expected(ok)[0].jax == ("0.10",)
  with pytest.raises(js.SuiteError, match="category"):
    js.parse_expected({"expected": [{"pattern": "A::t", "category": "z",
                                     "reason": "r"}]})
  with pytest.raises(js.SuiteError, match="needs"):
    js.parse_expected({"expected": [{"pattern": "A::t", "category": "a"}]})


def test_project_expectations_load():
  entries = js.load_expected()
  assert entries and all(e.category in js.CATEGORIES for e in entries)
  with open(js.EXPECTED_FILE, "rb") as fh:
    assert len(tomllib.load(fh)["expected"]) == len(entries)


def test_missing_peer_is_an_error(tmp_path, capsys):
  assert js.main(["--peer", str(tmp_path / "nope")]) == 2
  assert "peer folder not found" in capsys.readouterr().err
  (tmp_path / "conftest.py").write_text("")
  assert js.main(["--peer", str(tmp_path), "--file-tag", "jax-v0.10.2"]) == 2
  assert "test file not found" in capsys.readouterr().err


def test_write_json(tmp_path):
  base = _results(A__exp="passed", A__bug="passed")
  smart = _results(A__exp="failed", A__bug="failed")
  comp = js.classify(base, smart, [_entry("A::exp")], "0.10.2")
  runs = {"baseline": {"results": base, "returncode": 0, "wall_s": 1.0},
          "smart": {"results": smart, "returncode": 1, "wall_s": 2.0}}
  out = tmp_path / "o.json"
  js.write_json(str(out), runs, comp, "jax-v0.10.2", "0.10.2", {})
  doc = json.loads(out.read_text())
  assert doc["tests"]["A::exp"]["verdict"] == "expected"
  assert doc["tests"]["A::bug"]["verdict"] == "unexpected"
  assert doc["passes"]["smart"]["counts"]["failed"] == 2


# -- other JAX test files (--file, --tests-dir, --jax-repo, --uses) -----------

SOURCE = '''
import jax

class MutableArrayTest(object):
  def test_custom_vjp_ref(self):
    f = jax.custom_vjp(lambda x: x)

  def test_plain(self):
    pass

  def helper_custom_vjp(self):
    jax.custom_vjp

class Other(object):
  def test_uses_it_inside(self):
    @jax.custom_vjp
    def g(x):
      return x
'''


def test_tests_using():
  assert js.tests_using(SOURCE, "custom_vjp") == [
      ("MutableArrayTest", "test_custom_vjp_ref"),
      ("Other", "test_uses_it_inside")]
  assert js.tests_using(SOURCE, "nothing_like_it") == []


def test_selection_expr():
  tests = [("A", "test_x"), ("B", "test_y")]
  assert js.selection_expr(tests, None) == "(A and test_x) or (B and test_y)"
  assert js.selection_expr(tests, "not slow") == (
      "(not slow) and ((A and test_x) or (B and test_y))")
  with pytest.raises(js.SuiteError, match="--uses"):
    js.selection_expr([], None)


def test_expected_entries_belong_to_a_file():
  data = {"expected": [
      {"pattern": "A::t", "category": "d", "reason": "r"},
      {"pattern": "A::t", "category": "d", "reason": "r",
       "file": "mutable_array_test.py"},
      {"pattern": "api_test.py::TracebackTest::t", "category": "e",
       "reason": "r"}]}
  plain, mutable, api = js.parse_expected(data)
  assert plain.file == js.TEST_FILE and mutable.file == "mutable_array_test.py"
  assert api.file == "api_test.py"
  assert plain.applies("A::t", "0.12.0.1")
  assert not mutable.applies("A::t", "0.12.0.1")
  assert mutable.applies("A::t", "0.12.0.1", "mutable_array_test.py")
  assert api.applies("TracebackTest::t", "0.10.2", "api_test.py")
  with pytest.raises(js.SuiteError, match="names api_test.py"):
    js.parse_expected({"expected": [
        {"pattern": "api_test.py::A::t", "category": "a", "reason": "r",
         "file": "checkify_test.py"}]})


def test_classify_uses_only_the_file_s_entries():
  base = _results(A__t="passed", A__u="passed")
  smart = _results(A__t="failed", A__u="failed")
  expected = [js.Expected("A::t", "d", "why"),
              js.Expected("A::u", "d", "why", (), "api_test.py")]
  comp = js.classify(base, smart, expected, "0.12.0.1", "api_test.py")
  assert [t for t, _ in comp.expected] == ["A::u"]
  assert [t for t, _ in comp.unexpected] == ["A::t"]
  assert comp.unused == []


def _args(**kw):
  import argparse
  defaults = dict(peer=None, tests_dir=None, jax_repo=None,
                  file="api_test.py")
  defaults.update(kw)
  return argparse.Namespace(**defaults)


def test_find_test_file(tmp_path):
  flat = tmp_path / "flat"
  flat.mkdir()
  (flat / "api_test.py").write_text("# flat")
  nested = tmp_path / "nested" / "jax-v0.10.2"
  nested.mkdir(parents=True)
  (nested / "api_test.py").write_text("# nested")
  scratch = str(tmp_path)
  path, conftest = js.find_test_file(_args(tests_dir=str(flat)),
                                     "jax-v0.10.2", scratch)
  assert open(path).read() == "# flat" and conftest is None
  path, _ = js.find_test_file(_args(tests_dir=str(tmp_path / "nested")),
                              "jax-v0.10.2", scratch)
  assert open(path).read() == "# nested"
  with pytest.raises(js.SuiteError, match="not found"):
    js.find_test_file(_args(tests_dir=str(flat), file="checkify_test.py"),
                      "jax-v0.10.2", scratch)
  with pytest.raises(js.SuiteError, match="exactly one"):
    js.find_test_file(_args(tests_dir=str(flat), peer=str(flat)),
                      "jax-v0.10.2", scratch)
  with pytest.raises(js.SuiteError, match="exactly one"):
    js.find_test_file(_args(), "jax-v0.10.2", scratch)


def test_find_test_file_in_a_git_clone(tmp_path):
  import subprocess
  repo = tmp_path / "jax"
  (repo / "tests").mkdir(parents=True)
  (repo / "tests" / "api_test.py").write_text("# at the tag")
  git = ["git", "-C", str(repo), "-c", "user.email=t@t", "-c", "user.name=t"]
  subprocess.run(["git", "init", "-q", str(repo)], check=True)
  subprocess.run(git + ["add", "."], check=True)
  subprocess.run(git + ["commit", "-q", "-m", "t"], check=True)
  subprocess.run(git + ["tag", "jax-v0.10.2"], check=True)
  out = tmp_path / "out"
  out.mkdir()
  path, conftest = js.find_test_file(_args(jax_repo=str(repo)), "jax-v0.10.2",
                                     str(out))
  assert open(path).read() == "# at the tag" and conftest is None
  assert path.startswith(str(out))
  with pytest.raises(js.SuiteError, match="git could not read"):
    js.find_test_file(_args(jax_repo=str(repo), file="nope_test.py"),
                      "jax-v0.10.2", str(out))
  with pytest.raises(js.SuiteError, match="no JAX git revision"):
    js.find_test_file(_args(jax_repo=str(repo)), "jax-v9", str(out))


def test_swap_conftest_matches_the_peer_s(monkeypatch):
  """The conftest the tool writes swaps the decorator as the peer's does
  (SMART=1 by default, SMART=0 leaves jax.custom_vjp)."""
  import types
  import jax
  import smartvjp
  original = jax.custom_vjp
  for smart, want in (("0", original), ("1", smartvjp.smart_custom_vjp)):
    monkeypatch.setenv("SMART", smart)
    monkeypatch.setattr(jax, "custom_vjp", original)
    exec(compile(js.SWAP_CONFTEST, "conftest.py", "exec"),
         types.ModuleType("conftest").__dict__)
    assert jax.custom_vjp is want


def test_git_revisions_cover_every_tag():
  assert set(js.GIT_REVS) == set(js.TAGS.values())


def test_missing_imports_are_found_and_stubbed(monkeypatch):
  source = ("from jax._src import core, no_such_submodule_here\n"
            "from jax._src.core import Tracer, NoSuchThingInJax\n"
            "from jax._src.no_such_module import a_name\n"
            "from numpy import NoSuchThingInNumpy\n"
            "import jax\n")
  assert js.missing_imports(source) == [
      ("jax._src", "no_such_submodule_here"),
      ("jax._src.core", "NoSuchThingInJax"),
      ("jax._src.no_such_module", "a_name")]
  import types
  from jax._src import core
  plugin = types.ModuleType(js.STUBS_MODULE)
  monkeypatch.delenv("JAX_SUITE_TEST_FILE", raising=False)
  exec(compile(js.STUB_PLUGIN, js.STUBS_MODULE, "exec"), plugin.__dict__)
  plugin.install(source)
  try:
    stub = core.NoSuchThingInJax
    assert not isinstance(object(), stub)
    with pytest.raises(NotImplementedError, match="NoSuchThingInJax"):
      stub()
    from jax._src.no_such_module import a_name
    with pytest.raises(NotImplementedError, match="no_such_module.a_name"):
      a_name()
  finally:
    sys.modules.pop("jax._src.no_such_module", None)
    delattr(core, "NoSuchThingInJax")
    import jax._src
    if hasattr(jax._src, "no_such_submodule_here"):
      delattr(jax._src, "no_such_submodule_here")
