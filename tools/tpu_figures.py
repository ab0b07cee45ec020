"""The TPU results as the docs show them: a PNG and markdown tables.

Reads ``benchmarks/results/accel_mlp_tpu.json`` (``benchmarks/accel_mlp.py``)
and ``benchmarks/results/tpu_lm_*.json`` (``benchmarks/tpu_lm.py``), writes
``docs/tpu_results.png`` (step time relative to ``jax.custom_vjp``, per
workload and per LM policy, with XLA only beside them) and prints the tables
``docs/performance.md`` holds. Nothing is measured here.

Run:  python tools/tpu_figures.py [--png docs/tpu_results.png]
"""

from __future__ import annotations

import argparse
import glob
import json
import os

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
RESULTS = os.path.join(ROOT, "benchmarks", "results")
COLUMNS = ("xla", "jax.custom_vjp", "optimize_remat", "smartvjp",
           "smartvjp+fused")


def load():
  with open(os.path.join(RESULTS, "accel_mlp_tpu.json")) as fh:
    mlp = json.load(fh)
  lm = {}
  for path in sorted(glob.glob(os.path.join(RESULTS, "tpu_lm_*.json"))):
    with open(path) as fh:
      doc = json.load(fh)
    for policy, res in doc["policies"].items():
      lm[policy] = dict(res, commit=doc["versions"]["commit"],
                        jax=doc["versions"]["jax"], peaks=doc.get("peaks"))
  return mlp, lm


def mlp_rows(mlp):
  """``{(workload, hidden): {impl: record}}``."""
  rows = {}
  for r in mlp["results"]:
    rows.setdefault((r["workload"], r["hidden"]), {})[r["impl"]] = r
  return rows


def _ms(r):
  s = r.get("step", {})
  return s.get("median_s") * 1e3 if s.get("status") == "ok" else None


def mlp_table(mlp):
  out = ["| workload | hidden | " + " | ".join(f"`{c}`" for c in COLUMNS)
         + " |", "|---|---:|" + "---:|" * len(COLUMNS)]
  for (workload, hidden), by in mlp_rows(mlp).items():
    base = _ms(by.get("jax.custom_vjp", {}))
    cells = []
    for c in COLUMNS:
      ms = _ms(by.get(c, {}))
      if ms is None:
        cells.append("did not compile (VMEM)")
        continue
      ratio = f" ({ms / base:.2f}x)" if base else ""
      ideal = by[c].get("ideal")
      ideal = f", ideal {ideal['step_s'] * 1e3:.1f}" if ideal else ""
      cells.append(f"{ms:.2f}{ratio}{ideal}")
    out.append(f"| {workload} | {hidden} | " + " | ".join(cells) + " |")
  return "\n".join(out)


def lm_table(lm):
  out = ["| policy | " + " | ".join(f"`{c}`" for c in COLUMNS) + " |",
         "|---|" + "---:|" * len(COLUMNS)]
  for policy, res in lm.items():
    cols = res["columns"]
    base = cols.get("jax.custom_vjp", {}).get("step_s", {}).get("median")
    cells = []
    for c in COLUMNS:
      r = cols.get(c, {})
      if "step_s" not in r:
        cells.append("out of memory" if "RESOURCE_EXHAUSTED" in
                     r.get("error", "") else "-")
        continue
      ms = r["step_s"]["median"] * 1e3
      cells.append(f"{ms:.1f} ({ms / 1e3 / base:.3f}x), MFU "
                   f"{100 * r['mfu']:.1f}%")
    out.append(f"| `{policy}` | " + " | ".join(cells) + " |")
  return "\n".join(out)


def title(mlp, lm) -> str:
  """The figure's title, from the JSON: the chip, the JAX versions and the
  commits measured, and which groups are relative to XLA only (those whose
  ``jax.custom_vjp`` row did not run)."""
  versions = sorted({mlp["versions"]["jax"]} | {
      r.get("jax") for r in lm.values() if r.get("jax")})
  commits = sorted({mlp["versions"].get("commit") or "unknown"} | {
      r["commit"] or "unknown" for r in lm.values()})
  fallback = [f"{w} {h}" for (w, h), by in mlp_rows(mlp).items()
              if _ms(by.get("jax.custom_vjp", {})) is None]
  text = (f"{mlp['machine']['device_kind']}, jax {', '.join(versions)}, "
          f"smartvjp at {', '.join(commits)}: step time relative to "
          "jax.custom_vjp's, lower is faster")
  if fallback:
    text += (f" ({', '.join(fallback)}: relative to xla; its kernel rows "
             "did not run)")
  return text


def plot(mlp, lm, path):
  import matplotlib
  matplotlib.use("Agg")
  import matplotlib.pyplot as plt
  colors = dict(zip(COLUMNS, ("#7f7f7f", "#1f77b4", "#ff7f0e", "#2ca02c",
                              "#d62728")))
  fig, axes = plt.subplots(1, 2, figsize=(12, 4.2),
                           gridspec_kw=dict(width_ratios=[4, 3]))
  groups = [(f"{w}\n{h}", by) for (w, h), by in mlp_rows(mlp).items()]
  groups += [(f"LM\n{p}", {c: dict(step=dict(
      status="ok", median_s=r["step_s"]["median"])) for c, r in
      res["columns"].items() if "step_s" in r}) for p, res in lm.items()]
  for ax, part in ((axes[0], groups[:4]), (axes[1], groups[4:])):
    width = 0.8 / len(COLUMNS)
    for i, (label, by) in enumerate(part):
      # jax.custom_vjp's step, or XLA's where the kernel rows did not compile
      base = _ms(by.get("jax.custom_vjp", {})) or _ms(by.get("xla", {}))
      for j, c in enumerate(COLUMNS):
        ms = _ms(by.get(c, {}))
        if ms is None or base is None:
          continue
        ax.bar(i + (j - 2) * width, ms / base, width, color=colors[c],
               label=c if i == 0 or (label.startswith("gelu") and j) else None)
    ax.axhline(1.0, color="black", lw=0.6)
    ax.set_xticks(range(len(part)), [g[0] for g in part], fontsize=8)
    ax.set_ylabel("step time / jax.custom_vjp's")
    if ax is axes[1]:
      ax.set_ylim(0.9, 1.03)
  axes[0].set_title("one kernel in 8 checkpointed layers (scan), batch 8192")
  axes[1].set_title("decoder LM, 8 layers, 16k tokens per step")
  handles, labels = axes[0].get_legend_handles_labels()
  seen = dict(zip(labels, handles))
  fig.legend([seen[c] for c in COLUMNS if c in seen],
             [c for c in COLUMNS if c in seen], loc="lower center", ncol=5,
             fontsize=8)
  fig.suptitle(title(mlp, lm), fontsize=9)
  fig.tight_layout(rect=(0, 0.08, 1, 0.95))
  fig.savefig(path, dpi=110)


def main(argv=None):
  p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  p.add_argument("--png", default=os.path.join(ROOT, "docs", "tpu_results.png"))
  args = p.parse_args(argv)
  mlp, lm = load()
  print(mlp_table(mlp))
  print()
  print(lm_table(lm))
  if args.png:
    plot(mlp, lm, args.png)
    print(f"\nplot: {args.png}")


if __name__ == "__main__":
  main()
