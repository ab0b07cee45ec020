"""Run in a subprocess with 4 CPU devices (see tests/test_shard_map_types.py).

Forward mode and transposes inside ``shard_map(check_vma=True)`` keep the
varying-manual-axes type of every value they rebuild; compared with the
plain function and with jax.custom_vjp."""

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import PartitionSpec as P

from smartvjp import smart_custom_vjp

assert jax.device_count() == 4, jax.devices()
try:  # jax 0.10 has axis types; make_mesh without them elsewhere
  mesh = jax.make_mesh((4,), ("i",),
                       axis_types=(jax.sharding.AxisType.Auto,))
except (AttributeError, TypeError):
  mesh = jax.make_mesh((4,), ("i",))

X = jnp.linspace(-1.0, 1.0, 8, dtype=jnp.float32)
T = jnp.ones(8, jnp.float32)


def sin_of(kind, f=jnp.sin):
  """``f`` (sin by default) as the plain function or with sin's rules."""
  if kind == "plain":
    return jnp.sin
  S = smart_custom_vjp(f) if kind == "smart" else jax.custom_vjp(f)
  S.defvjp(lambda x: (jnp.sin(x), (x,)), lambda r, g: (g * jnp.cos(r[0]),))
  return S


def sharded(F, remat=False):
  G = jax.checkpoint(F) if remat else F
  return jax.shard_map(G, mesh=mesh, in_specs=P("i"), out_specs=P("i"),
                       check_vma=True)


def close(a, b):
  np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=1e-5,
                             atol=1e-6)


def check_forward_over_reverse():
  """jvp of grad: the reference values are jax.custom_vjp's and the plain
  function's (both agree)."""
  def hvp(kind, remat, jit):
    loss = lambda x: jnp.sum(sharded(sin_of(kind), remat)(x) ** 2)
    fn = lambda x, t: jax.jvp(jax.grad(loss), (x,), (t,))[1]
    return (jax.jit(fn) if jit else fn)(X, T)
  for remat in (False, True):
    for jit in (False, True):
      want = hvp("plain", remat, jit)
      close(hvp("custom", remat, jit), want)
      close(hvp("smart", remat, jit), want)


def check_forward_mode():
  """jvp and grad of jvp (jax.custom_vjp refuses forward mode)."""
  for jit in (False, True):
    jvp = lambda F: (lambda x, t: jax.jvp(sharded(F), (x,), (t,)))
    jvp = (lambda F, j=jvp: jax.jit(j(F))) if jit else jvp
    ys, ts = jvp(sin_of("smart"))(X, T)
    yp, tp = jvp(sin_of("plain"))(X, T)
    close(ys, yp)
    close(ts, tp)
    close(tp, jnp.cos(X))

    def grad_of_jvp(F):
      g = jax.grad(lambda x: jnp.sum(jax.jvp(sharded(F), (x,), (T,))[1]))
      return (jax.jit(g) if jit else g)(X)
    close(grad_of_jvp(sin_of("smart")), grad_of_jvp(sin_of("plain")))


def opaque_sin(x):
  """sin through a host callback: its output is not varying over ``i``."""
  return jax.pure_callback(np.sin, jax.ShapeDtypeStruct(x.shape, x.dtype), x)


def check_f_and_fwd_output_types_differ():
  """f's output is unvarying, fwd's varies over ``i``. Without remat
  jax.custom_vjp uses fwd's type and the gradient is right; with remat it
  refuses with a TypeError, and so must smartvjp (not a wrong gradient)."""
  def grad_of(kind, remat, jit):
    F = sin_of(kind, opaque_sin)
    loss = lambda x: jnp.sum(sharded(F, remat)(x) ** 2)
    g = jax.grad(loss)
    return (jax.jit(g) if jit else g)(X)
  want = jax.grad(lambda x: jnp.sum(jnp.sin(x) ** 2))(X)
  for jit in (False, True):
    close(grad_of("custom", False, jit), want)
    close(grad_of("smart", False, jit), want)
    for kind in ("custom", "smart"):
      try:
        grad_of(kind, True, jit)
      except TypeError as e:
        if kind == "smart":
          msg = str(e)
          for word in ("opaque_sin", "<lambda>", "output", "{V:i}"):
            assert word in msg, msg
      else:
        raise AssertionError(f"{kind}: expected a TypeError under remat")


check_forward_over_reverse()
check_forward_mode()
check_f_and_fwd_output_types_differ()
print("vma types ok")
