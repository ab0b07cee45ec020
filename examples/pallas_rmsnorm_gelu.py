"""A memory-bound kernel: fused RMSNorm + GELU in Pallas.

``z = gelu(x * rsqrt(mean(x**2, -1) + eps) * gamma)`` for ``x: [M, D]``. The
work is a few flops per element, so time is memory traffic; ``fwd`` writes the
normalized activations ``n = x * r`` (as large as ``x``) and ``r`` as
residuals, which is where skipping residual writes in the forward pass
matters most:

* ``f``: reads ``x``, writes ``z``;
* ``fwd``: reads ``x``, writes ``z``, ``n`` and ``r``;
* ``bwd``: reads ``n``, ``r``, ``g``, writes ``dx`` and per-block ``dgamma``;
* ``fwd_bwd``: reads ``x``, ``g``, recomputes ``n`` and ``r`` in registers,
  writes ``dx`` and per-block ``dgamma`` (no ``n`` in memory at all).

Counting ``M x D`` arrays read or written (``r`` is ``M x 1``, negligible):
``f`` 2, ``fwd`` 3, ``bwd`` 3 (reads ``n``, ``g``, writes ``dx``), ``fwd_bwd`` 3.
Under ``jax.checkpoint``, ``jax.custom_vjp`` runs ``fwd`` + ``fwd`` + ``bwd``
(9 arrays); smartvjp ``f`` + ``fwd`` + ``bwd`` (8) or, with the fused rule,
``f`` + ``fwd_bwd`` (5).

Run:  python examples/pallas_rmsnorm_gelu.py
"""

from __future__ import annotations

import collections
import functools
import time

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl

from smartvjp import smart_custom_vjp

LAUNCHES: collections.Counter = collections.Counter()
EPS = 1e-6


def _gelu_and_grad(u):
  c = 0.7978845608028654
  t = jnp.tanh(c * (u + 0.044715 * u ** 3))
  return (0.5 * u * (1 + t),
          0.5 * (1 + t) + 0.5 * u * (1 - t * t) * c * (1 + 3 * 0.044715 * u * u))


def _norm(x):
  r = jax.lax.rsqrt(jnp.mean(x * x, axis=-1, keepdims=True) + EPS)
  return x * r, r


def _f_kernel(x_ref, gamma_ref, z_ref):
  n, _ = _norm(x_ref[...].astype(jnp.float32))
  z_ref[...] = _gelu_and_grad(n * gamma_ref[...].astype(jnp.float32))[0
                                                                      ].astype(z_ref.dtype)


def _fwd_kernel(x_ref, gamma_ref, z_ref, n_ref, r_ref):
  n, r = _norm(x_ref[...].astype(jnp.float32))
  z_ref[...] = _gelu_and_grad(n * gamma_ref[...].astype(jnp.float32))[0
                                                                      ].astype(z_ref.dtype)
  n_ref[...] = n.astype(n_ref.dtype)
  r_ref[...] = r


def _grads(n, r, gamma, g, m, bm):
  # rows past M in a ragged last block hold padding: keep them out of dgamma
  rows = pl.program_id(0) * bm + jax.lax.broadcasted_iota(jnp.int32, n.shape, 0)
  valid = rows < m
  n = jnp.where(valid, n, 0.0)
  _, dgelu = _gelu_and_grad(n * gamma)
  du = jnp.where(valid, g * dgelu, 0.0)
  dgamma = jnp.sum(du * n, axis=0, keepdims=True)
  dn = du * gamma
  dx = r * (dn - n * jnp.mean(dn * n, axis=-1, keepdims=True))
  return dx, dgamma


def _bwd_kernel(n_ref, r_ref, gamma_ref, g_ref, dx_ref, dgamma_ref, *, m, bm):
  dx, dgamma = _grads(n_ref[...].astype(jnp.float32), r_ref[...],
                      gamma_ref[...].astype(jnp.float32),
                      g_ref[...].astype(jnp.float32), m, bm)
  dx_ref[...] = dx.astype(dx_ref.dtype)
  dgamma_ref[...] = dgamma


def _fwd_bwd_kernel(x_ref, gamma_ref, g_ref, dx_ref, dgamma_ref, *, m, bm):
  n, r = _norm(x_ref[...].astype(jnp.float32))
  dx, dgamma = _grads(n, r, gamma_ref[...].astype(jnp.float32),
                      g_ref[...].astype(jnp.float32), m, bm)
  dx_ref[...] = dx.astype(dx_ref.dtype)
  dgamma_ref[...] = dgamma


