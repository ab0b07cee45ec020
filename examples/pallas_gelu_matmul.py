"""Fused matmul + GELU in Pallas: ``z = gelu(x @ w)`` (the kernel of seed 000).

Four kernels, blocked over rows (``block_m``) and columns (``block_n``):

* ``f``: writes only ``z`` (inference);
* ``fwd``: writes ``z`` and the residual ``y = x @ w`` (training);
* ``bwd``: ``dx = dy @ w.T`` and ``dw = x.T @ dy`` from ``y``, where
  ``dy = g * gelu'(y)``;
* ``fwd_bwd`` (fused): recomputes ``y`` tile by tile and never writes it.

Rule calls and kernel launches differ here: ``bwd`` and ``fwd_bwd`` each
launch two kernels (one for ``dx``, one for ``dw``), so one call of either
rule is two kernel launches. The script prints both counts.

Cost per gradient step (``M x K`` times ``K x N``), counting matmuls of that
size and ``M x N`` arrays written to or read from memory by the rules that
touch ``y`` or ``z`` (``g`` is read the same way on every path):

================  =========================  ==================================
path              matmuls                    M x N arrays moved
================  =========================  ==================================
no remat          fwd 1 + bwd 2 = 3          fwd writes z, y; bwd reads y twice
remat, fwd+bwd    f 1 + fwd 1 + bwd 2 = 4    f writes z; fwd writes z, y; bwd
                                             reads y twice
remat, fwd_bwd    f 1 + fwd_bwd 2 + 2 = 5    f writes z
================  =========================  ==================================

Under remat the fused rule costs one more matmul than ``fwd`` + ``bwd``
(``dx`` and ``dw`` both need ``dy``, so each of its two kernels recomputes
``y``), and it saves four ``M x N`` transfers (``fwd``'s writes of ``z`` and
``y``, ``bwd``'s two reads of ``y``) and the ``M x N`` buffer for ``y``.
Time: it pays when ``2 M K N / peak_flops < 4 M N b / bandwidth`` for
``b`` bytes per element, that is when ``K < 2 b * peak_flops / bandwidth``.
``main()`` prints this bound for an H200 in bf16.

On a GPU the kernels lower through Pallas' Triton backend; elsewhere they run
in interpret mode (``interpret=True``), which is how the tests run them.

Run:  python examples/pallas_gelu_matmul.py
"""

from __future__ import annotations

import collections
import functools
import math
import time

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl

from smartvjp import smart_custom_vjp

LAUNCHES: collections.Counter = collections.Counter()
_C = math.sqrt(2.0 / math.pi)


def gelu(y):
  """tanh-approximate GELU (``jax.nn.gelu``'s default), in f32."""
  return 0.5 * y * (1.0 + jnp.tanh(_C * (y + 0.044715 * y ** 3)))


def gelu_grad(y):
  t = jnp.tanh(_C * (y + 0.044715 * y ** 3))
  return 0.5 * (1.0 + t) + 0.5 * y * (1.0 - t * t) * _C * (1.0 + 3 * 0.044715 * y * y)


def _dot(a, b, trans_a=False, trans_b=False):
  dims = (((0,) if trans_a else (1,), (1,) if trans_b else (0,)), ((), ()))
  return jax.lax.dot_general(a, b, dims, preferred_element_type=jnp.float32)


def _counted(name, kernel, grid_rank):
  """Counts one launch (at the first grid point) in ``LAUNCHES``."""
  def wrapped(*refs):
    first = functools.reduce(
        jnp.logical_and, [pl.program_id(a) == 0 for a in range(grid_rank)])

    @pl.when(first)
    def _():
      jax.debug.callback(lambda: LAUNCHES.update([name]))
    kernel(*refs)
  return wrapped


def _call(name, kernel, grid, in_specs, out_specs, out_shape, *args,
          interpret, count):
  if count:
    kernel = _counted(name, kernel, len(grid))
  return pl.pallas_call(kernel, grid=grid, in_specs=in_specs,
                        out_specs=out_specs, out_shape=out_shape,
                        interpret=interpret)(*args)


# -- kernels --------------------------------------------------------------------

def _f_kernel(x_ref, w_ref, z_ref):
  z_ref[...] = gelu(_dot(x_ref[...], w_ref[...])).astype(z_ref.dtype)


def _fwd_kernel(x_ref, w_ref, z_ref, y_ref):
  y = _dot(x_ref[...], w_ref[...])
  z_ref[...] = gelu(y).astype(z_ref.dtype)
  y_ref[...] = y.astype(y_ref.dtype)


