"""Work per training step under every remat policy, measured by XLA and by
counting kernel launches.

Columns: ``jax.custom_vjp``, ``jax.custom_vjp(optimize_remat=True)``,
smartvjp, smartvjp with a fused ``fwd_bwd``. Rows: no checkpoint and
``jax.checkpoint`` with each of JAX's policies, each crossed with four kinds
of rule for the layer ``gelu(x @ w)``:

* ``saveable``: JAX-coded rules, ``fwd`` returns ``(x, w, y)``, ``y = x @ w``;
* ``mixed``: JAX-coded, ``fwd`` also returns ``gelu'(y)`` (not a dot);
* ``kernel``: opaque kernels that count their launches
  (``tests/kernels.py``): like a ``pallas_call`` whose output is used, they
  run whole, residual writes included;
* ``named``: JAX-coded, the residual ``gelu'(y)`` named ``"res"`` with
  ``checkpoint_name``.

Per cell, for ``jit(grad(loss))`` of a ``lax.scan`` over layers (or, with
``--unrolled``, a Python loop; at the top level of a program XLA may merge a
rematerialized computation with the forward one, hiding the difference): XLA's
flops and bytes accessed (``cost_analysis``), temporary memory
(``memory_analysis().temp_size_in_bytes``) and kernel launches counted when
the step runs. Deterministic: the same program gives the same numbers.

Run:  python benchmarks/cost.py [--batch 256 --width 512 --layers 4 --unrolled]
"""

from __future__ import annotations

import argparse
import os
import sys

import jax
import jax.numpy as jnp
import numpy as np
from jax.ad_checkpoint import checkpoint_name

sys.path.insert(0, os.path.join(os.path.dirname(__file__), os.pardir, "tests"))
import kernels as K  # noqa: E402

from smartvjp import smart_custom_vjp  # noqa: E402

IMPLS = ("jax.custom_vjp", "optimize_remat", "smartvjp", "smartvjp+fwd_bwd")
KINDS = ("saveable", "mixed", "kernel", "named")
_P = jax.checkpoint_policies
POLICIES = {
    "no checkpoint": None,
    "nothing_saveable": _P.nothing_saveable,
    "everything_saveable": _P.everything_saveable,
    "dots_saveable": _P.dots_saveable,
    "checkpoint_dots": _P.checkpoint_dots,
    "dots_with_no_batch_dims_saveable": _P.dots_with_no_batch_dims_saveable,
    "checkpoint_dots_with_no_batch_dims":
        _P.checkpoint_dots_with_no_batch_dims,
    "save_only_these_names(res)": _P.save_only_these_names("res"),
    "save_any_names_but_these(other)": _P.save_any_names_but_these("other"),
    "save_anything_except_these_names(res)":
        _P.save_anything_except_these_names("res"),
    "save_from_both_policies(dots, res)": _P.save_from_both_policies(
        _P.dots_saveable, _P.save_only_these_names("res")),
    "save_and_offload_only_these_names(res)":
        _P.save_and_offload_only_these_names(
            names_which_can_be_saved=[], names_which_can_be_offloaded=["res"],
            offload_src="device", offload_dst="pinned_host"),
}


# -- the layer's rules ----------------------------------------------------------

def _dgelu(y):
  """gelu'(y), elementwise."""
  return jax.jvp(jax.nn.gelu, (y,), (jnp.ones_like(y),))[1]


def _np_gelu(y):
  c = np.sqrt(2 / np.pi).astype(y.dtype)
  return 0.5 * y * (1 + np.tanh(c * (y + 0.044715 * y ** 3)))


def _np_dgelu(y):
  c = np.sqrt(2 / np.pi).astype(y.dtype)
  t = np.tanh(c * (y + 0.044715 * y ** 3))
  return 0.5 * (1 + t) + 0.5 * y * (1 - t ** 2) * c * (1 + 3 * 0.044715 * y ** 2)


def _backward(x, w, d, g):
  dy = g * d
  return dy @ w.T, x.T @ dy


