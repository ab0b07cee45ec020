"""cuDNN attention cannot be swapped (``design/limitations.md``): its
``custom_vjp`` is built in one of JAX's private modules, which
``import_swapped`` refuses by design, with an error that says why and what
to name instead."""

from __future__ import annotations

import importlib.util
import os

import pytest

import smartvjp

CUDNN = "jax._src.cudnn.fused_attention_stablehlo"
ROOT = os.path.join(os.path.dirname(os.path.abspath(__file__)), os.pardir)


@pytest.mark.skipif(importlib.util.find_spec(CUDNN) is None,
                    reason="this jax has no cuDNN attention module")
def test_import_swapped_refuses_the_cudnn_attention_module():
  with pytest.raises(smartvjp.SwapError, match="private modules"):
    smartvjp.import_swapped(CUDNN)


def test_the_limitation_and_what_to_do_instead_are_written_down():
  with open(os.path.join(ROOT, "design", "limitations.md")) as fh:
    text = fh.read()
  entry = text[text.index("**cuDNN attention cannot be swapped.**"):]
  entry = entry[:entry.index("\n")]
  for words in ("import_swapped", CUDNN, "What a user can do instead",
                "attention_mgpu", "outside the checkpointed function"):
    assert words in entry, words
