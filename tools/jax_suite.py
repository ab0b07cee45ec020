"""Run JAX's own ``custom_api_test.py`` (or another JAX test file) against smartvjp.

The test files are not part of this project: they live in a peer folder (see
its README), one copy per JAX tag, or in a folder given with ``--tests-dir``,
or are read from a git clone of JAX with ``--jax-repo`` (at the tag matching
the installed JAX). This tool copies the file and a ``conftest.py`` that swaps
the decorator (the peer's, or its own when no peer is given) into a scratch
folder and runs pytest on it twice with the current interpreter: once with
``SMART=0`` (plain ``jax.custom_vjp``, the baseline) and once with ``SMART=1``
(``jax.custom_vjp`` replaced by ``smartvjp.smart_custom_vjp``). Per-test
outcomes come from pytest's junit XML. ``--uses custom_vjp`` runs only the
tests whose source mentions ``custom_vjp`` (for large files such as
``api_test.py``).

A test *fails with the swap* when it passes in the baseline and fails or errors
with smartvjp. Such a failure is *expected* when it matches an entry of
``tools/jax_suite_expected.toml``; any other one is *unexpected* and makes the
exit status non-zero (unless ``--report-only``). Entries that match a test
which now passes with smartvjp are reported as stale. Exit status: 0 when
nothing is unexpected, 1 with unexpected failures, 2 when the setup or a pass
is broken (missing files, a pytest crash, a collection error).

Usage::

  PYTHONPATH=. python tools/jax_suite.py --peer ../shared/peer [--file-tag auto]
      [--junit-dir DIR] [-k EXPR] [--jobs 1|2] [--passes both|baseline|smart]
      [--json OUT] [--report-only]
  PYTHONPATH=. python tools/jax_suite.py --tests-dir DIR --file api_test.py
      --uses custom_vjp      # DIR/api_test.py or DIR/<tag>/api_test.py
  PYTHONPATH=. python tools/jax_suite.py --jax-repo JAX_CLONE
      --file mutable_array_test.py    # tests/<file> at the matching tag
  (add --stub-missing-imports where the file is newer than the installed jax)
"""

from __future__ import annotations

import argparse
import ast
import dataclasses
import fnmatch
import json
import os
import re
import shutil
import subprocess
import sys
import tempfile
import time
import tomllib
import xml.etree.ElementTree as ET

