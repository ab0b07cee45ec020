import os
import sys

import jax
import pytest

sys.path.insert(0, os.path.dirname(__file__))

import kernels  # noqa: E402


@pytest.fixture(params=[True, False], ids=["direct_linearize", "jvp_partial_eval"])
def linearize_mode(request):
  """Runs a test with ``jax_use_direct_linearize`` on and off."""
  old = jax.config.jax_use_direct_linearize
  jax.config.update("jax_use_direct_linearize", request.param)
  yield request.param
  jax.config.update("jax_use_direct_linearize", old)


@pytest.fixture(params=[False, True], ids=["callback", "never_dce"])
def never_dce(request):
  return request.param


@pytest.fixture(autouse=True)
def _reset_counts():
  kernels.reset()
  yield