def _dx_kernel(g_ref, y_ref, w_ref, dx_ref):       # rows block: dy @ w.T
  dy = g_ref[...].astype(jnp.float32) * gelu_grad(y_ref[...].astype(jnp.float32))
  dx_ref[...] = _dot(dy.astype(w_ref.dtype), w_ref[...], trans_b=True
                     ).astype(dx_ref.dtype)


def _dw_kernel(x_ref, g_ref, y_ref, dw_ref):       # columns block: x.T @ dy
  dy = g_ref[...].astype(jnp.float32) * gelu_grad(y_ref[...].astype(jnp.float32))
  dw_ref[...] = _dot(x_ref[...], dy.astype(x_ref.dtype), trans_a=True
                     ).astype(dw_ref.dtype)


def _fused_dx_kernel(x_ref, w_ref, g_ref, dx_ref):  # recomputes its rows of y
  y = _dot(x_ref[...], w_ref[...])
  dy = g_ref[...].astype(jnp.float32) * gelu_grad(y)
  dx_ref[...] = _dot(dy.astype(w_ref.dtype), w_ref[...], trans_b=True
                     ).astype(dx_ref.dtype)


def _fused_dw_kernel(x_ref, w_ref, g_ref, dw_ref):  # recomputes its columns of y
  y = _dot(x_ref[...], w_ref[...])
  dy = g_ref[...].astype(jnp.float32) * gelu_grad(y)
  dw_ref[...] = _dot(x_ref[...], dy.astype(x_ref.dtype), trans_a=True
                     ).astype(dw_ref.dtype)


# -- the smart_custom_vjp -----------------------------------------------------

def make_gelu_matmul(block_m=128, block_n=128, interpret=None, fused=True,
                     count=False, residual_dtype=None):
  """``gelu_matmul(x, w) -> gelu(x @ w)`` as a ``smart_custom_vjp``.

  Args:
    block_m, block_n: tile sizes over the rows of ``x`` and columns of ``w``.
    interpret: Pallas interpret mode; default: on unless the backend is GPU.
    fused: also define the fused ``fwd_bwd`` rule.
    count: count kernel launches in ``LAUNCHES`` (interpret mode only).
    residual_dtype: dtype of the residual ``y`` (default: ``x``'s dtype).

  Returns:
    ``(gelu_matmul, rules)`` where ``rules`` holds the four rule functions.
    ``x: [M, K]``, ``w: [K, N]``, same float dtype; result ``[M, N]``.
  """
  if interpret is None:
    interpret = jax.default_backend() != "gpu"
  count = count and interpret
  call = functools.partial(_call, interpret=interpret, count=count)

  def grid_mn(x, w):
    m, n = x.shape[0], w.shape[1]
    bm, bn = min(block_m, m), min(block_n, n)
    return bm, bn, (pl.cdiv(m, bm), pl.cdiv(n, bn))

  def f(x, w):
    (m, k), n = x.shape, w.shape[1]
    bm, bn, grid = grid_mn(x, w)
    return call("f", _f_kernel, grid,
                [pl.BlockSpec((bm, k), lambda i, j: (i, 0)),
                 pl.BlockSpec((k, bn), lambda i, j: (0, j))],
                pl.BlockSpec((bm, bn), lambda i, j: (i, j)),
                jax.ShapeDtypeStruct((m, n), x.dtype), x, w)

  def fwd(x, w):
    (m, k), n = x.shape, w.shape[1]
    bm, bn, grid = grid_mn(x, w)
    rdt = residual_dtype or x.dtype
    z, y = call("fwd", _fwd_kernel, grid,
                [pl.BlockSpec((bm, k), lambda i, j: (i, 0)),
                 pl.BlockSpec((k, bn), lambda i, j: (0, j))],
                [pl.BlockSpec((bm, bn), lambda i, j: (i, j))] * 2,
                [jax.ShapeDtypeStruct((m, n), x.dtype),
                 jax.ShapeDtypeStruct((m, n), rdt)], x, w)
    return z, (x, w, y)

  def dx_dw(x, w, g, y=None):
    (m, k), n = x.shape, w.shape[1]
    bm, bn = min(block_m, m), min(block_n, n)
    if y is None:   # fused: recompute y
      dx = call("fwd_bwd", _fused_dx_kernel, (pl.cdiv(m, bm),),
                [pl.BlockSpec((bm, k), lambda i: (i, 0)),
                 pl.BlockSpec((k, n), lambda i: (0, 0)),
                 pl.BlockSpec((bm, n), lambda i: (i, 0))],
                pl.BlockSpec((bm, k), lambda i: (i, 0)),
                jax.ShapeDtypeStruct(x.shape, x.dtype), x, w, g)
      dw = call("fwd_bwd", _fused_dw_kernel, (pl.cdiv(n, bn),),
                [pl.BlockSpec((m, k), lambda j: (0, 0)),
                 pl.BlockSpec((k, bn), lambda j: (0, j)),
                 pl.BlockSpec((m, bn), lambda j: (0, j))],
                pl.BlockSpec((k, bn), lambda j: (0, j)),
                jax.ShapeDtypeStruct(w.shape, w.dtype), x, w, g)
      return dx, dw
    dx = call("bwd", _dx_kernel, (pl.cdiv(m, bm),),
              [pl.BlockSpec((bm, n), lambda i: (i, 0)),
               pl.BlockSpec((bm, n), lambda i: (i, 0)),
               pl.BlockSpec((k, n), lambda i: (0, 0))],
              pl.BlockSpec((bm, k), lambda i: (i, 0)),
              jax.ShapeDtypeStruct(x.shape, x.dtype), g, y, w)
    dw = call("bwd", _dw_kernel, (pl.cdiv(n, bn),),
              [pl.BlockSpec((m, k), lambda j: (0, 0)),
               pl.BlockSpec((m, bn), lambda j: (0, j)),
               pl.BlockSpec((m, bn), lambda j: (0, j))],
              pl.BlockSpec((k, bn), lambda j: (0, j)),
              jax.ShapeDtypeStruct(w.shape, w.dtype), x, g, y)
    return dx, dw

  def bwd(res, g):
    x, w, y = res
    return dx_dw(x, w, g, y)

  def fwd_bwd(x, w, g):
    return dx_dw(x, w, g)

  gelu_matmul = smart_custom_vjp(f)
  gelu_matmul.defvjp(fwd, bwd, fwd_bwd=fwd_bwd if fused else None)
  return gelu_matmul, dict(f=f, fwd=fwd, bwd=bwd, fwd_bwd=fwd_bwd)