HERE = os.path.dirname(os.path.abspath(__file__))
EXPECTED_FILE = os.path.join(HERE, "jax_suite_expected.toml")
TEST_FILE = "custom_api_test.py"
# Installed jax (major, minor) -> folder of the peer that holds its test file.
TAGS = {
    (0, 10): "jax-v0.10.2",
    (0, 11): "jax-v0.11.0",
    (0, 12): "jax-main-2026-08-08",
}
# Peer folder -> the git revision of JAX's repository it was taken from
# (for --jax-repo): the tags, and main as of 2026-08-08.
GIT_REVS = {
    "jax-v0.10.2": "jax-v0.10.2",
    "jax-v0.11.0": "jax-v0.11.0",
    "jax-main-2026-08-08": "cec06d116c05f0d52adfceee3d3b730fdbcb0ce5",
}
CATEGORIES = {
    "a": "inspects JAX's own primitives",
    "b": "asserts that forward mode of a custom VJP raises",
    "c": "JAX's vjp3 path raises where smartvjp computes the value",
    "d": "same exception type, smartvjp's own wording",
    "e": "asserts JAX's own internals beyond its primitives (stack depth)",
}
# The conftest.py used when no peer folder is given: the peer's, in effect.
SWAP_CONFTEST = """\
# Written by smartvjp's tools/jax_suite.py: swaps jax.custom_vjp for
# smartvjp.smart_custom_vjp before the tests are collected (SMART=0: not).
import os
import jax

if os.environ.get("SMART", "1") == "1":
  import smartvjp
  jax.custom_vjp = smartvjp.smart_custom_vjp
"""
# --stub-missing-imports: a pytest plugin loaded in both passes alike. A JAX
# test file newer than the installed jax may import internals this jax lacks
# (the main-branch api_test.py imports jax._src.ad_checkpoint.custom_remat,
# which jax 0.12.0.1 does not have; the jax-v0.10.2 one a module jax 0.10.0
# lacks); each such name becomes a class whose construction raises (in an
# empty module standing in for a missing one), so the file is collected and
# only the tests using it fail, in the baseline too (so they are never held
# against smartvjp).
STUBS_MODULE = "jax_suite_stubs"
STUB_PLUGIN = """\
# Written by smartvjp's tools/jax_suite.py (--stub-missing-imports).
import ast
import importlib
import os
import sys
import types


def missing_imports(source):
  out = []
  for node in ast.parse(source).body:
    if not (isinstance(node, ast.ImportFrom) and node.module
            and node.module.split(".")[0] == "jax"):
      continue
    try:
      module = importlib.import_module(node.module)
    except ImportError:   # a whole module this jax lacks
      out += [(node.module, alias.name) for alias in node.names]
      continue
    for alias in node.names:
      if hasattr(module, alias.name):
        continue
      try:
        importlib.import_module(node.module + "." + alias.name)
      except ImportError:
        out.append((node.module, alias.name))
  return out


def install(source):
  for module, name in missing_imports(source):
    def refuse(self, *args, _where=module + "." + name, **kwargs):
      raise NotImplementedError(
          _where + " is not in the installed jax (stubbed by jax_suite.py)")
    try:
      target = importlib.import_module(module)
    except ImportError:
      target = sys.modules[module] = types.ModuleType(module)
    setattr(target, name, type(name, (), {"__init__": refuse}))


if os.environ.get("JAX_SUITE_TEST_FILE"):
  with open(os.environ["JAX_SUITE_TEST_FILE"]) as fh:
    install(fh.read())
"""


def missing_imports(source: str) -> list[tuple[str, str]]:
  """``(module, name)`` of each ``from jax... import name`` in a test file's
  ``source`` that the installed jax lacks (what --stub-missing-imports
  stubs)."""
  namespace: dict = {}
  exec(compile(STUB_PLUGIN, STUBS_MODULE, "exec"), namespace)
  return namespace["missing_imports"](source)


FAILED = ("failed", "error")


class SuiteError(Exception):
  """A problem with the setup (missing files, bad expectations, pytest crash)."""


# -- pure helpers (tested in tests/test_jax_suite_tool.py) --------------------


def version_tuple(version: str) -> tuple[int, ...]:
  """``"0.12.0.1"`` -> ``(0, 12, 0, 1)``; stops at the first non-numeric part."""
  out = []
  for part in version.split("."):
    digits = ""
    for ch in part:
      if not ch.isdigit():
        break
      digits += ch
    if not digits:
      break
    out.append(int(digits))
    if len(digits) != len(part):
      break
  return tuple(out)


def pick_tag(jax_version: str) -> str:
  """The peer folder whose test file matches an installed jax version."""
  tag = TAGS.get(version_tuple(jax_version)[:2])
  if tag is None:
    raise SuiteError(
        f"no JAX test file is known for jax {jax_version}; pass --file-tag "
        f"(one of {', '.join(sorted(TAGS.values()))}).")
  return tag


def test_id(classname: str, name: str) -> str:
  """Short id of a junit test case: ``Class::test`` (module part dropped)."""
  cls = classname.rsplit(".", 1)[-1] if classname else ""
  return f"{cls}::{name}" if cls else name


_FILE_PREFIX = re.compile(r"^([\w.-]+\.py)::")


def pattern_file(pattern: str) -> str | None:
  """The test file a full node id names (``mutable_array_test.py::C::t``)."""
  m = _FILE_PREFIX.match(pattern)
  return m.group(1) if m else None


