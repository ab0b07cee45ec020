"""Forward over reverse (jvp of grad, jacfwd of jacrev, hessian, vmap of an
hvp) through shard_map(check_vma=True), lax.map, fori_loop, scan and
checkpoint, for every set of given rules and every rule made opaque: the
plain function's values, jax.custom_vjp's error, or a refusal naming f,
never a wrong value (tests/multidevice/check_forward_over_reverse.py).

Runs in a subprocess because the device count is fixed when JAX starts."""

import os
import subprocess
import sys

HERE = os.path.dirname(__file__)


def test_forward_over_reverse_family():
  env = dict(os.environ,
             XLA_FLAGS="--xla_force_host_platform_device_count=4",
             JAX_PLATFORMS="cpu")
  proc = subprocess.run(
      [sys.executable,
       os.path.join(HERE, "multidevice", "check_forward_over_reverse.py")],
      env=env, capture_output=True, text=True, timeout=900)
  assert proc.returncode == 0, proc.stdout[-8000:] + proc.stderr[-4000:]
  assert "forward over reverse ok" in proc.stdout
