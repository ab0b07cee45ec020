import os
import sys

import jax
import pytest

sys.path.insert(0, os.path.dirname(__file__))

import kernels  # noqa: E402

REMAT3_FLAGS = ("jax_remat3", "jax_custom_vjp3")

_has_flag = kernels.has_flag


@pytest.fixture(params=["default", "remat3"])
def ad_mode(request):
  """Runs a test on JAX's default autodiff path and on its upgrade path,
  ``jax_remat3=True`` + ``jax_custom_vjp3=True`` (where this JAX has both)."""
  if request.param == "default":
    yield "default"
    return
  missing = [f for f in REMAT3_FLAGS if not _has_flag(f)]
  if missing:
    pytest.skip(f"jax {jax.__version__} does not define {', '.join(missing)} "
                "(jax_remat3 first appears in jax 0.10.1)")
  with kernels.config(**{f: True for f in REMAT3_FLAGS}):
    yield "remat3"


@pytest.fixture(params=[False, True], ids=["callback", "never_dce"])
def never_dce(request):
  return request.param


@pytest.fixture(autouse=True)
def _reset_counts():
  kernels.reset()
  yield


@pytest.fixture(params=["direct", "jvp_partial_eval"])
def linearize(request):
  """Runs a test with JAX's direct linearize (the default: linearization
  rules) and without it (JVP, then partial evaluation by a JaxprTrace)."""
  with kernels.config(jax_use_direct_linearize=request.param == "direct"):
    yield request.param
