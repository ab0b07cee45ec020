"""Run in a subprocess with 4 CPU devices (see tests/test_multidevice.py)."""

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import AxisType, NamedSharding, PartitionSpec as P

from smartvjp import smart_custom_vjp

assert jax.device_count() == 4, jax.devices()
mesh = jax.make_mesh((4,), ("d",), axis_types=(AxisType.Auto,))


def rules(psum_in=None):
  def f(x, w):
    y = jnp.tanh(x * w)
    return jax.lax.psum(y, "d") if psum_in == "f" else y

  def fwd(x, w):
    y = f(x, w)
    t = jnp.tanh(x * w)
    return y, (x, w, t)

  def bwd(res, g):
    x, w, t = res
    d = g * (1 - t ** 2)
    dw = jnp.sum(d * x, 0)
    if psum_in in ("bwd", "f"):   # w is unvarying: its cotangent is summed
      dw = jax.lax.psum(dw, "d")
    return d * w, dw
  return f, fwd, bwd


def both(psum_in=None):
  f, fwd, bwd = rules(psum_in)
  s = smart_custom_vjp(f)
  s.defvjp(fwd, bwd)
  r = jax.custom_vjp(f)
  r.defvjp(fwd, bwd)
  return s, r


def check_gspmd():
  s, r = both()
  x = jax.device_put(jnp.arange(16.0).reshape(8, 2) / 10,
                     NamedSharding(mesh, P("d", None)))
  w = jax.device_put(jnp.array([0.5, -1.5]), NamedSharding(mesh, P()))
  for remat in (False, True):
    def loss(F):
      G = jax.checkpoint(F) if remat else F
      return jax.jit(jax.grad(lambda x, w: jnp.sum(G(x, w) ** 2), (0, 1)))
    gs, gr = loss(s)(x, w), loss(r)(x, w)
    for a, b in zip(gs, gr):
      np.testing.assert_allclose(a, b, rtol=1e-6)
      assert a.sharding.is_equivalent_to(b.sharding, a.ndim), (a.sharding,
                                                               b.sharding)
    ys, yr = jax.jit(s)(x, w), jax.jit(r)(x, w)
    assert ys.sharding.is_equivalent_to(yr.sharding, ys.ndim)


def check_shard_map(psum_in):
  s, r = both(psum_in)
  x = jnp.arange(16.0).reshape(8, 2) / 10
  w = jnp.array([0.5, -1.5])

  for remat in (False, True):
    def prog(F):
      G = jax.checkpoint(F) if remat else F

      def body(x, w):
        out = G(x, w)
        return jnp.sum(out ** 2, keepdims=True)[None] if psum_in != "f" \
            else jnp.sum(out ** 2, keepdims=True)[None] / 4

      loss = jax.shard_map(body, mesh=mesh, in_specs=(P("d"), P()),
                           out_specs=P("d"), check_vma=True)
      return jax.jit(jax.grad(lambda x, w: jnp.sum(loss(x, w)), (0, 1)))
    gs, gr = prog(s)(x, w), prog(r)(x, w)
    for a, b in zip(gs, gr):
      np.testing.assert_allclose(a, b, rtol=1e-5)
      assert a.sharding.is_equivalent_to(b.sharding, a.ndim)

  def vma_of(F):
    captured = {}

    def spy(x, w):
      y = F(x, w)
      captured["vma"] = jax.typeof(y).str_short()  # shows {V:axes}
      return y
    jax.shard_map(spy, mesh=mesh, in_specs=(P("d"), P()), out_specs=P("d")
                  if psum_in != "f" else P(), check_vma=True)(x, w)
    return captured["vma"]
  assert vma_of(s) == vma_of(r), (vma_of(s), vma_of(r))


def check_varying_cotangent_error():
  s, r = both(None)   # bwd forgets the psum for the unvarying w
  x = jnp.arange(16.0).reshape(8, 2) / 10
  w = jnp.array([0.5, -1.5])
  for F, pattern in ((s, "bwd rule bwd of smart_custom_vjp function f .*"
                      r"output\[1\].*varying manual axes"),
                     (r, "Custom VJP bwd rule")):
    loss = jax.shard_map(lambda x, w: jnp.sum(F(x, w) ** 2, keepdims=True),
                         mesh=mesh, in_specs=(P("d"), P()), out_specs=P("d"),
                         check_vma=True)
    try:
      jax.grad(lambda x, w: jnp.sum(loss(x, w)), (0, 1))(x, w)
    except ValueError as e:
      import re
      assert re.search(pattern, str(e)), str(e)
    else:
      raise AssertionError("expected an error")


check_gspmd()
check_varying_cotangent_error()
for where in ("bwd", "f"):
  check_shard_map(where)
print("multidevice ok")
