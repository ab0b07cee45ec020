"""Issue 65 item 7: a ring-attention custom_vjp (collectives, dots and an
inner jax.checkpoint in its rules) in shard_map over 2 CPU devices gives
jax.custom_vjp's gradients bit for bit, eagerly and under jit, with
checkpoint, dots_saveable and a scan of it (a 2-device subprocess,
``multidevice/check_ring_attention.py``), on JAX's default path and with the
remat3 flags. Eagerly, shard_map compiles each primitive it meets alone; a
rule bound as one primitive was fused by XLA as a whole (other roundings, up
to 2.4e-7 here), so there smartvjp evaluates the rule equation by equation,
as jax.custom_vjp's inlined rules are."""

import os
import subprocess
import sys

import pytest

import kernels

HERE = os.path.dirname(__file__)


@pytest.mark.parametrize("path", ["default", "remat3"])
def test_ring_attention_gradients_are_bitwise(path):
  if path == "remat3" and not all(
      kernels.has_flag(f) for f in ("jax_remat3", "jax_custom_vjp3")):
    pytest.skip("this jax has no jax_remat3 / jax_custom_vjp3")
  env = dict(os.environ,
             XLA_FLAGS="--xla_force_host_platform_device_count=2",
             JAX_PLATFORMS="cpu")
  proc = subprocess.run(
      [sys.executable, os.path.join(HERE, "multidevice",
                                    "check_ring_attention.py"),
       *(["remat3"] if path == "remat3" else [])],
      env=env, capture_output=True, text=True, timeout=600)
  assert proc.returncode == 0, proc.stdout + proc.stderr
  assert "ring ok" in proc.stdout
  assert proc.stdout.count(": bitwise") >= (10 if path == "default" else 1)
