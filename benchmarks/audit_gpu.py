"""``smartvjp.audit(..., measure=True)`` on a GPU, against its own measurement.

Two steps, audited one after the other (the JSON is rewritten after each):

* ``gpu_transformer/nothing_saveable``: ``benchmarks/gpu_transformer.py``'s
  model on JAX's shipped Pallas kernels as shipped (attention and RMSNorm,
  ``jax.custom_vjp`` in JAX's own files), the step the audit is for;
* ``accel_mlp/gelu_matmul``: ``benchmarks/accel_mlp.py``'s matmul+GELU
  stack (8 checkpointed layers, hidden 4096, batch 8192, bf16) built as its
  ``smartvjp+fused`` column.

The audit's time model reads the chip's peaks: ``--peaks`` names a JSON
whose ``audit_peaks`` (``{"flops", "bytes"}``, this chip's measured bf16
matmul rate and copy bandwidth: ``tools/gpu_session.py``'s ``env.json``)
is passed as ``peaks=``; without it the table's entry (a datasheet figure
for an H200) is used, and the JSON says which. Each entry keeps what
``reading`` takes from ``report.data``: the prediction, the paired
measurement, and each site's predicted saving.

Run on a GPU:  python benchmarks/audit_gpu.py --out FILE.json [--peaks env.json]
Smoke (CPU):   python benchmarks/audit_gpu.py --smoke --out FILE.json
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
import platform
import sys
import time

import jax
import jax.numpy as jnp

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
sys.path.insert(0, os.path.dirname(HERE))
sys.path.insert(0, os.path.join(os.path.dirname(HERE), "examples"))

import accel_mlp   # noqa: E402
import pallas_ops_transformer as EX   # noqa: E402
import smartvjp    # noqa: E402

SCHEMA = "smartvjp/audit_gpu/1"


def reading(report) -> dict:
  """What this benchmark keeps of an audit: the one place that reads
  ``report.data`` (its keys are the audit's; absent ones are ``None``)."""
  d = report.data
  predicted, measured = d.get("predicted") or {}, d.get("measured") or {}
  return dict(
      predicted=predicted, measured=measured,
      predicted_ratio=predicted.get("predicted_ratio"),
      measured_ratio=measured.get("paired_ratio"),
      model=d.get("model"), errors=d.get("errors"),
      audit_cost_in_compiles=d.get("audit_cost_in_compiles"),
      sites=[dict(name=s.get("name"), called_at=s.get("called_at"),
                  runs=s.get("runs"), predicted=s.get("predicted"),
                  suggestion=s.get("suggestion"))
             for s in d.get("sites") or []])


def transformer_job(smoke):
  """The shipped-kernel transformer step and its arguments; ``None`` where
  this JAX ships no Triton Pallas kernels (jax 0.12.1 removed them)."""
  if importlib.util.find_spec(EX.ATTENTION) is None:
    return None
  cfg = EX.Config(steps=1) if smoke else EX.Config(
      layers=4, batch=8, seq=2048, heads=16, head_dim=64, mlp=4096,
      vocab=8192, dtype="bfloat16", steps=1)
  step = EX.make_step(cfg, *EX.load_kernels(False),
                      EX.POLICIES["nothing_saveable"], interpret=smoke)
  params = EX.init_params(cfg, jax.random.key(0))
  return step, (params, EX.make_data(cfg, jax.random.key(1)))


def stack_job(smoke):
  layers, m, d = (1, 16, 16) if smoke else (8, 8192, 4096)
  op = accel_mlp.build("gelu_matmul", "smartvjp+fused", interpret=smoke,
                       target=None if smoke else "gpu",
                       block=16 if smoke else None)
  step = accel_mlp.stack_grad(op, "gelu_matmul")
  return step, accel_mlp.make_inputs("gelu_matmul", layers, m, d,
                                     jnp.bfloat16)


JOBS = {"gpu_transformer/nothing_saveable": transformer_job,
        "accel_mlp/gelu_matmul": stack_job}


def main(argv=None):
  p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  p.add_argument("--out", required=True)
  p.add_argument("--smoke", action="store_true",
                 help="tiny shapes, interpret mode (CPU ok)")
  p.add_argument("--peaks", metavar="PATH", default=None,
                 help="a JSON with \"audit_peaks\": this chip's measured rates")
  p.add_argument("--only", nargs="*", default=None)
  opts = p.parse_args(argv)
  peaks = None
  if opts.peaks:
    with open(opts.peaks) as fh:
      peaks = json.load(fh).get("audit_peaks")
  doc = dict(schema=SCHEMA, jax=jax.__version__,
             device=str(jax.devices()[0].device_kind),
             python=platform.python_version(), peaks=peaks,
             peaks_source=(f"measured ({opts.peaks})" if peaks else
                           "the audit's table"), entries=[])

  def save():
    with open(opts.out + ".tmp", "w") as f:
      json.dump(doc, f, indent=1, default=str)
    os.replace(opts.out + ".tmp", opts.out)

  save()
  for name, job in JOBS.items():
    if opts.only and not any(o in name for o in opts.only):
      continue
    t = time.perf_counter()
    try:
      built = job(opts.smoke)
      if built is None:
        doc["entries"].append(dict(name=name, skipped=(
            f"jax {jax.__version__} ships no Triton Pallas kernels")))
        continue
      step, args = built
      report = smartvjp.audit(step, *args, measure=True, peaks=peaks)
      entry = dict(name=name, seconds=time.perf_counter() - t,
                   **reading(report))
      doc["entries"].append(entry)
      print(f"{name}: predicted ratio {entry['predicted_ratio']}, measured "
            f"{entry['measured_ratio']}", flush=True)
    except Exception as e:   # noqa: BLE001  (recorded; the next one runs)
      doc["entries"].append(dict(name=name, error=f"{type(e).__name__}: {e}"))
      print(name, "ERROR", type(e).__name__, str(e)[:300], flush=True)
    finally:
      save()
  return doc


if __name__ == "__main__":
  main()
