"""Fused matmul + GELU in Pallas: ``z = gelu(x @ w)`` (the kernel of seed 000).

Four kernels, blocked over rows (``block_m``) and columns (``block_n``):

* ``f``: writes only ``z`` (inference);
* ``fwd``: writes ``z`` and the residual ``y = x @ w`` (training);
* ``bwd``: ``dx = dy @ w.T`` and ``dw = x.T @ dy`` from ``y``, where
  ``dy = g * gelu'(y)``;
* ``fwd_bwd`` (fused): recomputes ``y`` tile by tile and never writes it.

Cost per gradient step (``M x K`` times ``K x N``), counting matmuls of that
size and ``M x N`` arrays written to or read from memory:

================  =========================  ==========================
path              matmuls                    M x N memory traffic
================  =========================  ==========================
no remat          fwd 1 + bwd 2 = 3          y written, y read twice
remat, fwd+bwd    f 1 + fwd 1 + bwd 2 = 4    y written, y read twice
remat, fwd_bwd    f 1 + fwd_bwd 2 + 2 = 5    none for y
================  =========================  ==========================

The fused rule costs one more matmul than ``fwd`` + ``bwd`` (``dx`` and
``dw`` both need ``dy``, so each of its two kernels recomputes its share of
``y``) and saves writing and reading ``y``: it pays when the matmul is cheap
relative to moving ``y``, i.e. when ``K`` is small (roughly when
``2 K / bytes_per_element`` is below the chip's flop/byte ratio, about 300
on an H200 in bf16) or memory is the constraint.

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


def main():
  t0 = time.perf_counter()
  print(f"Pallas matmul+GELU on {jax.default_backend()} "
        f"({'interpret mode' if jax.default_backend() != 'gpu' else 'Triton'})\n")
  print("Values and gradients against jax.nn.gelu(x @ w):")
  for dtype, tol in ((jnp.float32, 2e-5), (jnp.bfloat16, 2e-2)):
    for (m, k, n) in ((64, 32, 48), (50, 20, 37)):   # multiple / not of 16
      gm, _ = make_gelu_matmul(block_m=16, block_n=16)
      kx, kw = jax.random.split(jax.random.key(0))
      x = jax.random.normal(kx, (m, k), dtype)
      w = (jax.random.normal(kw, (k, n)) / math.sqrt(k)).astype(dtype)
      err = jnp.max(jnp.abs(gm(x, w).astype(jnp.float32)
                            - reference(x, w).astype(jnp.float32)))
      gerr = []
      for remat in (False, True):
        g1 = jax.jit(jax.grad(_loss(gm, remat), (0, 1)))(x, w)
        g2 = jax.grad(_loss(reference, False), (0, 1))(x, w)
        gerr.append(max(float(jnp.max(jnp.abs(a.astype(jnp.float32)
                                               - b.astype(jnp.float32)))
                              / (jnp.max(jnp.abs(b.astype(jnp.float32))) + 1e-9))
                        for a, b in zip(g1, g2)))
      print(f"  {jnp.dtype(dtype).name:8s} {m}x{k} @ {k}x{n}: max|z err| "
            f"{float(err):.1e}, grad rel err {max(gerr):.1e} "
            f"({'ok' if max(gerr) < tol else 'TOO LARGE'})")

  print("\nKernel launches per gradient step (x 64x32, w 32x48):")
  x = jax.random.normal(jax.random.key(1), (64, 32))
  w = jax.random.normal(jax.random.key(2), (32, 48)) / 6
  for remat in (False, True):
    for name in ("jax.custom_vjp", "optimize_remat", "smartvjp",
                 "smartvjp + fwd_bwd"):
      gm, rules = make_gelu_matmul(block_m=16, block_n=16, count=True,
                                   fused=name.endswith("fwd_bwd"))
      F = gm if name.startswith("smartvjp") else custom_vjp_version(
          rules, optimize_remat=name == "optimize_remat")
      LAUNCHES.clear()
      jax.block_until_ready(jax.jit(jax.grad(_loss(F, remat), (0, 1)))(x, w))
      jax.effects_barrier()
      order = ("f", "fwd", "bwd", "fwd_bwd")
      c = ", ".join(f"{k} {LAUNCHES[k]}" for k in order if LAUNCHES[k])
      print(f"  {'remat' if remat else 'no remat':8s} {name:20s} {c}")
  print("\nbwd and fwd_bwd are two kernels each (dx, dw). The fused path "
        "writes no y: it pays when K is small or memory is short (see the "
        "module docstring).")
  print(f"Finished in {time.perf_counter() - t0:.1f} s.")


if __name__ == "__main__":
  main()
