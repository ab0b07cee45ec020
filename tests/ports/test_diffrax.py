"""diffrax's default adjoint (RecursiveCheckpointAdjoint, through equinox)
with smart_custom_vjp swapped in for jax.custom_vjp: bitwise the same
solution and gradients."""

import numpy as np
import pytest

pytest.importorskip("diffrax")


def test_recursive_checkpoint_adjoint_matches_custom_vjp(compare_port):
  ref = compare_port("prog_diffrax.py")
  assert all(np.isfinite(v).all() for v in ref.values())