def make_rmsnorm_gelu(block_m=64, interpret=None, fused=True, count=False):
  """``rmsnorm_gelu(x: [M, D], gamma: [D]) -> [M, D]`` as a ``smart_custom_vjp``.

  Returns ``(rmsnorm_gelu, rules)``. Rows are blocked by ``block_m``; each
  block reads whole rows (the norm needs them). ``dgamma`` is reduced over
  row blocks outside the kernels.
  """
  if interpret is None:
    interpret = jax.default_backend() != "gpu"

  def call(name, kernel, x, in_arrays, in_specs, out_shapes, out_specs):
    m = x.shape[0]
    bm = min(block_m, m)
    if count and interpret:
      inner = kernel

      def kernel(*refs):
        @pl.when(pl.program_id(0) == 0)
        def _():
          jax.debug.callback(lambda: LAUNCHES.update([name]))
        inner(*refs)
    return pl.pallas_call(kernel, grid=(pl.cdiv(m, bm),),
                          in_specs=in_specs(bm), out_specs=out_specs(bm),
                          out_shape=out_shapes(bm), interpret=interpret)(*in_arrays)

  row = lambda d: (lambda bm: pl.BlockSpec((bm, d), lambda i: (i, 0)))
  whole = lambda d: pl.BlockSpec((1, d), lambda i: (0, 0))
  per_block = lambda d: pl.BlockSpec((1, d), lambda i: (i, 0))

  def f(x, gamma):
    d = x.shape[1]
    return call("f", _f_kernel, x, (x, gamma[None]),
                lambda bm: [row(d)(bm), whole(d)],
                lambda bm: jax.ShapeDtypeStruct(x.shape, x.dtype), row(d))

  def fwd(x, gamma):
    (m, d), dt = x.shape, x.dtype
    z, n, r = call("fwd", _fwd_kernel, x, (x, gamma[None]),
                   lambda bm: [row(d)(bm), whole(d)],
                   lambda bm: [jax.ShapeDtypeStruct((m, d), dt),
                               jax.ShapeDtypeStruct((m, d), dt),
                               jax.ShapeDtypeStruct((m, 1), jnp.float32)],
                   lambda bm: [row(d)(bm), row(d)(bm), row(1)(bm)])
    return z, (n, r, gamma)

  def grads(kernel, name, x, arrays, specs):
    (m, d) = x.shape
    kernel = functools.partial(kernel, m=m, bm=min(block_m, m))
    dx, dgamma = call(
        name, kernel, x, arrays, specs,
        lambda bm: [jax.ShapeDtypeStruct((m, d), x.dtype),
                    jax.ShapeDtypeStruct((pl.cdiv(m, bm), d), jnp.float32)],
        lambda bm: [row(d)(bm), per_block(d)])
    return dx, jnp.sum(dgamma, axis=0).astype(arrays[-2].dtype)

  def bwd(res, g):
    n, r, gamma = res
    d = n.shape[1]
    return grads(_bwd_kernel, "bwd", n, (n, r, gamma[None], g),
                 lambda bm: [row(d)(bm), row(1)(bm), whole(d), row(d)(bm)])

  def fwd_bwd(x, gamma, g):
    d = x.shape[1]
    return grads(_fwd_bwd_kernel, "fwd_bwd", x, (x, gamma[None], g),
                 lambda bm: [row(d)(bm), whole(d), row(d)(bm)])

  op = smart_custom_vjp(f)
  op.defvjp(fwd, bwd, fwd_bwd=fwd_bwd if fused else None)
  return op, dict(f=f, fwd=fwd, bwd=bwd, fwd_bwd=fwd_bwd)


def reference(x, gamma):
  x32 = x.astype(jnp.float32)
  n = x32 * jax.lax.rsqrt(jnp.mean(x32 * x32, -1, keepdims=True) + EPS)
  return jax.nn.gelu(n * gamma.astype(jnp.float32)).astype(x.dtype)


ARRAYS_MOVED = {"f": 2, "fwd": 3, "bwd": 3, "fwd_bwd": 3}  # M x D, per call


def main():
  t0 = time.perf_counter()
  x = jax.random.normal(jax.random.key(0), (200, 96))
  gamma = 1.0 + 0.1 * jax.random.normal(jax.random.key(1), (96,))
  loss = lambda F, remat: (lambda x, gm: jnp.sum(
      (jax.checkpoint(F) if remat else F)(x, gm).astype(jnp.float32) ** 2))
  want = jax.grad(loss(reference, False), (0, 1))(x, gamma)
  print("RMSNorm+GELU in Pallas, x 200x96 (ragged against the 64-row block), "
        "one jitted gradient step of sum(z**2).")
  print("Each rule is one kernel, so rule calls are also kernel launches. "
        "Arrays moved: M x D arrays read or written")
  print("by the kernels (f 2, fwd 3, bwd 3, fwd_bwd 3 per call). Gradient "
        "error: max |ours - reference| / max |reference|")
  print("over dx and dgamma, reference = jax.grad of the same function in "
        "plain JAX.\n")
  print(f"  {'remat':6s} {'implementation':34s} {'rule calls':20s} "
        f"{'arrays moved':>12s}  grad error")
  for remat, name, impl, fused in (
      (False, "jax.custom_vjp", "jax", False),
      (False, "smartvjp (fwd_bwd given, unused)", "smart", True),
      (True, "jax.custom_vjp", "jax", False),
      (True, "smartvjp, fwd + bwd", "smart", False),
      (True, "smartvjp, fused fwd_bwd", "smart", True)):
    op, rules = make_rmsnorm_gelu(count=True, fused=fused)
    if impl == "jax":
      op = jax.custom_vjp(rules["f"])
      op.defvjp(rules["fwd"], rules["bwd"])
    LAUNCHES.clear()
    got = jax.block_until_ready(jax.jit(jax.grad(loss(op, remat), (0, 1)))(x, gamma))
    jax.effects_barrier()
    err = max(float(jnp.max(jnp.abs(a - b)) / jnp.max(jnp.abs(b)))
              for a, b in zip(got, want))
    moved = sum(ARRAYS_MOVED[k] * n for k, n in LAUNCHES.items())
    c = ", ".join(f"{k} {LAUNCHES[k]}" for k in ("f", "fwd", "bwd", "fwd_bwd")
                  if LAUNCHES[k])
    print(f"  {'yes' if remat else 'no':6s} {name:34s} {c:20s} {moved:12d}  "
          f"{err:.1e}")
  print(f"Finished in {time.perf_counter() - t0:.1f} s.")


if __name__ == "__main__":
  main()
