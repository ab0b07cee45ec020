"""The custom_vjp examples of JAX's docs, unchanged except for the decorator,
give the same numbers under smart_custom_vjp as under jax.custom_vjp.

Sources: the ``jax.custom_vjp`` docstring and the custom_vjp sections of
"Custom derivative rules for JAX-transformable Python functions"."""

from functools import partial

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax import lax

from smartvjp import smart_custom_vjp

DECORATORS = {"jax": jax.custom_vjp, "smartvjp": smart_custom_vjp}


def both(build):
  ref, ours = build(jax.custom_vjp), build(smart_custom_vjp)
  return ref, ours


def close(a, b):
  jax.tree_util.tree_map(
      lambda x, y: np.testing.assert_allclose(x, y, rtol=1e-6, atol=1e-7), a, b)


def docstring_example(custom_vjp):
  @custom_vjp
  def f(x, y):
    return jnp.sin(x) * y

  def f_fwd(x, y):
    return f(x, y), (jnp.cos(x), jnp.sin(x), y)

  def f_bwd(res, g):
    cos_x, sin_x, y = res
    return (cos_x * g * y, sin_x * g)

  f.defvjp(f_fwd, f_bwd)
  return lambda: (jax.value_and_grad(f)(jnp.float32(1.0), jnp.float32(2.0)),
                  jax.grad(f, 1)(3.0, 4.0))


def clip_gradient_example(custom_vjp):
  @custom_vjp
  def clip_gradient(lo, hi, x):
    return x  # identity function

  def clip_gradient_fwd(lo, hi, x):
    return x, (lo, hi)  # save bounds as residuals

  def clip_gradient_bwd(res, g):
    lo, hi = res
    return (None, None, jnp.clip(g, lo, hi))  # use None to indicate zero cotangents for lo and hi

  clip_gradient.defvjp(clip_gradient_fwd, clip_gradient_bwd)
  t = jnp.linspace(0, 10, 100)
  return lambda: jax.vmap(jax.grad(lambda x: clip_gradient(-0.75, 0.75, jnp.sin(x))))(t)


def fixed_point_example(custom_vjp):
  @partial(custom_vjp, nondiff_argnums=(0,))
  def fixed_point(f, a, x_guess):
    def cond_fun(carry):
      x_prev, x = carry
      return jnp.abs(x_prev - x) > 1e-6

    def body_fun(carry):
      _, x = carry
      return x, f(a, x)

    _, x_star = lax.while_loop(cond_fun, body_fun, (x_guess, f(a, x_guess)))
    return x_star

  def fixed_point_fwd(f, a, x_init):
    x_star = fixed_point(f, a, x_init)
    return x_star, (a, x_star)

  def fixed_point_rev(f, res, x_star_bar):
    a, x_star = res
    _, vjp_a = jax.vjp(lambda a: f(a, x_star), a)
    a_bar, = vjp_a(fixed_point(partial(rev_iter, f),
                               (a, x_star, x_star_bar),
                               x_star_bar))
    return a_bar, jnp.zeros_like(x_star)

  def rev_iter(f, packed, u):
    a, x_star, x_star_bar = packed
    _, vjp_x = jax.vjp(lambda x: f(a, x), x_star)
    return x_star_bar + vjp_x(u)[0]

  fixed_point.defvjp(fixed_point_fwd, fixed_point_rev)

  def newton_sqrt(a):
    update = lambda a, x: 0.5 * (x + a / x)
    return fixed_point(update, a, a)

  return lambda: (newton_sqrt(2.), jax.grad(newton_sqrt)(2.),
                  jax.grad(jax.grad(newton_sqrt))(2.),
                  jax.jit(jax.grad(jax.checkpoint(newton_sqrt)))(2.))


def print_grad_example(custom_vjp):
  @custom_vjp
  def print_grad(x):
    return x

  def print_grad_fwd(x):
    return x, None

  def print_grad_bwd(_, x_grad):
    jax.debug.print("x_grad: {}", x_grad)
    return (x_grad,)

  print_grad.defvjp(print_grad_fwd, print_grad_bwd)

  def f(x):
    x = 2 * x
    x = print_grad(x)
    return x
  return lambda: jax.grad(f)(3.)


def closure_convert_example(custom_vjp):
  # jax.closure_convert's documented use: a custom_vjp function taking a
  # function argument that closes over values being differentiated.
  @partial(custom_vjp, nondiff_argnums=(0,))
  def apply(f, consts, x):
    return f(x, *consts)

  def apply_fwd(f, consts, x):
    return f(x, *consts), (consts, x)

  def apply_bwd(f, res, g):
    consts, x = res
    _, vjp = jax.vjp(lambda x, *c: f(x, *c), x, *consts)
    gx, *gc = vjp(g)
    return list(gc), gx

  apply.defvjp(apply_fwd, apply_bwd)

  def outer(w, x):
    fn = lambda x: jnp.sin(w * x)
    converted, consts = jax.closure_convert(fn, x)
    return apply(converted, consts, x)

  return lambda: jax.grad(outer, argnums=(0, 1))(1.5, 0.3)


@pytest.mark.parametrize("example", [
    docstring_example, clip_gradient_example, fixed_point_example,
    print_grad_example, closure_convert_example])
def test_docs_example_gives_the_same_numbers(example):
  ref, ours = both(example)
  close(ours(), ref())


def test_doctest_value():
  (val, grad), _ = docstring_example(smart_custom_vjp)()
  np.testing.assert_allclose(val, 1.68, atol=5e-3)
  np.testing.assert_allclose(grad, 1.08, atol=5e-3)
