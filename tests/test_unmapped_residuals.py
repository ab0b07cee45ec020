"""``grad(vmap(F))`` where ``fwd`` saves an input that is not mapped.

Found by ``tools/try_libraries.py`` (issue 34): jax-cce's fused linear
cross-entropy saves the vocabulary weights ``w`` (unmapped under
``vmap(loss, in_axes=(0, None))``) and its ``bwd`` loops over them with
``lax.scan``. ``jax.custom_vjp`` batches ``fwd`` keeping ``w`` unmapped, so
``bwd`` loops over one ``w``; smartvjp's batched ``smartvjp_fwd`` returns
``w`` broadcast along the batch (a ``[B, V, D]`` residual) and the batched
``bwd`` loops over ``B`` copies, then sums them: 7% more flops here, 1.4%
for jax-cce, 6% for optimistix's ``grad(vmap(solve))``. Gradients are
equal. Fixed in the core (``_vmap.batched_rules``): a residual that
``fwd``'s batched trace leaves unmapped leaves it unmapped, and the batched
``bwd`` takes it with ``in_axes=None``, as for Python residuals.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from smartvjp import smart_custom_vjp


def _program(decorator):
  @decorator
  def f(x, w):
    return jnp.sum(x @ jnp.tanh(w))

  def fwd(x, w):
    return f(x, w), (x, w)

  def bwd(res, g):
    x, w = res
    # a loop over the saved weights, as jax-cce's chunked backward pass
    t = jax.lax.scan(lambda c, row: (c, jnp.tanh(row)), 0.0, w)[1]
    ones = jnp.ones((x.shape[0], w.shape[1]), x.dtype)
    return g * ones @ t.T, (x.T @ (g * ones)) * (1 - t ** 2)
  f.defvjp(fwd, bwd)
  return jax.grad(lambda x, w: jnp.sum(jax.vmap(f, (0, None))(x, w)),
                  argnums=(0, 1))


X = jnp.linspace(-1.0, 1.0, 3 * 4 * 8, dtype=jnp.float32).reshape(3, 4, 8)
W = jnp.linspace(0.5, -0.5, 8 * 8, dtype=jnp.float32).reshape(8, 8)


def _flops(fn):
  cost = jax.jit(fn).lower(X, W).compile().cost_analysis()
  return (cost[0] if isinstance(cost, list) else cost)["flops"]


def test_gradients_equal_jax_custom_vjp():
  want = jax.jit(_program(jax.custom_vjp))(X, W)
  got = jax.jit(_program(smart_custom_vjp))(X, W)
  for a, b in zip(want, got):
    np.testing.assert_array_equal(np.asarray(a), np.asarray(b))


def test_an_unmapped_residual_stays_unmapped():
  # the batched fwd leaves w unmapped (forwarded, not broadcast along the
  # batch) and the batched bwd reads it so, as jax.custom_vjp's does
  program = jax.make_jaxpr(_program(smart_custom_vjp))(X, W)
  rules = [e for e in program.jaxpr.eqns if e.primitive.name == "smartvjp_rule"]
  shapes = [tuple(v.aval.shape) for e in rules for v in (*e.invars, *e.outvars)]
  assert W.shape in shapes and (3, *W.shape) not in shapes, shapes
  assert _flops(_program(smart_custom_vjp)) <= _flops(
      _program(jax.custom_vjp))


# Issue 34 crash 4 (jax-md's rigid-body NVE, differentiated in the
# orientations: gradients up to 1.4e-7 apart, relative). The form: forces
# are a gradient through the custom rule, taken inside vmap(F, (0, None))
# (every point rotated by its own quaternion, one body frame for all), and
# the loss is differentiated again. jax.custom_vjp's batched bwd keeps the
# unmapped input unmapped: its cotangent is summed over the batch inside
# bwd's own contractions (a dot_general contracting the batch axis);
# smartvjp's batched bwd maps it, computes one cotangent per example and
# sums them afterwards (reduce_sum): float32 sums in another order.

def _second_order(decorator):
  def raw(x, v):
    return x * jnp.dot(x, v) + jnp.roll(x, 1) * v

  @decorator
  def f(x, v):
    return raw(x, v)

  def fwd(x, v):
    return f(x, v), (x, v)

  def bwd(res, g):
    x, v = res
    dx = g * jnp.dot(x, v) + v * jnp.dot(g, x) + jnp.roll(g * v, -1)
    dv = x * jnp.dot(g, x) + g * jnp.roll(x, 1)
    return dx - jnp.dot(x, dx) * x, dv   # the projection jax-md's bwd makes
  f.defvjp(fwd, bwd)

  def energy(x, v):
    return jnp.sum(jnp.sin(jax.vmap(f, (0, None))(x, v)))

  def loss(x, v):
    return jnp.sum(jax.grad(energy)(x, v) ** 2)
  return jax.jit(jax.grad(loss, argnums=(0, 1)))


XS = jax.random.normal(jax.random.key(0), (5, 4), jnp.float32)
V = jax.random.normal(jax.random.key(1), (4,), jnp.float32)


def test_second_order_through_an_unmapped_input_within_float32_rounding():
  want = _second_order(jax.custom_vjp)(XS, V)
  got = _second_order(smart_custom_vjp)(XS, V)
  for a, b in zip(want, got):
    a, b = np.asarray(a, np.float64), np.asarray(b, np.float64)
    np.testing.assert_allclose(b, a, rtol=0, atol=1e-6 * np.abs(a).max())


def test_second_order_through_an_unmapped_input_is_bitwise():
  want = _second_order(jax.custom_vjp)(XS, V)
  got = _second_order(smart_custom_vjp)(XS, V)
  for a, b in zip(want, got):
    assert np.asarray(a).tobytes() == np.asarray(b).tobytes(), (a, b)
