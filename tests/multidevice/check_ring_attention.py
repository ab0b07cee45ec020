"""Ring attention's custom_vjp shape (issue 65 item 7; written here, not
ringattention 0.1.2's code): fwd and bwd each scan the ring with ``psum`` of
a constant (the ring's size), ``axis_index``, ``ppermute`` of the blocks and
``dot_general``s around an inner ``jax.checkpoint``, in ``shard_map`` over 2
CPU devices. Every gradient must equal ``jax.custom_vjp``'s bit for bit.

Run with ``XLA_FLAGS=--xla_force_host_platform_device_count=2`` (or more);
``remat3`` as the argument turns on ``jax_remat3`` + ``jax_custom_vjp3``.
Prints one line per case and ``ring ok`` at the end."""

import functools
import sys

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax
from jax.sharding import Mesh, PartitionSpec as P

from smartvjp import smart_custom_vjp

AXIS = "ring"
INNER = dict(prevent_cse=True, policy=jax.checkpoint_policies.nothing_saveable)


def _shift(x):
  n = lax.psum(1, AXIS)
  return lax.ppermute(x, AXIS, [(j, (j + 1) % n) for j in range(n)])


def _accumulate(q, k, v, carry):
  """One block of online softmax, rematerialized, skipped by a cond that
  never skips (as a causal mask's block test)."""
  @functools.partial(jax.checkpoint, **INNER)
  def block(carry, k, v):
    num, den, top = carry
    s = jnp.einsum("qd,kd->qk", q, k) * 0.5
    new_top = lax.stop_gradient(jnp.maximum(top, s.max(-1)))
    e = jnp.exp(s - new_top[:, None])
    scale = jnp.exp(top - new_top)
    return (num * scale[:, None] + jnp.einsum("qk,kd->qd", e, v),
            den * scale + e.sum(-1), new_top)
  return lax.cond(jnp.sum(q) > -1e9, block, lambda c, k, v: c, carry, k, v)


def ring_fwd(q, k, v):
  def step(c, _):
    num, den, top, k, v = c
    num, den, top = _accumulate(q, k, v, (num, den, top))
    return (num, den, top, _shift(k), _shift(v)), lax.axis_index(AXIS)
  init = (jnp.zeros_like(q), jnp.zeros(q.shape[:1], q.dtype),
          jnp.full(q.shape[:1], -jnp.inf, q.dtype), k, v)
  (num, den, top, _, _), _ = lax.scan(step, init, None,
                                      length=lax.psum(1, AXIS))
  out = num / den[:, None]
  return out, (out, q, k, v, den, top)


def ring_bwd(res, g):
  out, q, k, v, den, top = res
  g_out = jnp.sum(g * out, -1)

  def step(c, _):
    dq, dk, dv, k, v = c

    @functools.partial(jax.checkpoint, **INNER)
    def block(dq, k, v):
      p = jnp.exp(jnp.einsum("qd,kd->qk", q, k) * 0.5 - top[:, None])
      p = p / den[:, None]
      ds = (jnp.einsum("qd,kd->qk", g, v) - g_out[:, None]) * p
      return (dq + jnp.einsum("qk,kd->qd", ds, k) * 0.5,
              jnp.einsum("qk,qd->kd", ds, q) * 0.5,
              jnp.einsum("qk,qd->kd", p, g))
    dq, dk_part, dv_part = block(dq, k, v)
    return (dq, _shift(dk + dk_part), _shift(dv + dv_part), _shift(k),
            _shift(v)), None
  zeros = tuple(jnp.zeros_like(x) for x in (q, k, v))
  (dq, dk, dv, _, _), _ = lax.scan(step, (*zeros, k, v), None,
                                   length=lax.psum(1, AXIS))
  return dq, dk, dv


def ring(make):
  F = make(lambda q, k, v: ring_fwd(q, k, v)[0])
  F.defvjp(ring_fwd, ring_bwd)
  return F


def cases(F):
  mesh = Mesh(np.array(jax.devices()[:2]), (AXIS,))
  sharded = lambda fn: jax.shard_map(
      fn, mesh=mesh, in_specs=(P(AXIS),) * 3, out_specs=P(AXIS),
      check_vma=False)
  dots = lambda fn: jax.checkpoint(
      fn, policy=jax.checkpoint_policies.dots_saveable)

  def scanned(fn):   # two layers, a scan of checkpoint(dots_saveable)
    return lambda q, k, v: lax.scan(
        lambda c, _: (dots(fn)(c, k, v), None), q, None, length=2)[0]
  grad = lambda fn: jax.grad(lambda q, k, v: jnp.sum(jnp.sin(fn(q, k, v))),
                             argnums=(0, 1, 2))
  S = sharded(F)
  return {
      "jit grad": lambda: jax.jit(grad(S)),
      "jit grad(checkpoint)": lambda: jax.jit(grad(jax.checkpoint(S))),
      "jit grad(dots_saveable)": lambda: jax.jit(grad(dots(S))),
      "eager grad(checkpoint)": lambda: grad(jax.checkpoint(S)),
      "eager grad(dots_saveable)": lambda: grad(dots(S)),
      "jit scan of dots_saveable": lambda: jax.jit(grad(scanned(S))),
      "eager scan of dots_saveable": lambda: grad(scanned(S)),
      "jit, dots_saveable inside shard_map": lambda: jax.jit(
          grad(sharded(dots(F)))),
      "eager, checkpoint inside shard_map": lambda: grad(
          sharded(jax.checkpoint(F))),
      "eager, scan inside shard_map": lambda: grad(sharded(scanned(F))),
  }


def main():
  if sys.argv[1:] == ["remat3"]:
    jax.config.update("jax_remat3", True)
    jax.config.update("jax_custom_vjp3", True)
  rng = np.random.RandomState(0)
  args = [jnp.asarray(rng.randn(8, 4), jnp.float32) for _ in range(3)]
  theirs, ours = cases(ring(jax.custom_vjp)), cases(ring(smart_custom_vjp))
  bad = []
  for name in theirs:
    try:
      want = theirs[name]()(*args)
    except AttributeError as e:   # jax 0.10.2's remat3: no shard_map rule
      print(f"{name}: jax.custom_vjp raises {e}; skipped")
      continue
    got = ours[name]()(*args)
    worst = max(float(jnp.max(jnp.abs(a - b))) for a, b in zip(got, want))
    same = all(np.asarray(a).tobytes() == np.asarray(b).tobytes()
               for a, b in zip(got, want))
    print(f"{name}: {'bitwise' if same else f'differs by {worst:.3g}'}")
    if not same:
      bad.append(name)
  if bad:
    sys.exit(f"not bitwise: {bad}")
  print("ring ok")


if __name__ == "__main__":
  main()
