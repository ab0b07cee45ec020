"""smartvjp.filter_custom_vjp: equinox.filter_custom_vjp's API, values and
the core contract's remat behaviour (equinox's own always runs fwd twice
under remat, since it always uses symbolic zeros and optimize_remat cannot
apply)."""

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
import pytest

import kernels as K
import smartvjp


class Dense(eqx.Module):
  w: jax.Array
  b: jax.Array
  steps: jax.Array          # an integer array: never differentiated
  name: str = eqx.field(static=True)


def model():
  k = jax.random.split(jax.random.key(0), 2)
  return Dense(jax.random.normal(k[0], (3, 2)) * 0.5,
               jax.random.normal(k[1], (2,)) * 0.1, jnp.array(3), "dense")


X = jnp.linspace(-1.0, 1.0, 12, dtype=jnp.float32).reshape(4, 3)


def make(deco, fused=None, counted=False):
  def fwd_kernel(z):
    if not counted:
      return jnp.tanh(z)
    (y,) = K.kernel("fwd", lambda z: (np.tanh(z),), [z], z)
    return y

  @deco
  def layer(m, x, scale=1.0):
    z = x @ m.w + m.b
    if counted:
      (y,) = K.kernel("f", lambda z: (np.tanh(z),), [z], z)
      return {"y": y * scale, "tag": m.name}
    return {"y": jnp.tanh(z) * scale, "tag": m.name}

  def fwd(perturbed, m, x, scale=1.0):
    assert perturbed.steps is False and perturbed.w is True
    y = fwd_kernel(x @ m.w + m.b)
    return {"y": y * scale, "tag": m.name}, (y,)

  def grads(m, x, y, g, scale):
    d = g["y"] * scale * (1 - y ** 2)
    if counted:
      (d,) = K.kernel("bwd", lambda d: (d,), [d], d)
    return Dense(x.T @ d, d.sum(0), None, m.name)

  def bwd(res, g, perturbed, m, x, scale=1.0):
    (y,) = res
    return grads(m, x, y, g, scale)

  def fwd_bwd(g, perturbed, m, x, scale=1.0):
    y = jnp.tanh(x @ m.w + m.b)
    d = g["y"] * scale * (1 - y ** 2)
    if counted:
      (d,) = K.kernel("fwd_bwd", lambda d: (d,), [d], d)
    return Dense(x.T @ d, d.sum(0), None, m.name)

  if fused != "only":
    layer.def_fwd(fwd)
    layer.def_bwd(bwd)
  if fused and deco is smartvjp.filter_custom_vjp:
    if fused in (True, False):    # forced, through the decorator form
      layer.def_fwd_bwd(fused=fused)(fwd_bwd)
    else:
      layer.def_fwd_bwd(fwd_bwd)
  return layer


def loss_of(layer, remat):
  L = eqx.filter_checkpoint(layer) if remat else layer
  return lambda m, x: jnp.sum(L(m, x, 2.0)["y"] ** 2)


def close(a, b):
  jax.tree_util.tree_map(
      lambda x, y: np.testing.assert_allclose(x, y, rtol=1e-5, atol=1e-6),
      eqx.filter(a, eqx.is_inexact_array), eqx.filter(b, eqx.is_inexact_array))


@pytest.mark.parametrize("remat", [False, True], ids=["plain", "remat"])
def test_same_gradients_as_equinox(remat):
  ours = make(smartvjp.filter_custom_vjp)
  theirs = make(eqx.filter_custom_vjp)
  m = model()
  g1 = eqx.filter_jit(eqx.filter_grad(loss_of(ours, remat)))(m, X)
  g2 = eqx.filter_jit(eqx.filter_grad(loss_of(theirs, remat)))(m, X)
  close(g1, g2)
  assert g1.steps is None and g1.name == "dense"
  out = ours(m, X)
  assert out["tag"] == "dense"


