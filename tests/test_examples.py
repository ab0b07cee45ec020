"""The examples run and show what the README says they show."""

import importlib.util
import os

import pytest


def load(name):
  return load_from("examples", name)


def load_from(folder, name):
  spec = importlib.util.spec_from_file_location(
      name, os.path.join(os.path.dirname(__file__), os.pardir, folder,
                         f"{name}.py"))
  module = importlib.util.module_from_spec(spec)
  spec.loader.exec_module(module)
  return module


def test_seed_remat_table(capsys):
  seed = load("seed_remat")
  table = seed.main()
  out = capsys.readouterr().out
  assert "WRONG" not in out
  remat = "jit(grad(remat(F))), fwd computes its residual"
  assert table[remat, "jax.custom_vjp"][0] == {"fwd": 2, "bwd": 1}
  assert table[remat, "smartvjp"][0] == {"f": 1, "fwd": 1, "bwd": 1}
  literal = "jit(grad(remat(F))), seed's fwd (residual = x)"
  assert table[literal, "smartvjp"][0] == {"f": 1, "bwd": 1}
  named = "named residual, save_only_these_names"
  assert table[named, "optimize_remat"][0] == {"f": 1, "fwd": 1, "bwd": 1}
  assert table[named, "smartvjp"][0] == {"fwd": 1, "bwd": 1}
  fused = "remat(F) with fused fwd_bwd"
  assert table[fused, "smartvjp"][0] == {"f": 1, "fwd_bwd": 1}
  scan = "scan of 4 remat(F) layers"
  assert table[scan, "smartvjp"][0] == {"f": 4, "fwd": 4, "bwd": 4}


def test_counts_benchmark_smartvjp_column():
  counts = load_from("benchmarks", "counts")
  table = counts.measure()
  smart = {row: cells["smartvjp"] for row, cells in table.items()}
  assert all(ok for _, ok, _ in smart.values()), smart
  assert smart["grad(checkpoint(F))"][0] == {"f": 1, "fwd": 1, "bwd": 1}
  assert smart["checkpoint, everything_saveable"][0] == {"fwd": 1, "bwd": 1}
  assert smart["debug print in fwd, checkpoint"][0] == {"f": 1, "fwd": 1,
                                                         "bwd": 1}
  assert table["grad(checkpoint(F))"]["jax.custom_vjp"][0] == {"fwd": 2,
                                                                "bwd": 1}
  assert table["jax.jvp (forward mode)"]["jax.custom_vjp"][2] == "TypeError"


def test_gpu_benchmark_smoke_runs_on_cpu(tmp_path):
  gpu = load_from("benchmarks", "gpu_mlp")
  out = tmp_path / "smoke.json"
  rows = gpu.main(["--smoke", "--out", str(out)])
  assert {r["impl"] for r in rows} == set(gpu.IMPLS)
  assert all(r["step_s"] > 0 and r["program_memory_bytes"] for r in rows)
  assert out.exists()


def test_architecture_walkthrough_is_current():
  import re
  import jax
  walk = load_from("design", "walkthrough")
  recorded = re.search(r"walkthrough.py` \(jax ([\d.]+)\)", open(walk.DOC).read())
  if recorded is None or recorded.group(1) != jax.__version__:
    pytest.skip("generated with another JAX version (jaxpr printing differs)")
  assert walk.main(["--check"]) == 0, "run: python design/walkthrough.py"
