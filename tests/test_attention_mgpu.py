"""JAX's Mosaic GPU attention (``jax.experimental.pallas.ops.gpu.attention_mgpu``,
the one shipped GPU kernel with a ``custom_vjp`` left in jax 0.12.1), swapped
by ``smartvjp.import_swapped`` and lowered for CUDA on this CPU: a scanned,
checkpointed step launches the minimum per layer, and smartvjp's one
definition of an opaque kernel (``_jaxprs.is_opaque_kernel``) sees the
kernel, an ``mpmd_map`` equation.

Two things the module needs off a GPU, both scoped to each test with
``monkeypatch``: a ``cuda_versions`` stub (a CPU jaxlib has none, and the
forward pass reads the CUDA runtime's version), and f16 inputs (bf16 fails
to trace: the kernel's shared-memory scratch is f16 whatever the inputs;
``design/upstream/bugs/mgpu-attention-bf16.md``).
"""

from __future__ import annotations

import importlib.util
import os
import sys

import jax
import jax.numpy as jnp
import pytest

import shipped_kernels as SK
from smartvjp import _jaxprs

pytestmark = [
    pytest.mark.skipif(importlib.util.find_spec(SK.MGPU) is None,
                       reason="this jax ships no attention_mgpu"),
    pytest.mark.filterwarnings("ignore::DeprecationWarning")]

EX = SK.load_example()
SCHEDULES = ("shipped", "swapped")
LAYERS = 3
SHAPE = (1, 128, 2, 64)       # batch, sequence, heads, head_dim (64 | head_dim)


@pytest.fixture
def modules(monkeypatch):
  out = {s: SK.load(SK.MGPU, s == "swapped") for s in SCHEDULES}
  for module in out.values():
    monkeypatch.setattr(module, "cuda_versions", SK.CudaVersionsStub)
  return out


def step(module, policy):
  """``grad`` of a scan of ``LAYERS`` checkpointed attention calls."""
  config = SK.mgpu_config(module)
  layer = jax.checkpoint(lambda q, k, v: module.attention(q, k, v, config),
                         policy=policy)

  def loss(q, k, v):
    def body(x, scale):
      y = layer(x * scale, k, v)
      return y, jnp.sum(y.astype(jnp.float32) ** 2)
    _, totals = jax.lax.scan(body, q, jnp.linspace(0.5, 1.5, LAYERS,
                                                    dtype=q.dtype))
    return jnp.sum(totals)
  return jax.grad(loss, (0, 1, 2))


def expected(schedule):
  out = {}
  for rule, n in SK.REMAT[schedule].items():
    for kernel in SK.MGPU_RULES[rule]:
      out[kernel] = out.get(kernel, 0) + n * LAYERS
  return out


@pytest.mark.parametrize("policy", [None, jax.checkpoint_policies.dots_saveable],
                         ids=["nothing_saveable", "dots_saveable"])
def test_lowered_for_cuda_swapped_launches_the_minimum(modules, policy):
  """Per layer, shipped: fwd twice (forward, and again in the backward
  pass) and the two backward kernels; swapped: the kernel without the lse
  output forward, fwd once, the backward kernels."""
  q = jax.ShapeDtypeStruct(SHAPE, jnp.float16)
  for schedule in SCHEDULES:
    got = SK.static_launches(EX, step(modules[schedule], policy), q, q, q)
    assert got == expected(schedule), schedule


def test_the_mosaic_gpu_kernel_is_an_opaque_kernel(modules):
  """Its equation is ``mpmd_map`` (jax 0.10.2 through 0.12.1): the facade
  counts it as a kernel and walks nothing inside it."""
  q = jax.ShapeDtypeStruct(SHAPE, jnp.float16)
  module = modules["shipped"]
  config = SK.mgpu_config(module)
  closed = jax.make_jaxpr(
      lambda q, k, v: module.attention(q, k, v, config))(q, q, q)
  kernels = [e for e, _ in _jaxprs.equations(closed) if _jaxprs.is_opaque_kernel(e)]
  assert [e.primitive.name for e in kernels] == ["mpmd_map"]
  assert _jaxprs.inner_jaxprs(kernels[0]) == []


def test_bf16_does_not_trace(modules):
  """The upstream bug, as it stands: when this starts passing, JAX fixed
  it; then test bf16 above and update the bug report."""
  q = jax.ShapeDtypeStruct(SHAPE, jnp.bfloat16)
  module = modules["shipped"]
  config = SK.mgpu_config(module)
  with pytest.raises(ValueError, match="(?i)float16|dtype"):
    jax.make_jaxpr(lambda q, k, v: module.attention(q, k, v, config))(q, q, q)


@pytest.mark.skipif(jax.default_backend() != "gpu", reason="needs a GPU")
def test_gpu_gradients_bitwise_equal_shipped(modules):
  """On a Hopper GPU: the real kernels' gradients, swapped against
  shipped, bit for bit (f16), through the scanned checkpointed step."""
  keys = jax.random.split(jax.random.key(0), 3)
  q, k, v = (jax.random.normal(key, SHAPE, jnp.float16) for key in keys)
  grads = {s: jax.block_until_ready(jax.jit(step(modules[s], None))(q, k, v))
           for s in SCHEDULES}
  for a, b in zip(grads["swapped"], grads["shipped"], strict=True):
    assert a.dtype == b.dtype == jnp.float16
    assert bool(jnp.all(jnp.isfinite(a)))
    assert (jax.lax.bitcast_convert_type(a, jnp.uint16)
            == jax.lax.bitcast_convert_type(b, jnp.uint16)).all()


def test_the_transformer_with_mgpu_attention_lowers_for_cuda(monkeypatch):
  """``benchmarks/gpu_transformer.py --attention mgpu``'s model at its GPU
  size (f16), lowered for CUDA as shipped and swapped: per layer, swapped
  runs the minimum and writes the lse residual once, shipped twice."""
  spec = importlib.util.spec_from_file_location(
      "gpu_transformer", os.path.join(SK.ROOT, "benchmarks",
                                      "gpu_transformer.py"))
  bench = importlib.util.module_from_spec(spec)
  monkeypatch.setitem(sys.modules, "gpu_transformer", bench)
  spec.loader.exec_module(bench)
  cfg = bench.MGPU_CONFIG
  kernels = bench.load_all_kernels("mgpu")
  for schedule in SCHEDULES:
    monkeypatch.setattr(kernels[schedule][0].module, "cuda_versions",
                        SK.CudaVersionsStub)
  params = jax.eval_shape(lambda: EX.init_params(cfg, jax.random.key(0)))
  tokens = jax.ShapeDtypeStruct((cfg.batch, cfg.seq + 1), "int32")
  want = EX.expected_launches(cfg, bench.kernel_modules("mgpu"))
  residual = {}
  for schedule in SCHEDULES:
    launches = EX.count_step(cfg, kernels[schedule],
                             EX.POLICIES["nothing_saveable"], params, tokens)
    assert EX.by_label(launches) == want[schedule], schedule
    residual[schedule] = EX.residual_bytes(launches)
  lse = cfg.batch * cfg.heads * cfg.seq * 4          # f32, once per layer
  assert residual["swapped"] == cfg.layers * lse
  assert residual["shipped"] == 2 * residual["swapped"]
  assert want["swapped"] == {
      "attention_mgpu forward (o)": cfg.layers,
      "attention_mgpu forward (o, lse)": cfg.layers,
      "attention_mgpu backward (dq)": cfg.layers,
      "attention_mgpu backward (dk, dv)": cfg.layers}
