"""Run JAX's own ``custom_api_test.py`` against smartvjp and compare.

The test file is not part of this project: it lives in a peer folder (see its
README), one copy per JAX tag. This tool copies that file and the peer's
``conftest.py`` into a scratch folder and runs pytest on it twice with the
current interpreter: once with ``SMART=0`` (plain ``jax.custom_vjp``, the
baseline) and once with ``SMART=1`` (``jax.custom_vjp`` replaced by
``smartvjp.smart_custom_vjp``). Per-test outcomes come from pytest's junit XML.

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
"""

from __future__ import annotations

import argparse
import dataclasses
import fnmatch
import json
import os
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
CATEGORIES = {
    "a": "inspects JAX's own primitives",
    "b": "asserts that forward mode of a custom VJP raises",
    "c": "JAX's vjp3 path raises where smartvjp computes the value",
    "d": "same exception type, smartvjp's own wording",
}
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


def normalize_pattern(pattern: str) -> str:
  """Accepts full pytest node ids (``custom_api_test.py::C::t``) as patterns."""
  prefix = TEST_FILE + "::"
  return pattern[len(prefix):] if pattern.startswith(prefix) else pattern


@dataclasses.dataclass(frozen=True)
class Expected:
  """One expected difference: tests matching ``pattern`` may fail with smartvjp."""
  pattern: str
  category: str
  reason: str
  jax: tuple[str, ...] = ()  # version prefixes ("0.10", "0.11.2"); () = all

  def for_version(self, jax_version: str) -> bool:
    """Whether the entry applies to this jax version (prefix match)."""
    have = version_tuple(jax_version)
    return not self.jax or any(
        have[:len(version_tuple(v))] == version_tuple(v) for v in self.jax)

  def applies(self, tid: str, jax_version: str) -> bool:
    return (self.for_version(jax_version)
            and fnmatch.fnmatchcase(tid, normalize_pattern(self.pattern)))


def parse_expected(data: dict) -> list[Expected]:
  """Entries from the parsed TOML (``[[expected]]`` tables), checked."""
  out = []
  for i, entry in enumerate(data.get("expected", [])):
    unknown = set(entry) - {"pattern", "category", "reason", "jax"}
    if unknown or not {"pattern", "category", "reason"} <= set(entry):
      raise SuiteError(f"expected entry {i}: needs pattern, category, reason "
                       f"(and optionally jax); got keys {sorted(entry)}.")
    if entry["category"] not in CATEGORIES:
      raise SuiteError(f"expected entry {i} ({entry['pattern']}): category "
                       f"must be one of {sorted(CATEGORIES)}.")
    jax_versions = entry.get("jax", ())
    if isinstance(jax_versions, str):
      jax_versions = (jax_versions,)
    out.append(Expected(entry["pattern"], entry["category"], entry["reason"],
                        tuple(jax_versions)))
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
             expected: list[Expected], jax_version: str) -> Comparison:
  """Sorts the tests that pass in the baseline by their smartvjp outcome."""
  comp = Comparison([], [], [], [])
  used = set()
  for tid in sorted(baseline):
    if baseline[tid]["outcome"] != "passed":
      continue
    entry = next((e for e in expected if e.applies(tid, jax_version)), None)
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


def counts(results: dict[str, dict]) -> dict[str, int]:
  out = {"passed": 0, "failed": 0, "error": 0, "skipped": 0}
  for r in results.values():
    out[r["outcome"]] += 1
  return out


# -- running pytest -----------------------------------------------------------


def start_pass(smart: bool, workdir: str, junit: str, kexpr: str | None,
               log: str) -> subprocess.Popen:
  """Starts one pytest run of the copied file (stdout/stderr to ``log``)."""
  cmd = [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider",
         f"--junitxml={junit}", TEST_FILE]
  if kexpr:
    cmd += ["-k", kexpr]
  env = dict(os.environ, SMART="1" if smart else "0")
  out = open(log, "w")
  proc = subprocess.Popen(cmd, cwd=workdir, env=env, stdout=out,
                          stderr=subprocess.STDOUT)
  proc.log_handle = out
  return proc


