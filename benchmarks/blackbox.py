"""CPU wall time with opaque kernels of controlled cost, side by side.

Callback kernels do numpy work sized so that ``f`` costs 0.7 units, ``fwd``
1.0, ``bwd`` 1.0 and ``fwd_bwd`` 1.6. A stack of ``L`` layers (each one call)
is differentiated with and without ``jax.checkpoint`` per layer; for each
implementation the table gives the median step time, the ratio to
``jax.custom_vjp``, and the ratio to the lower bound: the sum of the costs of
the kernels that must run for that implementation's schedule, measured in the
same run by timing the kernels alone. The black-box heat simulator of
``examples/blackbox_heat.py`` gets the same treatment.

Goals (issue 6): smartvjp within 1.05x of its lower bound, and its speed-up
over ``jax.custom_vjp`` under remat at least 0.95 of the ideal
``(2 fwd + bwd) / (f + fwd + bwd)``.

Run:  python benchmarks/blackbox.py [--layers 16] [--unit-ms 4] [--repeats 7]
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time

import jax
import jax.numpy as jnp
import numpy as np

sys.path.insert(0, os.path.join(os.path.dirname(__file__), os.pardir, "examples"))
import blackbox_heat as BH  # noqa: E402

from smartvjp import smart_custom_vjp  # noqa: E402

COSTS = {"f": 0.7, "fwd": 1.0, "bwd": 1.0, "fwd_bwd": 1.6}


_WORK_SIZE = 4096


def _step(a):
  # single-threaded numpy ufuncs: no BLAS thread pool competing with XLA
  return np.sin(a) * 1.0001


def calibrate(unit_ms: float) -> int:
  """Iterations of an elementwise numpy step that take ``unit_ms``."""
  a = np.linspace(0.0, 1.0, _WORK_SIZE)
  n = 2000
  best = float("inf")
  for _ in range(3):
    t0 = time.perf_counter()
    for _ in range(n):
      a = _step(a)
    best = min(best, (time.perf_counter() - t0) / n)
  return max(1, int(unit_ms / 1e3 / best))


class Work:
  """Numpy busy work: ``units(c)`` runs ``c`` units."""

  def __init__(self, iters_per_unit):
    self.iters = iters_per_unit
    self.a = np.linspace(0.0, 1.0, _WORK_SIZE)

  def units(self, c):
    a = self.a
    for _ in range(int(round(c * self.iters))):
      a = _step(a)
    return float(a[0]) * 0.0


def make_rules(work: Work):
  def kernel(cost, fn, outs, *args):
    shapes = [jax.ShapeDtypeStruct(o.shape, o.dtype) for o in outs]

    def host(*a):
      z = work.units(cost)
      return [np.asarray(o + z, np.float32) for o in fn(*a)]
    return jax.pure_callback(host, shapes, *args)

  def f(x):
    return kernel(COSTS["f"], lambda x: [np.sin(x)], [x], x)[0]

  def fwd(x):
    y, c = kernel(COSTS["fwd"], lambda x: [np.sin(x), np.cos(x)], [x, x], x)
    return y, c

  def bwd(c, g):
    return (kernel(COSTS["bwd"], lambda c, g: [c * g], [g], c, g)[0],)

  def fwd_bwd(x, g):
    return (kernel(COSTS["fwd_bwd"], lambda x, g: [np.cos(x) * g], [g], x, g)[0],)
  return f, fwd, bwd, fwd_bwd


def implementations(work):
  f, fwd, bwd, fb = make_rules(work)
  out = {}
  for name in ("jax.custom_vjp", "optimize_remat", "smartvjp", "smartvjp+fused"):
    if name.startswith("smartvjp"):
      F = smart_custom_vjp(f)
      F.defvjp(fwd, bwd, fwd_bwd=fb if name.endswith("fused") else None)
    else:
      F = jax.custom_vjp(f)
      F.defvjp(fwd, bwd, optimize_remat=name == "optimize_remat")
    out[name] = F
  return out


# kernels each implementation must run per layer
SCHEDULES = {
    (False, "jax.custom_vjp"): {"fwd": 1, "bwd": 1},
    (False, "optimize_remat"): {"fwd": 1, "bwd": 1},
    (False, "smartvjp"): {"fwd": 1, "bwd": 1},
    (False, "smartvjp+fused"): {"fwd": 1, "bwd": 1},
    (True, "jax.custom_vjp"): {"fwd": 2, "bwd": 1},
    (True, "optimize_remat"): {"f": 1, "fwd": 1, "bwd": 1},
    (True, "smartvjp"): {"f": 1, "fwd": 1, "bwd": 1},
    (True, "smartvjp+fused"): {"f": 1, "fwd_bwd": 1},
}


def stack_loss(F, layers, remat):
  layer = jax.checkpoint(F) if remat else F

  def loss(x):
    for _ in range(layers):
      x = layer(x)
    return jnp.sum(x ** 2)
  return loss


def median_time(fn, x, repeats):  # used for the heat simulator
  jax.block_until_ready(fn(x))
  times = []
  for _ in range(repeats):
    t0 = time.perf_counter()
    jax.block_until_ready(fn(x))
    times.append(time.perf_counter() - t0)
  return statistics.median(times)


def run_stack(work, layers, repeats):
  """Interleaved rounds: each round times every program and every kernel once,
  so drift on a noisy machine hits all of them alike; medians over rounds."""
  x = jnp.linspace(-1.0, 1.0, 256, dtype=jnp.float32)
  programs = {(remat, name): jax.jit(jax.grad(stack_loss(F, layers, remat)))
              for remat in (True, False)
              for name, F in implementations(work).items()}
  # each kernel alone, as a jitted callback (so the bound includes the
  # callback's own dispatch cost, which every implementation pays)
  f, fwd, bwd, fb = make_rules(work)
  kernels = {"f": jax.jit(f), "fwd": jax.jit(fwd),
             "bwd": jax.jit(lambda x: bwd(x, x)),
             "fwd_bwd": jax.jit(lambda x: fb(x, x))}
  for fn in [*programs.values(), *kernels.values()]:
    jax.block_until_ready(fn(x))
  times = {k: [] for k in programs}
  kernel_times = {k: [] for k in COSTS}
  for _ in range(repeats):
    for key, fn in programs.items():
      t0 = time.perf_counter()
      jax.block_until_ready(fn(x))
      times[key].append(time.perf_counter() - t0)
    for name, fn in kernels.items():
      for _ in range(3):
        t0 = time.perf_counter()
        jax.block_until_ready(fn(x))
        kernel_times[name].append(time.perf_counter() - t0)
  costs = {k: statistics.median(v) for k, v in kernel_times.items()}
  rows = []
  for remat in (True, False):
    base = statistics.median(times[remat, "jax.custom_vjp"])
    for name in implementations(work):
      t = statistics.median(times[remat, name])
      bound = layers * sum(costs[k] * n for k, n in SCHEDULES[remat, name].items())
      rows.append((remat, name, t, t / base, t / bound))
  ideal = (2 * costs["fwd"] + costs["bwd"]) / (costs["f"] + costs["fwd"] + costs["bwd"])
  return rows, costs, ideal


def run_heat(repeats, nx=200, nt=2000):
  sim = BH.HeatSimulator(nx=nx, nt=nt)
  comp, apply_then_vjp = BH.make_component(sim)
  T0 = jnp.asarray(sim.initial_state(), jnp.float32)
  t0_np = np.asarray(T0, np.float64)
  g = np.ones(nx)
  ep = {
      "apply": lambda: sim.apply(t0_np),
      "apply_with_residuals": lambda: sim.apply_with_residuals(t0_np),
      "bwd": lambda r=sim.apply_with_residuals(t0_np)[1]: sim.bwd(r, g),
      "vector_jacobian_product": lambda: sim.vector_jacobian_product(t0_np, g),
  }
  ep_t = {k: statistics.median(_times(v, repeats)) for k, v in ep.items()}
  modes = [
      ("apply + vjp (jax.custom_vjp, tesseract-jax)", BH.loss(apply_then_vjp),
       ep_t["apply"] + ep_t["vector_jacobian_product"]),
      ("smartvjp, no remat (residual path)", BH.loss(comp),
       ep_t["apply_with_residuals"] + ep_t["bwd"]),
      ("smartvjp, checkpoint (apply + vjp)", BH.loss(jax.checkpoint(comp)),
       ep_t["apply"] + ep_t["vector_jacobian_product"]),
  ]
  rows = []
  base = None
  for name, prog, bound in modes:
    t = median_time(jax.jit(jax.grad(prog)), T0, repeats)
    base = base or t
    rows.append((name, t, t / base, t / bound))
  return rows, ep_t


def _times(fn, repeats):
  out = []
  for _ in range(repeats):
    t0 = time.perf_counter()
    fn()
    out.append(time.perf_counter() - t0)
  return out


def main(argv=None):
  p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  p.add_argument("--layers", type=int, default=16)
  p.add_argument("--unit-ms", type=float, default=8.0)
  p.add_argument("--repeats", type=int, default=7)
  args = p.parse_args(argv)
  work = Work(calibrate(args.unit_ms))
  print(f"jax {jax.__version__}, {os.cpu_count()} CPUs; 1 unit = "
        f"{args.unit_ms} ms of numpy work; {args.layers} layers; median of "
        f"{args.repeats}\n")
  rows, costs, ideal = run_stack(work, args.layers, args.repeats)
  print("each kernel alone (jitted callback): " + ", ".join(f"{k} {v * 1e3:.2f} ms" for k, v in
                                      costs.items()))
  print(f"\n{'checkpoint':10s} {'implementation':16s} {'step':>9s} "
        f"{'vs jax.custom_vjp':>18s} {'vs lower bound':>15s}")
  for remat, name, t, rel, bound in rows:
    print(f"{'yes' if remat else 'no':10s} {name:16s} {t * 1e3:7.1f}ms "
          f"{rel:17.3f}x {bound:14.3f}x")
  smart = next(r for r in rows if r[0] and r[1] == "smartvjp")
  speedup = 1 / smart[3]
  print(f"\nremat speed-up of smartvjp over jax.custom_vjp: {speedup:.3f}x; "
        f"ideal (2 fwd + bwd)/(f + fwd + bwd), measured costs = {ideal:.3f}x; achieved "
        f"{speedup / ideal:.3f} of ideal (goal >= 0.95)")
  worst = max(r[4] for r in rows if r[1].startswith("smartvjp"))
  print(f"smartvjp worst ratio to its lower bound: {worst:.3f}x (goal <= 1.05)")

  heat_rows, ep_t = run_heat(args.repeats)
  print("\nBlack-box heat simulator (200 cells, 2000 steps): endpoint times "
        + ", ".join(f"{k} {v * 1e3:.0f} ms" for k, v in ep_t.items()))
  for name, t, rel, bound in heat_rows:
    print(f"  {name:45s} {t * 1e3:7.1f}ms {rel:6.3f}x vs first, "
          f"{bound:5.3f}x its endpoints")
  return rows, heat_rows


if __name__ == "__main__":
  main()
