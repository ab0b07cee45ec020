"""flax fp8 training with smart_custom_vjp swapped in for jax.custom_vjp:
bitwise the same losses, gradients, parameters, scales and amax histories."""

import numpy as np
import pytest

pytest.importorskip("flax")


@pytest.mark.parametrize("case", ["dot", "einsum"])
def test_fp8_training_matches_custom_vjp(compare_port, case):
  ref = compare_port("prog_flax_fp8.py", case)
  losses = [ref[f"step{i}/loss"] for i in range(4)]
  assert all(np.isfinite(l) for l in losses), losses
  # the scales are real: the fp8 meta gradients overwrite them with positive
  # scales computed from the amax histories
  scales = [v for n, v in ref.items()
            if n.startswith("step3/fp8_meta") and n.endswith("_scale']")]
  assert scales and all((s > 0).all() for s in scales), scales