def jax_rules(kind):
  """(f, fwd, bwd, fwd_bwd) in JAX for ``saveable``, ``mixed``, ``named``."""
  def f(x, w):
    return jax.nn.gelu(x @ w)

  def fwd(x, w):
    y = x @ w
    if kind == "saveable":
      return jax.nn.gelu(y), (x, w, y)
    d = _dgelu(y)
    if kind == "named":
      d = checkpoint_name(d, "res")
    return jax.nn.gelu(y), (x, w, d)

  def bwd(res, g):
    x, w, r = res
    return _backward(x, w, _dgelu(r) if kind == "saveable" else r, g)

  def fwd_bwd(x, w, g):
    return _backward(x, w, _dgelu(x @ w), g)

  return f, fwd, bwd, fwd_bwd


def kernel_rules():
  """(f, fwd, bwd, fwd_bwd), each one opaque counting kernel."""
  k = lambda *a: K.kernel(*a, never_dce=True)

  def f(x, w):
    (z,) = k("f", lambda x, w: (_np_gelu(x @ w),), [x @ w], x, w)
    return z

  def fwd(x, w):
    z, y = k("fwd", lambda x, w: (_np_gelu(x @ w), x @ w), [x @ w] * 2, x, w)
    return z, (x, w, y)

  def bwd(res, g):
    x, w, y = res

    def run(x, w, y, g):
      dy = g * _np_dgelu(y)
      return dy @ w.T, x.T @ dy
    return tuple(k("bwd", run, [x, w], x, w, y, g))

  def fwd_bwd(x, w, g):
    def run(x, w, g):
      dy = g * _np_dgelu(x @ w)
      return dy @ w.T, x.T @ dy
    return tuple(k("fwd_bwd", run, [x, w], x, w, g))

  return f, fwd, bwd, fwd_bwd


def make(impl, kind):
  f, fwd, bwd, fwd_bwd = kernel_rules() if kind == "kernel" else jax_rules(kind)
  if impl.startswith("smartvjp"):
    F = smart_custom_vjp(f)
    F.defvjp(fwd, bwd, fwd_bwd=fwd_bwd if impl.endswith("fwd_bwd") else None)
  else:
    F = jax.custom_vjp(f)
    F.defvjp(fwd, bwd, optimize_remat=impl == "optimize_remat")
  return F


# -- one cell -----------------------------------------------------------------

def _inputs(batch, width, layers):
  x = jnp.asarray(np.random.RandomState(0).randn(batch, width), jnp.float32)
  ws = tuple(jnp.full((width, width), 1.0 / width, jnp.float32) * (i + 1)
             for i in range(layers))
  return x, ws


def step(impl, kind, policy_name, scan=False):
  """``jit(grad(loss))`` of a stack of layers, unrolled or a ``lax.scan``."""
  F = make(impl, kind)
  policy = POLICIES[policy_name]
  layer = F if policy_name == "no checkpoint" else jax.checkpoint(
      F, policy=policy)

  def loss(x, ws):
    if scan:
      x, _ = jax.lax.scan(lambda h, w: (layer(h, w), None), x, ws)
    else:
      for w in ws:
        x = layer(x, w)
    return jnp.sum(x ** 2)
  return jax.jit(jax.grad(loss, argnums=(0, 1)))


def _first(d):
  return d[0] if isinstance(d, (list, tuple)) else d


# XLA options that make compilation faster without changing the optimized
# HLO that cost and memory analysis read (only machine-code generation)
FAST_COMPILE = {"xla_backend_optimization_level": 0,
                "xla_llvm_disable_expensive_passes": True}


