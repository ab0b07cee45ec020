"""jax.experimental.ode.odeint with smart_custom_vjp swapped in for
jax.custom_vjp: bitwise the same values, gradients (with and without
jax.checkpoint) and batched results."""

import numpy as np
import pytest

pytest.importorskip("jax.experimental.ode")


def test_odeint_matches_custom_vjp(compare_port):
  ref = compare_port("prog_odeint.py")
  assert all(np.isfinite(v).all() for v in ref.values())
  # the checkpointed gradient is the gradient
  for i in range(3):
    np.testing.assert_allclose(ref[f"grad_checkpoint[{i}]"], ref[f"grad[{i}]"],
                               rtol=1e-5)


def test_odeint_grad_of_grad_matches_custom_vjp(compare_port):
  ref = compare_port("prog_odeint.py", "grad_of_grad")
  assert all(np.isfinite(v).all() for v in ref.values())
