"""The memory-bound Pallas example (fused RMSNorm + GELU)."""

import importlib.util
import os

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import kernels as K
import shipped_kernels as SK

PATH = os.path.join(os.path.dirname(__file__), os.pardir, "examples",
                    "pallas_rmsnorm_gelu.py")
spec = importlib.util.spec_from_file_location("pallas_rmsnorm_gelu", PATH)
RG = importlib.util.module_from_spec(spec)
spec.loader.exec_module(RG)


def loss(F, remat):
  G = jax.checkpoint(F) if remat else F
  return lambda x, g: jnp.sum(G(x, g).astype(jnp.float32) ** 2)


@pytest.mark.parametrize("dtype,tol", [(jnp.float32, 1e-4), (jnp.bfloat16, 5e-2)])
@pytest.mark.parametrize("m", [32, 45], ids=["multiple", "ragged"])
@pytest.mark.parametrize("remat,fused,expected", [
    (False, True, {"fwd": 1, "bwd": 1}),
    (True, False, {"f": 1, "fwd": 1, "bwd": 1}),
    (True, True, {"f": 1, "fwd_bwd": 1}),
])
def test_values_gradients_counts(dtype, tol, m, remat, fused, expected):
  op, _ = RG.make_rmsnorm_gelu(block_m=16, fused=fused, count=True,
                               interpret=True)
  x = jax.random.normal(jax.random.key(0), (m, 24), dtype)
  gamma = (1.0 + 0.1 * jax.random.normal(jax.random.key(1), (24,))).astype(dtype)
  np.testing.assert_allclose(np.float32(op(x, gamma)),
                             np.float32(RG.reference(x, gamma)), rtol=tol, atol=tol)
  RG.LAUNCHES.clear()
  got = jax.jit(jax.grad(loss(op, remat), (0, 1)))(x, gamma)
  jax.effects_barrier()
  assert dict(RG.LAUNCHES) == expected
  want = jax.grad(loss(RG.reference, False), (0, 1))(x, gamma)
  for a, b in zip(got, want):
    assert a.dtype == dtype
    scale = float(jnp.max(jnp.abs(b.astype(jnp.float32))))
    np.testing.assert_allclose(np.float32(a), np.float32(b), rtol=tol,
                               atol=tol * scale)


# -- on a GPU: the kernels lowered through Pallas' Triton backend -------------

needs_gpu = pytest.mark.skipif(jax.default_backend() != "gpu",
                               reason="needs a GPU")


@needs_gpu
@pytest.mark.parametrize("dtype,tol", [(jnp.float32, 1e-4), (jnp.bfloat16, 5e-2)])
@pytest.mark.parametrize("shape", [(256, 512), (45, 200), (64, 8192)],
                         ids=["multiple", "ragged", "wide"])
@pytest.mark.parametrize("remat,fused", [(False, True), (True, False),
                                         (True, True)])
def test_gpu_values_and_gradients(dtype, tol, shape, remat, fused):
  op, _ = RG.make_rmsnorm_gelu(interpret=False, fused=fused)
  m, d = shape
  x = jax.random.normal(jax.random.key(0), (m, d), dtype)
  gamma = (1.0 + 0.1 * jax.random.normal(jax.random.key(1), (d,))).astype(dtype)
  np.testing.assert_allclose(np.float32(op(x, gamma)),
                             np.float32(RG.reference(x, gamma)), rtol=tol, atol=tol)
  got = jax.jit(jax.grad(loss(op, remat), (0, 1)))(x, gamma)
  want = jax.jit(jax.grad(loss(RG.reference, False), (0, 1)))(x, gamma)
  for a, b in zip(got, want):
    assert a.dtype == dtype
    scale = float(jnp.max(jnp.abs(b.astype(jnp.float32))))
    np.testing.assert_allclose(np.float32(a), np.float32(b), rtol=tol,
                               atol=tol * scale)


@needs_gpu
@pytest.mark.parametrize("impl,remat,expected", [
    ("jax", True, {"fwd": 2, "bwd": 1}),
    ("smart", True, {"f": 1, "fwd": 1, "bwd": 1}),
    ("fused", True, {"f": 1, "fwd_bwd": 1}),
    ("smart", False, {"fwd": 1, "bwd": 1}),
])
def test_gpu_kernel_launches(impl, remat, expected):
  """Launches at run time, from the profiler, for one jitted
  ``value_and_grad`` step."""
  op, rules = RG.make_rmsnorm_gelu(interpret=False, fused=impl == "fused")
  if impl == "jax":
    op = jax.custom_vjp(rules["f"])
    op.defvjp(rules["fwd"], rules["bwd"])
  x = jax.random.normal(jax.random.key(0), (256, 1024), jnp.bfloat16)
  gamma = jnp.ones((1024,), jnp.bfloat16)
  step = jax.jit(jax.value_and_grad(loss(op, remat), (0, 1)))
  assert K.gpu_rule_launches(step, x, gamma,
                             kernel_names=RG.KERNEL_NAMES) == expected


# -- the TPU kernels (Mosaic): interpret mode here, lowered for a TPU ---------

EX = SK.load_example()      # kernel_launches: Mosaic calls in a lowered module

SMALL_TILE = 16 * 256 * 4      # 16-row blocks at width 256: several steps


def _data(m, d, dtype):
  x = jax.random.normal(jax.random.key(0), (m, d), dtype)
  gamma = (1.0 + 0.1 * jax.random.normal(jax.random.key(1), (d,))).astype(dtype)
  return x, gamma


