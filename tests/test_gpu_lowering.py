"""The Pallas examples lowered for an H200 on this machine, no GPU needed.

Pallas lowers a kernel to Triton IR in Python, at JAX lowering time: that is
where block shapes that are not powers of two, unsupported operations and
shape errors fail. ``jax.export`` with ``platforms=["cuda"]`` runs that
lowering on a CPU-only machine, for an abstract H200 (JAX 0.11 asks for the
device kind; 0.10 lowers for compute capability 9.0 when it sees no GPU).
What a CPU cannot check, compiling the Triton IR to machine code and running
it, the GPU-only tests in test_pallas_*.py do.

The lowered module also shows which kernels a step launches: outside a loop
each custom call in it runs once per step, so these counts are the run-time
launches of the GPU path, compared here with the counts interpret mode
measures.
"""

import collections
import importlib.util
import os
import re

import jax
import jax.numpy as jnp
import pytest

import kernels as K

TRITON_CALL = "__gpu$xla.gpu.triton"
# JAX 0.11 deprecates Pallas' Triton backend (design/limitations.md).
pytestmark = pytest.mark.filterwarnings(
    "ignore:The Pallas Triton backend is deprecated:DeprecationWarning")


def load(name):
  path = os.path.join(os.path.dirname(__file__), os.pardir, "examples",
                      f"{name}.py")
  spec = importlib.util.spec_from_file_location(name, path)
  module = importlib.util.module_from_spec(spec)
  spec.loader.exec_module(module)
  return module


PG = load("pallas_gelu_matmul")
RG = load("pallas_rmsnorm_gelu")


def lowered_kernels(fn, *avals):
  """``{kernel name: calls}`` in ``jit(fn)`` lowered for an H200."""
  try:
    device = jax.sharding.AbstractDevice(device_kind="NVIDIA H200",
                                         num_cores=132, platform="gpu")
  except TypeError:   # jax 0.10.0's AbstractDevice has no platform field
    device = jax.sharding.AbstractDevice(device_kind="NVIDIA H200",
                                         num_cores=132)
  mesh = jax.sharding.AbstractMesh((1,), ("gpu",), abstract_device=device)
  export = jax.export.export(
      jax.jit(fn), platforms=["cuda"],
      disabled_checks=[jax.export.DisabledSafetyCheck.custom_call(TRITON_CALL)])
  with jax.sharding.use_abstract_mesh(mesh):
    text = export(*avals).mlir_module()
  calls = re.findall(r"stablehlo\.custom_call @" + re.escape(TRITON_CALL)
                     + r"\(.*?name = \"(\w+)\"", text)
  return collections.Counter(calls)


def step(F, remat):
  G = jax.checkpoint(F) if remat else F
  return jax.value_and_grad(
      lambda a, b: jnp.sum(G(a, b).astype(jnp.float32) ** 2), (0, 1))


def sds(shape, dtype):
  return jax.ShapeDtypeStruct(shape, dtype)


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16],
                         ids=["f32", "bf16"])
@pytest.mark.parametrize("shape", [(8192, 4096, 4096), (8192, 8192, 8192),
                                   (200, 72, 136)],
                         ids=["4096", "8192", "ragged"])
@pytest.mark.parametrize("impl,remat,expected", [
    ("jax", True, {"fwd": 2, "bwd": 2}),
    ("smart", True, {"f": 1, "fwd": 1, "bwd": 2}),
    ("fused", True, {"f": 1, "fwd_bwd": 3}),
    ("smart", False, {"fwd": 1, "bwd": 2}),
])
def test_gelu_matmul_lowers_for_h200(dtype, shape, impl, remat, expected):
  gm, rules = PG.make_gelu_matmul(interpret=False, fused=impl == "fused")
  F = PG.custom_vjp_version(rules) if impl == "jax" else gm
  m, k, n = shape
  counts = lowered_kernels(step(F, remat), sds((m, k), dtype),
                           sds((k, n), dtype))
  assert K.per_rule(counts, PG.KERNEL_NAMES) == expected


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16],
                         ids=["f32", "bf16"])
@pytest.mark.parametrize("shape", [(8192, 4096), (8192, 8192), (45, 200)],
                         ids=["4096", "8192", "ragged"])
@pytest.mark.parametrize("impl,remat,expected", [
    ("jax", True, {"fwd": 2, "bwd": 1}),
    ("smart", True, {"f": 1, "fwd": 1, "bwd": 1}),
    ("fused", True, {"f": 1, "fwd_bwd": 1}),
    ("smart", False, {"fwd": 1, "bwd": 1}),
])
def test_rmsnorm_gelu_lowers_for_h200(dtype, shape, impl, remat, expected):
  op, rules = RG.make_rmsnorm_gelu(interpret=False, fused=impl == "fused")
  if impl == "jax":
    op = jax.custom_vjp(rules["f"])
    op.defvjp(rules["fwd"], rules["bwd"])
  m, d = shape
  counts = lowered_kernels(step(op, remat), sds((m, d), dtype),
                           sds((d,), dtype))
  assert K.per_rule(counts, RG.KERNEL_NAMES) == expected


def test_tiles_must_be_powers_of_two():
  with pytest.raises(ValueError, match="powers of two"):
    PG.make_gelu_matmul(block_m=48)
  with pytest.raises(ValueError, match="power of two"):
    RG.make_rmsnorm_gelu(block_m=12)


def test_profiler_kernel_names_tell_the_kernels_apart():
  """The GPU launch counter (``kernels.gpu_kernel_launches``) matches each
  example's kernel names as whole words: no name counts another's launches."""
  names = [n for example in (PG, RG)
           for ns in example.KERNEL_NAMES.values() for n in ns]
  for name in names:
    pattern = K.kernel_name_pattern(name)
    assert pattern.search(name) and pattern.search(f"{name}_1")
    assert pattern.search(f"void {name}(float*)")
    assert [other for other in names if pattern.search(other)] == [name]
