"""Seven real libraries with smartvjp swapped in by one call, side by side
with ``jax.custom_vjp``.

For each library that imports here (jax-cce, ejkernel, qwix, aqtp, jax-md,
optimistix, TensorFlow Probability's JAX substrate), the same programs run
twice, each side in a fresh process:

* ``--side jax``: the library as installed (``jax.custom_vjp``);
* ``--side smartvjp``: the library imported as usual, then every program
  traced inside ``with smartvjp.swap_custom_vjp(existing=True):``, the one
  call that swaps all seven (see design/migration.md, "Kernels and solvers
  you did not write").

For each case (a program under ``grad``, ``vmap(grad)``, ``grad(vmap)``,
``checkpoint``, eager or jitted) it compares the values bit for bit (else
the largest absolute and relative difference), the gradient program's
equations (all of them, and ``dot_general``, its matrix products, counted
through loop and call bodies once each), XLA's flops for the jitted
gradient, and whether ``smartvjp.swap_report(fn, *args)`` agrees with the
jaxpr (smartvjp's equations present and no ``custom_vjp_call`` exactly when
the report is ``ok``).

    python tools/try_libraries.py                     # every library installed
    python tools/try_libraries.py jax_cce optimistix  # some of them
    python tools/try_libraries.py --json out.json     # also the records

Install the libraries first (they are not smartvjp dependencies), e.g.
``pip install jax-cce qwix aqtp optimistix tfp-nightly`` and
``pip install --no-deps jax-md && pip install ml_collections jraph einops``
on jax 0.12; ejkernel 0.0.80 needs jax 0.10. A library that does not import
is reported as skipped, with the error. Exit status: 0 when every case that
ran is equal or within tolerance, no case does more work, and every
report agrees with its jaxpr; 1 otherwise.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import subprocess
import sys
import tempfile
import time
import traceback

# cases that are not bitwise equal: within tolerance when every difference
# is at most RTOL times the largest magnitude in its array (float32: 8 ulp)
RTOL = 1e-6

LIBRARIES = ("jax_cce", "ejkernel", "qwix", "aqt", "jax_md", "optimistix",
             "tfp", "qpax", "recurrentgemma", "tensorcircuit", "jax_fdm",
             "agjax", "fmmax")


# -- the programs, one function per library ---------------------------------------
# Each returns a list of cases: (name, fn, args, how), where how is a tuple of
# transformations: "grad" (jax.grad over every argument), "vmap" (the
# arguments' leading axis; jax.vmap(grad) when after "grad", grad(vmap) when
# before it), "checkpoint", "jit" (the whole thing jitted; otherwise eager).

def _jax_cce():
  import jax
  import jax.numpy as jnp
  import jax_cce
  x = jax.random.normal(jax.random.key(0), (32, 16))
  w = jax.random.normal(jax.random.key(1), (80, 16)) * 0.3
  labels = jnp.arange(32) % 80

  def loss(x, w):
    return jax_cce.linear_cross_entropy(x, w, labels, chunk_size=32)

  def loss_filtered(x, w):
    return jax_cce.linear_cross_entropy(x, w, labels, chunk_size=16,
                                        filter_eps=8.0)
  xs = jnp.stack([x, 0.5 * x])
  return [
      ("loss", loss, (x, w), ("grad", "jit")),
      ("loss eager", loss, (x, w), ("grad",)),
      ("loss checkpoint", loss, (x, w), ("checkpoint", "grad", "jit")),
      ("filter_eps", loss_filtered, (x, w), ("grad", "jit")),
      ("vmap(grad)", lambda x: loss(x, w), (xs,), ("grad", "vmap", "jit")),
      ("grad(vmap)", lambda x: loss(x, w), (xs,), ("vmap", "grad", "jit")),
  ]


def _ejkernel():
  import jax
  import jax.numpy as jnp
  from ejkernel.kernels._xla.flash_attention import flash_attention
  from ejkernel.modules.operations import fused_cross_entropy
  from ejkernel.ops import FwdParams
  ks = jax.random.split(jax.random.key(0), 4)
  q, k, v = (jax.random.normal(kk, (1, 32, 2, 16)) for kk in ks[:3])
  params = FwdParams(q_blocksize=16, kv_blocksize=16)

  def attention(q, k, v, causal=True):
    return jnp.sum(flash_attention(q, k, v, causal=causal,
                                   fwd_params=params) ** 2)
  logits = jax.random.normal(ks[3], (16, 64))
  targets = jnp.arange(16) % 64

  def cross_entropy(logits, **kw):
    return fused_cross_entropy(logits, targets, platform="xla", **kw).loss
  qs = jnp.stack([q, 0.5 * q])
  return [
      ("flash_attention causal", attention, (q, k, v), ("grad", "jit")),
      ("flash_attention eager", attention, (q, k, v), ("grad",)),
      ("flash_attention checkpoint", attention, (q, k, v),
       ("checkpoint", "grad", "jit")),
      ("flash_attention grad(vmap)", lambda q: attention(q, k, v), (qs,),
       ("vmap", "grad")),
      ("flash_attention vmap(grad)", lambda q: attention(q, k, v), (qs,),
       ("grad", "vmap", "jit")),
      ("fused_cross_entropy", cross_entropy, (logits,), ("grad", "jit")),
      ("fused_cross_entropy smoothing, z-loss",
       lambda x: cross_entropy(x, label_smoothing=0.1, z_loss=1e-3),
       (logits,), ("grad", "jit")),
      ("fused_cross_entropy eager vmap(grad)", cross_entropy,
       (jnp.stack([logits, -logits]),), ("grad", "vmap")),
  ]


def _qwix():
  import flax.linen as nn
  import jax
  import jax.numpy as jnp
  import qwix

  class MLP(nn.Module):
    @nn.compact
    def __call__(self, x):
      x = jax.nn.gelu(nn.Dense(32)(x))
      return nn.Dense(8)(jax.nn.gelu(nn.Dense(32)(x)))
  rules = [qwix.QtRule(module_path=".*", weight_qtype=jnp.int8,
                       act_qtype=jnp.int8, bwd_qtype=jnp.int8)]
  model = qwix.quantize_model(MLP(), qwix.QtProvider(rules))
  x = jax.random.normal(jax.random.key(0), (16, 16))
  params = MLP().init(jax.random.key(1), x)

  def loss(params, x):
    return jnp.mean(model.apply(params, x) ** 2)
  return [
      ("QtProvider int8 MLP", loss, (params, x), ("grad", "jit")),
      ("QtProvider eager", loss, (params, x), ("grad",)),
      ("QtProvider checkpoint", loss, (params, x),
       ("checkpoint", "grad", "jit")),
  ]


def _aqt():
  import jax
  import jax.numpy as jnp
  from aqt.jax.v2 import config
  dg = config.fully_quantized(fwd_bits=8, bwd_bits=8,
                              use_stochastic_rounding=False)
  dg4 = config.fully_quantized(fwd_bits=4, bwd_bits=8, use_fwd_quant=False,
                               use_stochastic_rounding=False)
  x = jax.random.normal(jax.random.key(0), (16, 32))
  w1 = jax.random.normal(jax.random.key(1), (32, 32)) * 0.2
  w2 = jax.random.normal(jax.random.key(2), (32, 8)) * 0.2
  dn = (((1,), (0,)), ((), ()))

  def mlp(cfg):
    def loss(w1, w2, x):
      return jnp.mean(cfg(jax.nn.gelu(cfg(x, w1, dn)), w2, dn) ** 2)
    return loss
  xs = jnp.stack([x, -x])
  return [
      ("fully_quantized 8-bit", mlp(dg), (w1, w2, x), ("grad", "jit")),
      # eager, twice: the DotGeneral object is reused between calls
      ("fully_quantized eager", mlp(dg), (w1, w2, x), ("grad",)),
      ("fully_quantized eager again", mlp(dg), (w1, w2, x), ("grad",)),
      ("4-bit forward, no fwd quant", mlp(dg4), (w1, w2, x), ("grad", "jit")),
      ("vmap(grad)", lambda x: mlp(dg)(w1, w2, x), (xs,),
       ("grad", "vmap", "jit")),
      ("checkpoint", mlp(dg), (w1, w2, x), ("checkpoint", "grad", "jit")),
  ]


def _jax_md():
  import jax
  import jax.numpy as jnp
  from jax_md import energy, rigid_body, simulate, space
  displacement, shift = space.periodic(6.0)
  shape = rigid_body.point_union_shape(
      jnp.array([[-0.5, 0.0, 0.0], [0.5, 0.0, 0.0]], jnp.float32),
      jnp.array([1.0, 1.0], jnp.float32))
  centers = jnp.array([[1.0, 1.0, 1.0], [1.0, 3.2, 1.2], [3.1, 1.1, 2.9],
                       [3.3, 3.4, 3.5]], jnp.float32)
  quat = jnp.array([[1.0, 0.0, 0.0, 0.0], [0.9, 0.1, 0.3, 0.2],
                    [0.7, 0.5, 0.1, 0.3], [0.5, 0.5, 0.5, 0.5]], jnp.float32)
  quat = quat / jnp.linalg.norm(quat, axis=1, keepdims=True)

  def nve(steps, loop, orientations=False):
    def run(sigma, centers, orientation=quat):
      pair = energy.soft_sphere_pair(displacement, sigma=sigma)
      energy_fn = rigid_body.point_energy(pair, shape)
      init, apply = simulate.nve(energy_fn, shift, 1e-3)
      body = rigid_body.RigidBody(centers,
                                  rigid_body.Quaternion(orientation))
      state = init(jax.random.key(1), body, mass=shape.mass(), kT=1e-3)
      if loop == "scan":
        state = jax.lax.scan(lambda s, _: (apply(s), None), state, None,
                             length=steps)[0]
      else:
        state = jax.lax.fori_loop(0, steps, lambda i, s: apply(s), state)
      return (energy_fn(state.position)
              + 1e-2 * jnp.sum(state.position.center ** 2))
    return run if orientations else (lambda sigma, centers: run(sigma,
                                                                centers))
  sigma = jnp.float32(1.2)
  return [
      ("rigid-body NVE, scan of 50 steps", nve(50, "scan"), (sigma, centers),
       ("grad", "jit")),
      ("rigid-body NVE, fori_loop of 20", nve(20, "fori"), (sigma, centers),
       ("grad", "jit")),
      ("rigid-body NVE, checkpoint", nve(20, "scan"), (sigma, centers),
       ("checkpoint", "grad", "jit")),
      # issue 34's crash 4: differentiated in the orientations too
      ("rigid-body NVE, scan, orientations", nve(50, "scan", True),
       (sigma, centers, quat), ("grad", "jit")),
  ]


def _optimistix():
  import jax.numpy as jnp
  import optimistix as optx
  adjoint = optx.RecursiveCheckpointAdjoint()
  a = jnp.array([1.0, 8.0, 27.0])
  solves = {
      "root_find Newton": lambda a: optx.root_find(
          lambda y, a: y ** 3 - a, optx.Newton(1e-8, 1e-8), jnp.ones(3),
          args=a, throw=False, adjoint=adjoint).value.sum(),
      "least_squares LM": lambda a: optx.least_squares(
          lambda y, a: y ** 3 - a, optx.LevenbergMarquardt(1e-8, 1e-8),
          jnp.ones(3), args=a, throw=False, adjoint=adjoint).value.sum(),
      "minimise BFGS": lambda a: optx.minimise(
          lambda y, a: jnp.sum((y - a) ** 2), optx.BFGS(1e-8, 1e-8),
          jnp.ones(3), args=a, throw=False, adjoint=adjoint).value.sum(),
      "fixed_point": lambda a: optx.fixed_point(
          lambda y, a: jnp.cos(y) * a / 30,
          optx.FixedPointIteration(1e-8, 1e-8), jnp.ones(3), args=a,
          throw=False, adjoint=adjoint).value.sum(),
  }
  batch = jnp.stack([a, 2.0 * a])
  cases = []
  for name, solve in solves.items():
    cases += [(f"{name} grad", solve, (a,), ("grad", "jit")),
              (f"{name} vmap(grad)", solve, (batch,), ("grad", "vmap", "jit")),
              (f"{name} grad(vmap)", solve, (batch,), ("vmap", "grad", "jit"))]
  cases += [("root_find Newton eager grad(vmap)", solves["root_find Newton"],
             (batch,), ("vmap", "grad"))]
  return cases


def _tfp():
  import jax.numpy as jnp
  import tensorflow_probability.substrates.jax as tfp

  def solve(solver):
    def run(y0, a):
      result = solver.solve(lambda t, y, a: -a * y + jnp.sin(t), 0.0, y0,
                            solution_times=jnp.array([0.5, 1.0]),
                            constants={"a": a})
      return jnp.sum(result.states ** 2)
    return run
  dopri = solve(tfp.math.ode.DormandPrince(rtol=1e-5, atol=1e-5))
  bdf = solve(tfp.math.ode.BDF(rtol=1e-5, atol=1e-5))
  y0, a = jnp.array([1.0, 2.0]), jnp.float32(0.7)
  y0s = jnp.stack([y0, 0.5 * y0])
  # TFP's adjoint bwd needs concrete values: it runs eagerly only, with
  # jax.custom_vjp as with smartvjp (jax.jit of the gradient fails in both)
  return [
      ("DormandPrince adjoint", dopri, (y0, a), ("grad",)),
      ("DormandPrince vmap(grad)", lambda y: dopri(y, a), (y0s,),
       ("grad", "vmap")),
      ("DormandPrince grad(vmap)", lambda y: dopri(y, a), (y0s,),
       ("vmap", "grad")),
      ("BDF adjoint", bdf, (y0, a), ("grad",)),
  ]


def _qpax():
  import jax
  import jax.numpy as jnp
  import qpax
  # a QP with equality and inequality constraints; f is a primal-dual
  # interior-point solve (a while_loop), fwd the solve then a relaxed re-solve
  ks = jax.random.split(jax.random.key(0), 5)
  m = jax.random.normal(ks[0], (4, 4))
  Q = m @ m.T + jnp.eye(4)
  A = jax.random.normal(ks[1], (1, 4))
  b = jax.random.normal(ks[2], (1,))
  G = jax.random.normal(ks[3], (3, 4))
  h = jnp.abs(jax.random.normal(ks[4], (3,))) + 1.0
  q = jnp.linspace(-1.0, 1.0, 4)

  def solve(q, h):
    return jnp.sum(qpax.solve_qp_primal(Q, q, A, b, G, h) ** 2)

  def scanned(q):
    def step(c, _):
      return qpax.solve_qp_primal(Q, c, A, b, G, h) * 0.5 + c, None
    return jnp.sum(jax.lax.scan(step, q, None, length=2)[0] ** 2)
  qs = jnp.stack([q, -q])
  return [
      ("solve", solve, (q, h), ("grad", "jit")),
      ("solve checkpoint", solve, (q, h), ("checkpoint", "grad", "jit")),
      ("scan", scanned, (q,), ("grad", "jit")),
      ("vmap(grad)", lambda q: solve(q, h), (qs,), ("grad", "vmap", "jit")),
  ]


def _recurrentgemma():
  import jax
  import jax.numpy as jnp
  from recurrentgemma import jax as rg
  # the RG-LRU layer (its sqrt_bound_derivative is a jax.custom_vjp), the
  # jax.lax.scan implementation (Pallas' needs a TPU)
  layer = rg.RGLRU(width=8, num_heads=2,
                   scan_type=rg.ScanType.LINEAR_NATIVE)
  x = jax.random.normal(jax.random.key(0), (2, 6, 8))
  pos = jnp.broadcast_to(jnp.arange(6), (2, 6))
  params = layer.init(jax.random.key(1), x, pos)

  def loss(params, x):
    y, _ = layer.apply(params, x, pos)
    return jnp.sum(y ** 2)
  return [
      ("RGLRU", loss, (params, x), ("grad", "jit")),
      ("RGLRU checkpoint", loss, (params, x), ("checkpoint", "grad", "jit")),
  ]


def _tensorcircuit():
  import jax
  import jax.numpy as jnp
  import tensorcircuit as tc
  tc.set_backend("jax")
  n = 4

  def layered(c, params):
    for i in range(n):
      c.rx(i, theta=params[i])
    for i in range(n - 1):
      c.cnot(i, i + 1)
    for i in range(n):
      c.rz(i, theta=params[n + i])
    return c

  def energy(params):
    c = layered(tc.Circuit(n), params)
    return jnp.real(sum(c.expectation_ps(z=[i]) for i in range(n)))

  def mps(params):
    # truncated MPS simulation: tensorcircuit's adaware svd and qr rules
    c = tc.MPSCircuit(n)
    c.set_split_rules({"max_singular_values": 2})
    c = layered(c, params)
    return jnp.real(c.expectation_ps(z=[0]) + c.expectation_ps(z=[n - 1]))
  params = jnp.linspace(0.1, 1.5, 2 * n)
  return [
      ("Circuit", energy, (params,), ("grad", "jit")),
      ("MPSCircuit svd", mps, (params,), ("grad", "jit")),
      ("MPSCircuit svd checkpoint", mps, (params,),
       ("checkpoint", "grad", "jit")),
  ]



# issue 56's libraries that install quickly (jax-fdm, agjax, fmmax)
def _jax_fdm():
  import jax
  import jax.numpy as jnp
  from jax_fdm.equilibrium.solvers.fixed_point import (
      solver_fixedpoint, solver_fixedpoint_implicit)
  # the implicit fixed-point solver (a jax.custom_vjp over jaxopt's
  # FixedPointIteration, a while_loop; its bwd the pseudo-adjoint with the
  # stiffness matrix theta[0]) on x = K^-1 p(theta, x), a contraction
  def loads(theta, x):
    return theta[1] + 0.2 * jnp.tanh(x)

  config = {"tmax": 100, "eta": 1e-6, "verbose": False,
            "implicit_diff": True, "loads_fn": loads}

  def f(theta, x):
    return jnp.linalg.solve(theta[0], loads(theta, x))

  def solve(k, p):
    x = solver_fixedpoint_implicit(solver_fixedpoint, config, f, (k, p),
                                   jnp.zeros_like(p))
    return jnp.sum(x ** 2)

  def scanned(k, p):
    def step(c, _):
      return c + 0.1 * solver_fixedpoint_implicit(
          solver_fixedpoint, config, f, (k, c), jnp.zeros_like(c)), None
    return jnp.sum(jax.lax.scan(step, p, None, length=2)[0] ** 2)
  m = jnp.linspace(-0.3, 0.3, 16).reshape(4, 4)
  k = 3.0 * jnp.eye(4) + (m + m.T) / 2
  p = jnp.linspace(-1.0, 1.0, 12).reshape(4, 3)
  return [
      ("fixed_point grad", solve, (k, p), ("grad", "jit")),
      ("fixed_point checkpoint", solve, (k, p),
       ("checkpoint", "grad", "jit")),
      ("fixed_point scan", scanned, (k, p), ("grad", "jit")),
  ]


def _agjax():
  import autograd.numpy as anp
  import agjax.experimental
  import jax
  import jax.numpy as jnp
  # autograd code behind a host callback (its bwd runs autograd's VJP)
  fn = agjax.experimental.wrap_for_jax(
      lambda x, y: anp.sin(x) * anp.cos(y),
      result_shape_dtypes=jax.ShapeDtypeStruct((4,), jnp.float32))

  def loss(x, y):
    return jnp.sum(fn(x, y) ** 2)
  x = jnp.linspace(0.1, 1.0, 4)
  y = jnp.linspace(-1.0, 0.5, 4)
  return [
      ("wrapped grad", loss, (x, y), ("grad", "jit")),
      ("wrapped checkpoint", loss, (x, y), ("checkpoint", "grad", "jit")),
  ]


def _fmmax():
  import fmmax.eig
  import jax.numpy as jnp
  # fmmax's eig: a jax.custom_vjp giving eigenvector gradients (the
  # eigendecomposition runs on the host on CPU)
  m = jnp.array([[2.0, 1.0, 0.3], [0.5, 3.0, 0.2], [0.1, 0.4, 1.0]],
                jnp.complex64)

  def loss(m):
    w, v = fmmax.eig.eig(m)
    return jnp.sum(jnp.abs(w) ** 2) + jnp.sum(jnp.abs(v[:, 0]))
  return [
      ("eig grad", loss, (m,), ("grad", "jit")),
      ("eig checkpoint", loss, (m,), ("checkpoint", "grad", "jit")),
  ]


PROGRAMS = {"jax_cce": _jax_cce, "ejkernel": _ejkernel, "qwix": _qwix,
            "aqt": _aqt, "jax_md": _jax_md, "optimistix": _optimistix,
            "tfp": _tfp, "qpax": _qpax, "recurrentgemma": _recurrentgemma,
            "tensorcircuit": _tensorcircuit, "jax_fdm": _jax_fdm,
            "agjax": _agjax, "fmmax": _fmmax}


# -- one side -----------------------------------------------------------------------

def _primal(fn, how):
  """The program before differentiation (what swap_report traces): ``fn``
  under the case's vmap and checkpoint."""
  import jax
  import jax.numpy as jnp
  f = fn
  if "vmap" in how:
    inner = f
    f = lambda *a: jnp.sum(jax.vmap(inner)(*a))
  if "checkpoint" in how:
    f = jax.checkpoint(f)
  return f


