"""A pytest plugin (``-p pytest_results``, with ``tools/`` on the path) that
appends one JSON line per test to ``$SMARTVJP_TEST_RESULTS`` as each test
finishes, tagged with ``$SMARTVJP_TEST_STAGE``: ``{"stage", "nodeid",
"outcome", "seconds", "message"}``, ``outcome`` one of passed, failed,
skipped, error (setup or teardown failed, or a file did not collect). A
run killed at its time limit keeps every test that finished before
(``tools/gpu_session.py``; pytest's ``--junitxml`` writes only at the end).
Under pytest-xdist only the controller writes (the workers' reports reach it
as they finish); each line is one ``write`` to a file opened for appending.
"""

from __future__ import annotations

import json
import os

_PATH = os.environ.get("SMARTVJP_TEST_RESULTS")
_STAGE = os.environ.get("SMARTVJP_TEST_STAGE", "")
_WORKER = [False]      # this process is a pytest-xdist worker


def pytest_configure(config):
  _WORKER[0] = hasattr(config, "workerinput")


def _write(nodeid, outcome, seconds, message=""):
  if not _PATH:
    return
  line = json.dumps(dict(stage=_STAGE, nodeid=nodeid, outcome=outcome,
                         seconds=round(seconds, 3), message=message[-2000:]))
  fd = os.open(_PATH, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
  try:
    os.write(fd, (line + "\n").encode())
  finally:
    os.close(fd)


def _message(report):
  if report.passed:
    return ""
  if report.skipped and isinstance(report.longrepr, tuple):
    return str(report.longrepr[2])
  return str(report.longrepr)


def pytest_runtest_logreport(report):
  if _WORKER[0]:
    return      # an xdist worker: its controller relays the report and writes
  if report.when == "call":
    outcome = report.outcome
  elif report.failed:
    outcome = "error"      # setup or teardown failed
  elif report.when == "setup" and report.skipped:
    outcome = "skipped"
  else:
    return
  _write(report.nodeid, outcome, report.duration, _message(report))


def pytest_collectreport(report):
  """A file that fails to collect is an error; one skipped whole (no GPU,
  no jax_triton) a skip."""
  if _WORKER[0] or report.passed:
    return
  _write(report.nodeid, "error" if report.failed else "skipped", 0.0,
         _message(report))
