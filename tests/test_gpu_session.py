"""``tools/gpu_session.py``, the one prepared GPU call, on a CPU: its plan
holds the mission inside the device call's budget, a test stage cut off
keeps the tests it finished, pytest's exit 5 is "no tests", and the whole
session runs (``--smoke``) within its budget, writing at most 8 files."""

from __future__ import annotations

import importlib.util
import json
import os
import sys
import time

import pytest

ROOT = os.path.abspath(os.path.join(os.path.dirname(__file__), os.pardir))


@pytest.fixture(scope="module")
def gs():
  spec = importlib.util.spec_from_file_location(
      "gpu_session", os.path.join(ROOT, "tools", "gpu_session.py"))
  module = importlib.util.module_from_spec(spec)
  sys.modules["gpu_session"] = module      # its dataclass looks it up
  spec.loader.exec_module(module)
  return module


def test_the_plan_holds_the_mission_inside_the_budget(gs, capsys):
  """Mission stages first, in the issue's order, each ending by the
  budget even when every stage before it runs to its cap."""
  rows = gs.plan(gs.BUDGET_S)
  assert [s.name for s, _, _ in rows] == [
      "env", "seed", "jax-triton", "shipped-tests", "shipped-bench",
      "kernels-vs-xla", "audit", "rest"]
  assert sum(cap for _, cap, _ in rows) == pytest.approx(gs.BUDGET_S)
  missions = [s.mission for s, _, _ in rows]
  assert missions == sorted(missions, reverse=True) and all(missions[:-1])
  for stage, cap, start in rows:
    assert cap == stage.cap_s and start + cap <= gs.BUDGET_S + 1e-9
  assert gs.BUDGET_S <= 540      # one device call of at most 9 minutes
  # a smaller budget scales the caps, never reorders
  small = gs.plan(270)
  assert [c for _, c, _ in small] == pytest.approx([c / 2 for _, c, _ in rows])
  gs.main(["--dry-plan"])
  printed = capsys.readouterr().out
  for stage, cap, start in rows:
    assert f"{stage.name:15s} cap {cap:5.0f} s  starts by {start:5.0f} s" in (
        printed)


def write_tests(folder, body):
  path = folder / "test_sample.py"
  path.write_text(body)
  return str(path)


def test_a_stage_cut_off_keeps_the_tests_it_finished(gs, tmp_path):
  tests = write_tests(tmp_path, (
      "import time\n"
      "def test_quick(): pass\n"
      "def test_fails(): assert False\n"
      "def test_slow(): time.sleep(600)\n"))
  out = tmp_path / "out"
  out.mkdir()
  session = gs.Session(str(out), 60, smoke=True)
  results = str(out / gs.RESULTS)
  t = time.monotonic()
  status = gs.run_tests(session, "cut", [tests],
                        time.monotonic() + 20, dict(os.environ), results)
  assert status == "cut off" and time.monotonic() - t < 45
  entry = json.loads((out / "session.json").read_text())["stages"]["cut"]
  assert entry["tests"]["counts"] == {"passed": 1, "failed": 1}
  [failing] = entry["tests"]["failing"]
  assert failing.endswith("test_sample.py::test_fails")


def test_exit_5_is_no_tests(gs, tmp_path):
  tests = write_tests(tmp_path, "def helper(): pass\n")
  out = tmp_path / "out"
  out.mkdir()
  session = gs.Session(str(out), 60, smoke=True)
  status = gs.run_tests(session, "empty", [tests], time.monotonic() + 60,
                        dict(os.environ), str(out / gs.RESULTS))
  assert status == "no tests"
  assert session.record["stages"]["empty"]["commands"][0]["rc"] == 5


def test_smoke_runs_every_stage_within_its_budget(gs, tmp_path):
  """The whole session at tiny sizes under a 40 s budget: on a loaded CPU
  some stages are cut off, which is part of what is checked."""
  out = tmp_path / "out"
  budget = 40
  t = time.monotonic()
  assert gs.main(["--smoke", "--out", str(out), "--budget", str(budget)]) == 0
  assert time.monotonic() - t < budget + 15     # kills take up to 10 s
  files = sorted(os.listdir(out))
  assert len(files) <= gs.MAX_FILES and "session.json" in files
  assert set(files) <= {"session.json", "log.txt", gs.RESULTS,
                        "gpu_transformer.json", "gpu_transformer_mgpu.json",
                        "accel_mlp.json", "audit_gpu.json"}   # 7 at most
  record = json.loads((out / "session.json").read_text())
  assert record["files"] == files and record["smoke"] is True
  assert list(record["stages"]) == list(gs.NAMES)
  for name, entry in record["stages"].items():
    assert entry["status"] in ("ok", "no tests", "cut off", "skipped"), (
        name, entry)
    assert entry["started_s"] <= budget + 1
  for line in (out / gs.RESULTS).read_text().splitlines() if (
      out / gs.RESULTS).exists() else []:
    assert json.loads(line)["stage"] in gs.NAMES
  if record["stages"]["env"]["status"] == "ok":   # not cut off on this CPU
    env = record["environment"]
    assert env["peaks"]["TFLOP/s"] > 0 and env["audit_peaks"]["bytes"] > 0
    assert env["backend"] == "cpu"
  assert record["plan"][0] == dict(stage="env", cap_s=pytest.approx(
      45 * budget / gs.BUDGET_S), worst_start_s=0.0)
