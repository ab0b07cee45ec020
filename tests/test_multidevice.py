"""Multi-device: GSPMD (NamedSharding under jit) and shard_map (psum inside
f or bwd, check_vma on) on 4 CPU devices, compared with jax.custom_vjp.

Runs in a subprocess because the device count is fixed when JAX starts."""

import os
import subprocess
import sys

HERE = os.path.dirname(__file__)


def test_sharding_and_shard_map_match_custom_vjp():
  env = dict(os.environ,
             XLA_FLAGS="--xla_force_host_platform_device_count=4",
             JAX_PLATFORMS="cpu")
  proc = subprocess.run(
      [sys.executable, os.path.join(HERE, "multidevice", "check_sharding.py")],
      env=env, capture_output=True, text=True, timeout=600)
  assert proc.returncode == 0, proc.stdout + proc.stderr
  assert "multidevice ok" in proc.stdout
