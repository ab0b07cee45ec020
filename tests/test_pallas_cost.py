"""Pallas' cost estimate (``pl.estimate_cost``) counts a smartvjp call as
it counts the ``jax.custom_vjp`` call it replaces: JAX's shipped kernels fill
their ``cost_estimate`` from it, and XLA's TPU compiler reads that (a
swapped flash attention whose kernel claimed 0 flops ran 3% slower on a TPU
v5e; design/upstream/tpu_gap.md)."""

import jax
import jax.numpy as jnp
import pytest

import smartvjp

pl = pytest.importorskip("jax.experimental.pallas")


def _rules(decorator):
  @decorator
  def f(x, w):
    return jnp.tanh(x @ w)

  def f_fwd(x, w):
    return f(x, w), (x, w)

  def f_bwd(res, g):
    x, w = res
    return g @ w.T, x.T @ g
  f.defvjp(f_fwd, f_bwd)
  return f


def test_estimate_cost_matches_custom_vjp():
  x = jax.ShapeDtypeStruct((8, 16), jnp.float32)
  w = jax.ShapeDtypeStruct((16, 4), jnp.float32)
  mine = pl.estimate_cost(_rules(smartvjp.smart_custom_vjp), x, w)
  theirs = pl.estimate_cost(_rules(jax.custom_vjp), x, w)
  assert mine == theirs
  assert mine.flops > 0 and mine.transcendentals == 8 * 4


def test_swapped_flash_attention_reference_cost():
  name = "jax.experimental.pallas.ops.tpu.flash_attention"
  shipped = pytest.importorskip(name)
  swapped = smartvjp.import_swapped(name)
  q = jax.ShapeDtypeStruct((1, 2, 256, 128), jnp.float32)
  est = [pl.estimate_cost(m.mha_reference, q, q, q, None, None, causal=True,
                          sm_scale=1.0) for m in (shipped, swapped)]
  assert est[0] == est[1] and est[1].flops > 0
