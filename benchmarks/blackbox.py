"""CPU wall time with opaque kernels of controlled cost, side by side.

Callback kernels do numpy work sized so that ``f`` costs 0.7 units, ``fwd``
1.0, ``bwd`` 1.0 and ``fwd_bwd`` 1.6. A stack of ``L`` layers (each one call)
is differentiated with and without ``jax.checkpoint`` per layer; for each
implementation the table gives the step time, the ratio to
``jax.custom_vjp``, and the ratio to the lower bound: the sum of the costs of
the kernels that must run for that implementation's schedule, measured in the
same run by timing the kernels alone. The black-box heat simulator of
``examples/blackbox_heat.py`` (seed 003: pasteurlabs/tesseract-jax#27, a
report this project answers) gets the same treatment.

Rounds are interleaved: each round runs every program once (in an order
rotated by the round) and every kernel alone three times, so drift on a noisy
machine hits all of them alike. Times are the median [min-max] over the
rounds; ratios are computed round by round (against the same round's
``jax.custom_vjp`` step, or the same round's kernel times) and given as the
median [min-max] of those per-round ratios.

Goals, each printed with a verdict (met / not met), judged on the
medians of the per-round ratios:

* smartvjp (with and without the fused rule, with and without
  ``jax.checkpoint``) within 1.05x of its lower bound, in its worst row;
* its speed-up over ``jax.custom_vjp`` under remat at least 0.95 of the
  ideal ``(2 fwd + bwd) / (f + fwd + bwd)``, computed from the kernel costs
  measured in the same round (not the nominal 0.7 : 1 : 1);
* the heat simulator: smartvjp without ``jax.checkpoint`` (the residual path,
  ``apply_with_residuals`` + ``bwd``) is faster than ``apply`` +
  ``vector_jacobian_product`` under ``jax.custom_vjp`` (ratio below 1).

Run:    python benchmarks/blackbox.py [--layers 16] [--unit-ms 8] [--repeats 7]
Smoke:  python benchmarks/blackbox.py --smoke   (4 layers, 1 ms units, 3
        rounds, a small heat grid: checks that the script runs)
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

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.join(HERE, os.pardir, "examples"))
sys.path.insert(1, HERE)
sys.path.insert(2, os.path.join(HERE, os.pardir))
import _report as R  # noqa: E402
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


def _rotated(items, r):
  items = list(items)
  k = r % len(items)
  return items[k:] + items[:k]


def run_stack(work, layers, repeats):
  """Interleaved rounds: each round times every program once (order rotated
  by the round) and every kernel alone three times.

  Returns ``(rows, costs, speedup)``: rows of ``dict(remat, name, step, vs_base,
  vs_bound)`` (lists, one entry per round: seconds, then the per-round
  ratios), ``costs`` ``{kernel: [seconds per round]}`` (the median of its
  three runs in that round) and ``speedup`` ``dict(speedup, ideal,
  achieved)`` (per-round lists; under remat, ``jax.custom_vjp`` / smartvjp)."""
  x = jnp.linspace(-1.0, 1.0, 256, dtype=jnp.float32)
  impls = implementations(work)
  programs = {(remat, name): jax.jit(jax.grad(stack_loss(F, layers, remat)))
              for remat in (True, False) for name, F in impls.items()}
  # each kernel alone, as a jitted callback (so the bound includes the
  # callback's own dispatch cost, which every implementation pays)
  f, fwd, bwd, fb = make_rules(work)
  kernels = {"f": jax.jit(f), "fwd": jax.jit(fwd),
             "bwd": jax.jit(lambda x: bwd(x, x)),
             "fwd_bwd": jax.jit(lambda x: fb(x, x))}
  for fn in [*programs.values(), *kernels.values()]:
    jax.block_until_ready(fn(x))
  times = {k: [] for k in programs}
  costs = {k: [] for k in COSTS}
  for r in range(repeats):
    for key in _rotated(programs, r):
      t0 = time.perf_counter()
      jax.block_until_ready(programs[key](x))
      times[key].append(time.perf_counter() - t0)
    for name, fn in kernels.items():
      alone = []
      for _ in range(3):
        t0 = time.perf_counter()
        jax.block_until_ready(fn(x))
        alone.append(time.perf_counter() - t0)
      costs[name].append(statistics.median(alone))
  bound = {key: [layers * sum(costs[k][r] * n for k, n in SCHEDULES[key].items())
                 for r in range(repeats)] for key in programs}
  rows = []
  for remat in (True, False):
    base = times[remat, "jax.custom_vjp"]
    for name in impls:
      t = times[remat, name]
      rows.append(dict(remat=remat, name=name, step=t,
                       vs_base=R.paired_ratios(t, base),
                       vs_bound=R.paired_ratios(t, bound[remat, name])))
  speedup = R.paired_ratios(times[True, "jax.custom_vjp"], times[True, "smartvjp"])
  ideal = [(2 * costs["fwd"][r] + costs["bwd"][r])
           / (costs["f"][r] + costs["fwd"][r] + costs["bwd"][r])
           for r in range(repeats)]
  achieved = R.paired_ratios(speedup, ideal)
  return rows, costs, dict(speedup=speedup, ideal=ideal, achieved=achieved)


def _times(fn, repeats):
  out = []
  for _ in range(repeats):
    t0 = time.perf_counter()
    fn()
    out.append(time.perf_counter() - t0)
  return out


HEAT_BASE = "apply + vjp (jax.custom_vjp, tesseract-jax)"
HEAT_RESIDUAL = "smartvjp, no remat (residual path)"


def run_heat(repeats, nx=200, nt=2000):
  """The heat simulator: ``(rows, endpoint_times)``; rows of ``dict(name,
  step, vs_base, vs_endpoints)`` (per-round lists), endpoint times
  ``{endpoint: [seconds, one per round]}`` (numpy/scipy called directly)."""
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
  ep_t = {k: _times(v, repeats) for k, v in ep.items()}
  modes = {
      HEAT_BASE: (BH.loss(apply_then_vjp), ("apply", "vector_jacobian_product")),
      HEAT_RESIDUAL: (BH.loss(comp), ("apply_with_residuals", "bwd")),
      "smartvjp, checkpoint (apply + vjp)": (
          BH.loss(jax.checkpoint(comp)), ("apply", "vector_jacobian_product")),
  }
  fns = {name: jax.jit(jax.grad(prog)) for name, (prog, _) in modes.items()}
  times = BH.interleaved(fns, T0, rounds=repeats)
  rows = []
  for name, (_, endpoints) in modes.items():
    bound = [sum(ep_t[e][r] for e in endpoints) for r in range(repeats)]
    rows.append(dict(name=name, step=times[name],
                     vs_base=R.paired_ratios(times[name], times[HEAT_BASE]),
                     vs_endpoints=R.paired_ratios(times[name], bound)))
  return rows, ep_t


def main(argv=None):
  p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  p.add_argument("--layers", type=int, default=None, help="default 16 (smoke 4)")
  p.add_argument("--unit-ms", type=float, default=None,
                 help="ms of numpy work per cost unit (default 8; smoke 1)")
  p.add_argument("--repeats", "--rounds", type=int, default=None,
                 help="interleaved rounds (default 7; smoke 3; at least 3)")
  p.add_argument("--smoke", action="store_true",
                 help="a quick run that checks the script, not the goals")
  args = p.parse_args(argv)
  t_start = time.perf_counter()
  pick = lambda given, full, small: given if given is not None else (
      small if args.smoke else full)
  layers = pick(args.layers, 16, 4)
  unit_ms = pick(args.unit_ms, 8.0, 1.0)
  repeats = max(3, pick(args.repeats, 7, 3))
  heat = (32, 60) if args.smoke else (200, 2000)
  work = Work(calibrate(unit_ms))
  print(R.header())
  print(f"1 unit = {unit_ms:g} ms of numpy work (f 0.7, fwd 1, bwd 1, fwd_bwd "
        f"1.6 units); {layers} layers; {repeats} interleaved rounds; figures: "
        "median [min-max] over the rounds" + (
            " -- SMOKE RUN: sizes too small for the figures to mean anything"
            if args.smoke else "") + "\n")
  rows, costs, speed = run_stack(work, layers, repeats)
  print("each kernel alone (jitted callback, ms): " + ", ".join(
      f"{k} {R.spread(v, 1e3, 2)}" for k, v in costs.items()))
  print("step: ms; vs jax.custom_vjp and vs lower bound: per-round ratios "
        "(lower bound: the kernels of that\nimplementation's schedule, each "
        "timed alone in the same round)")
  head = (f"{'checkpoint':10s} {'implementation':16s} {'step ms':>24s} "
          f"{'vs jax.custom_vjp':>22s} {'vs lower bound':>22s}")
  print(head)
  print("-" * len(head))
  for row in rows:
    print(f"{'yes' if row['remat'] else 'no':10s} {row['name']:16s} "
          f"{R.spread(row['step'], 1e3):>24s} "
          f"{R.spread(row['vs_base'], digits=3, unit='x'):>22s} "
          f"{R.spread(row['vs_bound'], digits=3, unit='x'):>22s}")
  goals = R.Goals()
  speedup, ideal, achieved = (R.Spread(speed[k]) for k in
                              ("speedup", "ideal", "achieved"))
  print(f"\nremat speed-up of smartvjp over jax.custom_vjp: "
        f"{speedup.fmt(digits=3, unit='x')}; ideal (2 fwd + bwd)/(f + fwd + "
        f"bwd) from the measured kernel costs: {ideal.fmt(digits=3, unit='x')}; "
        f"achieved {achieved.fmt(digits=3)} of ideal")
  smart = [r for r in rows if r["name"].startswith("smartvjp")]
  worst = max(smart, key=lambda r: R.Spread(r["vs_bound"]).median)
  worst_s = R.Spread(worst["vs_bound"])
  goals.check(f"smartvjp <= 1.05x its lower bound in every row (worst: "
              f"{worst['name']}, checkpoint {'yes' if worst['remat'] else 'no'}"
              f", {worst_s.fmt(digits=3, unit='x')})", worst_s.median <= 1.05)
  goals.check(f"remat speed-up >= 0.95 of ideal (achieved "
              f"{achieved.fmt(digits=3)})", achieved.median >= 0.95)

  heat_rows, ep_t = run_heat(repeats, *heat)
  print(f"\nBlack-box heat simulator (seed 003: pasteurlabs/tesseract-jax#27; "
        f"{heat[0]} cells, {heat[1]} steps). Endpoint times, numpy/scipy "
        "called directly (ms): "
        + ", ".join(f"{k} {R.spread(v, 1e3, 0)}" for k, v in ep_t.items()))
  print(f"  {'implementation':45s} {'step ms':>24s} {'vs row 1':>22s} "
        f"{'vs its endpoints':>22s}")
  for row in heat_rows:
    print(f"  {row['name']:45s} {R.spread(row['step'], 1e3):>24s} "
          f"{R.spread(row['vs_base'], digits=3, unit='x'):>22s} "
          f"{R.spread(row['vs_endpoints'], digits=3, unit='x'):>22s}")
  residual = R.Spread(next(r for r in heat_rows if r["name"] == HEAT_RESIDUAL)
                      ["vs_base"])
  goals.check(f"heat: the residual path faster than apply + vjp (ratio "
              f"{residual.fmt(digits=3, unit='x')} < 1)", residual.median < 1)
  print()
  print(goals.render())
  print(f"\nFinished in {time.perf_counter() - t_start:.1f} s.")
  return rows, heat_rows, goals


if __name__ == "__main__":
  main()