def _transform(fn, args, how):
  """The case's program: ``fn`` under the transformations of ``how``."""
  import jax
  import jax.numpy as jnp
  f = fn
  for step in how:
    if step == "checkpoint":
      f = jax.checkpoint(f)
    elif step == "vmap":
      if "grad" in how[:how.index("vmap")]:
        f = jax.vmap(f)
      else:
        inner = f
        f = lambda *a, _f=inner: jnp.sum(jax.vmap(_f)(*a))
    elif step == "grad":
      f = jax.grad(f, argnums=tuple(range(len(args))))
  return jax.jit(f) if "jit" in how else f


def _work(g, args):
  """(matrix products in the lowered program, XLA's flops once compiled)."""
  import re
  import jax
  lowered = jax.jit(g).lower(*args)
  dots = len(re.findall(r"stablehlo\.dot_general", lowered.as_text()))
  cost = lowered.compile().cost_analysis()
  cost = cost[0] if isinstance(cost, list) else cost
  return dots, float(cost.get("flops", -1))


def run_side(library: str, side: str, out: str, only=()) -> None:
  import jax
  import numpy as np
  jax.config.update("jax_platforms", "cpu")
  import smartvjp
  record = {"library": library, "side": side, "jax": jax.__version__,
            "cases": {}}
  arrays = {}
  t0 = time.perf_counter()
  try:
    cases = PROGRAMS[library]()
  except Exception as e:   # noqa: BLE001 -- reported, not raised
    record["skipped"] = f"{type(e).__name__}: {e}"[:600]
    _write(out, record, arrays)
    return
  record["versions"] = _versions(library)
  # the one call: every program traced inside it (the library was imported
  # as usual, above)
  swap = (lambda: smartvjp.swap_custom_vjp(existing=True)) if (
      side == "smartvjp") else contextlib.nullcontext
  for name, fn, args, how in cases:
    if only and name not in only:
      continue
    entry = record["cases"][name] = {"how": list(how)}
    with swap():
      try:
        primal = _primal(fn, how)
        report = smartvjp.swap_report(primal, *args)
        entry["report"] = {k: bool(v) for k, v in report.items()}
        entry["report_ok"] = report.ok
        entry["why"] = dict(report.why)
        fn_text = str(jax.make_jaxpr(primal)(*args))
        entry["custom_vjp_call"] = "custom_vjp_call" in fn_text
        entry["smartvjp_in_fn"] = "smartvjp_" in fn_text
        g = _transform(fn, args, how)
        try:
          closed = jax.make_jaxpr(g)(*args)
          entry["smartvjp_in_grad"] = "smartvjp_" in str(closed)
          entry["dots"], entry["flops"] = _work(g, args)
        except Exception as e:  # noqa: BLE001 -- TFP: only eager works
          entry["no_jaxpr"] = f"{type(e).__name__}"
        value = g(*args)
        for i, leaf in enumerate(jax.tree.leaves(value)):
          arrays[f"{name}|{i}"] = np.asarray(leaf)
      except Exception as e:  # noqa: BLE001 -- a failing case is a result
        entry["error"] = f"{type(e).__name__}: {e}"[:800]
        entry["traceback"] = traceback.format_exc()[-3000:]
  record["seconds"] = time.perf_counter() - t0
  _write(out, record, arrays)


