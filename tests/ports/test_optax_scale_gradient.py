"""optax.scale_gradient in a checkpointed scan with smart_custom_vjp swapped
in for jax.custom_vjp: bitwise the same loss and gradients."""

import numpy as np
import pytest

pytest.importorskip("optax")


def test_scale_gradient_in_checkpointed_scan_matches_custom_vjp(compare_port):
  ref = compare_port("prog_optax_scale_gradient.py")
  assert all(np.isfinite(v).all() for v in ref.values())
  for name in ("checkpoint", "dots_saveable"):  # remat changes no value
    for key in ("[0]['b']", "[0]['k']", "[1]"):
      np.testing.assert_allclose(ref[f"{name}/grad{key}"],
                                 ref[f"plain/grad{key}"], rtol=1e-5, atol=1e-6)
