"""``optax.scale_gradient`` inside a checkpointed ``lax.scan`` body
(default policy and ``dots_saveable``), and outside remat for reference."""

import os
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import _harness  # noqa: E402

rec = _harness.start("optax")

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import optax  # noqa: E402


def layer(carry, w):
  h = jnp.tanh(carry @ w["k"] + w["b"])
  h = optax.scale_gradient(h, 0.5)
  z = optax.scale_gradient({"h": h, "s": jnp.sin(h)}, -2.0)
  return z["h"] + 0.1 * z["s"], jnp.sum(z["s"] ** 2)


def make_loss(body):
  def loss(ws, x):
    c, ys = jax.lax.scan(body, x, ws)
    return jnp.sum(c ** 2) + jnp.sum(ys)
  return loss


BODIES = {
    "plain": layer,
    "checkpoint": jax.checkpoint(layer),
    "dots_saveable": jax.checkpoint(
        layer, policy=jax.checkpoint_policies.dots_saveable),
}


def main():
  kk, kb, kx = jax.random.split(jax.random.key(1), 3)
  ws = {"k": jax.random.normal(kk, (5, 6, 6), jnp.float32) * 0.5,
        "b": jax.random.normal(kb, (5, 6), jnp.float32) * 0.1}
  x = jax.random.normal(kx, (3, 6), jnp.float32)
  rec.check_swap(str(jax.make_jaxpr(make_loss(BODIES["checkpoint"]))(ws, x)))
  for name, body in BODIES.items():
    loss = make_loss(body)
    value, grads = jax.jit(jax.value_and_grad(loss, argnums=(0, 1)))(ws, x)
    rec.add(f"{name}/loss", value)
    rec.add(f"{name}/grad", grads)
  rec.save()


main()
