"""What the rules receive, compared with ``jax.custom_vjp`` under each
transformation: Python scalars among the residuals reach ``bwd`` as Python
values (``grad(vmap(F))`` included), a ``bwd`` that reads a residual's value
runs on concrete values wherever JAX runs it eagerly (``vmap(grad(F))``
without ``jit``), and an eager call hands ``f`` its arguments rebuilt from
their leaves, as JAX does, not the caller's own objects.

Forms reduced from real libraries: chunk sizes among a flash attention's
residuals, equinox's ``perturbed`` flags, a differentiated solve under
``grad(vmap(...))``, an ODE adjoint that sizes an array from a residual, and
a quantization config that calibrates itself once per object."""

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
import pytest

import smartvjp
from smartvjp import smart_custom_vjp

DECORATORS = {"jax": jax.custom_vjp, "smartvjp": smart_custom_vjp}


def python_residual(deco, seen):
  """``fwd`` returns an int among its residuals; ``bwd`` branches on it."""
  @deco
  def F(x):
    return jnp.sin(x)

  def fwd(x):
    return jnp.sin(x), (jnp.cos(x), 8, 0.5)

  def bwd(res, g):
    c, n, half = res
    seen.append((isinstance(n, int) and not isinstance(n, jax.core.Tracer),
                 isinstance(half, float)))
    return (g * c * (min(n, 4) * half / 2.0),)   # needs Python values
  F.defvjp(fwd, bwd)
  return F


PROGRAMS = {
    "grad(vmap)": lambda F: jax.grad(lambda x: jnp.sum(jax.vmap(F)(x))),
    "jit(grad(vmap))": lambda F: jax.jit(
        jax.grad(lambda x: jnp.sum(jax.vmap(F)(x)))),
    "grad(vmap(vmap))": lambda F: jax.grad(
        lambda x: jnp.sum(jax.vmap(jax.vmap(F))(x[None]))),
    "grad(vmap(checkpoint))": lambda F: jax.grad(
        lambda x: jnp.sum(jax.vmap(jax.checkpoint(F))(x))),
    "grad(checkpoint(vmap))": lambda F: jax.grad(
        lambda x: jnp.sum(jax.checkpoint(jax.vmap(F))(x))),
    "vmap(grad)": lambda F: jax.vmap(jax.grad(F)),
    "jit(vmap(grad))": lambda F: jax.jit(jax.vmap(jax.grad(F))),
    "grad": lambda F: jax.grad(lambda x: jnp.sum(F(x))),
}


@pytest.mark.parametrize("program", PROGRAMS)
def test_python_residual_reaches_bwd_as_python_value(program):
  x = jnp.linspace(0.1, 0.9, 3)
  got = {}
  for name, deco in DECORATORS.items():
    seen = []
    got[name] = PROGRAMS[program](python_residual(deco, seen))(x)
    assert seen, f"{name}: bwd never ran"
    got[name + " types"] = set(seen)
  assert got["smartvjp types"] == got["jax types"] == {(True, True)}
  np.testing.assert_array_equal(got["smartvjp"], got["jax"])


def test_equinox_perturbed_flags_under_grad_of_vmap():
  """equinox's perturbed flags are Python bools among the residuals."""
  @smartvjp.filter_custom_vjp
  def scale(vjp_arg, s):
    return vjp_arg * s

  @scale.def_fwd
  def fwd(perturbed, vjp_arg, s):
    return vjp_arg * s, perturbed

  @scale.def_bwd
  def bwd(res, g, perturbed, vjp_arg, s):
    assert res is True or res is False, type(res)
    return g * s if res else None

  loss = lambda x: jnp.sum(jax.vmap(lambda xi: scale(xi, 3.0))(x))
  x = jnp.arange(3.0)
  np.testing.assert_array_equal(jax.grad(loss)(x), jnp.full(3, 3.0))
  want = jax.grad(lambda x: jnp.sum(
      eqx.filter_vmap(lambda xi: xi * 3.0)(x)))(x)
  np.testing.assert_array_equal(jax.jit(jax.grad(loss))(x), want)


def concrete_residual(deco):
  """``bwd`` sizes an array from a residual's value: it needs the concrete
  value JAX hands it wherever it runs ``bwd`` eagerly."""
  @deco
  def F(x):
    return jnp.sin(x)

  def fwd(x):
    return jnp.sin(x), (jnp.cos(x), jnp.asarray(3))

  def bwd(res, g):
    c, n = res
    pad = jnp.ones(int(n))            # a shape from a value
    return (g * c * pad.sum() / 3.0,)
  F.defvjp(fwd, bwd)
  return F


EAGER_PROGRAMS = {
    "vmap(grad)": lambda F: jax.vmap(jax.grad(F)),
    "vmap(vmap(grad))": lambda F: lambda x: jax.vmap(
        jax.vmap(jax.grad(F)))(x[None])[0],
    "grad(grad)": lambda F: jax.vmap(jax.grad(jax.grad(F))),
    "jacrev": lambda F: lambda x: jnp.diag(jax.jacrev(F)(x)),
    "vmap(value_and_grad)": lambda F: lambda x: jax.vmap(
        jax.value_and_grad(F))(x)[1],
}


@pytest.mark.parametrize("program", EAGER_PROGRAMS)
def test_bwd_runs_on_concrete_values_where_jax_runs_it_eagerly(program):
  x = jnp.linspace(0.1, 0.9, 3)
  want = EAGER_PROGRAMS[program](concrete_residual(jax.custom_vjp))(x)
  got = EAGER_PROGRAMS[program](concrete_residual(smart_custom_vjp))(x)
  np.testing.assert_array_equal(got, want)


def test_bwd_needing_values_fails_under_jit_as_with_jax():
  """Under ``jit`` both trace ``bwd``: the same error type."""
  x = jnp.linspace(0.1, 0.9, 3)
  errors = []
  for deco in DECORATORS.values():
    with pytest.raises(Exception) as info:
      jax.jit(jax.vmap(jax.grad(concrete_residual(deco))))(x)
    errors.append(info.type)
  assert errors[0] is errors[1]


@jax.tree_util.register_pytree_node_class
class Calibrating:
  """A config whose rule calibrates it once per object, as a quantization
  library's dot-general config does."""

  def __init__(self, w):
    self.w = w
    self.calibrated = False

  def tree_flatten(self):
    return (self.w,), None

  @classmethod
  def tree_unflatten(cls, aux, children):
    return cls(*children)


def calibrating(deco):
  @deco
  def F(cfg, x):
    if cfg.calibrated:
      raise RuntimeError("this object was calibrated before")
    cfg.calibrated = True
    return cfg.w * x

  def fwd(cfg, x):
    return F(cfg, x), (cfg.w,)

  def bwd(res, g):
    return None, g * res[0]
  F.defvjp(fwd, bwd)
  return F


@pytest.mark.parametrize("name", DECORATORS)
def test_eager_call_hands_f_fresh_argument_objects(name):
  F = calibrating(DECORATORS[name])
  cfg = Calibrating(jnp.float32(2.0))
  assert float(F(cfg, 1.0)) == float(F(cfg, 1.0)) == 2.0
  assert not cfg.calibrated        # f saw a copy, never the caller's object
  assert float(jax.grad(F, argnums=1)(cfg, 1.0)) == 2.0
