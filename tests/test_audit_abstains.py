"""A model that abstains (issue 68, "What to build" 4, 5 and 11): a site
whose kernels XLA cannot cost gets no seconds (``None``, "unpriced:
calibrate=True times it"), and the step's figure says it is partial; a
``cond`` with such a kernel in one branch and JAX code in the other is
unpriced (XLA's analysis would take the branch it can see); under
``shard_map`` a site's share is per device, as its step is; and a site
whose backward region runs ``fwd`` then ``bwd`` is told what a
``fwd_bwd`` would save, against host counters in its kernels."""

import os
import subprocess
import sys

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import kernels as K
import smartvjp
from smartvjp import smart_custom_vjp
from smartvjp.audit import _analysis as A

HERE = os.path.dirname(__file__)
CONFIGS = ("as_written", "smartvjp")


def _step(F, n=3):
  def step(x, ws):
    layer = lambda c, w: (F(c * w), None)
    loss = lambda x, ws: jnp.sum(
        jax.lax.scan(jax.checkpoint(layer), x, ws)[0] ** 2)
    return jax.grad(loss)(x, ws)
  return step, (jnp.ones((4, 8)), jnp.full((n, 4, 8), 0.5))


def _executed(a, config, *args):
  K.reset()
  jax.block_until_ready(a._builds[config].compiled(*args))
  return {k: v for k, v in K.COUNTS.items() if v}


def _cond_site(kernel_branch: bool):
  """``f`` chooses, by its input's values, between a branch and a JAX
  fallback that the data never takes (``x`` is positive here)."""
  def fallback(x):
    for _ in range(4):
      x = jnp.tanh(x @ jnp.ones((8, 8)))   # visible, and never run
    return x

  def branch(x):
    if kernel_branch:
      return K.kernel("f", lambda x: (np.sin(x),), [x], x)[0]
    return jnp.sin(x)

  @jax.custom_vjp
  def F(x):
    return jax.lax.cond(jnp.all(x > 0), branch, fallback, x)

  F.defvjp(lambda x: (F(x), x), lambda x, g: (jnp.cos(x) * g,))
  return F


@pytest.mark.parametrize("kernel_branch", [True, False])
def test_a_cond_is_priced_from_visible_costs_only(kernel_branch):
  step, args = _step(_cond_site(kernel_branch))
  a = smartvjp.audit(step, *args, configs=CONFIGS)
  (s,) = a.sites
  p = s["predicted"]
  if kernel_branch:
    # the kernel branch outranks the fallback XLA's analysis would take
    assert p["unpriced"] == {"f": ["pure_callback"], "fwd": ["pure_callback"]}
    assert p["seconds_saved"] is None and p["share_of_step"] is None
    assert a.predicted["partial"] and a.predicted["unpriced_kernels"] == [
        "pure_callback"]
    assert "unpriced: calibrate=True times it" in a.table()
    assert "0.0% of the step" not in a.table()
  else:
    assert "unpriced" not in p and p["seconds_saved"] is not None
    assert not a.predicted["partial"]


def test_unpriced_kernels_reads_every_branch_and_not_the_interpreter():
  from jax.experimental import pallas as pl

  def body(x_ref, o_ref):
    o_ref[...] = x_ref[...] * 2.0

  x = jnp.ones((8, 128))
  interpreted = jax.make_jaxpr(lambda x: pl.pallas_call(
      body, out_shape=jax.ShapeDtypeStruct(x.shape, x.dtype),
      interpret=True)(x))(x)
  assert A.unpriced_kernels(interpreted.jaxpr) == []
  cb = lambda x: K.kernel("k", lambda x: (x,), [x], x)[0]
  branchy = jax.make_jaxpr(lambda x: jax.lax.cond(
      x[0, 0] > 0, cb, jnp.sin, x))(x)
  assert A.unpriced_kernels(branchy.jaxpr) == ["pure_callback"]
  never = jax.make_jaxpr(lambda x: K.kernel(
      "k", lambda x: (x,), [x], x, never_dce=True)[0])(x)
  assert A.unpriced_kernels(never.jaxpr) == ["test_opaque_kernel"]
  assert A.unpriced_kernels(jax.make_jaxpr(jnp.sin)(x).jaxpr) == []


def test_a_fwd_bwd_opportunity_is_named_where_bwd_follows_fwd():
  f, fwd, bwd, _ = K.sin_rules(True)
  F = jax.custom_vjp(f)
  F.defvjp(fwd, bwd)
  step, args = _step(F, n=3)
  a = smartvjp.audit(step, *args, configs=CONFIGS)
  (s,) = a.sites
  ran = _executed(a, "smartvjp", *args)
  assert ran == {"f": 3, "fwd": 3, "bwd": 3}
  opp = s["fwd_bwd_opportunity"]
  # per backward run: fwd's one residual, cos(x) of 4 x 8 float32, and
  # fwd's and bwd's kernels made one
  assert opp == dict(runs=ran["bwd"], residual_bytes_not_written=3 * 128,
                     launches_not_made=3)
  assert "fwd_bwd opportunity: fwd then bwd 3x per step" in a.table()
  assert "a fwd_bwd (defvjp(fwd, bwd, fwd_bwd=...)" in s["suggestion"]
  assert "would not write 384 bytes of residuals" in s["suggestion"]


def test_no_fwd_bwd_opportunity_where_there_is_one_or_no_kernel():
  f, fwd, bwd, fb = K.sin_rules(True)
  G = smart_custom_vjp(f)
  G.defvjp(fwd, bwd, fwd_bwd=fb)
  H, _ = K.counting_sin(jax.custom_vjp)
  for F in (G, H):
    step, args = _step(F)
    (s,) = smartvjp.audit(step, *args, configs=CONFIGS).sites
    assert s["fwd_bwd_opportunity"] is None, s["name"]
    assert "fwd_bwd opportunity" not in s["suggestion"]
  # no remat: the backward pass reads saved residuals, no fwd runs there
  J = jax.custom_vjp(f)
  J.defvjp(fwd, bwd)
  step = jax.grad(lambda x: jnp.sum(J(x) ** 2))
  (s,) = smartvjp.audit(step, jnp.ones(8), configs=CONFIGS).sites
  assert s["fwd_bwd_opportunity"] is None


def test_a_share_under_shard_map_is_per_device_as_its_step():
  env = dict(os.environ,
             XLA_FLAGS="--xla_force_host_platform_device_count=4",
             JAX_PLATFORMS="cpu")
  proc = subprocess.run(
      [sys.executable, os.path.join(HERE, "multidevice",
                                    "check_audit_shards.py")],
      env=env, capture_output=True, text=True, timeout=600)
  assert proc.returncode == 0, proc.stdout + proc.stderr
  assert "audit shards ok" in proc.stdout
