"""diffrax's default adjoint (``RecursiveCheckpointAdjoint``, built on
equinox's checkpointed while loop and ``filter_custom_vjp``): values and
gradients with an adaptive step size controller, and ``vmap`` of the
gradient."""

import os
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import _harness  # noqa: E402

rec = _harness.start("diffrax")

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import diffrax  # noqa: E402


def vector_field(t, y, args):
  a, b = args
  return jnp.stack([a * y[1], -b * jnp.sin(y[0]) - 0.1 * y[1] + jnp.cos(t)])


TS = jnp.linspace(0.0, 2.0, 6)


def solve(y0, args):
  sol = diffrax.diffeqsolve(
      diffrax.ODETerm(vector_field), diffrax.Tsit5(), t0=0.0, t1=2.0,
      dt0=0.1, y0=y0, args=args, saveat=diffrax.SaveAt(ts=TS),
      stepsize_controller=diffrax.PIDController(rtol=1e-5, atol=1e-5),
      adjoint=diffrax.RecursiveCheckpointAdjoint(), max_steps=64)
  return sol.ys


def loss(y0, args):
  return jnp.sum(solve(y0, args) ** 2)


def main():
  y0 = jnp.array([0.8, -0.3], jnp.float32)
  args = (jnp.float32(1.1), jnp.float32(0.7))
  rec.check_swap(str(jax.make_jaxpr(jax.grad(loss, argnums=(0, 1)))(y0, args)))
  rec.add("value", jax.jit(solve)(y0, args))
  rec.add("grad", jax.jit(jax.grad(loss, argnums=(0, 1)))(y0, args))
  y0s = jnp.stack([y0, y0 * 0.5, -y0])
  rec.add("vmap_grad", jax.jit(jax.vmap(
      jax.grad(loss, argnums=(0, 1)), (0, None)))(y0s, args))
  rec.save()


main()
