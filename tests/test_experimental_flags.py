"""JAX's experimental jax_remat3 / jax_custom_vjp3 paths: values stay correct.

With jax_remat3 smartvjp's remat3 rules (smartvjp/_remat.py) run f 1,
fwd 1, bwd 1 under a plain checkpoint and fwd 1, bwd 1 when the policy saves
the residuals (tests/test_remat3.py counts each policy); jax_custom_vjp3
alone changes nothing for smartvjp."""

import itertools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import kernels as K
from smartvjp import smart_custom_vjp

FLAGS = ("jax_remat3", "jax_custom_vjp3")
X = jnp.array([0.3, -1.2, 2.0], jnp.float32)


def _has(flag):
  try:
    getattr(jax.config, flag)
    return True
  except AttributeError:
    return False


@pytest.fixture
def flags(request):
  wanted = request.param
  if not all(_has(f) for f in FLAGS):
    pytest.skip("this JAX has no experimental remat3/custom_vjp3 flags")
  with K.config(**{f: f in wanted for f in FLAGS}):
    yield wanted


@pytest.mark.parametrize(
    "flags", [c for n in (1, 2) for c in itertools.combinations(FLAGS, n)],
    indirect=True, ids=lambda c: "+".join(c))
@pytest.mark.parametrize("policy", [None, "everything_saveable"])
def test_values_and_counts_under_experimental_flags(flags, policy):
  f, fwd, bwd, _ = K.sin_rules()
  F = smart_custom_vjp(f)
  F.defvjp(fwd, bwd)
  p = getattr(jax.checkpoint_policies, policy) if policy else None
  K.reset()
  g = jax.jit(jax.grad(lambda x: jnp.sum(jax.checkpoint(F, policy=p)(x) ** 2)))(X)
  np.testing.assert_allclose(g, 2 * np.sin(X) * np.cos(X), rtol=1e-6)
  counts = dict(K.COUNTS)
  assert counts["bwd"] == 1 and counts["fwd"] == 1 and counts.get("f", 0) <= 1
