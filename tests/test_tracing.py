"""Tracing and caching: f traced once per abstract signature, fwd lazily,
bwd never for plain evaluation; no leaks of per-step functions; closures."""

import gc
import weakref

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from smartvjp import smart_custom_vjp


def counted_rules():
  traces = {"f": 0, "fwd": 0, "bwd": 0}

  def f(x):
    traces["f"] += 1
    return jnp.sin(x)

  def fwd(x):
    traces["fwd"] += 1
    return jnp.sin(x), jnp.cos(x)

  def bwd(c, g):
    traces["bwd"] += 1
    return (c * g,)

  F = smart_custom_vjp(f)
  F.defvjp(fwd, bwd)
  return F, traces


def test_pure_evaluation_never_traces_fwd_or_bwd():
  F, traces = counted_rules()
  x = jnp.ones(3)
  F(x)
  F(x)
  jax.jit(F)(x)
  jax.jit(lambda x: F(x) + 1)(x)
  jax.vmap(lambda x: x)(x)
  assert traces == {"f": 1, "fwd": 0, "bwd": 0}
  F(jnp.ones(4))  # a new shape is a new signature
  assert traces["f"] == 2


def test_fwd_traced_once_and_jit_does_not_retrace():
  F, traces = counted_rules()
  x = jnp.ones(3)
  g = jax.jit(jax.grad(lambda x: jnp.sum(jax.checkpoint(F)(x))))
  g(x)
  after_first = dict(traces)
  g(x)
  g(x + 1)
  assert traces == after_first
  assert traces["f"] == 1 and traces["fwd"] == 1


def test_weak_type_and_dtype_are_part_of_the_signature():
  F, traces = counted_rules()
  F(1.0)              # weak f32
  F(jnp.float32(1))   # strong f32
  F(jnp.float32(2))
  assert traces["f"] == 2


def test_functions_created_per_step_do_not_leak():
  refs = []
  for i in range(3):
    def f(x):
      return x * 2.0

    F = smart_custom_vjp(f)
    F.defvjp(lambda x: (x * 2.0, None), lambda _, g: (2.0 * g,))
    F(jnp.float32(i))
    jax.grad(jax.checkpoint(F))(jnp.float32(i))
    refs.append(weakref.ref(f))
    del F, f
  gc.collect()
  assert sum(r() is not None for r in refs) == 0


def test_closure_over_constant_and_nondifferentiated_tracer():
  c = jnp.array([1.0, 2.0])

  def make(k):
    @smart_custom_vjp
    def f(x):
      return x * k

    f.defvjp(lambda x: (x * k, None), lambda _, g: (g * k,))
    return f

  x = jnp.array([3.0, 4.0])
  np.testing.assert_allclose(jax.grad(lambda x: jnp.sum(make(c)(x)))(x), c)

  @jax.jit
  def g(x, k):
    return jax.grad(lambda x: jnp.sum(jax.checkpoint(make(k))(x)))(x)

  np.testing.assert_allclose(g(x, c), c)


def test_differentiating_a_closed_over_value_is_an_error():
  def make(k):
    @smart_custom_vjp
    def f_closing(x):
      return x * k

    f_closing.defvjp(lambda x: (x * k, None), lambda _, g: (g * k,))
    return f_closing

  x = jnp.array([3.0, 4.0])
  for remat in (False, True):
    def loss(k):
      F = make(k)
      F = jax.checkpoint(F) if remat else F
      return jnp.sum(F(x))
    with pytest.raises(TypeError, match="f_closing.*closes over"):
      jax.grad(loss)(jnp.float32(2.0))