def reference(x, w):
  return jax.nn.gelu(x @ w)


def custom_vjp_version(rules, optimize_remat=False):
  """The same kernels under ``jax.custom_vjp`` (for side-by-side runs)."""
  F = jax.custom_vjp(rules["f"])
  F.defvjp(rules["fwd"], rules["bwd"], optimize_remat=optimize_remat)
  return F


def _loss(F, remat):
  G = jax.checkpoint(F) if remat else F
  return lambda x, w: jnp.sum(G(x, w).astype(jnp.float32) ** 2)


KERNELS_PER_RULE = {"f": 1, "fwd": 1, "bwd": 2, "fwd_bwd": 2}  # bwd: dx, dw
RULES = ("f", "fwd", "bwd", "fwd_bwd")

# Published H200 SXM figures, for the break-even printed at the end.
H200_BF16_FLOPS = 989e12      # dense bf16 tensor-core flop/s
H200_BYTES_PER_S = 4.8e12     # HBM3e bandwidth


def rule_calls(launches):
  """Rule calls from kernel launches: each call of a rule launches all of its
  kernels once (``KERNELS_PER_RULE``)."""
  calls = {}
  for rule, n in launches.items():
    assert n % KERNELS_PER_RULE[rule] == 0, (rule, n)
    calls[rule] = n // KERNELS_PER_RULE[rule]
  return calls


def fmt(counts):
  return ", ".join(f"{k} {counts[k]}" for k in RULES if counts.get(k)) or "none"


def fused_break_even_k(bytes_per_element=2, flops=H200_BF16_FLOPS,
                       bandwidth=H200_BYTES_PER_S):
  """The ``K`` below which ``fwd_bwd`` is faster than ``fwd`` + ``bwd`` under
  remat: one extra ``2 M K N``-flop matmul against four ``M x N`` transfers."""
  return 2 * bytes_per_element * flops / bandwidth


