"""Runs every code block of design/migration.md: each section's "before" and
"after" must compute the same numbers; blocks after those two continue the
"after" (in its namespace) and check themselves."""

import os
import re

import numpy as np
import pytest

from smartvjp import _versions

DOC = os.path.join(os.path.dirname(__file__), os.pardir, "design", "migration.md")


def sections():
  text = open(DOC).read()
  out = []
  for part in re.split(r"^## ", text, flags=re.M)[1:]:
    title = part.splitlines()[0]
    blocks = re.findall(r"```python\n(.*?)```", part, flags=re.S)
    out.append(pytest.param(blocks, id=title))
  return out


@pytest.mark.parametrize("blocks", sections())
def test_before_and_after_agree(blocks):
  assert len(blocks) >= 2, "each section has a before and an after"
  if "import flax" in blocks[1]:
    pytest.importorskip("flax", reason="the flax section needs flax "
                        "(the ports extra)")
  if "pallas.ops.gpu" in blocks[1] and not _versions.SHIPS_TRITON_PALLAS_OPS:
    pytest.skip("the section uses JAX's Triton Pallas attention, which jax "
                "0.12.1 removed")
  if "smartvjp.tesseract" in blocks[1]:
    pytest.importorskip("tesseract_jax", reason="the tesseract-jax section "
                        "needs the tesseract extra")
  before, after = {}, {}
  exec(compile(blocks[0], "migration-before", "exec"), before)
  exec(compile(blocks[1], "migration-after", "exec"), after)
  for i, block in enumerate(blocks[2:]):
    exec(compile(block, f"migration-after-{i + 1}", "exec"), after)
  np.testing.assert_allclose(np.asarray(after["after"]),
                             np.asarray(before["before"]), rtol=1e-6, atol=1e-7)
