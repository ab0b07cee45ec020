# The batching rule of custom_vjp: vmap of (jit or checkpoint) of vmap of a
# custom_vjp function whose primal function or fwd rule calls a pure_callback
# with vmap_method='sequential'. Linearized, the primal output comes back with
# its batch axes swapped, and the gradient is wrong. JAX_REMAT3=1
# JAX_CUSTOM_VJP3=1 in the environment turn the remat3 flags on.
import os
import numpy as np
import jax
import jax.numpy as jnp

if os.environ.get('JAX_REMAT3') and os.environ.get('JAX_CUSTOM_VJP3'):
  jax.config.update('jax_remat3', True)
  jax.config.update('jax_custom_vjp3', True)

def opaque_sin(x):
  return jax.pure_callback(np.sin, jax.ShapeDtypeStruct(x.shape, x.dtype), x,
                           vmap_method='sequential')

def make(callback_in):
  @jax.custom_vjp
  def f(x):
    return opaque_sin(x) if callback_in == 'f' else jnp.sin(x)
  fwd = lambda x: (opaque_sin(x) if callback_in == 'fwd' else jnp.sin(x), x)
  f.defvjp(fwd, lambda x, g: (jnp.cos(x) * g,))
  return f

x = jnp.arange(1., 7.).reshape(2, 3) / 6
expected = jnp.cos(x) * (jnp.arange(3) == 0)
def nothing(h):
  return h

print('jax', jax.__version__)
for wrap in (jax.jit, jax.checkpoint, nothing):
  for callback_in in ('f', 'fwd'):
    g = jax.vmap(wrap(jax.vmap(make(callback_in))))
    where = f'vmap({wrap.__name__}(vmap(f))), callback in {callback_in}:'
    try:
      y, _ = jax.linearize(g, x)
      grad = jax.grad(lambda x: g(x)[:, 0].sum())(x)
    except Exception as e:  # the table shows it
      print(where, type(e).__name__)
      continue
    print(where, f'linearized output {y.shape} (expected (2, 3)), gradient '
          f'{"right" if np.allclose(grad, expected) else "WRONG"}')
