"""Higher-order reverse mode (grad of grad, jacrev of jacrev, hessian), with
and without remat, where optimize_remat=True raises."""

import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import kernels as K
from smartvjp import smart_custom_vjp

X = jnp.array([0.3, -1.2, 2.0], jnp.float32)


def rules():
  def f(x, w):
    return jnp.sin(x) * w

  def fwd(x, w):
    return jnp.sin(x) * w, (jnp.cos(x), jnp.sin(x), w)

  def bwd(res, g):
    c, s, w = res
    return c * w * g, jnp.sum(s * g)
  return f, fwd, bwd


def both():
  f, fwd, bwd = rules()
  s = smart_custom_vjp(f)
  s.defvjp(fwd, bwd)
  r = jax.custom_vjp(f)
  r.defvjp(fwd, bwd)
  return s, r


def close(a, b):
  jax.tree_util.tree_map(
      lambda x, y: np.testing.assert_allclose(x, y, rtol=1e-5, atol=1e-6), a, b)


@pytest.mark.parametrize("remat", [False, True], ids=["plain", "remat"])
def test_grad_of_grad(ad_mode, remat):
  s, r = both()
  w = jnp.float32(1.5)

  def g(F):
    G = jax.checkpoint(F) if remat else F
    inner = jax.grad(lambda x, w: jnp.sum(G(x, w) ** 3), argnums=(0, 1))
    return jax.grad(lambda x, w: jnp.sum(inner(x, w)[0]) + inner(x, w)[1],
                    argnums=(0, 1))

  close(jax.jit(g(s))(X, w), jax.jit(g(r))(X, w))


@pytest.mark.parametrize("remat", [False, True], ids=["plain", "remat"])
def test_jacrev_jacrev_and_hessian(ad_mode, remat):
  # compared with the plain function: jax.custom_vjp refuses the forward
  # mode of jax.hessian under remat3 on jax 0.10
  s, r = both()[0], rules()[0]
  w = jnp.float32(0.7)

  def h(F, how):
    G = jax.checkpoint(F) if remat else F
    loss = lambda x: jnp.sum(G(x, w) ** 2)
    return how(loss)

  close(h(s, lambda f: jax.jacrev(jax.jacrev(f)))(X),
        h(r, lambda f: jax.jacrev(jax.jacrev(f)))(X))
  close(jax.jit(h(s, jax.hessian))(X), jax.jit(h(r, jax.hessian))(X))


def test_optimize_remat_cannot_do_grad_of_grad_but_we_can():
  f, fwd, bwd = rules()
  o = jax.custom_vjp(f)
  o.defvjp(fwd, bwd, optimize_remat=True)
  s, r = both()
  w = jnp.float32(1.5)
  gg = lambda F: jax.grad(jax.grad(lambda x: jnp.sum(jax.checkpoint(F)(x, w))))
  with pytest.raises(Exception):
    gg(o)(jnp.float32(0.4))
  np.testing.assert_allclose(gg(s)(jnp.float32(0.4)), gg(r)(jnp.float32(0.4)),
                             rtol=1e-6)


def test_opaque_rule_error_is_jaxs_with_a_note_naming_the_rule():
  """Grad of grad through callback rules: JAX's own error, as
  ``jax.custom_vjp`` raises it, with smartvjp's note naming the rule."""
  f, fwd, bwd, _ = K.sin_rules()
  gg = lambda F: jax.grad(jax.grad(lambda x: jnp.sum(F(x))))
  F = jax.custom_vjp(f)
  F.defvjp(fwd, bwd)
  with pytest.raises(Exception) as theirs:
    gg(F)(jnp.float32(0.5))
  S = smart_custom_vjp(f)
  S.defvjp(fwd, bwd)
  with pytest.raises(type(theirs.value)) as ours:
    gg(S)(jnp.float32(0.5))
  assert str(ours.value) == str(theirs.value)
  notes = "\n".join(getattr(ours.value, "__notes__", []))
  assert re.search(r"derivative of its (fwd|bwd) rule \((fwd|bwd)\)", notes)


def test_hessian_under_remat_when_bwd_calls_another_custom_function():
  def inner(cls):
    G = cls(lambda x: 2 * x)
    G.defvjp(lambda x: (2 * x, None), lambda r, g: (2 * g,))
    return G

  def outer(cls):
    G = inner(cls)
    F = cls(jnp.sin)
    F.defvjp(lambda x: (jnp.sin(x), jnp.cos(x)), lambda r, g: (G(g) / 2 * r,))
    return F

  x = jnp.array([0.3, 0.5, 0.7])
  want = jax.hessian(lambda x: jnp.sum(jnp.sin(x)))(x)
  F = outer(smart_custom_vjp)
  for remat in (False, True):
    G = jax.checkpoint(F) if remat else F
    got = jax.jit(jax.hessian(lambda x: jnp.sum(G(x))))(x)
    np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-6)


def test_linear_transpose_of_a_nonlinear_call_is_refused():
  F = smart_custom_vjp(jnp.sin)
  F.defvjp(lambda x: (jnp.sin(x), jnp.cos(x)), lambda r, g: (g * r,))
  with pytest.raises(NotImplementedError):
    jax.linear_transpose(F, X)(jnp.ones(3))


def test_grad_of_grad_through_a_fwd_that_calls_f_with_constants():
  """fwd calls the custom function itself, whose f closes over a constant
  (as jax.experimental.ode.odeint's does): the outer derivative moves the
  arguments only, never the constants."""
  def make(cls):
    @cls
    def f(x, a):
      return jnp.sin(x * a) * jnp.array([1.0, 2.0])

    def fwd(x, a):
      y = f(x, a)
      return y, (x, a, y)

    def bwd(res, g):
      x, a, _ = res
      d = jnp.sum(g * jnp.cos(x * a) * jnp.array([1.0, 2.0]))
      return d * a, d * x
    f.defvjp(fwd, bwd)
    return f

  got, want = (jax.jit(jax.grad(jax.grad(
      lambda x, a, f=make(cls): jnp.sum(f(x, a) ** 2), 1), 0))(0.3, 0.7)
      for cls in (smart_custom_vjp, jax.custom_vjp))
  np.testing.assert_allclose(got, want, rtol=1e-6)
