"""Serialization: jax.export of jit(grad(loss)) with JAX-coded and Pallas
(interpret) rules round-trips with the same values. Host callbacks cannot be
serialized by JAX; its export error says so."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax import export

import kernels as K
from smartvjp import smart_custom_vjp

X = jnp.linspace(-1.0, 2.0, 8, dtype=jnp.float32)


def jax_coded():
  F = smart_custom_vjp(jnp.sin)
  F.defvjp(lambda x: (jnp.sin(x), jnp.cos(x)), lambda c, g: (c * g,))
  return F


def _pallas(body, n_out, *args):
  from jax.experimental import pallas as pl
  return pl.pallas_call(
      body, out_shape=[jax.ShapeDtypeStruct(X.shape, X.dtype)] * n_out,
      interpret=True)(*args)


def pallas_coded():
  def f(x):
    def body(x_ref, y_ref):
      y_ref[...] = jnp.sin(x_ref[...])
    return _pallas(body, 1, x)[0]

  def fwd(x):
    def body(x_ref, y_ref, c_ref):
      y_ref[...] = jnp.sin(x_ref[...])
      c_ref[...] = jnp.cos(x_ref[...])
    y, c = _pallas(body, 2, x)
    return y, c

  def bwd(c, g):
    def body(c_ref, g_ref, d_ref):
      d_ref[...] = c_ref[...] * g_ref[...]
    return (_pallas(body, 1, c, g)[0],)

  F = smart_custom_vjp(f)
  F.defvjp(fwd, bwd)
  return F


@pytest.mark.parametrize("make", [jax_coded, pallas_coded])
@pytest.mark.parametrize("remat", [False, True], ids=["plain", "remat"])
def test_export_round_trip(make, remat):
  F = make()
  G = jax.checkpoint(F) if remat else F
  fn = jax.jit(jax.grad(lambda x: jnp.sum(G(x) ** 2)))
  exported = export.export(fn)(X)
  restored = export.deserialize(exported.serialize())
  np.testing.assert_allclose(restored.call(X), fn(X), rtol=1e-6)
  np.testing.assert_allclose(restored.call(X), 2 * np.sin(X) * np.cos(X),
                             rtol=1e-6)


def test_export_of_callback_kernels_is_refused():
  f, fwd, bwd, _ = K.sin_rules()
  F = smart_custom_vjp(f)
  F.defvjp(fwd, bwd)
  with pytest.raises(Exception, match="(?i)callback"):
    export.export(jax.jit(jax.grad(lambda x: jnp.sum(F(x)))))(X)