def _versions(library):
  from importlib import metadata
  dist = {"jax_cce": "jax-cce", "ejkernel": "ejkernel", "qwix": "qwix",
          "aqt": "aqtp", "jax_md": "jax-md", "optimistix": "optimistix",
          "tfp": "tfp-nightly", "qpax": "qpax",
          "recurrentgemma": "recurrentgemma",
          "tensorcircuit": "tensorcircuit-ng", "jax_fdm": "jax-fdm",
          "agjax": "agjax", "fmmax": "fmmax"}[library]
  for d in (dist, "tensorflow-probability"):
    try:
      return f"{d} {metadata.version(d)}"
    except metadata.PackageNotFoundError:
      continue
  return dist


def _write(out, record, arrays):
  import numpy as np
  np.savez(out + ".npz", **{f"a{i}": a for i, a in enumerate(arrays.values())})
  record["arrays"] = list(arrays)
  with open(out + ".json", "w") as fh:
    json.dump(record, fh)


def _load(out):
  import numpy as np
  with open(out + ".json") as fh:
    record = json.load(fh)
  with np.load(out + ".npz") as data:
    arrays = {n: data[f"a{i}"] for i, n in enumerate(record["arrays"])}
  return record, arrays


# -- both sides, compared -----------------------------------------------------------

