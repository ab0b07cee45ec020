"""A smart_custom_vjp call in a linear position, linear in only some of its
arguments (the others are values of the primals), transposed with respect to
the linear ones. jax.custom_vjp cannot transpose its call at all, so the
reference is the plain, un-customized function."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from smartvjp import smart_custom_vjp

X = jnp.array([0.3, -1.2, 2.0], jnp.float32)


def _mul(kind):
  """``a * b`` as the plain function, a jax.custom_vjp or a smart one."""
  def f(a, b):
    return a * b
  if kind == "plain":
    return f
  F = smart_custom_vjp(f) if kind == "smart" else jax.custom_vjp(f)
  F.defvjp(lambda a, b: (a * b, (a, b)), lambda r, g: (g * r[1], g * r[0]))
  return F


def _sin_with_jvp_rule(kind, position):
  """``sin`` whose custom_jvp rule multiplies the tangent by ``cos(x)``
  through the call (the tangent as first or second argument)."""
  M = _mul(kind)

  @jax.custom_jvp
  def h(x):
    return jnp.sin(x)

  @h.defjvp
  def h_jvp(primals, tangents):
    (x,), (t,) = primals, tangents
    out = M(t, jnp.cos(x)) if position == 0 else M(jnp.cos(x), t)
    return jnp.sin(x), out
  return h


@pytest.mark.parametrize("position", [0, 1])
@pytest.mark.parametrize("jit", [False, True])
def test_custom_jvp_rule_calls_it_on_a_tangent_and_a_primal_value(position,
                                                                   jit):
  def grad_of(kind):
    h = _sin_with_jvp_rule(kind, position)
    g = jax.grad(lambda x: jnp.sum(h(x) * X))
    return jax.jit(g) if jit else g
  want = grad_of("plain")(X)
  np.testing.assert_allclose(grad_of("smart")(X), want, rtol=1e-6)
  with pytest.raises(NotImplementedError):  # why the reference is plain
    grad_of("custom")(X)


def test_vjp_of_custom_jvp_rule_with_two_arguments_one_differentiated():
  M = _mul("smart")

  def make(Mul):
    @jax.custom_jvp
    def h(x, y):
      return jnp.sin(x) * y

    @h.defjvp
    def h_jvp(primals, tangents):
      (x, y), (tx, ty) = primals, tangents
      return jnp.sin(x) * y, Mul(tx, jnp.cos(x) * y) + jnp.sin(x) * ty
    return h
  y = jnp.array([1.5, 0.5, -2.0])
  for argnums in (0, 1, (0, 1)):
    got = jax.grad(lambda x, y: jnp.sum(make(M)(x, y)), argnums)(X, y)
    want = jax.grad(lambda x, y: jnp.sum(make(_mul("plain"))(x, y)),
                    argnums)(X, y)
    jax.tree_util.tree_map(
        lambda a, b: np.testing.assert_allclose(a, b, rtol=1e-6), got, want)


def _outer(kind):
  """``sin(x) * x`` whose ``bwd`` calls another function (``Inner``) on the
  cotangent and a value of the residuals."""
  Inner = _mul(kind)

  def f(x):
    return jnp.sin(x) * x
  if kind == "plain":
    return f
  F = smart_custom_vjp(f) if kind == "smart" else jax.custom_vjp(f)
  F.defvjp(lambda x: (f(x), (x,)),
           lambda r, g: (Inner(g, jnp.cos(r[0]) * r[0] + jnp.sin(r[0])),))
  return F


@pytest.mark.parametrize("jit", [False, True])
def test_hessian_when_bwd_calls_another_smart_function(jit):
  def hess(kind):
    F = _outer(kind)
    h = jax.hessian(lambda x: jnp.sum(F(x) * X))
    return jax.jit(h) if jit else h
  np.testing.assert_allclose(hess("smart")(X), hess("plain")(X), rtol=1e-5,
                             atol=1e-6)
  with pytest.raises(TypeError):  # jax.custom_vjp refuses forward mode
    hess("custom")(X)


def test_nonlinear_use_of_the_linear_argument_is_refused():
  """``f`` not linear in the transposed argument: an error, not a value,
  and the plain function's error type."""
  def f(a, b):
    return a * a * b
  S = smart_custom_vjp(f)
  S.defvjp(lambda a, b: (f(a, b), (a, b)),
           lambda r, g: (2 * g * r[0] * r[1], g * r[0] ** 2))

  def grad_of(F):
    @jax.custom_jvp
    def h(x):
      return jnp.sin(x)

    @h.defjvp
    def h_jvp(primals, tangents):
      (x,), (t,) = primals, tangents
      return jnp.sin(x), F(t, jnp.cos(x))
    return jax.grad(lambda x: jnp.sum(h(x)))

  try:
    grad_of(f)(X)
  except Exception as e:  # noqa: BLE001 - the type is what is compared
    expected = type(e)
  else:
    raise AssertionError("the plain function should fail")
  with pytest.raises(expected):
    grad_of(S)(X)