def main():
  t0 = time.perf_counter()
  mode = "Triton" if jax.default_backend() == "gpu" else "interpret mode"
  print(f"Pallas matmul+GELU on {jax.default_backend()} ({mode})\n")
  print("Accuracy of the smartvjp kernels (32 x 32 tiles) against the plain-JAX "
        "reference jax.nn.gelu(x @ w),")
  print("gradients against jax.grad of it. Output: max |ours - reference|. "
        "Gradient: max |ours - reference|")
  print("over dx and dw, divided by max |reference gradient|; it must be below "
        "the tolerance.")
  print(f"  {'dtype':8s} {'x @ w':14s} {'output':>8s}  "
        f"{'gradient: no remat / remat':>26s}  tolerance")
  for dtype, tol in ((jnp.float32, 2e-5), (jnp.bfloat16, 2e-2)):
    for (m, k, n) in ((64, 32, 64), (50, 20, 37)):   # multiple / not of 32
      gm, _ = make_gelu_matmul(block_m=32, block_n=32)
      kx, kw = jax.random.split(jax.random.key(0))
      x = jax.random.normal(kx, (m, k), dtype)
      w = (jax.random.normal(kw, (k, n)) / math.sqrt(k)).astype(dtype)
      err = jnp.max(jnp.abs(gm(x, w).astype(jnp.float32)
                            - reference(x, w).astype(jnp.float32)))
      want = jax.grad(_loss(reference, False), (0, 1))(x, w)
      gerr = []
      for remat in (False, True):
        got = jax.jit(jax.grad(_loss(gm, remat), (0, 1)))(x, w)
        gerr.append(max(float(jnp.max(jnp.abs(a.astype(jnp.float32)
                                               - b.astype(jnp.float32)))
                              / (jnp.max(jnp.abs(b.astype(jnp.float32))) + 1e-9))
                        for a, b in zip(got, want)))
      verdict = "ok" if max(gerr) < tol else "TOO LARGE"
      shape = f"{m}x{k} @ {k}x{n}"
      print(f"  {jnp.dtype(dtype).name:8s} {shape:14s} {float(err):8.1e}  "
            f"{gerr[0]:18.1e} / {gerr[1]:.1e}  {tol:.0e} {verdict}")

  print("\nPer jitted gradient step of sum(gelu(x @ w)**2), x 64x32, w 32x48, "
        "counted by a callback in each kernel.")
  print("Rule calls count calls of f, fwd, bwd, fwd_bwd; kernel launches count "
        "kernels: bwd and fwd_bwd")
  print("launch two each (dx and dw), f and fwd one.")
  print(f"  {'remat':8s} {'implementation':20s} {'rule calls':20s} kernel launches")
  x = jax.random.normal(jax.random.key(1), (64, 32))
  w = jax.random.normal(jax.random.key(2), (32, 48)) / 6
  for remat in (False, True):
    for name in ("jax.custom_vjp", "optimize_remat", "smartvjp",
                 "smartvjp + fwd_bwd"):
      gm, rules = make_gelu_matmul(block_m=32, block_n=32, count=True,
                                   fused=name.endswith("fwd_bwd"))
      F = gm if name.startswith("smartvjp") else custom_vjp_version(
          rules, optimize_remat=name == "optimize_remat")
      LAUNCHES.clear()
      jax.block_until_ready(jax.jit(jax.grad(_loss(F, remat), (0, 1)))(x, w))
      jax.effects_barrier()
      launches = dict(LAUNCHES)
      print(f"  {'remat' if remat else 'no remat':8s} {name:20s} "
            f"{fmt(rule_calls(launches)):20s} {fmt(launches)}")

  k_bf16 = fused_break_even_k()
  print("\nWhen the fused rule pays: under remat it replaces fwd + bwd in the "
        "backward pass. It runs one")
  print("more M x K x N matmul (each of its two kernels recomputes y = x @ w), "
        "moves four fewer M x N")
  print("arrays (fwd's writes of z and y, bwd's two reads of y) and never holds "
        "y in memory. By a roofline")
  print("estimate it is faster when 2*M*K*N / peak_flops < 4*M*N*bytes / "
        "bandwidth, i.e. when")
  print(f"K < 2 * bytes * peak_flops / bandwidth: on an H200 in bf16 "
        f"({H200_BF16_FLOPS / 1e12:.0f} TFLOP/s, "
        f"{H200_BYTES_PER_S / 1e12:.1f} TB/s), K < {k_bf16:.0f}.")
  print("For larger K it is slower but still saves the M x N buffer for y. "
        f"(The kernels here run in {mode},")
  print("so this machine's times say nothing about it.)")
  print(f"Finished in {time.perf_counter() - t0:.1f} s.")


if __name__ == "__main__":
  main()