def normalize_pattern(pattern: str) -> str:
  """Accepts full pytest node ids (``custom_api_test.py::C::t``) as patterns."""
  m = _FILE_PREFIX.match(pattern)
  return pattern[m.end():] if m else pattern


@dataclasses.dataclass(frozen=True)
class Expected:
  """One expected difference: tests matching ``pattern`` may fail with smartvjp."""
  pattern: str
  category: str
  reason: str
  jax: tuple[str, ...] = ()  # version prefixes ("0.10", "0.11.2"); () = all
  file: str = TEST_FILE      # the JAX test file the entry is about

  def for_version(self, jax_version: str) -> bool:
    """Whether the entry applies to this jax version (prefix match)."""
    have = version_tuple(jax_version)
    return not self.jax or any(
        have[:len(version_tuple(v))] == version_tuple(v) for v in self.jax)

  def for_file(self, test_file: str) -> bool:
    return self.file == test_file

  def applies(self, tid: str, jax_version: str,
              test_file: str = TEST_FILE) -> bool:
    return (self.for_file(test_file) and self.for_version(jax_version)
            and fnmatch.fnmatchcase(tid, normalize_pattern(self.pattern)))


def parse_expected(data: dict) -> list[Expected]:
  """Entries from the parsed TOML (``[[expected]]`` tables), checked."""
  out = []
  for i, entry in enumerate(data.get("expected", [])):
    unknown = set(entry) - {"pattern", "category", "reason", "jax", "file"}
    if unknown or not {"pattern", "category", "reason"} <= set(entry):
      raise SuiteError(f"expected entry {i}: needs pattern, category, reason "
                       f"(and optionally jax, file); got keys {sorted(entry)}.")
    if entry["category"] not in CATEGORIES:
      raise SuiteError(f"expected entry {i} ({entry['pattern']}): category "
                       f"must be one of {sorted(CATEGORIES)}.")
    jax_versions = entry.get("jax", ())
    if isinstance(jax_versions, str):
      jax_versions = (jax_versions,)
    named = pattern_file(entry["pattern"])
    test_file = entry.get("file", named or TEST_FILE)
    if named is not None and named != test_file:
      raise SuiteError(f"expected entry {i} ({entry['pattern']}): its pattern "
                       f"names {named} but its file is {test_file}.")
    out.append(Expected(entry["pattern"], entry["category"], entry["reason"],
                        tuple(jax_versions), test_file))
  return out


def load_expected(path: str = EXPECTED_FILE) -> list[Expected]:
  with open(path, "rb") as fh:
    return parse_expected(tomllib.load(fh))


def first_line(text: str | None) -> str:
  for line in (text or "").splitlines():
    if line.strip():
      return line.strip()
  return ""


def parse_junit(path_or_text: str) -> dict[str, dict]:
  """Per-test outcomes from a pytest junit XML file (or its text).

  Returns ``{id: {"outcome": passed|failed|error|skipped, "message": str}}``.
  A failure beats an error in the call phase of the same test; the message is
  the first line of the failure's ``message`` attribute (or of its body).
  """
  if path_or_text.lstrip().startswith("<"):
    root = ET.fromstring(path_or_text)
  else:
    root = ET.parse(path_or_text).getroot()
  results = {}
  for case in root.iter("testcase"):
    tid = test_id(case.get("classname", ""), case.get("name", ""))
    outcome, message = "passed", ""
    for tag in ("failure", "error", "skipped"):
      node = case.find(tag)
      if node is not None:
        outcome = {"failure": "failed"}.get(tag, tag)
        message = first_line(node.get("message")) or first_line(node.text)
        break
    results[tid] = {"outcome": outcome, "message": message}
  return results


@dataclasses.dataclass
class Comparison:
  """How the smartvjp pass differs from the baseline."""
  expected: list[tuple[str, Expected]]     # fail with the swap, as listed
  unexpected: list[tuple[str, str]]        # (id, first line of the error)
  stale: list[tuple[str, Expected]]        # listed, but passes with smartvjp
  unused: list[Expected]                   # entries that matched no test