@pytest.mark.parametrize("dtype,tol", [(jnp.float32, 1e-5), (jnp.bfloat16, 5e-2)])
@pytest.mark.parametrize("shape,remat,fused,expected", [
    ((64, 256), False, True, {"fwd": 1, "bwd": 1}),
    ((45, 200), True, False, {"f": 1, "fwd": 1, "bwd": 1}),
    ((45, 200), True, True, {"f": 1, "fwd_bwd": 1}),
], ids=["multiple-plain", "ragged-remat", "ragged-remat-fwd_bwd"])
def test_tpu_kernels_values_gradients_counts(dtype, tol, shape, remat, fused,
                                             expected):
  op, _ = RG.make_rmsnorm_gelu(target="tpu", interpret=True, fused=fused,
                               count=True, tile_bytes=SMALL_TILE)
  x, gamma = _data(*shape, dtype)
  np.testing.assert_allclose(np.float32(op(x, gamma)),
                             np.float32(RG.reference(x, gamma)), rtol=tol,
                             atol=tol)
  RG.LAUNCHES.clear()
  got = jax.jit(jax.grad(loss(op, remat), (0, 1)))(x, gamma)
  jax.effects_barrier()
  assert dict(RG.LAUNCHES) == expected
  want = jax.grad(loss(RG.reference, False), (0, 1))(x, gamma)
  for a, b in zip(got, want):
    assert a.dtype == dtype and a.shape == b.shape
    scale = float(jnp.max(jnp.abs(b.astype(jnp.float32))))
    np.testing.assert_allclose(np.float32(a), np.float32(b), rtol=tol,
                               atol=tol * scale)


def test_tpu_fused_rule_is_bitwise_fwd_then_bwd():
  x, gamma = _data(64, 256, jnp.bfloat16)
  grads = []
  for fused in (False, True):
    op, _ = RG.make_rmsnorm_gelu(target="tpu", interpret=True, fused=fused,
                                 tile_bytes=SMALL_TILE)
    grads.append(jax.jit(jax.grad(loss(op, True), (0, 1)))(x, gamma))
  for a, b in zip(*grads):
    assert np.array_equal(np.asarray(a).view(np.uint16),
                          np.asarray(b).view(np.uint16))


@pytest.mark.parametrize("fused,expected", [
    (False, {"rmsnorm_gelu_f": 1, "rmsnorm_gelu_fwd": 1, "rmsnorm_gelu_bwd": 1}),
    (True, {"rmsnorm_gelu_f": 1, "rmsnorm_gelu_fwd_bwd": 1}),
])
@pytest.mark.parametrize("shape", [(8192, 4096), (1000, 700), (16384, 1024)],
                         ids=["benchmark", "ragged", "lm"])
def test_tpu_kernels_lower_for_a_tpu(fused, expected, shape):
  """Mosaic accepts the blocks (whole rows, (M, 1) for r, (1, D) for dgamma:
  no one-row block per step); launches per checkpointed step."""
  op, _ = RG.make_rmsnorm_gelu(target="tpu", interpret=False, fused=fused)
  x = jax.ShapeDtypeStruct(shape, jnp.bfloat16)
  gamma = jax.ShapeDtypeStruct(shape[1:], jnp.bfloat16)
  lowered = jax.jit(jax.grad(loss(op, True), (0, 1))).trace(x, gamma).lower(
      lowering_platforms=("tpu",))
  launches = EX.kernel_launches(lowered.compiler_ir())
  assert {k.name: n for k, n in launches.items()} == expected


@pytest.mark.skipif(jax.default_backend() != "tpu", reason="needs a TPU")
@pytest.mark.parametrize("dtype,tol", [(jnp.float32, 1e-4), (jnp.bfloat16, 5e-2)])
def test_tpu_compiled_values_and_gradients(dtype, tol):
  op, _ = RG.make_rmsnorm_gelu(fused=True)        # Mosaic, the table's tile
  x, gamma = _data(1000, 700, dtype)
  K.assert_grads_close(jax.jit(jax.grad(loss(op, True), (0, 1)))(x, gamma),
                       jax.grad(loss(RG.reference, False), (0, 1))(x, gamma),
                       tol)


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16])
def test_tpu_gelu_forms_agree(dtype):
  """The sigmoid form is the tanh GELU: in bf16 its values and gradients stay
  within the bf16 bound of the tanh form's; f32 keeps the tanh form, so the
  two are bitwise equal there."""
  x, gamma = _data(45, 200, dtype)
  out = {}
  for form in RG.TPU_GELU_FORMS:
    op, _ = RG.make_rmsnorm_gelu(target="tpu", interpret=True, fused=True,
                                 tile_bytes=SMALL_TILE, gelu=form)
    out[form] = (op(x, gamma),
                 *jax.jit(jax.grad(loss(op, True), (0, 1)))(x, gamma))
  for a, b in zip(out["tanh"], out["sigmoid"]):
    if dtype == jnp.float32:
      assert np.array_equal(np.asarray(a), np.asarray(b))
    else:
      scale = float(jnp.max(jnp.abs(a.astype(jnp.float32))))
      np.testing.assert_allclose(np.float32(b), np.float32(a), rtol=5e-2,
                                 atol=5e-2 * scale)
  with pytest.raises(ValueError, match="gelu must be one of"):
    RG.make_rmsnorm_gelu(target="tpu", gelu="erf")


@pytest.mark.parametrize("d", [1024, 2048, 4096, 700])
def test_tpu_config_by_width(d):
  """Row widths in ``TPU_BY_WIDTH`` take its (tile, form); others the
  module defaults; given arguments win."""
  want = RG.TPU_BY_WIDTH.get(d, (RG.TPU_TILE_BYTES, RG.TPU_GELU))
  assert RG._tpu_config(d, None, None) == want
  assert RG._tpu_config(d, 2**20, "tanh") == (2**20, "tanh")
  assert set(RG.TPU_GELU_FORMS) >= {g for _, g in RG.TPU_BY_WIDTH.values()}