def compare(library: str, tmp: str, only=()) -> dict:
  """Runs both sides of ``library`` (only the cases named in ``only``, if
  given) and returns one verdict per case."""
  sides = {}
  for side in ("jax", "smartvjp"):
    out = os.path.join(tmp, f"{library}.{side}")
    proc = subprocess.run(
        [sys.executable, os.path.abspath(__file__), "--side", side,
         "--library", library, "--out", out,
         *(a for c in only for a in ("--case", c))],
        capture_output=True, text=True,
        env=dict(os.environ, JAX_PLATFORMS="cpu"))
    if proc.returncode != 0:
      return {"library": library, "failed": f"{side} side exited "
              f"{proc.returncode}: {proc.stderr[-3000:]}"}
    sides[side] = _load(out)
  (ref, ref_arrays), (got, got_arrays) = sides["jax"], sides["smartvjp"]
  if "skipped" in ref:
    return {"library": library, "skipped": ref["skipped"]}
  result = {"library": library, "versions": ref.get("versions"),
            "jax": ref["jax"], "cases": {},
            "seconds": {"jax": ref["seconds"], "smartvjp": got["seconds"]}}
  for name, theirs in ref["cases"].items():
    mine = got["cases"][name]
    verdict = {"how": " ".join(theirs["how"])}
    if "error" in mine or "error" in theirs:
      verdict["value"] = (
          "both fail" if "error" in mine and "error" in theirs and
          mine["error"].split(":")[0] == theirs["error"].split(":")[0]
          else "ERROR")
      verdict["errors"] = {"jax": theirs.get("error"),
                           "smartvjp": mine.get("error")}
    else:
      verdict["value"] = _values(name, ref_arrays, got_arrays)
    for key in ("dots", "flops"):
      if key in theirs and key in mine:
        verdict[key] = (theirs[key], mine[key])
    verdict["more_work"] = any(
        verdict[k][1] > verdict[k][0] for k in ("dots", "flops")
        if k in verdict)
    verdict["report"] = _agreement(theirs, mine)
    verdict["why"] = mine.get("why", {})
    result["cases"][name] = verdict
  return result


