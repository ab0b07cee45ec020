"""Drop-in API parity with ``jax.custom_vjp``: decorators, defvjp, pytrees,
keyword arguments, ``None`` cotangents, integer inputs, dtypes."""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from smartvjp import smart_custom_vjp


def both(fun, fwd, bwd, **kw):
  """The same rules under smart_custom_vjp and jax.custom_vjp."""
  s = smart_custom_vjp(fun, **kw)
  s.defvjp(fwd, bwd)
  r = jax.custom_vjp(fun, **kw)
  r.defvjp(fwd, bwd)
  return s, r


def assert_trees_close(a, b, rtol=1e-6):
  jax.tree_util.tree_map(
      lambda x, y: np.testing.assert_allclose(np.asarray(x, np.float32),
                                              np.asarray(y, np.float32),
                                              rtol=rtol, atol=rtol), a, b)
  assert jax.tree_util.tree_structure(a) == jax.tree_util.tree_structure(b)


def test_decorator_and_defvjp_returns_none():
  # the values of jax.custom_vjp's docstring example: tests/test_jax_docs.py
  @smart_custom_vjp
  def f(x):
    return x * 3.0

  assert f.defvjp(lambda x: (x * 3.0, None), lambda _, g: (3.0 * g,)) is None
  assert jax.grad(f)(1.0) == 3.0
  assert f.__name__ == "f" and f.__wrapped__ is not None


def test_defvjp_keywords_like_jax():
  f = smart_custom_vjp(lambda x: x * 2)
  f.defvjp(fwd=lambda x: (x * 2, None), bwd=lambda _, g: (2 * g,),
           symbolic_zeros=False, optimize_remat=True)
  assert jax.grad(f)(1.0) == 2.0
  with pytest.raises(TypeError):  # fwd_bwd is keyword-only
    f.defvjp(None, None, False, False, lambda x, g: (g,))


@pytest.mark.parametrize("given", [
    dict(fwd=lambda x: (x, ())), dict(bwd=lambda r, g: (g,)), dict(),
    dict(fwd=lambda x: (x, ()), fwd_bwd=lambda x, g: (g,))])
def test_defvjp_needs_a_pair_or_fused(given):
  def my_f(x):
    return x
  f = smart_custom_vjp(my_f)
  with pytest.raises(TypeError, match="my_f.*defvjp needs fwd and bwd, or fwd_bwd"):
    f.defvjp(**given)


def test_call_before_defvjp():
  def my_f(x):
    return x
  with pytest.raises(AttributeError, match="No VJP defined.*my_f"):
    smart_custom_vjp(my_f)(1.0)


def test_nondiff_argnums_function_valued():
  @functools.partial(smart_custom_vjp, nondiff_argnums=(0,))
  def app(fn, x):
    return fn(x)

  def app_fwd(fn, x):
    return fn(x), x

  def app_bwd(fn, x, g):
    return (jax.vjp(fn, x)[1](g)[0],)

  app.defvjp(app_fwd, app_bwd)
  x = jnp.array([0.5, 1.5])
  g = jax.grad(lambda x: jnp.sum(app(jnp.tanh, x)))(x)
  np.testing.assert_allclose(g, 1 - np.tanh(x) ** 2, rtol=1e-6)
  g2 = jax.jit(jax.grad(lambda x: jnp.sum(
      jax.checkpoint(lambda x: app(jnp.sin, x))(x))))(x)
  np.testing.assert_allclose(g2, np.cos(x), rtol=1e-6)


def test_nondiff_argnames_and_kwargs():
  def scale(x, k):
    return x * k

  s, r = both(scale, lambda x, k: (x * k, None),
              lambda k, _, g: (g * k,), nondiff_argnames=("k",))
  x = jnp.arange(3.0)
  for F in (s, r):
    assert F.nondiff_argnums == (1,)
  gs = jax.grad(lambda x: jnp.sum(s(x, k=3.0)))(x)
  gr = jax.grad(lambda x: jnp.sum(r(x, k=3.0)))(x)
  assert_trees_close(gs, gr)


