"""Full types through forward mode and transposes: varying manual axes under
``shard_map(check_vma=True)`` (a 4-device subprocess,
``multidevice/check_vma_types.py``) and the memory space of residuals a
policy offloads, under ``jax.linearize``."""

import os
import subprocess
import sys

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.ad_checkpoint import checkpoint_name

from smartvjp import smart_custom_vjp

HERE = os.path.dirname(__file__)


def test_shard_map_forward_mode_and_transposes_keep_varying_axes():
  env = dict(os.environ,
             XLA_FLAGS="--xla_force_host_platform_device_count=4",
             JAX_PLATFORMS="cpu")
  proc = subprocess.run(
      [sys.executable, os.path.join(HERE, "multidevice", "check_vma_types.py")],
      env=env, capture_output=True, text=True, timeout=600)
  assert proc.returncode == 0, proc.stdout + proc.stderr
  assert "vma types ok" in proc.stdout


X = jnp.array([0.3, -1.2, 2.0], jnp.float32)
OFFLOAD = jax.checkpoint_policies.save_and_offload_only_these_names(
    names_which_can_be_saved=[], names_which_can_be_offloaded=["res"],
    offload_src="device", offload_dst="pinned_host")


def _offloading(kind, seen):
  """``2 sin(x)`` whose residual ``cos(x)`` is named for the policy; ``bwd``
  records the type (with its memory space) of the residual it gets."""
  def f(x):
    return 2 * jnp.sin(x)

  def fwd(x):
    return 2 * jnp.sin(x), (checkpoint_name(jnp.cos(x), "res"),)

  def bwd(r, g):
    seen.append(jax.typeof(r[0]).str_short())
    return (2 * g * r[0],)
  if kind == "plain":
    return f
  F = smart_custom_vjp(f) if kind == "smart" else jax.custom_vjp(f)
  F.defvjp(fwd, bwd)
  return jax.checkpoint(F, policy=OFFLOAD)


@pytest.mark.parametrize("jit", [False, True])
def test_linearize_reloads_offloaded_residuals_before_bwd(jit):
  seen_smart, seen_ref = [], []

  def lin(F):
    fn = lambda x, t: jax.linearize(F, x)[1](t)
    return (jax.jit(fn) if jit else fn)(X, jnp.ones(3))
  got = lin(_offloading("smart", seen_smart))
  np.testing.assert_allclose(got, lin(_offloading("plain", [])), rtol=1e-6)
  # the memory space bwd sees is jax.custom_vjp's under reverse mode
  jax.grad(lambda x: jnp.sum(_offloading("custom", seen_ref)(x)))(X)
  assert seen_smart and seen_ref
  assert set(seen_smart) == set(seen_ref), (seen_smart, seen_ref)
  assert all("host" not in s for s in seen_smart), seen_smart
  with pytest.raises(TypeError):  # jax.custom_vjp refuses forward mode
    lin(_offloading("custom", []))
