"""Bad input gets a clear error naming the rule, the pytree path and the
expected vs actual type, never a wrong gradient or an internal assertion."""

import functools

import jax
import jax.numpy as jnp
import pytest

from smartvjp import smart_custom_vjp

X = jnp.ones((2, 3), jnp.float32)


def make(fwd=None, bwd=None, **kw):
  def my_f(x, y):
    return {"out": x * y, "aux": (x,)}

  def good_fwd(x, y):
    return my_f(x, y), (x, y)

  def good_bwd(res, g):
    x, y = res
    return g["out"] * y + g["aux"][0], g["out"] * x

  F = smart_custom_vjp(my_f, **kw)
  F.defvjp(fwd or good_fwd, bwd or good_bwd)
  return F


def grad_of(F, remat=False):
  G = jax.checkpoint(F) if remat else F
  return jax.grad(lambda x, y: jnp.sum(G(x, y)["out"]), argnums=(0, 1))


@pytest.mark.parametrize("remat", [False, True])
def test_fwd_not_a_pair(remat):
  def my_fwd(x, y):
    return x * y
  with pytest.raises(TypeError, match=r"the fwd rule my_fwd of smart_custom_vjp "
                     r"function my_f must return a pair"):
    grad_of(make(fwd=my_fwd), remat)(X, X)


def test_fwd_primal_structure_differs():
  def my_fwd(x, y):
    return {"out": x * y}, (x, y)
  # checked where f is traced (under jit); eager grad never traces f
  with pytest.raises(TypeError, match=r"my_fwd.*pytree structure differs from "
                     r"my_f's output"):
    jax.jit(grad_of(make(fwd=my_fwd)))(X, X)


@pytest.mark.parametrize("bad,expected,got", [
    (lambda x: x[:1], "float32\\[2,3\\]", "float32\\[1,3\\]"),
    (lambda x: x.astype(jnp.float16), "float32\\[2,3\\]", "float16\\[2,3\\]")])
def test_fwd_primal_shape_or_dtype_differs(bad, expected, got):
  def my_fwd(x, y):
    return {"out": bad(x * y), "aux": (x,)}, (x, y)
  with pytest.raises(TypeError, match=rf"my_fwd.*at output\['out'\]: expected "
                     rf"{expected}, got {got}"):
    jax.jit(grad_of(make(fwd=my_fwd)))(X, X)


def test_residuals_not_jax_types():
  def my_fwd(x, y):
    return {"out": x * y, "aux": (x,)}, (x, "not an array")
  with pytest.raises(TypeError, match=r"my_fwd.*type str at residuals\[1\].*not a "
                     r"valid JAX type"):
    grad_of(make(fwd=my_fwd))(X, X)


def test_bwd_wrong_length_or_cotangent_for_nondiff_arg():
  def my_bwd(res, g):
    return (g["out"],)
  with pytest.raises(TypeError, match=r"the bwd rule my_bwd of smart_custom_vjp "
                     r"function my_f must return a tuple with one cotangent.*"
                     r"length 2"):
    grad_of(make(bwd=my_bwd))(X, X)

  # a cotangent for the nondiff argument is one entry too many
  @functools.partial(smart_custom_vjp, nondiff_argnums=(1,))
  def scale(x, k):
    return x * k

  def scale_bwd(k, res, g):
    return g * k, 0.0

  scale.defvjp(lambda x, k: (x * k, None), scale_bwd)
  with pytest.raises(TypeError, match=r"scale_bwd.*length 1"):
    jax.grad(lambda x: jnp.sum(scale(x, 2.0)))(X)


def test_bwd_wrong_structure():
  def my_bwd(res, g):
    x, y = res
    return g["out"] * y, {"oops": g["out"]}
  with pytest.raises(TypeError, match=r"my_bwd.*pytree structure"):
    grad_of(make(bwd=my_bwd))(X, X)


@pytest.mark.parametrize("remat", [False, True])
def test_bwd_wrong_shape_or_dtype(remat):
  def my_bwd(res, g):
    x, y = res
    return g["out"] * y, (g["out"] * x)[0]
  with pytest.raises(ValueError, match=r"my_bwd of smart_custom_vjp function "
                     r"my_f returned a cotangent of type float32\[3\] at "
                     r"output\[1\].*has type float32\[2,3\]"):
    grad_of(make(bwd=my_bwd), remat)(X, X)

  def my_bwd_int(res, g):
    x, y = res
    return g["out"] * y, (g["out"] * x).astype(jnp.int32)
  with pytest.raises(ValueError, match=r"int32\[2,3\] at output\[1\]"):
    grad_of(make(bwd=my_bwd_int))(X, X)


def test_other_float_precision_is_cast_like_jax_allows():
  def my_bwd16(res, g):
    x, y = res
    return g["out"] * y, (g["out"] * x).astype(jnp.float16)
  gx, gy = grad_of(make(bwd=my_bwd16))(X, X)
  assert gy.dtype == jnp.float32


def test_fwd_bwd_wrong_output():
  @smart_custom_vjp
  def my_f(x):
    return x * 2.0

  def my_fwd_bwd(x, g):
    return g * 2.0  # not a tuple
  my_f.defvjp(fwd_bwd=my_fwd_bwd)
  with pytest.raises(TypeError, match=r"the fwd_bwd rule my_fwd_bwd of "
                     r"smart_custom_vjp function my_f must return a tuple"):
    jax.grad(lambda x: jnp.sum(my_f(x)))(X)


def test_non_array_argument():
  def my_f(x, mode):
    return x
  F = smart_custom_vjp(my_f)
  F.defvjp(lambda x, m: (x, None), lambda r, g: (g, None))
  with pytest.raises(TypeError, match=r"my_f was called with a value of type "
                     r"str at \(differentiable\) arguments\[1\].*nondiff_argnums"):
    F(X, "fast")


def test_keyword_only_arguments_are_refused_clearly():
  def my_f(x, *, scale):
    return x * scale
  F = smart_custom_vjp(my_f)
  F.defvjp(lambda x, scale: (x, None), lambda r, g: (g,))
  with pytest.raises(TypeError, match=r"my_f could not be resolved.*scale"):
    F(X, scale=2.0)


def test_unknown_nondiff_argname():
  def my_f(x, k):
    return x
  with pytest.raises(ValueError, match=r"nondiff_argnames contains 'q'.*my_f"):
    smart_custom_vjp(my_f, nondiff_argnames=("q",))