def run_passes(names: list[str], peer_file: str, conftest: str, junit_dir: str,
               kexpr: str | None, jobs: int) -> dict[str, dict]:
  """Runs the named passes (``baseline``/``smart``), ``jobs`` at a time.

  Each pass gets its own scratch folder so the two never share files.
  Returns ``{name: {"results", "returncode", "wall_s", "log"}}``.
  """
  todo, running, done = list(names), {}, {}
  scratch = tempfile.mkdtemp(prefix="jax_suite_")
  try:
    while todo or running:
      while todo and len(running) < max(1, jobs):
        name = todo.pop(0)
        work = os.path.join(scratch, name)
        os.makedirs(work)
        shutil.copy(conftest, work)
        shutil.copy(peer_file, os.path.join(work, TEST_FILE))
        junit = os.path.join(junit_dir, f"{name}.xml")
        log = os.path.join(junit_dir, f"{name}.log")
        if os.path.exists(junit):  # never read an older run's results
          os.remove(junit)
        proc = start_pass(name == "smart", work, junit, kexpr, log)
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
           problems: dict[str, str], show_unused: bool = True) -> None:
  print(f"\nJAX suite: {tag}/{TEST_FILE} on jax {jax_version}")
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
               jax_version: str, problems: dict[str, str]) -> None:
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
  doc = {"tag": tag, "jax": jax_version, "problems": problems,
         "passes": {n: {"returncode": r["returncode"],
                        "wall_s": round(r["wall_s"], 1),
                        "counts": counts(r["results"])}
                    for n, r in runs.items()},
         "tests": tests}
  with open(path, "w") as fh:
    json.dump(doc, fh, indent=1, sort_keys=True)


def main(argv: list[str] | None = None) -> int:
  parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
  parser.add_argument("--peer", required=True,
                      help="folder holding conftest.py and <tag>/" + TEST_FILE)
  parser.add_argument("--file-tag", default="auto",
                      help="peer subfolder, or 'auto' from the jax version")
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


def _main(args) -> int:
  import jax  # only to read its version; the passes run in subprocesses
  jax_version = jax.__version__
  if not os.path.isdir(args.peer):
    raise SuiteError(f"peer folder not found: {args.peer}")
  conftest = os.path.join(args.peer, "conftest.py")
  if not os.path.isfile(conftest):
    raise SuiteError(f"no conftest.py in the peer folder {args.peer}")
  tag = pick_tag(jax_version) if args.file_tag == "auto" else args.file_tag
  peer_file = os.path.join(args.peer, tag, TEST_FILE)
  if not os.path.isfile(peer_file):
    raise SuiteError(f"test file not found: {peer_file}")
  expected = load_expected(args.expected)
  names = {"both": ["baseline", "smart"], "baseline": ["baseline"],
           "smart": ["smart"]}[args.passes]

  junit_dir = args.junit_dir or tempfile.mkdtemp(prefix="jax_suite_junit_")
  os.makedirs(junit_dir, exist_ok=True)
  print(f"jax {jax_version}, file {tag}, passes {names}, jobs {args.jobs}",
        flush=True)
  t0 = time.monotonic()
  runs = run_passes(names, peer_file, conftest, junit_dir, args.kexpr,
                    args.jobs)
  wall = time.monotonic() - t0
  problems = {n: p for n, r in runs.items() if (p := pass_problem(r))}
  comp = None
  if len(runs) == 2 and not problems:
    comp = classify(runs["baseline"]["results"], runs["smart"]["results"],
                    expected, jax_version)
  report(runs, comp, tag, jax_version, problems, show_unused=not args.kexpr)
  print(f"\nwall time {wall:.0f}s")
  if args.json:
    write_json(args.json, runs, comp, tag, jax_version, problems)
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
