"""A black-box simulator behind callbacks (seed 003): 1-D plasma heat diffusion.

Seed 003 is pasteurlabs/tesseract-jax#27, one of the reports this project
answers: differentiating a loss of a black-box simulator wrapped for JAX runs
``apply`` and then ``vector_jacobian_product``, which repeats the forward
simulation, because JAX cannot know that one call could keep what the
gradient needs.

The simulator is numpy/scipy code outside JAX, exposed as a tesseract-style
component would be, through four ``jax.pure_callback`` endpoints:

* ``apply(T0)``: the final temperature after ``nt`` implicit steps;
* ``apply_with_residuals(T0)``: the final temperature and a checkpointed
  trajectory (every ``stride``-th state);
* ``bwd(trajectory, g)``: the adjoint sweep from those checkpoints;
* ``vector_jacobian_product(T0, g)``: an adjoint that recomputes the forward
  internally (a fused ``fwd_bwd``).

One ``smart_custom_vjp`` gives both trade-offs: without ``jax.checkpoint`` the
residual path runs (``apply_with_residuals`` + ``bwd``: the separate forward
``apply`` disappears), under ``jax.checkpoint`` only ``apply`` runs forward
and ``vector_jacobian_product`` backward (what tesseract-jax does today, least
memory). The physics: each step solves ``(I + A(k)) T_new = T`` with
``k = dt * T**2.5 / 3.5 / dx**2`` (tridiagonal, reflecting ends), as in the
seed's diffrax ``conduct_plasma``.

Run:  python examples/blackbox_heat.py
"""

from __future__ import annotations

import collections
import time

import jax
import jax.numpy as jnp
import numpy as np
from scipy.linalg import solve_banded

from smartvjp import smart_custom_vjp

CALLS: collections.Counter = collections.Counter()


class HeatSimulator:
  """The black box (numpy/scipy, float64 inside)."""

  def __init__(self, nx=200, nt=2000, t1=1e-3, stride=50):
    self.nx, self.nt, self.stride = nx, nt, stride
    self.dx = 2.0 / nx
    self.dt = t1 / nt
    self.coeff = self.dt / 3.5 / self.dx ** 2

  def initial_state(self):
    x = np.arange(-1 + self.dx / 2, 1, self.dx)[: self.nx]
    return 2.0 + np.tanh(5.0 * x)

  # -- one step and its adjoint ---------------------------------------------
  def _bands(self, T):
    k = self.coeff * T ** 2.5
    d = 1.0 + 2.0 * k
    d[0] -= k[0]
    d[-1] -= k[-1]
    ab = np.zeros((3, self.nx))
    ab[0, 1:] = -k[1:]      # super-diagonal: row i, column i+1
    ab[1] = d
    ab[2, :-1] = -k[:-1]    # sub-diagonal: row i+1, column i
    return ab, k

  def step(self, T):
    ab, _ = self._bands(T)
    return solve_banded((1, 1), ab, T)

  def step_adjoint(self, T, T_new, lam):
    """Cotangent of ``T`` given that of ``T_new = step(T)``."""
    ab, _ = self._bands(T)
    abT = np.zeros_like(ab)       # the transposed matrix's bands
    abT[0, 1:] = ab[2, :-1]
    abT[1] = ab[1]
    abT[2, :-1] = ab[0, 1:]
    mu = solve_banded((1, 1), abT, lam)
    c = np.full(self.nx, 2.0)
    c[0] = c[-1] = 1.0
    mu_l = np.concatenate([[0.0], mu[:-1]])
    mu_r = np.concatenate([mu[1:], [0.0]])
    grad_k = T_new * (c * mu - mu_l - mu_r)
    dk_dT = 2.5 * self.coeff * T ** 1.5
    return mu - dk_dT * grad_k

  # -- the endpoints --------------------------------------------------------
  def apply(self, T0):
    CALLS["apply"] += 1
    T = np.asarray(T0, np.float64)
    for _ in range(self.nt):
      T = self.step(T)
    return T

  def apply_with_residuals(self, T0):
    CALLS["apply_with_residuals"] += 1
    return self._forward_with_checkpoints(T0)

  def bwd(self, checkpoints, g):
    CALLS["bwd"] += 1
    return self._adjoint(np.asarray(checkpoints, np.float64),
                         np.asarray(g, np.float64))

  def vector_jacobian_product(self, T0, g):
    CALLS["vector_jacobian_product"] += 1
    _, checkpoints = self._forward_with_checkpoints(T0)   # recomputed inside
    return self._adjoint(checkpoints, np.asarray(g, np.float64))

  def _forward_with_checkpoints(self, T0):
    T = np.asarray(T0, np.float64)
    checkpoints = []
    for n in range(self.nt):
      if n % self.stride == 0:
        checkpoints.append(T)
      T = self.step(T)
    return T, np.stack(checkpoints)

  def _adjoint(self, checkpoints, lam):
    for seg in reversed(range(len(checkpoints))):
      start = seg * self.stride
      steps = min(self.stride, self.nt - start)
      states = [checkpoints[seg]]
      for _ in range(steps):            # recompute the segment
        states.append(self.step(states[-1]))
      for n in reversed(range(steps)):
        lam = self.step_adjoint(states[n], states[n + 1], lam)
    return lam