def classify(baseline: dict[str, dict], smart: dict[str, dict],
             expected: list[Expected], jax_version: str,
             test_file: str = TEST_FILE) -> Comparison:
  """Sorts the tests that pass in the baseline by their smartvjp outcome."""
  comp = Comparison([], [], [], [])
  expected = [e for e in expected if e.for_file(test_file)]
  used = set()
  for tid in sorted(baseline):
    if baseline[tid]["outcome"] != "passed":
      continue
    entry = next((e for e in expected if e.applies(tid, jax_version, test_file)),
                 None)
    if entry is not None:
      used.add(entry)
    got = smart.get(tid, {"outcome": "missing",
                          "message": "not run in the SMART=1 pass"})
    if got["outcome"] in FAILED + ("missing",):
      if entry is None or got["outcome"] == "missing":
        comp.unexpected.append((tid, got["message"]))
      else:
        comp.expected.append((tid, entry))
    elif entry is not None and got["outcome"] == "passed":
      comp.stale.append((tid, entry))
  comp.unused = [e for e in expected
                 if e not in used and e.for_version(jax_version)]
  return comp


def tests_using(source: str, needle: str) -> list[tuple[str, str]]:
  """``(class, test method)`` of each test in a test file's ``source`` whose
  own source text mentions ``needle`` (e.g. ``custom_vjp``)."""
  out = []
  for node in ast.parse(source).body:
    if not isinstance(node, ast.ClassDef):
      continue
    for fn in node.body:
      if (isinstance(fn, (ast.FunctionDef, ast.AsyncFunctionDef))
          and fn.name.startswith("test")
          and needle in (ast.get_source_segment(source, fn) or "")):
        out.append((node.name, fn.name))
  return out


def selection_expr(tests: list[tuple[str, str]], kexpr: str | None) -> str:
  """A pytest ``-k`` expression running ``tests`` (absl's parameterized
  variants ``test_x0``, ``test_x_name`` included: -k matches substrings, so
  a test whose name extends a selected one runs too, harmlessly), within
  ``kexpr`` when given."""
  if not tests:
    raise SuiteError("no test of the file matches --uses; nothing to run.")
  sel = " or ".join(f"({cls} and {name})" for cls, name in tests)
  return f"({kexpr}) and ({sel})" if kexpr else sel


def counts(results: dict[str, dict]) -> dict[str, int]:
  out = {"passed": 0, "failed": 0, "error": 0, "skipped": 0}
  for r in results.values():
    out[r["outcome"]] += 1
  return out


# -- running pytest -----------------------------------------------------------


def start_pass(smart: bool, workdir: str, junit: str, kexpr: str | None,
               log: str, test_file: str = TEST_FILE,
               stubs: bool = False) -> subprocess.Popen:
  """Starts one pytest run of the copied file (stdout/stderr to ``log``)."""
  cmd = [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider",
         f"--junitxml={junit}", test_file]
  if stubs:
    cmd[4:4] = ["-p", STUBS_MODULE]
  if kexpr:
    cmd += ["-k", kexpr]
  env = dict(os.environ, SMART="1" if smart else "0")
  if stubs:
    env["JAX_SUITE_TEST_FILE"] = os.path.join(workdir, test_file)
  out = open(log, "w")
  proc = subprocess.Popen(cmd, cwd=workdir, env=env, stdout=out,
                          stderr=subprocess.STDOUT)
  proc.log_handle = out
  return proc


