"""Step time and memory against the number of layers, per implementation.

A scanned stack of ``L`` checkpointed layers (``L`` = 1 ... 64) of the Pallas
matmul+GELU kernel of ``examples/pallas_gelu_matmul.py``; for each
implementation the step time (median [min-max] over ``--repeats`` rounds;
each round runs every implementation once, in an order rotated by the round)
and the compiled step's memory (``memory_analysis()``: temporaries +
arguments + outputs; deterministic). Prints a table, writes a PNG plot (with
matplotlib, from the ``bench`` extra).

On a CPU the kernels run in Pallas interpret mode, so absolute times say
nothing about a GPU; the shape of the curves (linear in ``L``) is what this
shows. Interpret mode also lowers kernels to ordinary XLA operations, which
XLA's own dead-code elimination can thin out (a real ``pallas_call`` runs
whole or not at all), so the gaps between implementations are smaller here than
with real kernels: for those, see ``counts.py`` and ``accel_mlp.py``.

No goal: this script shows how the costs grow; the goals are in
``counts.py``, ``cost.py``, ``accel_mlp.py`` and ``gpu_transformer.py``.

Run:    python benchmarks/scaling.py [--out scaling.png] [--max-layers 64]
Smoke:  python benchmarks/scaling.py --smoke   (1-4 layers, tiny shapes, no
        plot unless --out is given)
"""

from __future__ import annotations

import argparse
import os
import sys
import time

import jax
import jax.numpy as jnp

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
import _report as R  # noqa: E402
import accel_mlp as G  # noqa: E402

IMPLS = tuple(i for i in G.IMPLS if i != G.XLA)   # the kernel rows


def measure(layers_list, m, d, repeats):
  """``{impl: [(layers, [seconds per round], memory bytes)]}``."""
  interpret = jax.default_backend() != "gpu"
  results = {impl: [] for impl in IMPLS}
  for layers in layers_list:
    params, x = G.make_inputs("gelu_matmul", layers, m, d, jnp.float32)
    compiled, memory = {}, {}
    for impl in IMPLS:
      fn = G.stack_grad(G.build("gelu_matmul", impl, interpret, 32), "gelu_matmul")
      compiled[impl] = fn.lower(params, x).compile()
      memory[impl] = G.program_memory(compiled[impl])
      jax.block_until_ready(compiled[impl](params, x))   # warm-up
    samples = {impl: [] for impl in IMPLS}
    for r in range(repeats):
      order = IMPLS[r % len(IMPLS):] + IMPLS[:r % len(IMPLS)]
      for impl in order:
        t0 = time.perf_counter()
        jax.block_until_ready(compiled[impl](params, x))
        samples[impl].append(time.perf_counter() - t0)
    for impl in IMPLS:
      results[impl].append((layers, samples[impl], memory[impl]))
  return results


def plot(results, path):
  import matplotlib
  matplotlib.use("Agg")
  import matplotlib.pyplot as plt
  fig, (a1, a2) = plt.subplots(1, 2, figsize=(10, 4))
  for impl, rows in results.items():
    ls = [n for n, _, _ in rows]
    spreads = [R.Spread(s) for _, s, _ in rows]
    med = [s.median * 1e3 for s in spreads]
    a1.errorbar(ls, med, yerr=[[m - s.min * 1e3 for m, s in zip(med, spreads)],
                               [s.max * 1e3 - m for m, s in zip(med, spreads)]],
                marker="o", capsize=3, label=impl)
    a2.plot(ls, [mem / 2**20 for _, _, mem in rows], marker="o", label=impl)
  a1.set(xscale="log", yscale="log", xlabel="checkpointed layers",
         ylabel="step time (ms), median and min-max", title="step time")
  a2.set(xscale="log", xlabel="checkpointed layers", ylabel="MiB",
         title="compiled step memory")
  a1.legend()
  fig.suptitle(f"matmul+GELU stack, jax {jax.__version__}, "
               f"{jax.devices()[0].device_kind}")
  fig.tight_layout()
  fig.savefig(path, dpi=110)


def main(argv=None):
  p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  p.add_argument("--max-layers", type=int, default=None, help="default 64 (smoke 4)")
  p.add_argument("--batch", type=int, default=None, help="default 128 (smoke 16)")
  p.add_argument("--width", type=int, default=None, help="default 64 (smoke 32)")
  p.add_argument("--repeats", "--rounds", type=int, default=3,
                 help="timing rounds (default 3, at least 3)")
  p.add_argument("--out", default=None,
                 help="PNG to write (default scaling.png; smoke: none)")
  p.add_argument("--smoke", action="store_true",
                 help="tiny shapes and few layers: checks the script")
  args = p.parse_args(argv)
  t0 = time.perf_counter()
  pick = lambda given, full, small: given if given is not None else (
      small if args.smoke else full)
  max_layers = pick(args.max_layers, 64, 4)
  batch, width = pick(args.batch, 128, 16), pick(args.width, 64, 32)
  repeats = max(3, args.repeats)
  out = pick(args.out, "scaling.png", "")
  layers_list = [n for n in (1, 2, 4, 8, 16, 32, 64) if n <= max_layers]
  print(R.header())
  print(f"x {batch}x{width}, f32; step ms: median [min-max] of {repeats} "
        "rounds, each running every implementation once in turn; memory: "
        "compiled step MiB (deterministic)\n")
  results = measure(layers_list, batch, width, repeats)
  print(f"{'layers':>6s} " + " ".join(f"{i:>32s}" for i in IMPLS))
  for k, layers in enumerate(layers_list):
    cells = [f"{R.spread(results[i][k][1], 1e3, 2)} / {results[i][k][2] / 2**20:.2f}"
             for i in IMPLS]
    print(f"{layers:6d} " + " ".join(f"{c:>32s}" for c in cells))
  print("\nNo goal here: the curves show how step time and memory grow with "
        "the layers; counts.py, cost.py and accel_mlp.py hold the goals.")
  if out:
    try:
      plot(results, out)
      print(f"plot: {out}")
    except ImportError:
      print("plot: not written (matplotlib is missing: pip install -e "
            "'.[bench]')")
  print(f"Finished in {time.perf_counter() - t0:.1f} s.")
  return results


if __name__ == "__main__":
  main()
