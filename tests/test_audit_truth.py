"""``benchmarks/audit_truth.py``: the audit's ground truth on the CPU
(issue 68). Its smoke mode runs every entry at tiny shapes in a
subprocess (the ``shard_map`` entry needs 4 host devices, set before JAX
starts): every entry produces its fields, and the audit's compiled counts
equal the kernels' host counters. Accuracy is not asserted here (a few
pairs at tiny shapes are noise); the full run's verdicts are in
``benchmarks/results/audit_truth_*.json`` and ``docs/audit.md``."""

import importlib.util
import json
import os
import subprocess
import sys

import pytest

ROOT = os.path.abspath(os.path.join(os.path.dirname(__file__), os.pardir))
SCRIPT = os.path.join(ROOT, "benchmarks", "audit_truth.py")


def _load():
  sys.path.insert(0, os.path.join(ROOT, "benchmarks"))
  spec = importlib.util.spec_from_file_location("smartvjp_bench_audit_truth",
                                                SCRIPT)
  module = importlib.util.module_from_spec(spec)
  sys.modules[spec.name] = module   # its dataclasses look their module up
  spec.loader.exec_module(module)
  return module


T = _load()


@pytest.mark.parametrize("n,j", [(4, 0), (10, 1), (20, 5), (40, 13),
                                 (100, 39)])
def test_median_interval_is_the_binomial_order_statistics(n, j):
  # 95% ranks (1-based) of a median: n=10: 2 and 9; n=20: 6 and 15;
  # n=40: 14 and 27; n=100: 40 and 61 (binomial tables)
  values = list(range(n))[::-1]
  assert T.median_interval(values) == (j, n - 1 - j)


def test_saving_is_one_less_the_median_paired_ratio():
  base = [1.0] * 9
  s = T.saving([0.8] * 4 + [0.7, 0.9, 0.75, 0.85, 0.8], base)
  assert s["ratio"] == pytest.approx(0.8)
  assert s["saving"] == pytest.approx(0.2)
  lo, hi = s["interval"]
  assert lo <= 0.2 <= hi and s["pairs"] == 9


@pytest.mark.parametrize("est,true,ok", [
    (0.30, 0.30, True), (0.37, 0.30, True), (0.38, 0.30, False),
    (0.012, 0.003, True), (0.014, 0.003, False), (None, 0.1, None),
    (-0.005, 0.004, True)])
def test_within_the_tolerance(est, true, ok):
  # ±25% of the truth or 1 point of the step, whichever is larger
  assert T.within(est, true) is ok


@pytest.mark.parametrize("ratio_interval,saving,advice", [
    ((0.80, 0.90), 0.15, "swap"), ((0.98, 1.02), 0.0, "no action"),
    ((1.01, 1.05), -0.03, "no action"), ((0.995, 0.998), 0.003, "either")])
def test_right_advice(ratio_interval, saving, advice):
  t = dict(ratio_interval=list(ratio_interval), saving=saving,
           interval=[1 - ratio_interval[1], 1 - ratio_interval[0]])
  assert T.right_advice(t) == advice
  assert T.advice_ok("cannot tell", t) is False


def test_sign_is_judged_only_where_the_interval_excludes_zero():
  certain = dict(saving=0.05, interval=[0.02, 0.08])
  unsure = dict(saving=0.01, interval=[-0.01, 0.03])
  assert T.sign_right(0.04, certain) and not T.sign_right(-0.01, certain)
  assert not T.sign_right(0.0, certain)
  assert T.sign_right(-0.3, unsure)


def test_smoke_every_entry_and_counts_equal_host_counters(tmp_path):
  out = tmp_path / "truth.json"
  env = dict(os.environ, PYTHONPATH=ROOT,
             XLA_FLAGS="--xla_force_host_platform_device_count=4")
  done = subprocess.run([sys.executable, SCRIPT, "--smoke", "--out",
                         str(out)], env=env, capture_output=True, text=True,
                        timeout=900)
  assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
  text = done.stdout
  assert "machine: " in text and "smartvjp at commit " in text
  assert "summary: " in text and "held to: " in text
  doc = json.loads(out.read_text())
  names = [e["name"] for e in doc["entries"]]
  assert names == [e.name for e in T.entries()] and len(names) >= 8
  assert doc["load"]["busy_processes"] == 0 and doc["versions"]["jax"]
  ran = 0
  for e in doc["entries"]:
    if "skipped" in e:   # only the FFI entry, and only without a compiler
      assert e["name"] == "ffi" and "compil" in e["skipped"], e["skipped"]
      continue
    assert "error" not in e, (e["name"], e.get("trace"))
    ran += 1
    t = e["truth"]
    for clock in ("cpu", "wall"):
      assert len(t[clock]["step"]["interval"]) == 2
      assert set(t[clock]["sites"]) == {s["name"] for s in e["sites"]}
    for mode in ("calibrate", "measure"):
      assert "error" not in e[mode], (e["name"], mode, e[mode].get("trace"))
      est = e[mode]["estimates"]
      assert {"step_calibrated", "step_measured", "sites"} <= set(est)
      assert e[mode]["wall_s"] > 0
    assert e["calibrate"]["estimates"]["step_calibrated"] is not None
    assert e["measure"]["estimates"]["step_measured"] is not None
    for s in e["sites"]:
      for mode in ("calibrate", "measure"):
        assert e[mode]["estimates"]["sites"][s["name"]]["advice"] in (
            "swap", "no action", "cannot tell")
    v = e["verdict"]
    assert isinstance(v["met"], bool) and set(v["sites"]) == {
        s["name"] for s in e["sites"]}
    # the counts are facts: the audit's compiled runs equal the kernels'
    # host counters, as written and swapped
    opaque = {s["name"] for s in e["sites"] if s["kind"] != "jax"}
    for config in ("as_written", "smartvjp", "smartvjp_fused"):
      host = t["counts"][config]
      assert "error" not in host and set(host) == opaque, (e["name"], config)
    for mode, checks in e["counts_check"].items():
      for config, c in checks.items():
        assert c["ok"] is not False, (e["name"], mode, config, c)
    assert v["counts_equal"] is True
  assert ran >= 8
  s = doc["summary"]
  assert s["entries"] == ran and isinstance(s["held_to"], bool)
  table = T.markdown(doc)   # the docs' tables, a row per entry and site
  assert table.count("\n| `") == len(names) + sum(
      len(e["sites"]) for e in doc["entries"] if "verdict" in e)