def run_passes(names: list[str], peer_file: str, conftest: str, junit_dir: str,
               kexpr: str | None, jobs: int,
               test_file: str = TEST_FILE,
               stubs: bool = False) -> dict[str, dict]:
  """Runs the named passes (``baseline``/``smart``), ``jobs`` at a time.

  Each pass gets its own scratch folder so the two never share files.
  ``conftest`` is a path, or ``None`` for :data:`SWAP_CONFTEST`.
  Returns ``{name: {"results", "returncode", "wall_s", "log"}}``.
  """
  stem = "" if test_file == TEST_FILE else test_file[:-len(".py")] + "."
  todo, running, done = list(names), {}, {}
  scratch = tempfile.mkdtemp(prefix="jax_suite_")
  try:
    while todo or running:
      while todo and len(running) < max(1, jobs):
        name = todo.pop(0)
        work = os.path.join(scratch, name)
        os.makedirs(work)
        if conftest is None:
          with open(os.path.join(work, "conftest.py"), "w") as fh:
            fh.write(SWAP_CONFTEST)
        else:
          shutil.copy(conftest, os.path.join(work, "conftest.py"))
        shutil.copy(peer_file, os.path.join(work, test_file))
        if stubs:
          with open(os.path.join(work, STUBS_MODULE + ".py"), "w") as fh:
            fh.write(STUB_PLUGIN)
        junit = os.path.join(junit_dir, f"{stem}{name}.xml")
        log = os.path.join(junit_dir, f"{stem}{name}.log")
        if os.path.exists(junit):  # never read an older run's results
          os.remove(junit)
        proc = start_pass(name == "smart", work, junit, kexpr, log, test_file,
                          stubs)
        running[name] = (proc, junit, log, time.monotonic())
      time.sleep(0.2)
      for name, (proc, junit, log, t0) in list(running.items()):
        if proc.poll() is None:
          continue
        proc.log_handle.close()
        del running[name]
        results = parse_junit(junit) if os.path.exists(junit) else {}
        done[name] = {"results": results, "returncode": proc.returncode,
                      "wall_s": time.monotonic() - t0, "log": log}
  finally:
    for proc, *_ in running.values():
      proc.kill()
    shutil.rmtree(scratch, ignore_errors=True)
  return done


def pass_problem(run: dict) -> str | None:
  """Why a pass's results cannot be trusted (pytest crashed, import failed)."""
  if run["returncode"] not in (0, 1):
    with open(run["log"]) as fh:
      tail = [l.strip() for l in fh.read().splitlines() if l.strip()][-3:]
    return f"pytest exited with {run['returncode']}: " + " | ".join(tail)
  broken = [tid for tid, r in run["results"].items()
            if "::" not in tid and r["outcome"] in FAILED]
  if broken:
    return (f"collection error in {broken[0]}: "
            f"{run['results'][broken[0]]['message']}")
  return None


# -- report -------------------------------------------------------------------


def fmt_counts(results: dict[str, dict]) -> str:
  c = counts(results)
  return (f"{c['passed']} passed, {c['failed']} failed, {c['error']} errors, "
          f"{c['skipped']} skipped")


def report(runs: dict, comp: Comparison | None, tag: str, jax_version: str,
           problems: dict[str, str], show_unused: bool = True,
           test_file: str = TEST_FILE) -> None:
  print(f"\nJAX suite: {tag}/{test_file} on jax {jax_version}")
  for name, label in (("baseline", "SMART=0 (jax.custom_vjp)"),
                      ("smart", "SMART=1 (smartvjp)")):
    if name in runs:
      print(f"  {label:26s} {fmt_counts(runs[name]['results'])}"
            f"  [{runs[name]['wall_s']:.0f}s]")
  for name, why in problems.items():
    print(f"  !! {name} pass unusable: {why}")
  if comp is None:
    return
  print(f"\nExpected differences ({len(comp.expected)}):")
  for tid, e in comp.expected:
    print(f"  {tid}  [{e.category}] {e.reason}")
  print(f"\nUNEXPECTED failures with smartvjp ({len(comp.unexpected)}):")
  for tid, msg in comp.unexpected:
    print(f"  {tid}\n      {msg}")
  if comp.stale:
    print(f"\nWARNING: listed as expected but pass with smartvjp "
          f"({len(comp.stale)}):")
    for tid, e in comp.stale:
      print(f"  {tid}  (pattern {e.pattern})")
  if comp.unused and show_unused:
    print(f"\nNote: expected entries matching no baseline-passing test "
          f"({len(comp.unused)}):")
    for e in comp.unused:
      print(f"  {e.pattern}")


