"""smartvjp.filter_custom_vjp with Python numbers among the arguments.

Under eager ``jax.grad`` at a Python scalar JAX hands the rules the primal as
a Python-number subclass, not an array; equinox 0.13's own
``filter_custom_vjp`` then returns a zero gradient. Ours gives the gradient
that both give under ``jax.jit``, wherever the float sits."""

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
import pytest

import smartvjp


def build(deco):
  def scale(vjp_arg, *args, **kwargs):
    a, b = vjp_arg if isinstance(vjp_arg, tuple) else (vjp_arg, 1.0)
    s = args[0] if args else kwargs.get("s", 1.0)
    return a * b * s

  fn = deco(scale)

  @fn.def_fwd
  def fwd(perturbed, vjp_arg, *args, **kwargs):
    return scale(vjp_arg, *args, **kwargs), None

  @fn.def_bwd
  def bwd(res, g, perturbed, vjp_arg, *args, **kwargs):
    a, b = vjp_arg if isinstance(vjp_arg, tuple) else (vjp_arg, 1.0)
    s = args[0] if args else kwargs.get("s", 1.0)
    if isinstance(vjp_arg, tuple):   # a gradient for the float too: dropped
      return (g * b * s, g * a * s)
    return g * b * s
  return fn


CASES = {
    "float in args": lambda fn: lambda x: fn(x, 2.0),
    "int in args": lambda fn: lambda x: fn(x, 2),
    "float in kwargs": lambda fn: lambda x: fn(x, s=2.0),
    "float in vjp_arg": lambda fn: lambda x: fn((x, 2.0)),
    "float in vjp_arg and args": lambda fn: lambda x: fn((x, 2.0), 1.5),
}
WANT = {"float in args": 2.0, "int in args": 2.0, "float in kwargs": 2.0,
        "float in vjp_arg": 2.0, "float in vjp_arg and args": 3.0}


@pytest.mark.parametrize("case", CASES)
@pytest.mark.parametrize("mode", ["eager", "jit", "checkpoint", "vjp"])
@pytest.mark.parametrize("x", [1.0, np.float32(1.0), jnp.float32(1.0)],
                         ids=["python", "numpy", "jax"])
def test_python_numbers(case, mode, x):
  fn = CASES[case](build(smartvjp.filter_custom_vjp))
  if mode == "eager":
    got = jax.grad(fn)(x)
  elif mode == "jit":
    got = jax.jit(jax.grad(fn))(x)
  elif mode == "checkpoint":
    got = jax.grad(jax.checkpoint(fn))(x)
  else:
    out, pullback = jax.vjp(fn, x)
    np.testing.assert_allclose(out, WANT[case])
    (got,) = pullback(jnp.ones_like(out))
  np.testing.assert_allclose(got, WANT[case])


@pytest.mark.parametrize("case", CASES)
def test_same_as_equinox_under_jit(case):
  ours = jax.jit(jax.grad(CASES[case](build(smartvjp.filter_custom_vjp))))(1.0)
  theirs = jax.jit(jax.grad(CASES[case](build(eqx.filter_custom_vjp))))(1.0)
  np.testing.assert_allclose(ours, theirs)


def test_plain_calls_with_floats():
  fn = build(smartvjp.filter_custom_vjp)
  assert fn(1.0, 2.0) == 2.0
  assert fn((1.5, 2.0)) == 3.0


def test_differentiating_args_is_refused_as_in_equinox():
  fn = build(smartvjp.filter_custom_vjp)
  with pytest.raises(RuntimeError):
    jax.grad(lambda s: fn(2.0, s))(1.0)
