"""JAX's megablox ``gmm`` (a Pallas TPU kernel with integer work on its
group metadata before the kernel) in a scanned MoE step, lowered for a TPU
without one: smartvjp's module is no larger than ``jax.custom_vjp``'s,
operation for operation, each counted once per place it runs.

The rules' traced code used to be lowered as traced, dead code included
(the step ``jnp.linspace`` computes and drops inside ``gmm``'s metadata),
where JAX's partial evaluation removes it from an inlined ``fwd``: 25 more
operations in a 2-layer checkpointed scan (issue 48). ``tools/megablox_tpu.py``
also compares the compiled programs on a TPU."""

import importlib.util
import os
import sys

import jax
import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


@pytest.fixture(scope="module")
def tool():
  spec = importlib.util.spec_from_file_location(
      "smartvjp_tool_megablox_tpu", os.path.join(ROOT, "tools", "megablox_tpu.py"))
  module = importlib.util.module_from_spec(spec)
  sys.modules[spec.name] = module
  spec.loader.exec_module(module)
  return module


@pytest.mark.parametrize("checkpoint", [True, False])
def test_lowered_module_no_larger_than_jax_custom_vjp(tool, checkpoint):
  if jax.default_backend() == "tpu":
    pytest.skip("on a TPU: run tools/megablox_tpu.py, which also compiles")
  mods = tool.modules()
  args = tool.inputs(**tool.SHAPES)
  got = tool.lowered_summary(tool.step(mods["smartvjp"], checkpoint), *args)
  want = tool.lowered_summary(tool.step(mods["jax.custom_vjp"], checkpoint), *args)
  # forward 2 gmm; backward the first again (gelu's derivative), then gmm
  # and tgmm per call; without checkpoint the first is not run again
  assert want["kernels"] == (7 if checkpoint else 6)
  assert got["kernels"] == want["kernels"]
  assert got["ops"] <= want["ops"], {
      op: n - want["by_op"].get(op, 0) for op, n in got["by_op"].items()
      if n != want["by_op"].get(op, 0)}


def test_the_counter_counts_each_call_site(tool):
  text = """module @m {
  func.func public @main(%arg0: tensor<f32>) -> tensor<f32> {
    %0 = call @f(%arg0) : (tensor<f32>) -> tensor<f32>
    %1 = func.call @f(%0) : (tensor<f32>) -> tensor<f32>
    %2 = stablehlo.custom_call @tpu_custom_call(%1) : (tensor<f32>) -> tensor<f32>
    return %2 : tensor<f32>
  }
  func.func private @f(%arg0: tensor<f32>) -> tensor<f32> {
    %0 = stablehlo.add %arg0, %arg0 : tensor<f32>
    %1 = stablehlo.multiply %0, %0 : tensor<f32>
    return %1 : tensor<f32>
  }
}"""
  assert dict(tool.lowered_ops(text)) == {
      "stablehlo.add": 2, "stablehlo.multiply": 2, "tpu_custom_call": 1}