def write_json(path: str, runs: dict, comp: Comparison | None, tag: str,
               jax_version: str, problems: dict[str, str],
               test_file: str = TEST_FILE) -> None:
  tests = {}
  for name, run in runs.items():
    for tid, r in run["results"].items():
      tests.setdefault(tid, {})[name] = r
  if comp is not None:
    for tid, e in comp.expected:
      tests[tid]["verdict"] = "expected"
      tests[tid]["reason"] = e.reason
    for tid, _ in comp.unexpected:
      tests[tid]["verdict"] = "unexpected"
    for tid, e in comp.stale:
      tests[tid]["verdict"] = "stale"
  doc = {"tag": tag, "file": test_file, "jax": jax_version,
         "problems": problems,
         "passes": {n: {"returncode": r["returncode"],
                        "wall_s": round(r["wall_s"], 1),
                        "counts": counts(r["results"])}
                    for n, r in runs.items()},
         "tests": tests}
  with open(path, "w") as fh:
    json.dump(doc, fh, indent=1, sort_keys=True)


def main(argv: list[str] | None = None) -> int:
  parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
  source = parser.add_argument_group(
      "where the test file comes from (one of them; --peer also gives the "
      "conftest.py, which the tool writes itself otherwise)")
  source.add_argument("--peer",
                      help="folder holding conftest.py and <tag>/<file>")
  source.add_argument("--tests-dir",
                      help="folder holding <file> (or <tag>/<file>)")
  source.add_argument("--jax-repo",
                      help="git clone of JAX: tests/<file> at the tag's "
                           "revision (see GIT_REVS)")
  parser.add_argument("--file", default=TEST_FILE,
                      help=f"JAX test file to run (default {TEST_FILE})")
  parser.add_argument("--file-tag", default="auto",
                      help="peer subfolder, or 'auto' from the jax version")
  parser.add_argument("--uses", metavar="TEXT",
                      help="run only the tests whose source mentions TEXT "
                           "(e.g. custom_vjp)")
  parser.add_argument("--stub-missing-imports", action="store_true",
                      help="in both passes, stub the jax internals the file "
                           "imports that this jax lacks (a file newer than "
                           "the installed jax); the tests using them fail "
                           "in both passes")
  parser.add_argument("--junit-dir", help="keep junit XML and logs here")
  parser.add_argument("-k", dest="kexpr", help="pytest -k expression")
  parser.add_argument("--jobs", type=int, default=1,
                      help="pytest processes at once; 2 runs both passes "
                           "together (on a shared 2-core machine this gained "
                           "little: 163s vs 154s, 209s vs 274s)")
  parser.add_argument("--passes", choices=("both", "baseline", "smart"),
                      default="both")
  parser.add_argument("--expected", default=EXPECTED_FILE,
                      help="TOML file of expected differences")
  parser.add_argument("--json", help="write per-test results here")
  parser.add_argument("--report-only", action="store_true",
                      help="exit 0 even with unexpected failures")
  args = parser.parse_args(argv)
  try:
    return _main(args)
  except SuiteError as e:
    print(f"jax_suite: error: {e}", file=sys.stderr)
    return 2


