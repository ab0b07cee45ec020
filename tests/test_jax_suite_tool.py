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
