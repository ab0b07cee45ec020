"""``benchmarks/audit_gpu.py`` on a CPU (``--smoke``): the audit runs with
``measure=True`` on the matmul+GELU stack, the peaks measured by
``tools/gpu_session.py``'s ``env`` stage reach it as ``peaks=``, and the
entry keeps the prediction beside the paired measurement."""

from __future__ import annotations

import importlib.util
import json
import os
import sys

import pytest

ROOT = os.path.abspath(os.path.join(os.path.dirname(__file__), os.pardir))
pytestmark = pytest.mark.filterwarnings("ignore::DeprecationWarning")


@pytest.fixture(scope="module")
def script():
  spec = importlib.util.spec_from_file_location(
      "audit_gpu", os.path.join(ROOT, "benchmarks", "audit_gpu.py"))
  module = importlib.util.module_from_spec(spec)
  sys.modules["audit_gpu"] = module
  spec.loader.exec_module(module)
  return module


def test_smoke_passes_the_measured_peaks(script, tmp_path):
  env = tmp_path / "env.json"
  peaks = {"flops": 2.5e11, "bytes": 3.5e10}
  env.write_text(json.dumps({"audit_peaks": peaks}))
  out = tmp_path / "audit_gpu.json"
  doc = script.main(["--smoke", "--only", "accel_mlp", "--out", str(out),
                     "--peaks", str(env)])
  assert json.loads(out.read_text()) == json.loads(json.dumps(doc,
                                                              default=str))
  assert doc["schema"] == script.SCHEMA and doc["peaks"] == peaks
  [entry] = doc["entries"]
  assert entry["name"] == "accel_mlp/gelu_matmul" and "error" not in entry
  assert {k: entry["model"]["peaks"][k] for k in peaks} == peaks
  assert "from the argument" in entry["model"]["peaks_source"]
  assert entry["predicted_ratio"] > 0 and entry["measured_ratio"] > 0
  assert entry["sites"] and all(s["name"] for s in entry["sites"])
