"""optimistix's solves, jax.custom_vjp against smartvjp: XLA's cost analysis.

Each solve runs with ``optx.RecursiveCheckpointAdjoint`` (whose checkpointed
while loop is an ``equinox.filter_custom_vjp``), under ``jax.grad`` and
``jax.vmap(jax.grad)``. One process per side: ``--side jax`` imports equinox
and optimistix as they are, ``--side smartvjp`` imports them inside
``smartvjp.swap_custom_vjp()``; without ``--side`` both run, one after the
other, and the flops and bytes are printed side by side with a verdict.

    python tools/optimistix_cost.py        # needs optimistix (pip install optimistix)
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys


def measure(side: str) -> dict:
  import jax
  import jax.numpy as jnp
  import smartvjp
  if side == "smartvjp":
    with smartvjp.swap_custom_vjp():
      import optimistix as optx
  else:
    import optimistix as optx
  adjoint = optx.RecursiveCheckpointAdjoint()
  a = jnp.array([1.0, 8.0, 27.0])
  solves = {
      "root_find": lambda a: optx.root_find(
          lambda y, a: y ** 3 - a, optx.Newton(1e-8, 1e-8), jnp.ones(3),
          args=a, throw=False, adjoint=adjoint).value.sum(),
      "least_squares": lambda a: optx.least_squares(
          lambda y, a: y ** 3 - a, optx.LevenbergMarquardt(1e-8, 1e-8),
          jnp.ones(3), args=a, throw=False, adjoint=adjoint).value.sum(),
      "minimise": lambda a: optx.minimise(
          lambda y, a: jnp.sum((y - a) ** 2), optx.BFGS(1e-8, 1e-8),
          jnp.ones(3), args=a, throw=False, adjoint=adjoint).value.sum(),
      "fixed_point": lambda a: optx.fixed_point(
          lambda y, a: jnp.cos(y) * a / 30, optx.FixedPointIteration(1e-8, 1e-8),
          jnp.ones(3), args=a, throw=False, adjoint=adjoint).value.sum(),
  }
  out = {}
  for name, solve in solves.items():
    for how, fn, x in (("grad", jax.grad(solve), a),
                       ("vmap(grad)", jax.vmap(jax.grad(solve)),
                        jnp.stack([a, a]))):
      compiled = jax.jit(fn).lower(x).compile()
      cost = compiled.cost_analysis()
      cost = cost[0] if isinstance(cost, list) else cost
      out[f"{name} {how}"] = {
          "flops": cost.get("flops"), "bytes": cost.get("bytes accessed"),
          "grad": [float(v) for v in jnp.ravel(jax.jit(fn)(x))]}
  return out


def main() -> int:
  ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  ap.add_argument("--side", choices=["jax", "smartvjp"])
  args = ap.parse_args()
  if args.side:
    print(json.dumps(measure(args.side)))
    return 0
  runs = {}
  for side in ("jax", "smartvjp"):
    done = subprocess.run([sys.executable, __file__, "--side", side],
                          capture_output=True, text=True, check=True)
    runs[side] = json.loads(done.stdout.strip().splitlines()[-1])
  import jax
  print(f"jax {jax.__version__}; flops / bytes accessed (XLA's cost "
        "analysis of the jitted program)")
  worse = 0
  for case, mine in runs["smartvjp"].items():
    theirs = runs["jax"][case]
    more = mine["flops"] > theirs["flops"] or mine["bytes"] > theirs["bytes"]
    same = mine["grad"] == theirs["grad"]
    worse += more or not same
    print(f"  {case:28s} jax.custom_vjp {theirs['flops']:8.0f} / "
          f"{theirs['bytes']:8.0f}   smartvjp {mine['flops']:8.0f} / "
          f"{mine['bytes']:8.0f}   gradients {'equal' if same else 'DIFFER'}"
          + ("   MORE WORK" if more else ""))
  print("goal: smartvjp does no more work than jax.custom_vjp, gradients "
        f"bit for bit: {'met' if not worse else 'not met'}")
  return 1 if worse else 0


if __name__ == "__main__":
  sys.exit(main())
