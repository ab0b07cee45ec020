# A custom_vjp whose fwd rule calls a pure_callback with
# vmap_method='sequential', under vmap(checkpoint(vmap(...))).
import numpy as np
import jax
import jax.numpy as jnp

def opaque_sin(x):
  return jax.pure_callback(np.sin, jax.ShapeDtypeStruct(x.shape, x.dtype), x,
                           vmap_method='sequential')

@jax.custom_vjp
def f(x):
  return jnp.sin(x)

f.defvjp(lambda x: (opaque_sin(x), x), lambda x, g: (jnp.cos(x) * g,))

g = jax.vmap(jax.checkpoint(jax.vmap(f)))
x = jnp.arange(1., 7.).reshape(2, 3) / 6

y, _ = jax.linearize(g, x)
print(y.shape)                       # expected (2, 3), as g(x).shape

loss = lambda x: g(x)[:, 0].sum()
print(jax.grad(loss)(x))             # expected [[cos(x[0,0]) 0 0]
print(jnp.cos(x) * (jnp.arange(3) == 0))  #           [cos(x[1,0]) 0 0]]
