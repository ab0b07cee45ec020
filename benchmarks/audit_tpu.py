"""``smartvjp.audit`` of the project's own TPU steps, with ``measure=True``.

Audits, one after another (the JSON is rewritten after each, so a run cut
short keeps what it finished):

* both ``benchmarks/accel_mlp.py`` stacks (8 checkpointed layers of the
  GELU matmul and of RMSNorm+GELU, width 4096, batch 8192, bf16), built as
  its ``smartvjp+fused`` column: the audit's ``as_written`` is its
  ``jax.custom_vjp`` column, ``smartvjp_fused`` its ``smartvjp+fused``;
* ``benchmarks/tpu_lm.py``'s train step under each policy, built as its
  ``jax.custom_vjp`` column (the two kernels as ``jax.custom_vjp``, flash
  attention as JAX ships it, unswapped: three sites, found in their own
  files) and as its ``smartvjp+fused`` column (for the fused rules).

Each entry holds the audit's prediction beside its measurement
(interleaved pairs: median, min-max, paired ratio): the roofline time
model's ``predicted_ratio`` (``docs/audit.md``; the model, the device's
peaks and notes under ``model``), the old bytes-accessed and flops ratios,
each site's own predicted saving (seconds per step and share of the step,
with its rules' own costs), the sites' counts, and the audit's own cost in
compiles. At the end, one line per entry: predicted and measured ratio and
whether their signs agree (``sign``: a ratio within 0.2% of 1 counts as no
change, which agrees with a measured interquartile range holding 1).

Run on a TPU:  python benchmarks/audit_tpu.py --out FILE.json
Smoke (CPU):   python benchmarks/audit_tpu.py --smoke --out FILE.json
"""

from __future__ import annotations

import argparse
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

import accel_mlp   # noqa: E402
import tpu_lm      # noqa: E402
import smartvjp    # noqa: E402


def _entry(name, report, seconds):
  d = report.data
  return dict(
      name=name, seconds=seconds, predicted=d["predicted"],
      measured=d.get("measured"), step=d["step"], errors=d["errors"],
      model=d["model"], sign=sign_agrees(d),
      audit_cost_in_compiles=d["audit_cost_in_compiles"],
      audit_seconds=d["audit_seconds"],
      sites=[{k: s[k] for k in ("name", "kind", "defined_at", "called_at",
                                "path", "multiplicity", "opaque", "runs",
                                "residual_bytes", "predicted", "suggestion",
                                "hazards")}
             for s in d["sites"]])


def sign_agrees(d, flat=0.002):
  """Whether the predicted step ratio has the measured one's sign (a ratio
  within ``flat`` of 1 is no change: it agrees with a measurement whose
  interquartile range holds 1); ``None`` without both."""
  m = d.get("measured") or {}
  pred, ratio = d["predicted"].get("predicted_ratio"), m.get("paired_ratio")
  if pred is None or ratio is None:
    return None
  lo, hi = m["paired_ratio_iqr"]
  if abs(pred - 1) <= flat:
    return lo <= 1.0 <= hi
  if lo <= 1.0 <= hi:
    return False
  return (pred < 1) == (ratio < 1)


def summary_line(e):
  if "error" in e:
    return f"{e['name']:45} {e['error']}"
  p, m = e["predicted"], e["measured"] or {}
  sites = ", ".join(
      f"{s['name']} {s['predicted'].get('share_of_step') or 0:+.1%}"
      for s in e["sites"])
  return (f"{e['name']:45} {p.get('candidate', '-'):15} predicted "
          f"{p.get('predicted_ratio') or float('nan'):.3f} (bytes "
          f"{p.get('bytes_accessed_ratio') or float('nan'):.3f}) measured "
          f"{m.get('paired_ratio', float('nan')):.3f} sign "
          f"{'yes' if e['sign'] else 'no' if e['sign'] is not None else '-'}"
          f"  sites saved: {sites}")


def main(argv=None):
  p = argparse.ArgumentParser()
  p.add_argument("--out", required=True)
  p.add_argument("--smoke", action="store_true")
  p.add_argument("--only", nargs="*", default=None)
  p.add_argument("--budget", type=float, default=None,
                 help="seconds after which no further audit is started")
  opts = p.parse_args(argv)
  smoke = opts.smoke
  doc = dict(schema="smartvjp/audit_tpu/1", jax=jax.__version__,
             device=str(jax.devices()[0].device_kind),
             python=platform.python_version(), entries=[])

  def save():
    with open(opts.out, "w") as f:
      json.dump(doc, f, indent=1, default=str)

  jobs = []
  layers, m, d = (2, 64, 32) if smoke else (8, 8192, 4096)
  for workload in accel_mlp.WORKLOADS:
    def job(workload=workload):
      op = accel_mlp.build(workload, "smartvjp+fused", interpret=smoke,
                           target=None if smoke else "tpu",
                           block=16 if smoke else None)
      step = accel_mlp.stack_grad(op, workload)
      args = accel_mlp.make_inputs(workload, layers, m, d, jnp.bfloat16)
      return step, args
    jobs.append((f"accel_mlp/{workload}", job))
  cfg = tpu_lm.SMOKE_CONFIG if smoke else tpu_lm.TPU_CONFIG
  # the three unswapped sites under nothing_saveable first, then the fused
  # rules under each policy, then the unswapped sites under the others
  order = [("nothing_saveable", "jax.custom_vjp")] + [
      (p, "smartvjp+fused") for p in tpu_lm.POLICIES] + [
      (p, "jax.custom_vjp") for p in tpu_lm.POLICIES
      if p != "nothing_saveable"]
  for policy, column in order:
    def job(policy=policy, column=column):
      step = tpu_lm.make_train_step(cfg, column, tpu_lm.POLICIES[policy],
                                    smoke)
      tokens = jax.ShapeDtypeStruct((cfg.batch, cfg.seq + 1), jnp.int32)
      return step, (tpu_lm.state_shapes(cfg), tokens)
    jobs.append((f"tpu_lm/{policy}/{column}", job))
  start = time.perf_counter()
  for name, job in jobs:
    if opts.only and not any(o in name for o in opts.only):
      continue
    if opts.budget and time.perf_counter() - start > opts.budget:
      doc["entries"].append(dict(name=name, error="not run: --budget spent"))
      continue
    t = time.perf_counter()
    try:
      step, args = job()
      report = smartvjp.audit(step, *args, measure=True)
      doc["entries"].append(_entry(name, report, time.perf_counter() - t))
      print(name, report.data["measured"]["summary"],
            f"audit {report.data['audit_cost_in_compiles']:.2f}x a compile",
            flush=True)
      for s in report.sites:
        print(f"  {s['name']}: predicted saving "
              f"{(s['predicted'].get('seconds_saved') or 0) * 1e3:.3f} ms "
              f"per step; {s['suggestion']}", flush=True)
    except Exception as e:   # noqa: BLE001  (recorded; the next one runs)
      doc["entries"].append(dict(name=name, error=f"{type(e).__name__}: {e}"))
      print(name, "ERROR", type(e).__name__, str(e)[:300], flush=True)
    save()
  save()
  print("\nstep ratios, swapped / as written:")
  for e in doc["entries"]:
    print(summary_line(e))
  signs = [e.get("sign") for e in doc["entries"] if e.get("sign") is not None]
  print(f"predicted sign matches measured in {sum(signs)} of {len(signs)}")


if __name__ == "__main__":
  main()