def measure(impl, kind, policy_name, batch, width, layers, scan=False,
            compiler_options=None):
  """``dict(flops, bytes, temp, launches)``: XLA's flops and bytes accessed
  per layer (XLA counts a loop body once: per trip of a scan, the unrolled
  program's divided by its layers), temporary memory and kernel launches per
  step; ``None`` where this backend cannot compile the program (offloading
  on a backend without host memory spaces)."""
  x, ws = _inputs(batch, width, layers)
  if scan:
    ws = jnp.stack(ws)
  fn = step(impl, kind, policy_name, scan)
  try:
    compiled = fn.lower(x, ws).compile(compiler_options)
  except Exception:  # noqa: BLE001 - a backend without the memory space
    if "offload" in policy_name:
      return None
    raise
  cost = _first(compiled.cost_analysis())
  temp = compiled.memory_analysis().temp_size_in_bytes
  K.reset()
  jax.block_until_ready(compiled(x, ws))
  per = 1 if scan else layers
  return dict(flops=float(cost.get("flops", 0.0)) / per,
              bytes=float(cost.get("bytes accessed", 0.0)) / per,
              temp=int(temp),
              launches=sum(K.COUNTS.values()))


def table(batch=256, width=512, layers=4, kinds=KINDS, policies=None,
          scan=True, compiler_options=None):
  """``{(policy, kind): {impl: cell}}`` for every row and column."""
  policies = list(POLICIES) if policies is None else policies
  return {(p, k): {i: measure(i, k, p, batch, width, layers, scan,
                              compiler_options)
                   for i in IMPLS}
          for p in policies for k in kinds}


def _ratio(a, b):
  if b == 0:
    return "  - " if a == 0 else " inf"
  return f"{a / b:4.2f}"


def render(results) -> str:
  head = (f"{'policy':40} {'rules':9} " + " ".join(
      f"{i:>26}" for i in IMPLS))
  lines = [f"jax {jax.__version__}, {jax.default_backend()}; per cell: GFLOP "
           "per layer / MB accessed per layer / temp MB / kernel launches; "
           "(ratio to jax.custom_vjp in flops)", head, "-" * len(head)]
  for (p, k), row in results.items():
    base = row["jax.custom_vjp"]
    cells = []
    for i in IMPLS:
      c = row[i]
      if c is None:
        cells.append(f"{'n/a':>26}")
        continue
      text = (f"{c['flops'] / 1e9:.3f}/{c['bytes'] / 1e6:.1f}/"
              f"{c['temp'] / 1e6:.1f}/{c['launches']} "
              f"({_ratio(c['flops'], base['flops']) if base else 'n/a'})")
      cells.append(f"{text:>26}")
    lines.append(f"{p:40} {k:9} " + " ".join(cells))
  return "\n".join(lines)


def issue_case(batch=256, width=512, layers=8) -> str:
  """The mixed-residual case of the issue: a ``lax.scan`` of ``layers``
  checkpointed layers under ``dots_saveable`` and
  ``dots_with_no_batch_dims_saveable``, GFLOP per loop trip."""
  lines = [f"lax.scan of {layers} checkpointed gelu(x @ w) layers, batch "
           f"{batch}, width {width}, fwd returns (x, w, y, gelu'(y)); "
           "GFLOP per loop trip:"]
  for p in ("dots_saveable", "dots_with_no_batch_dims_saveable"):
    cells = {i: measure(i, "mixed", p, batch, width, layers, scan=True)
             for i in IMPLS}
    base = cells["jax.custom_vjp"]["flops"]
    lines.append(f"  {p:34} " + "  ".join(
        f"{i} {c['flops'] / 1e9:.3f} ({c['flops'] / base:.2f}x)"
        for i, c in cells.items()))
  return "\n".join(lines)


def main(argv=None):
  ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  ap.add_argument("--batch", type=int, default=256)
  ap.add_argument("--width", type=int, default=512)
  ap.add_argument("--layers", type=int, default=4)
  ap.add_argument("--unrolled", action="store_true",
                  help="a Python loop of layers instead of a lax.scan")
  args = ap.parse_args(argv)
  print(render(table(args.batch, args.width, args.layers,
                     scan=not args.unrolled)))
  print()
  print(issue_case(args.batch, args.width))


if __name__ == "__main__":
  main()
