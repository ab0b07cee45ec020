"""Step time and memory against the number of layers, per implementation.

A scanned stack of ``L`` checkpointed layers (``L`` = 1 ... 64) of the Pallas
matmul+GELU kernel of ``examples/pallas_gelu_matmul.py``; for each
implementation the median step time and the compiled step's memory
(``memory_analysis()``). Prints a table, writes a PNG plot.

On a CPU the kernels run in Pallas interpret mode, so absolute times say
nothing about a GPU; the shape of the curves (linear in ``L``) is what this
shows. Interpret mode also lowers kernels to ordinary XLA operations, which
XLA's own dead-code elimination can thin out (a real ``pallas_call`` runs
whole or not at all), so the gaps between implementations are smaller here than
with real kernels: for those, see ``counts.py`` and ``gpu_mlp.py``.

Run:  python benchmarks/scaling.py [--out scaling.png] [--max-layers 64]
"""

from __future__ import annotations

import argparse
import os
import sys

import jax
import jax.numpy as jnp

sys.path.insert(0, os.path.dirname(__file__))
import gpu_mlp as G  # noqa: E402


def measure(layers_list, m, d, repeats):
  interpret = jax.default_backend() != "gpu"
  results = {impl: [] for impl in G.IMPLS}
  for layers in layers_list:
    params, x = G.make_inputs("gelu_matmul", layers, m, d, jnp.float32)
    for impl in G.IMPLS:
      fn = G.stack_grad(G.build("gelu_matmul", impl, interpret, 32), "gelu_matmul")
      compiled = fn.lower(params, x).compile()
      results[impl].append((layers, G.time_compiled(compiled, (params, x), repeats),
                            G.program_memory(compiled)))
  return results


def plot(results, path):
  import matplotlib
  matplotlib.use("Agg")
  import matplotlib.pyplot as plt
  fig, (a1, a2) = plt.subplots(1, 2, figsize=(10, 4))
  for impl, rows in results.items():
    ls, ts, ms = zip(*rows)
    a1.plot(ls, [t * 1e3 for t in ts], marker="o", label=impl)
    a2.plot(ls, [m / 2**20 for m in ms], marker="o", label=impl)
  a1.set(xscale="log", yscale="log", xlabel="checkpointed layers",
         ylabel="step time (ms)", title="step time")
  a2.set(xscale="log", xlabel="checkpointed layers", ylabel="MiB",
         title="compiled step memory")
  a1.legend()
  fig.suptitle(f"matmul+GELU stack, jax {jax.__version__}, "
               f"{jax.devices()[0].device_kind}")
  fig.tight_layout()
  fig.savefig(path, dpi=110)


def main(argv=None):
  p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  p.add_argument("--max-layers", type=int, default=64)
  p.add_argument("--batch", type=int, default=128)
  p.add_argument("--width", type=int, default=64)
  p.add_argument("--repeats", type=int, default=3)
  p.add_argument("--out", default="scaling.png")
  args = p.parse_args(argv)
  layers_list = [n for n in (1, 2, 4, 8, 16, 32, 64) if n <= args.max_layers]
  results = measure(layers_list, args.batch, args.width, args.repeats)
  print(f"jax {jax.__version__}, {jax.devices()[0].device_kind}; x "
        f"{args.batch}x{args.width}; step ms / compiled MiB\n")
  print(f"{'layers':>6s} " + " ".join(f"{i:>22s}" for i in G.IMPLS))
  for k, layers in enumerate(layers_list):
    cells = [f"{results[i][k][1] * 1e3:9.1f} / {results[i][k][2] / 2**20:7.2f}"
             for i in G.IMPLS]
    print(f"{layers:6d} " + " ".join(f"{c:>22s}" for c in cells))
  if args.out:
    plot(results, args.out)
    print(f"\nplot: {args.out}")
  return results


if __name__ == "__main__":
  main()