def _values(name, ref, got):
  import numpy as np
  keys = [k for k in ref if k.split("|")[0] == name]
  if keys != [k for k in got if k.split("|")[0] == name] or not keys:
    return "DIFFERENT outputs"
  worst_abs = worst_rel = 0.0
  for k in keys:
    a, b = ref[k], got[k]
    if a.dtype != b.dtype or a.shape != b.shape:
      return f"DIFFERENT types {a.dtype}{a.shape} vs {b.dtype}{b.shape}"
    if a.tobytes() == b.tobytes():
      continue
    a64, b64 = a.astype(np.float64), b.astype(np.float64)
    diff = np.abs(a64 - b64)
    worst_abs = max(worst_abs, float(np.nanmax(diff)))
    worst_rel = max(worst_rel, float(np.nanmax(
        diff / np.maximum(np.abs(a64), 1e-30))))
  if worst_abs == 0.0:
    return "equal"
  # within tolerance: every difference at most RTOL times the largest
  # magnitude of its array (a few units in the last place of float32)
  scaled = max(float(np.nanmax(np.abs(ref[k].astype(np.float64) -
                                      got[k].astype(np.float64))))
               / max(float(np.nanmax(np.abs(ref[k]))), 1e-30)
               for k in keys if ref[k].size)
  ok = scaled <= RTOL
  return (f"{'within tolerance' if ok else 'DIFFERENT'} (max abs "
          f"{worst_abs:.2g}, rel {worst_rel:.2g}, rel to the array's largest "
          f"{scaled:.2g})")