@pytest.mark.parametrize("remat", [False, True], ids=["plain", "remat"])
def test_kernel_counts_vs_equinox(remat):
  m = model()
  K.reset()
  eqx.filter_jit(eqx.filter_grad(loss_of(
      make(smartvjp.filter_custom_vjp, counted=True), remat)))(m, X)
  ours = dict(K.COUNTS)
  K.reset()
  eqx.filter_jit(eqx.filter_grad(loss_of(
      make(eqx.filter_custom_vjp, counted=True), remat)))(m, X)
  theirs = dict(K.COUNTS)
  if remat:
    assert ours == {"f": 1, "fwd": 1, "bwd": 1}
    assert theirs == {"fwd": 2, "bwd": 1}
  else:
    assert ours == theirs == {"fwd": 1, "bwd": 1}


@pytest.mark.parametrize("fused", ["also", "only"])
def test_fused_rule(fused):
  m = model()
  K.reset()
  g = eqx.filter_jit(eqx.filter_grad(loss_of(
      make(smartvjp.filter_custom_vjp, fused=fused, counted=True), True)))(m, X)
  assert dict(K.COUNTS) == {"f": 1, "fwd_bwd": 1}
  ref = eqx.filter_grad(loss_of(make(eqx.filter_custom_vjp), True))(m, X)
  close(g, ref)


@pytest.mark.parametrize("fused, counts", [
    (True, {"f": 1, "fwd_bwd": 1}), (False, {"fwd": 1, "bwd": 1})])
def test_fused_forced_through_def_fwd_bwd(fused, counts):
  """The backward region reads the layer's output (``sin``'s derivative
  does): the pair is weighed unless ``def_fwd_bwd(fused=...)`` forces it;
  ``True`` runs ``f`` there before ``fwd_bwd`` (the forward pass's ``f`` is
  dead: the loss's value is not returned)."""
  m = model()

  def read(layer):
    inner = eqx.filter_checkpoint(lambda m, x: jnp.sin(layer(m, x, 2.0)["y"]))
    return lambda m, x: jnp.sum(inner(m, x))
  K.reset()
  g = eqx.filter_jit(eqx.filter_grad(read(make(
      smartvjp.filter_custom_vjp, fused=fused, counted=True))))(m, X)
  assert dict(K.COUNTS) == counts
  close(g, eqx.filter_grad(read(make(eqx.filter_custom_vjp)))(m, X))


def test_def_fwd_bwd_fused_must_be_a_bool():
  layer = make(smartvjp.filter_custom_vjp)
  with pytest.raises(TypeError, match="fused must be None, True or False"):
    layer.def_fwd_bwd(fused="yes")(lambda g, perturbed, m, x, scale=1.0: m)


def test_filter_vmap_and_args_not_differentiated():
  ours = make(smartvjp.filter_custom_vjp)
  theirs = make(eqx.filter_custom_vjp)
  m = model()
  xs = jnp.stack([X, X * 0.5])

  def per_example(layer):
    return eqx.filter_vmap(eqx.filter_grad(loss_of(layer, True)),
                           in_axes=(None, 0))
  close(per_example(ours)(m, xs), per_example(theirs)(m, xs))
  # x is in *args: its gradient is refused, as in equinox
  with pytest.raises(Exception):
    jax.grad(lambda x: jnp.sum(ours(m, x)["y"]))(X)


def test_not_yet_defined():
  @smartvjp.filter_custom_vjp
  def lonely(m, x):
    return x
  with pytest.raises(RuntimeError, match="lonely was called before its rules"):
    lonely(model(), X)


def test_bad_gradient_structure():
  @smartvjp.filter_custom_vjp
  def fn(m, x):
    return x @ m.w

  fn.def_fwd(lambda p, m, x: (x @ m.w, None))
  fn.def_bwd(lambda r, g, p, m, x: (m.w,))
  with pytest.raises(RuntimeError, match="structure differs from the first argument"):
    eqx.filter_grad(lambda m: jnp.sum(fn(m, X)))(model())
