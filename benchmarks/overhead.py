"""smartvjp's own overhead: trace + lower, compile, and eager dispatch.

``jit(grad(loss))`` of a 64-layer model (Python-unrolled, and scanned), each
layer one custom-VJP call with JAX-coded rules (``tanh(x @ w)``); and the
per-call dispatch time of an eager call. Measured side by side with
``jax.custom_vjp`` in one run; medians over repeats.

Goals (issue 6): trace + lower at most 1.1x ``jax.custom_vjp``, compile within
noise, eager dispatch at most 1.5x.

Run:  python benchmarks/overhead.py [--layers 64] [--repeats 5] [--profile]
"""

from __future__ import annotations

import argparse
import cProfile
import pstats
import statistics
import time

import jax
import jax.numpy as jnp

from smartvjp import smart_custom_vjp

IMPLS = ("jax.custom_vjp", "smartvjp")


def make(impl):
  def f(x, w):
    return jnp.tanh(x @ w)

  def fwd(x, w):
    y = jnp.tanh(x @ w)
    return y, (x, w, y)

  def bwd(res, g):
    x, w, y = res
    d = g * (1 - y * y)
    return d @ w.T, x.T @ d

  F = (smart_custom_vjp if impl == "smartvjp" else jax.custom_vjp)(f)
  F.defvjp(fwd, bwd)
  return F


def unrolled_loss(F, layers, remat):
  G = jax.checkpoint(F) if remat else F

  def loss(x, ws):
    for i in range(layers):
      x = G(x, ws[i])
    return jnp.sum(x ** 2)
  return loss


def scanned_loss(F, layers, remat):
  G = jax.checkpoint(F) if remat else F

  def loss(x, ws):
    x, _ = jax.lax.scan(lambda x, w: (G(x, w), None), x, ws)
    return jnp.sum(x ** 2)
  return loss


def trace_lower_compile(loss, x, ws):
  """Fresh ``jit`` each time: (trace+lower seconds, compile seconds)."""
  fn = jax.jit(jax.grad(loss, (0, 1)))
  t0 = time.perf_counter()
  lowered = fn.lower(x, ws)
  t1 = time.perf_counter()
  lowered.compile()
  t2 = time.perf_counter()
  return t1 - t0, t2 - t1


def eager_dispatch(F, x, w, n=200):
  F(x, w).block_until_ready()
  t0 = time.perf_counter()
  for _ in range(n):
    y = F(x, w)
  y.block_until_ready()
  return (time.perf_counter() - t0) / n


def measure(layers=64, repeats=5, width=32):
  x = jnp.ones((8, width))
  ws = jnp.full((layers, width, width), 0.01)
  rows = []
  for kind, make_loss in (("unrolled", unrolled_loss), ("scanned", scanned_loss)):
    for remat in (False, True):
      res = {}
      for impl in IMPLS:
        tl, cc = [], []
        for _ in range(repeats):
          loss = make_loss(make(impl), layers, remat)  # new functions: no cache
          a, b = trace_lower_compile(loss, x, ws)
          tl.append(a)
          cc.append(b)
        res[impl] = (statistics.median(tl), statistics.median(cc))
      rows.append((kind, remat, res))
  eager = {impl: statistics.median(
      eager_dispatch(make(impl), x, ws[0]) for _ in range(repeats))
      for impl in IMPLS}
  return rows, eager


def main(argv=None):
  p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  p.add_argument("--layers", type=int, default=64)
  p.add_argument("--repeats", type=int, default=5)
  p.add_argument("--profile", action="store_true",
                 help="cProfile smartvjp's unrolled trace+lower")
  args = p.parse_args(argv)
  print(f"jax {jax.__version__}, {jax.devices()[0].platform}; {args.layers} "
        f"layers; median of {args.repeats}\n")
  rows, eager = measure(args.layers, args.repeats)
  print(f"{'model':9s} {'remat':6s} {'trace+lower jax':>16s} {'smartvjp':>10s} "
        f"{'ratio':>7s} {'compile jax':>12s} {'smartvjp':>10s} {'ratio':>7s}")
  for kind, remat, res in rows:
    (tj, cj), (ts, cs) = res["jax.custom_vjp"], res["smartvjp"]
    print(f"{kind:9s} {str(remat):6s} {tj * 1e3:14.1f}ms {ts * 1e3:8.1f}ms "
          f"{ts / tj:6.2f}x {cj * 1e3:10.1f}ms {cs * 1e3:8.1f}ms {cs / cj:6.2f}x")
  ej, es = eager["jax.custom_vjp"], eager["smartvjp"]
  print(f"\neager dispatch per call: jax.custom_vjp {ej * 1e6:.1f} us, smartvjp "
        f"{es * 1e6:.1f} us ({es / ej:.2f}x)")
  if args.profile:
    x = jnp.ones((8, 32))
    ws = jnp.full((args.layers, 32, 32), 0.01)
    prof = cProfile.Profile()
    prof.enable()
    trace_lower_compile(unrolled_loss(make("smartvjp"), args.layers, True), x, ws)
    prof.disable()
    pstats.Stats(prof).sort_stats("cumulative").print_stats(25)
  return rows, eager


if __name__ == "__main__":
  main()