def _agreement(theirs, mine):
  """Does swap_report agree with the jaxpr, on each side?"""
  if "report_ok" not in theirs or "report_ok" not in mine:
    return "not traced"
  # the jaxpr's verdict: smartvjp's equations in the gradient (or, where the
  # gradient cannot be traced, in the function) and no custom_vjp_call
  smart_jaxpr = (mine.get("smartvjp_in_grad", mine["smartvjp_in_fn"])
                 and not mine["custom_vjp_call"])
  jax_jaxpr = theirs["custom_vjp_call"] and not theirs["smartvjp_in_fn"]
  if not (jax_jaxpr or theirs["report"] or mine["report"] or smart_jaxpr):
    return "agrees: no custom_vjp in this program"
  if mine["report_ok"] != smart_jaxpr:
    return (f"DISAGREES (smartvjp side: report ok={mine['report_ok']}, "
            f"jaxpr smartvjp={smart_jaxpr})")
  if theirs["report_ok"] or not jax_jaxpr:
    return "DISAGREES (jax.custom_vjp side)"
  return "agrees: all smartvjp" if smart_jaxpr else "agrees: NOT swapped"


def _print(result):
  lib = result["library"]
  if "skipped" in result:
    print(f"{lib}: skipped ({result['skipped'][:200]})")
    return
  if "failed" in result:
    print(f"{lib}: FAILED\n{result['failed']}")
    return
  print(f"{lib} ({result['versions']}, jax {result['jax']}; "
        f"{result['seconds']['jax']:.0f} s / {result['seconds']['smartvjp']:.0f}"
        " s)")
  for name, v in result["cases"].items():
    work = ", ".join(f"{k} {v[k][0]:g} -> {v[k][1]:g}"
                     for k in ("dots", "flops") if k in v)
    print(f"  {name:38s} [{v['how']}] {v['value']}; {work or 'eager'}; "
          f"report {v['report']}" + ("; MORE WORK" if v["more_work"] else ""))
    for key, why in v["why"].items():
      print(f"      {key}: {why}")
    if v["value"] in ("ERROR", "both fail"):
      print(f"      errors: {v['errors']}")


