"""``benchmarks/gpu_transformer.py``: its smoke mode runs on a CPU, and its
GPU-sized model lowers for an H200 here (Pallas lowers the shipped kernels
to Triton in Python) with the launches and residual writes it promises."""

from __future__ import annotations

import importlib.util
import json
import os
import sys

import jax
import numpy as np
import pytest

ROOT = os.path.abspath(os.path.join(os.path.dirname(__file__), os.pardir))
from smartvjp import _versions

pytestmark = [
    pytest.mark.skipif(not _versions.SHIPS_TRITON_PALLAS_OPS,
                       reason="the model uses JAX's Triton Pallas kernels, "
                       "which jax 0.12.1 removed"),
    pytest.mark.filterwarnings("ignore:The Pallas Triton backend is deprecated"),
    pytest.mark.filterwarnings("ignore::DeprecationWarning")]


@pytest.fixture(scope="module")
def bench():
  spec = importlib.util.spec_from_file_location(
      "gpu_transformer", os.path.join(ROOT, "benchmarks", "gpu_transformer.py"))
  module = importlib.util.module_from_spec(spec)
  sys.modules["gpu_transformer"] = module
  spec.loader.exec_module(module)
  return module


def test_smoke_runs_on_cpu(bench, tmp_path, capsys):
  out = tmp_path / "smoke.json"
  argv = ["--smoke", "--layers", "1", "--batch", "1", "--seq", "16",
          "--policies", "nothing_saveable", "--rounds", "2",
          "--check-steps", "1", "--out", str(out)]
  bench.main(argv)
  doc = json.loads(out.read_text())
  assert doc["schema"] == bench.SCHEMA and doc["status"] == "complete"
  assert doc["argv"] == argv and doc["interpret"] is (
      jax.default_backend() != "gpu")
  assert {"device_kind", "platform", "host", "cpu_count"} <= set(doc["machine"])
  assert {"jax", "jaxlib", "python"} <= set(doc["versions"])
  r = doc["policies"]["nothing_saveable"]
  for s in bench.ALL_SCHEDULES:
    step = r[s]["step"]
    assert 0 < step["min_s"] <= step["median_s"] <= step["max_s"]
    assert len(step["samples_s"]) == 2
    assert r[s]["memory"]["total_bytes"] > 0 and len(r[s]["losses"]) == 1
    pair = r[s]["paired_to_shipped"]
    assert pair["min"] <= pair["median"] <= pair["max"]
  # optimize_remat=True runs the shipped rules, bitwise too; in this model
  # (each kernel's f its fwd less the residuals) it launches what swapped
  # does. XLA alone computes the model another way, with no Pallas kernel.
  assert r["optimize_remat"]["bitwise_equal_shipped"]
  assert r["optimize_remat"]["launches"] == r["swapped"]["launches"]
  assert r["xla"]["launches"] == {} and r["xla"]["residual_bytes"] == 0
  np.testing.assert_allclose(r["xla"]["losses"], r["shipped"]["losses"],
                             rtol=2e-5)
  times = doc["kernel_times_s"]
  assert set(times) == {"attention", "rms_norm"}
  assert all(t[k] > 0 for t in times.values() for k in ("f", "fwd"))
  assert r["ideal_swapped_s"] == pytest.approx(
      r["shipped"]["step"]["median_s"] - sum(
          n * (times[k]["fwd"] - times[k]["f"])
          for k, n in (("attention", 1), ("rms_norm", 2))))
  goals = r["goals"]
  assert len(goals) == 5
  # the deterministic goals hold on any machine; step time is a measurement
  for goal, ok in goals.items():
    if not goal.startswith("step time"):
      assert ok, goal
  printed = capsys.readouterr().out
  assert "goal values: losses and parameters bitwise equal: met" in printed
  assert "median [min-max]" in printed and doc["versions"]["jax"] in printed
  assert bench.table(doc) in printed
  bench.main(["--from-json", str(out)])   # the same tables from the file
  assert capsys.readouterr().out.strip() == bench.table(doc)


def test_the_gpu_model_lowers_for_an_h200(bench):
  ex, cfg = bench.EX, bench.GPU_CONFIG
  params = jax.eval_shape(lambda: ex.init_params(cfg, jax.random.key(0)))
  tokens = jax.ShapeDtypeStruct((cfg.batch, cfg.seq + 1), "int32")
  want = ex.expected_launches(cfg)
  residual = {}
  for schedule in ex.SCHEDULES:
    kernels = ex.load_kernels(schedule == "swapped")
    launches = ex.count_step(cfg, kernels, ex.POLICIES["nothing_saveable"],
                             params, tokens)
    assert ex.by_label(launches) == want[schedule], schedule
    residual[schedule] = ex.residual_bytes(launches)
  # per layer and step: lse (batch x heads x seq, f32) once per attention
  # call and rstd (batch x seq, bf16) once per RMSNorm call, swapped
  lse, rstd = cfg.batch * cfg.heads * cfg.seq * 4, cfg.batch * cfg.seq * 2
  assert residual["swapped"] == cfg.layers * (lse + 2 * rstd)
  assert residual["shipped"] == 2 * residual["swapped"]
