"""``jax.experimental.ode.odeint``: values, ``grad``, ``grad`` of
``jax.checkpoint``, ``vmap`` and ``vmap`` of ``grad``; with
``--case grad_of_grad``, a second derivative instead (odeint's ``fwd`` calls
the custom_vjp function itself, and its Runge-Kutta tableau is a constant
that ``f`` closes over)."""

import os
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import _harness  # noqa: E402

rec = _harness.start("jax.experimental.ode")

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
from jax.experimental.ode import odeint  # noqa: E402


def rhs(y, t, a, b):
  return jnp.stack([a * y[1], -b * jnp.sin(y[0]) - 0.1 * y[1] + jnp.cos(t)])


TS = jnp.linspace(0.0, 2.0, 6)


def solve(y0, a, b):
  return odeint(rhs, y0, TS, a, b, rtol=1e-6, atol=1e-6)


def loss(y0, a, b):
  return jnp.sum(solve(y0, a, b) ** 2)


def main():
  y0 = jnp.array([0.8, -0.3], jnp.float32)
  a, b = jnp.float32(1.1), jnp.float32(0.7)
  rec.check_swap(str(jax.make_jaxpr(loss)(y0, a, b)))
  if rec.case == "grad_of_grad":
    d_da = jax.grad(loss, argnums=1)
    rec.add("d2_da_db", jax.jit(jax.grad(d_da, argnums=2))(y0, a, b))
    rec.add("d2_da_dy0", jax.jit(jax.grad(d_da, argnums=0))(y0, a, b))
    rec.save()
    return
  rec.add("value", jax.jit(solve)(y0, a, b))
  rec.add("grad", jax.jit(jax.grad(loss, argnums=(0, 1, 2)))(y0, a, b))
  rec.add("grad_checkpoint", jax.jit(
      jax.grad(jax.checkpoint(loss), argnums=(0, 1, 2)))(y0, a, b))
  y0s = jnp.stack([y0, y0 * 0.5, -y0])
  rec.add("vmap", jax.jit(jax.vmap(solve, (0, None, None)))(y0s, a, b))
  rec.add("vmap_grad", jax.jit(jax.vmap(
      jax.grad(loss, argnums=(0, 1)), (0, None, None)))(y0s, a, b))
  rec.save()


main()
