"""The FFI example: C++ handlers (or callback stand-ins without a compiler)
counted in C++, wrapped in smart_custom_vjp."""

import importlib.util
import os

import jax
import jax.numpy as jnp
import numpy as np
import pytest

PATH = os.path.join(os.path.dirname(__file__), os.pardir, "examples",
                    "ffi_kernel.py")
spec = importlib.util.spec_from_file_location("ffi_kernel", PATH)
FK = importlib.util.module_from_spec(spec)
spec.loader.exec_module(FK)

X = jnp.linspace(-1.0, 2.0, 16, dtype=jnp.float32)


@pytest.mark.parametrize("fused,remat,expected", [
    (False, False, {"fwd": 1, "bwd": 1}),
    (False, True, {"f": 1, "fwd": 1, "bwd": 1}),
    (True, True, {"f": 1, "fwd_bwd": 1}),
])
def test_ffi_rules(fused, remat, expected):
  F = FK.make(fused)
  G = jax.checkpoint(F) if remat else F
  FK.reset()
  g = jax.block_until_ready(jax.jit(jax.grad(lambda x: jnp.sum(G(x) ** 2)))(X))
  np.testing.assert_allclose(g, 2 * np.sin(X) * np.cos(X), rtol=1e-5, atol=1e-6)
  assert FK.counts() == expected
  np.testing.assert_allclose(F(X), np.sin(X), rtol=1e-6)
