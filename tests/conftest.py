import os
import sys

import jax
import pytest

sys.path.insert(0, os.path.dirname(__file__))

import kernels  # noqa: E402

REMAT3_FLAGS = ("jax_remat3", "jax_custom_vjp3")
REMAT3_PENDING = ("differs from the default path under jax_remat3 + "
                  "jax_custom_vjp3 (give the reason with reason=...)")


_has_flag = kernels.has_flag


def pytest_configure(config):
  config.addinivalue_line(
      "markers", "remat3_pending: fails under jax_remat3 + jax_custom_vjp3 "
      "for the reason given (strict xfail in that mode only)")


def _jax_version():
  return tuple(int(p) for p in jax.__version__.split(".")[:3])


def _mark_remat3_pending(request):
  """Applies ``xfail(strict=True)`` where a ``remat3_pending`` marker matches:
  ``@pytest.mark.remat3_pending(jax_min=(0, 12), remat=True)`` matches when
  the installed JAX is at least ``jax_min`` (and below ``jax_below``, when
  given) and the test's parameters have the given values (every
  parametrization when none are given); ``reason=`` says why it fails."""
  for mark in request.node.iter_markers("remat3_pending"):
    wanted = dict(mark.kwargs)
    jax_min = wanted.pop("jax_min", None)
    jax_below = wanted.pop("jax_below", None)
    reason = wanted.pop("reason", REMAT3_PENDING)
    if jax_min is not None and _jax_version() < tuple(jax_min):
      continue
    if jax_below is not None and _jax_version() >= tuple(jax_below):
      continue
    params = getattr(getattr(request.node, "callspec", None), "params", {})
    if all(params.get(k) == v for k, v in wanted.items()):
      request.applymarker(pytest.mark.xfail(strict=True, reason=reason))
      return


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
  _mark_remat3_pending(request)
  old = {f: getattr(jax.config, f) for f in REMAT3_FLAGS}
  for f in REMAT3_FLAGS:
    jax.config.update(f, True)
  try:
    yield "remat3"
  finally:
    for f, v in old.items():
      jax.config.update(f, v)


@pytest.fixture(params=[False, True], ids=["callback", "never_dce"])
def never_dce(request):
  return request.param


@pytest.fixture(autouse=True)
def _reset_counts():
  kernels.reset()
  yield