def make_component(sim: HeatSimulator, dtype=jnp.float32):
  """The simulator as a ``smart_custom_vjp`` over ``T0: f32[nx] -> f32[nx]``."""
  n_ckpt = -(-sim.nt // sim.stride)
  state = jax.ShapeDtypeStruct((sim.nx,), dtype)
  traj = jax.ShapeDtypeStruct((n_ckpt, sim.nx), dtype)
  cast = lambda *xs: tuple(np.asarray(x, dtype) for x in xs)

  def apply(T0):
    return jax.pure_callback(lambda t: cast(sim.apply(t))[0], state, T0)

  def apply_with_residuals(T0):
    T, ckpts = jax.pure_callback(
        lambda t: cast(*sim.apply_with_residuals(t)), (state, traj), T0)
    return T, ckpts

  def bwd(ckpts, g):
    return (jax.pure_callback(lambda c, g: cast(sim.bwd(c, g))[0], state,
                              ckpts, g),)

  def vector_jacobian_product(T0, g):
    return (jax.pure_callback(
        lambda t, g: cast(sim.vector_jacobian_product(t, g))[0], state, T0, g),)

  component = smart_custom_vjp(apply)
  component.defvjp(apply_with_residuals, bwd, fwd_bwd=vector_jacobian_product)

  # what tesseract-jax does today: apply forward, the VJP endpoint backward
  apply_then_vjp = jax.custom_vjp(apply)
  apply_then_vjp.defvjp(lambda T0: (apply(T0), T0), vector_jacobian_product)
  return component, apply_then_vjp


def jax_reference(sim: HeatSimulator):
  """The same solver in JAX (``tridiagonal_solve`` in a ``scan``)."""
  def step(T, _):
    k = sim.coeff * T ** 2.5
    d = 1.0 + 2.0 * k
    d = d.at[0].add(-k[0]).at[-1].add(-k[-1])
    dl = jnp.zeros_like(k).at[1:].set(-k[:-1])
    du = jnp.zeros_like(k).at[:-1].set(-k[1:])
    return jax.lax.linalg.tridiagonal_solve(dl, d, du, T[:, None])[:, 0], None

  return lambda T0: jax.lax.scan(step, T0, None, length=sim.nt)[0]


def loss(F):
  return lambda T0: jnp.sum(F(T0) ** 2)   # a nonlinear loss in the script


def _time(fn, *args, repeat=3):
  """``repeat`` wall times of ``fn(*args)`` in seconds, after a warm-up."""
  fn(*args)  # compile / warm up
  times = []
  for _ in range(repeat):
    t0 = time.perf_counter()
    jax.block_until_ready(fn(*args))
    times.append(time.perf_counter() - t0)
  return times


def _spread(xs, digits=3):
  """``median [min-max]``."""
  xs = np.asarray(xs)
  return (f"{np.median(xs):.{digits}f} [{xs.min():.{digits}f}-"
          f"{xs.max():.{digits}f}]")


def interleaved(fns, *args, rounds=5):
  """Wall times in seconds, ``{name: [one per round]}``: each round runs every
  function once, in turn, so that drifts in machine load hit all alike."""
  for fn in fns.values():
    jax.block_until_ready(fn(*args))   # compile / warm up
  times = {name: [] for name in fns}
  for _ in range(rounds):
    for name, fn in fns.items():
      t0 = time.perf_counter()
      jax.block_until_ready(fn(*args))
      times[name].append(time.perf_counter() - t0)
  return times


def main(nx=200, nt=2000, rounds=5):
  t_start = time.perf_counter()
  small = HeatSimulator(nx=48, nt=120, stride=16)
  comp, _ = make_component(small)
  T0 = jnp.asarray(small.initial_state(), jnp.float32)
  ref = jax.jit(jax.grad(loss(jax_reference(small))))(T0)
  print(f"Gradient check on a {small.nx}-cell, {small.nt}-step grid against a "
        "pure-JAX solver (tridiagonal_solve in a scan),")
  print("error = max |ours - reference| / max |reference|:")
  for name, prog in (("smartvjp, no remat", loss(comp)),
                     ("smartvjp, jax.checkpoint", loss(jax.checkpoint(comp)))):
    g = jax.jit(jax.grad(prog))(T0)
    err = float(jnp.max(jnp.abs(g - ref)) / jnp.max(jnp.abs(ref)))
    print(f"  {name:26s} {err:.1e}")

  sim = HeatSimulator(nx=nx, nt=nt)
  comp, apply_then_vjp = make_component(sim)
  T0 = jnp.asarray(sim.initial_state(), jnp.float32)
  g = jnp.ones_like(T0)
  t0_np = np.asarray(T0, np.float64)
  print(f"\nEndpoint times ({nx} cells, {nt} steps, numpy/scipy called "
        "directly), s, median [min-max] of 3:")
  endpoints = {
      "apply": lambda: sim.apply(t0_np),
      "apply_with_residuals": lambda: sim.apply_with_residuals(t0_np),
      "bwd": lambda r=sim.apply_with_residuals(t0_np)[1]: sim.bwd(r, g),
      "vector_jacobian_product": lambda: sim.vector_jacobian_product(t0_np, g),
  }
  alone = {}
  for name, fn in endpoints.items():
    runs = _time(lambda: fn())
    alone[name] = float(np.median(runs))
    print(f"  {name:24s} {_spread(runs)}")

  modes = {
      "jax.custom_vjp (tesseract-jax)": loss(apply_then_vjp),
      "smartvjp, no remat (residual path)": loss(comp),
      "smartvjp, jax.checkpoint": loss(jax.checkpoint(comp)),
  }
  fns = {name: jax.jit(jax.grad(prog)) for name, prog in modes.items()}
  schedules = {}
  for name, fn in fns.items():
    CALLS.clear()
    jax.block_until_ready(fn(T0))
    schedules[name] = dict(CALLS)
  times = interleaved(fns, T0, rounds=rounds)
  base = next(iter(fns))
  ratios = {}
  print(f"\nOne jitted gradient step of sum(T_final**2); {rounds} rounds, each "
        "running every row once in turn.")
  print("step: wall time in s, median [min-max] over the rounds. alone: the "
        "endpoint medians above, added up")
  print("over the endpoints the row runs. ratio: step time / row 1's step "
        "time in the same round, median [min-max].")
  print(f"  {'implementation':36s} {'endpoints run':36s} {'step (s)':>19s} "
        f"{'alone (s)':>9s}  ratio to row 1")
  for name in fns:
    step = _spread(times[name])
    alone_s = sum(alone[k] * v for k, v in schedules[name].items())
    calls = ", ".join(f"{k} {v}" for k, v in schedules[name].items())
    if name == base:
      ratio = "1 (the baseline)"
    else:
      r = np.array(times[name]) / np.array(times[base])
      ratio = f"{np.median(r):.2f} [{r.min():.2f}-{r.max():.2f}]"
      if schedules[name] == schedules[base]:
        ratio += " same schedule as row 1: noise"
    print(f"  {name:36s} {calls:36s} {step:>19s} {alone_s:9.3f}  {ratio}")
    ratios[name] = None if name == base else float(np.median(
        np.array(times[name]) / np.array(times[base])))
  residual = ratios["smartvjp, no remat (residual path)"]
  print(f"\nWhat to conclude: one smart_custom_vjp gives both schedules. "
        "Without jax.checkpoint it runs\napply_with_residuals + bwd, so the "
        "separate forward apply disappears (median step ratio "
        f"{residual:.2f} here);\nunder jax.checkpoint it runs apply + "
        "vector_jacobian_product, as tesseract-jax does, and keeps no "
        "trajectory.")
  print(f"\nFinished in {time.perf_counter() - t_start:.1f} s.")


if __name__ == "__main__":
  main()