def find_test_file(args, tag: str, scratch: str) -> tuple[str, str | None]:
  """``(path of the test file, path of the peer's conftest.py or None)``
  from ``--peer``, ``--tests-dir`` or ``--jax-repo`` (checked in that order
  of precedence for the file; the conftest comes from the peer only)."""
  given = [n for n in ("peer", "tests_dir", "jax_repo") if getattr(args, n)]
  if len(given) != 1:
    raise SuiteError("give exactly one of --peer, --tests-dir, --jax-repo "
                     f"(got {len(given)}).")
  name = args.file
  if args.peer:
    if not os.path.isdir(args.peer):
      raise SuiteError(f"peer folder not found: {args.peer}")
    conftest = os.path.join(args.peer, "conftest.py")
    if not os.path.isfile(conftest):
      raise SuiteError(f"no conftest.py in the peer folder {args.peer}")
    path = os.path.join(args.peer, tag, name)
    if not os.path.isfile(path):
      raise SuiteError(f"test file not found: {path}")
    return path, conftest
  if args.tests_dir:
    if not os.path.isdir(args.tests_dir):
      raise SuiteError(f"tests folder not found: {args.tests_dir}")
    for path in (os.path.join(args.tests_dir, name),
                 os.path.join(args.tests_dir, tag, name)):
      if os.path.isfile(path):
        return path, None
    raise SuiteError(f"test file not found: {name} in {args.tests_dir} "
                     f"(nor in its {tag}/)")
  rev = GIT_REVS.get(tag)
  if rev is None:
    raise SuiteError(f"no JAX git revision is known for {tag}; "
                     f"one of {', '.join(sorted(GIT_REVS))}.")
  got = subprocess.run(["git", "-C", args.jax_repo, "show",
                        f"{rev}:tests/{name}"], capture_output=True)
  if got.returncode != 0:
    raise SuiteError(f"git could not read tests/{name} at {rev} from "
                     f"{args.jax_repo}: {got.stderr.decode().strip()}")
  path = os.path.join(scratch, name)
  with open(path, "wb") as fh:
    fh.write(got.stdout)
  return path, None


def _main(args) -> int:
  import jax  # only to read its version; the passes run in subprocesses
  jax_version = jax.__version__
  tag = pick_tag(jax_version) if args.file_tag == "auto" else args.file_tag
  scratch = tempfile.mkdtemp(prefix="jax_suite_file_")
  try:
    return _run(args, jax_version, tag, scratch)
  finally:
    shutil.rmtree(scratch, ignore_errors=True)


def _run(args, jax_version: str, tag: str, scratch: str) -> int:
  peer_file, conftest = find_test_file(args, tag, scratch)
  test_file = args.file
  expected = load_expected(args.expected)
  kexpr = args.kexpr
  with open(peer_file) as fh:
    source = fh.read()
  if args.uses:
    kexpr = selection_expr(tests_using(source, args.uses), kexpr)
  if args.stub_missing_imports:
    stubbed = missing_imports(source)
    print("stubbed (the file imports them; this jax lacks them): "
          + (", ".join(f"{m}.{n}" for m, n in stubbed) or "none"))
  names = {"both": ["baseline", "smart"], "baseline": ["baseline"],
           "smart": ["smart"]}[args.passes]

  junit_dir = args.junit_dir or tempfile.mkdtemp(prefix="jax_suite_junit_")
  os.makedirs(junit_dir, exist_ok=True)
  print(f"jax {jax_version}, file {tag}/{test_file}, passes {names}, "
        f"jobs {args.jobs}", flush=True)
  t0 = time.monotonic()
  runs = run_passes(names, peer_file, conftest, junit_dir, kexpr,
                    args.jobs, test_file, args.stub_missing_imports)
  wall = time.monotonic() - t0
  problems = {n: p for n, r in runs.items() if (p := pass_problem(r))}
  comp = None
  if len(runs) == 2 and not problems:
    comp = classify(runs["baseline"]["results"], runs["smart"]["results"],
                    expected, jax_version, test_file)
  report(runs, comp, tag, jax_version, problems,
         show_unused=not (args.kexpr or args.uses), test_file=test_file)
  print(f"\nwall time {wall:.0f}s")
  if args.json:
    write_json(args.json, runs, comp, tag, jax_version, problems, test_file)
  if args.junit_dir or problems:
    print(f"junit XML and pytest logs in {junit_dir}")
  else:
    shutil.rmtree(junit_dir, ignore_errors=True)
  if args.report_only:
    return 0
  if problems:
    return 2
  return 1 if comp is not None and comp.unexpected else 0


if __name__ == "__main__":
  sys.exit(main())
