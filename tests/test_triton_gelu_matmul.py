"""The Triton (jax_triton) matmul+GELU example on a GPU: values and gradients
against jax.nn.gelu(x @ w) in f32 and bf16, ragged and block-multiple shapes,
plain and under jax.checkpoint, with and without fwd_bwd; and the kernels each
schedule launches per gradient step, counted with the JAX profiler.

Skipped without a GPU, triton or jax_triton. Without a GPU,
``tools/triton_compile_check.py`` compiles the kernels for sm_90, runs them
in Triton's interpreter (``--interpret``) and counts them in the exported
gradient (``--lower``)."""

import importlib.util
import os

import jax
import jax.numpy as jnp
import numpy as np
import pytest

pytestmark = pytest.mark.skipif(jax.default_backend() != "gpu",
                                reason="needs a GPU")
pytest.importorskip("triton")
try:   # on a CPU-only jaxlib jax_triton raises ImportError, which newer
  import jax_triton  # noqa: F401   pytest's importorskip does not skip
except ImportError as e:
  pytest.skip(f"jax_triton cannot be imported: {e}", allow_module_level=True)

import kernels as K  # noqa: E402

PATH = os.path.join(os.path.dirname(__file__), os.pardir, "examples",
                    "triton_gelu_matmul.py")
spec = importlib.util.spec_from_file_location("triton_gelu_matmul", PATH)
TG = importlib.util.module_from_spec(spec)
spec.loader.exec_module(TG)

SMALL = dict(block_m=32, block_n=32, block_k=16, num_warps=4, num_stages=2)
BENCH = dict()   # make_gelu_matmul's defaults: 128 x 128 x 64, 8 warps, 3 stages


data, loss = K.matmul_data, K.square_loss


def close(got, want, tol):
  scale = float(jnp.max(jnp.abs(want.astype(jnp.float32))))
  np.testing.assert_allclose(np.float32(got), np.float32(want), rtol=tol,
                             atol=tol * scale)


# f32: tl.dot runs in IEEE f32 (input_precision="ieee") and the reference's
# matmul at HIGHEST, so the errors are f32 rounding (~1e-6 relative); TF32
# on either side would be ~1e-3.
@pytest.mark.parametrize("dtype,tol", [(jnp.float32, 2e-5), (jnp.bfloat16, 3e-2)],
                         ids=["f32", "bf16"])
@pytest.mark.parametrize("blocks,shape", [
    (SMALL, (50, 37, 45)), (SMALL, (21, 7, 13)), (BENCH, (256, 128, 384)),
    (BENCH, (300, 200, 170))],
    ids=["small-ragged", "small-tiny", "bench-multiple", "bench-ragged"])
# Each case compiles its own kernels (sizes are constexprs): three schedules,
# not all four combinations, keep the GPU session's compile time down.
@pytest.mark.parametrize("remat,fused", [(False, False), (True, False),
                                         (True, True)],
                         ids=["plain", "remat", "remat-fwd_bwd"])
def test_values_and_gradients(dtype, tol, blocks, shape, remat, fused):
  gm, _ = TG.make_gelu_matmul(fused=fused, **blocks)
  x, w = data(*shape, dtype)
  z = gm(x, w)
  assert z.dtype == dtype and z.shape == (shape[0], shape[2])
  close(z, TG.reference(x, w), tol)
  got = jax.jit(jax.grad(loss(gm, remat), (0, 1)))(x, w)
  want = jax.grad(loss(TG.reference, False), (0, 1))(x, w)
  for a, b in zip(got, want):
    assert a.dtype == dtype and a.shape == b.shape
    close(a, b, tol)


def test_residual_dtype_f32_with_bf16_inputs():
  gm, rules = TG.make_gelu_matmul(residual_dtype=jnp.float32, **SMALL)
  x, w = data(50, 37, 45, jnp.bfloat16)
  _, (_, _, y) = rules["fwd"](x, w)
  assert y.dtype == jnp.float32
  np.testing.assert_allclose(
      np.float32(y), np.float32(x) @ np.float32(w), rtol=1e-5, atol=1e-5)
  got = jax.jit(jax.grad(loss(gm, True), (0, 1)))(x, w)
  want = jax.grad(loss(TG.reference, False), (0, 1))(x, w)
  for a, b in zip(got, want):
    close(a, b, 3e-2)


# Kernel launches per jitted gradient step, by kernel name (the profiler's
# GPU kernel names are the @triton.jit functions' names).
@pytest.mark.parametrize("impl,remat,expected", [
    ("jax", True, {"tgm_fwd_kernel": 2, "tgm_dx_kernel": 1, "tgm_dw_kernel": 1}),
    ("smart", True, {"tgm_f_kernel": 1, "tgm_fwd_kernel": 1, "tgm_dx_kernel": 1,
                     "tgm_dw_kernel": 1}),
    ("fused", True, {"tgm_f_kernel": 1, "tgm_dy_kernel": 1,
                     "tgm_dx_from_dy_kernel": 1, "tgm_dw_from_dy_kernel": 1}),
    ("jax", False, {"tgm_fwd_kernel": 1, "tgm_dx_kernel": 1, "tgm_dw_kernel": 1}),
    ("smart", False, {"tgm_fwd_kernel": 1, "tgm_dx_kernel": 1, "tgm_dw_kernel": 1}),
    ("fused", False, {"tgm_fwd_kernel": 1, "tgm_dx_kernel": 1, "tgm_dw_kernel": 1}),
])
def test_kernel_launches(impl, remat, expected):
  gm, rules = TG.make_gelu_matmul(fused=impl == "fused", **SMALL)
  F = TG.custom_vjp_version(rules) if impl == "jax" else gm
  x, w = data(64, 32, 96, jnp.bfloat16)
  step = jax.jit(jax.grad(loss(F, remat), (0, 1)))
  counts = K.gpu_kernel_launches(step, x, w, names=TG.KERNEL_NAMES)
  assert {k: v for k, v in counts.items() if v} == expected


def test_kernel_names_are_unambiguous():
  # the launch counter matches substrings: no name may contain another
  names = TG.KERNEL_NAMES
  assert len(set(names)) == len(names) == 7
  for a in names:
    assert TG.KERNELS[a].__name__ == a
    for b in names:
      assert a == b or a not in b, (a, b)
