# A custom_vjp whose fwd rule calls a custom_jvp function (jax.nn.relu),
# differentiated under jax.checkpoint with the remat3 flags.
import jax
import jax.numpy as jnp

jax.config.update('jax_remat3', True)
jax.config.update('jax_custom_vjp3', True)

@jax.custom_vjp
def f(x):
  return jax.nn.relu(x)

def f_fwd(x):
  return jax.nn.relu(x), x

def f_bwd(x, g):
  return (jnp.where(x > 0, g, 0.),)

f.defvjp(f_fwd, f_bwd)

x = jnp.array([-1., 2.])
print(jax.grad(lambda x: f(x).sum())(x))                  # [0. 1.]
print(jax.grad(jax.checkpoint(lambda x: f(x).sum()))(x))  # expected [0. 1.]