def bad(result) -> bool:
  if "failed" in result:
    return True
  return any(
      v["value"].startswith(("DIFF", "ERROR")) or v["more_work"]
      or not v["report"].startswith(("agrees: all", "agrees: no", "not traced"))
      for v in result.get("cases", {}).values())


def main() -> int:
  ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  ap.add_argument("libraries", nargs="*", metavar="LIBRARY",
                  help=f"some of {', '.join(LIBRARIES)} (default: all)")
  ap.add_argument("--json", help="write the verdicts here")
  ap.add_argument("--case", action="append", default=[],
                  help="run only this case (by name; repeatable)")
  ap.add_argument("--side", choices=["jax", "smartvjp"], help=argparse.SUPPRESS)
  ap.add_argument("--library", help=argparse.SUPPRESS)
  ap.add_argument("--out", help=argparse.SUPPRESS)
  args = ap.parse_args()
  unknown = set(args.libraries) - set(LIBRARIES)
  if unknown:
    ap.error(f"unknown libraries {sorted(unknown)}; choose from {LIBRARIES}")
  if args.side:
    run_side(args.library, args.side, args.out, tuple(args.case))
    return 0
  results = []
  with tempfile.TemporaryDirectory() as tmp:
    for library in args.libraries or LIBRARIES:
      result = compare(library, tmp, tuple(args.case))
      _print(result)
      results.append(result)
  if args.json:
    with open(args.json, "w") as fh:
      json.dump(results, fh, indent=1)
  failed = [r["library"] for r in results if bad(r)]
  ran = [r["library"] for r in results if "cases" in r]
  print(f"{len(ran)} of {len(results)} libraries ran ({', '.join(ran) or 'none'}"
        "); every case equal or within tolerance, no more work, reports "
        "agree: " + ("yes" if not failed else f"NO ({', '.join(failed)})"))
  return 1 if failed else 0


if __name__ == "__main__":
  sys.exit(main())
