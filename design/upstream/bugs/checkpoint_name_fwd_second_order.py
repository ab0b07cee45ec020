# The second derivative of a custom_vjp function under jax.checkpoint, with
# the remat3 flags, when fwd names its residual with checkpoint_name_fwd and
# the policy saves or offloads that name; eagerly and under jit. Each line
# should print -sin(x).
import jax
import jax.numpy as jnp
from jax.ad_checkpoint import checkpoint_name_fwd

jax.config.update('jax_remat3', True)
jax.config.update('jax_custom_vjp3', True)

POLICIES = dict(
    none=None,
    saved=jax.checkpoint_policies.save_only_these_names('cos'),
    offloaded=jax.checkpoint_policies.save_and_offload_only_these_names(
        names_which_can_be_saved=[], names_which_can_be_offloaded=['cos'],
        offload_src='device', offload_dst='pinned_host'))


def second_derivative(policy, optimize_remat, jit, x):
  @jax.custom_vjp
  def sin(x):
    return jnp.sin(x)
  def sin_fwd(x):
    return jnp.sin(x), checkpoint_name_fwd(jnp.cos(x), 'cos')
  sin.defvjp(sin_fwd, lambda cos_x, g: (cos_x * g,),
             optimize_remat=optimize_remat)
  g = jax.grad(jax.checkpoint(lambda x: sin(x).sum(), policy=policy))
  g2 = jax.grad(lambda x: g(x).sum())
  return (jax.jit(g2) if jit else g2)(x)


x = jnp.array([0.5, 1.0])
print('expected:', -jnp.sin(x))
for name, policy in POLICIES.items():
  for optimize_remat in (False, True):
    for jit in (False, True):
      try:
        out = second_derivative(policy, optimize_remat, jit, x)
      except Exception as e:  # noqa: BLE001 -- print what is raised
        out = f'{type(e).__name__}: {str(e).splitlines()[0]}'
      print(f'{name}, optimize_remat={optimize_remat}, '
            f'{"jit" if jit else "eager"}:', out)