def test_tracer_in_nondiff_position():
  f = functools.partial(smart_custom_vjp, nondiff_argnums=(1,))(
      lambda x, k: x * k)
  f.defvjp(lambda x, k: (x * k, None), lambda k, _, g: (g * k,))
  with pytest.raises(jax.errors.UnexpectedTracerError, match="nondiff_argnums"):
    jax.jit(lambda x, k: f(x, k))(1.0, 2.0)


def test_pytrees_in_and_out_with_none_cotangent():
  def fun(params, x):
    return {"y": params["w"] * x + params["b"], "z": (jnp.sum(x),)}

  def fwd(params, x):
    return fun(params, x), (params["w"], x)

  def bwd(res, g):
    w, x = res
    gy = g["y"]
    return {"w": gy * x, "b": gy}, None   # no cotangent for x

  s, r = both(fun, fwd, bwd)
  params = {"w": jnp.array([1.0, 2.0]), "b": jnp.array([0.5, -0.5])}
  x = jnp.array([3.0, 4.0])

  def loss(F, remat):
    G = jax.checkpoint(F) if remat else F
    return lambda p, x: jnp.sum(G(p, x)["y"] ** 2) + G(p, x)["z"][0]

  for remat in (False, True):
    gs = jax.jit(jax.grad(loss(s, remat), argnums=(0, 1)))(params, x)
    gr = jax.jit(jax.grad(loss(r, remat), argnums=(0, 1)))(params, x)
    assert_trees_close(gs, gr)
    np.testing.assert_array_equal(gs[1], 0.0)


def test_integer_input_and_output():
  def fun(x, n):
    return x * n, n + 1

  def fwd(x, n):
    return fun(x, n), n

  def bwd(n, g):
    gx, _ = g
    return gx * n, None

  s, r = both(fun, fwd, bwd)
  x, n = jnp.array([1.0, 2.0]), jnp.array([3, 4], jnp.int32)
  for remat in (False, True):
    def loss(F):
      G = jax.checkpoint(F) if remat else F
      return lambda x, n: jnp.sum(G(x, n)[0] ** 2)
    gs = jax.grad(loss(s), argnums=(0, 1), allow_int=True)(x, n)
    gr = jax.grad(loss(r), argnums=(0, 1), allow_int=True)(x, n)
    np.testing.assert_allclose(gs[0], gr[0], rtol=1e-6)
    assert gs[1].dtype == jax.dtypes.float0 and gs[1].shape == (2,)


@pytest.mark.parametrize("dtype,rtol", [(jnp.float32, 1e-6), (jnp.bfloat16, 1e-2)])
def test_values_match_custom_vjp(dtype, rtol):
  def fun(x, w):
    return jax.nn.gelu(x @ w)

  def fwd(x, w):
    y = x @ w
    return jax.nn.gelu(y), (x, w, y)

  def bwd(res, g):
    x, w, y = res
    dy = g * jax.vmap(jax.vmap(jax.grad(jax.nn.gelu)))(y)
    return dy @ w.T, x.T @ dy

  s, r = both(fun, fwd, bwd)
  k1, k2 = jax.random.split(jax.random.key(0))
  x = jax.random.normal(k1, (8, 16), dtype)
  w = jax.random.normal(k2, (16, 4), dtype)
  np.testing.assert_allclose(np.float32(s(x, w)), np.float32(r(x, w)),
                             rtol=rtol)
  np.testing.assert_allclose(np.float32(jax.jit(s)(x, w)),
                             np.float32(jax.jit(r)(x, w)), rtol=rtol)
  for remat in (False, True):
    def loss(F):
      G = jax.checkpoint(F) if remat else F
      return lambda x, w: jnp.sum(G(x, w).astype(jnp.float32) ** 2)
    gs = jax.jit(jax.grad(loss(s), argnums=(0, 1)))(x, w)
    gr = jax.jit(jax.grad(loss(r), argnums=(0, 1)))(x, w)
    assert_trees_close(gs, gr, rtol=rtol)
    assert gs[0].dtype == dtype


def test_python_scalars_and_weak_types():
  s, r = both(lambda x: x * 3.0, lambda x: (x * 3.0, None),
              lambda _, g: (3.0 * g,))
  assert s(2.0) == r(2.0) == 6.0
  assert jax.grad(s)(2.0) == jax.grad(r)(2.0) == 3.0
  assert s(jnp.float32(2)).dtype == r(jnp.float32(2)).dtype
