"""Run in a subprocess with 4 CPU devices (tests/test_audit_abstains.py).

Under ``shard_map`` a site's runs, its saving and the step it is a share
of are all per device: the counts equal the host counters of one device
(all devices' over 4), and a site's share of the step is the share it has
in the same step on one device with one shard's data."""

import collections
import functools
import os
import sys

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import Mesh, PartitionSpec as P

sys.path.insert(0, os.path.dirname(os.path.dirname(__file__)))
import kernels as K  # noqa: E402
import smartvjp  # noqa: E402

assert jax.device_count() == 4, jax.devices()
try:
  shard_map = jax.shard_map
except AttributeError:   # jax 0.10
  from jax.experimental.shard_map import shard_map
mesh = Mesh(np.array(jax.devices()), ("d",))


def fused_layer():
  """A layer whose fused rule never forms ``w @ w``, which ``fwd`` saves
  (tests/test_audit_model.py's)."""
  @smartvjp.smart_custom_vjp
  def layer(x, w):
    return jnp.tanh(x @ (w @ w))

  def fwd(x, w):
    m = w @ w
    h = x @ m
    return jnp.tanh(h), (x, w, m, h)

  def bwd(res, g):
    x, w, m, h = res
    gh = (1 - jnp.tanh(h) ** 2) * g
    gm = x.T @ gh
    return gh @ m.T, gm @ w.T + w.T @ gm

  def fwd_bwd(x, w, g):
    h = (x @ w) @ w
    gh = (1 - jnp.tanh(h) ** 2) * g
    gm = x.T @ gh
    return (gh @ w.T) @ w.T, gm @ w.T + w.T @ gm

  layer.defvjp(fwd, bwd, fwd_bwd=fwd_bwd)
  return layer


def loss_of(F):
  def loss(x, ws):
    body = lambda c, w: (jax.checkpoint(F)(c, w), None)
    return jnp.sum(jax.lax.scan(body, x, ws)[0] ** 2)
  return loss


def sharded(loss):
  def step(x, ws):
    inner = lambda x, ws: jax.lax.psum(loss(x, ws), "d")
    return jax.grad(lambda x, ws: shard_map(
        inner, mesh=mesh, in_specs=(P("d"), P()), out_specs=P(),
        check_vma=False)(x, ws))(x, ws)
  return step


def share(report):
  (s,) = report.sites
  return s, s["predicted"]["share_of_step"]


configs = ("as_written", "smartvjp_fused")
ws = jnp.full((3, 128, 128), 0.01)
F = fused_layer()
one = smartvjp.audit(jax.grad(loss_of(F)), jnp.ones((16, 128)), ws,
                     configs=configs)
four = smartvjp.audit(sharded(loss_of(F)), jnp.ones((64, 128)), ws,
                      configs=configs)
(s1, share1), (s4, share4) = share(one), share(four)
assert s1["shards"] == 1 and s4["shards"] == 4, (s1["shards"], s4["shards"])
assert s1["runs"] == s4["runs"], (s1["runs"], s4["runs"])
assert share1 > 0.05, share1
assert abs(share4 - share1) <= 0.15 * share1, (share1, share4)

# the counts, per device, against the host counters of all four
f, fwd, bwd, _ = K.sin_rules()
G = jax.custom_vjp(f)
G.defvjp(fwd, bwd)
step = sharded(loss_of(lambda c, w: G(c * w)))
x, w8 = jnp.ones((64, 8)), jnp.full((3, 1, 8), 0.5)
a = smartvjp.audit(step, x, w8, configs=("as_written", "smartvjp"))
(s,) = a.sites
assert s["shards"] == 4 and "shard_map" in s["path"]
for config in ("as_written", "smartvjp"):
  K.reset()
  jax.block_until_ready(a._builds[config].compiled(x, w8))
  ran = {k: v for k, v in K.COUNTS.items() if v}
  counted = {k: 4 * v for k, v in s["runs"][config]["compiled"].items() if v}
  assert counted == ran, (config, counted, ran)
print("audit shards ok", share1, share4)
