"""The Pallas matmul+GELU example: values and gradients against
jax.nn.gelu(x @ w) in f32 and bf16, block-multiple and ragged shapes, and
kernel launches (a callback in each kernel in interpret mode, the profiler
on a GPU)."""

import importlib.util
import os

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import kernels as K

PATH = os.path.join(os.path.dirname(__file__), os.pardir, "examples",
                    "pallas_gelu_matmul.py")
spec = importlib.util.spec_from_file_location("pallas_gelu_matmul", PATH)
PG = importlib.util.module_from_spec(spec)
spec.loader.exec_module(PG)


data, loss = K.matmul_data, K.square_loss


@pytest.mark.parametrize("dtype,tol", [(jnp.float32, 1e-5), (jnp.bfloat16, 3e-2)])
@pytest.mark.parametrize("shape", [(32, 16, 24), (21, 7, 13)], ids=["multiple", "ragged"])
@pytest.mark.parametrize("remat", [False, True], ids=["plain", "remat"])
@pytest.mark.parametrize("fused", [False, True], ids=["fwd_bwd_off", "fwd_bwd_on"])
def test_values_and_gradients(dtype, tol, shape, remat, fused):
  gm, _ = PG.make_gelu_matmul(block_m=8, block_n=8, fused=fused,
                              interpret=True)
  x, w = data(*shape, dtype)
  np.testing.assert_allclose(np.float32(gm(x, w)), np.float32(PG.reference(x, w)),
                             rtol=tol, atol=tol)
  got = jax.jit(jax.grad(loss(gm, remat), (0, 1)))(x, w)
  want = jax.grad(loss(PG.reference, False), (0, 1))(x, w)
  for a, b in zip(got, want):
    assert a.dtype == dtype
    scale = float(jnp.max(jnp.abs(b.astype(jnp.float32))))
    np.testing.assert_allclose(np.float32(a), np.float32(b), rtol=tol,
                               atol=tol * scale)


@pytest.mark.parametrize("impl,remat,expected", [
    ("jax", True, {"fwd": 2, "bwd": 2}),
    ("smart", True, {"f": 1, "fwd": 1, "bwd": 2}),
    ("fused", True, {"f": 1, "fwd_bwd": 3}),
    ("smart", False, {"fwd": 1, "bwd": 2}),
    ("fused", False, {"fwd": 1, "bwd": 2}),
])
def test_kernel_launches(impl, remat, expected):
  gm, rules = PG.make_gelu_matmul(block_m=8, block_n=8, count=True,
                                  fused=impl == "fused", interpret=True)
  F = PG.custom_vjp_version(rules) if impl == "jax" else gm
  x, w = data(16, 8, 16, jnp.float32)
  PG.LAUNCHES.clear()
  jax.block_until_ready(jax.jit(jax.grad(loss(F, remat), (0, 1)))(x, w))
  jax.effects_barrier()
  assert dict(PG.LAUNCHES) == expected


# -- on a GPU: the kernels lowered through Pallas' Triton backend -------------

needs_gpu = pytest.mark.skipif(jax.default_backend() != "gpu",
                               reason="needs a GPU")


@needs_gpu
@pytest.mark.parametrize("dtype,tol", [(jnp.float32, 1e-4), (jnp.bfloat16, 3e-2)])
@pytest.mark.parametrize("shape", [(256, 128, 192), (200, 72, 136)],
                         ids=["multiple", "ragged"])
# Three schedules (not all four combinations) keep a GPU session's compile
# time down; the fused rule matters only under remat.
@pytest.mark.parametrize("remat,fused", [(False, False), (True, False),
                                         (True, True)],
                         ids=["plain", "remat", "remat-fwd_bwd"])
def test_gpu_values_and_gradients(dtype, tol, shape, remat, fused):
  gm, _ = PG.make_gelu_matmul(block_m=64, block_n=64, block_k=32,
                              interpret=False, fused=fused)
  x, w = data(*shape, dtype)
  np.testing.assert_allclose(np.float32(gm(x, w)),
                             np.float32(PG.reference(x, w)), rtol=tol, atol=tol)
  got = jax.jit(jax.grad(loss(gm, remat), (0, 1)))(x, w)
  want = jax.jit(jax.grad(loss(PG.reference, False), (0, 1)))(x, w)
  for a, b in zip(got, want):   # reference: f32 matmuls at HIGHEST (not TF32)
    assert a.dtype == dtype
    scale = float(jnp.max(jnp.abs(b.astype(jnp.float32))))
    np.testing.assert_allclose(np.float32(a), np.float32(b), rtol=tol,
                               atol=tol * scale)


@needs_gpu
@pytest.mark.parametrize("impl,remat,expected", [
    ("jax", True, {"fwd": 2, "bwd": 2}),
    ("smart", True, {"f": 1, "fwd": 1, "bwd": 2}),
    ("fused", True, {"f": 1, "fwd_bwd": 3}),
    ("jax", False, {"fwd": 1, "bwd": 2}),
    ("smart", False, {"fwd": 1, "bwd": 2}),
])
def test_gpu_kernel_launches(impl, remat, expected):
  """Launches at run time, from the profiler, for one jitted
  ``value_and_grad`` step (the loss is used, as in training)."""
  gm, rules = PG.make_gelu_matmul(interpret=False, fused=impl == "fused")
  F = PG.custom_vjp_version(rules) if impl == "jax" else gm
  x, w = data(256, 128, 256, jnp.bfloat16)
  step = jax.jit(jax.value_and_grad(loss(F, remat), (0, 1)))
  assert K.gpu_rule_launches(step, x, w,
                             kernel_names=PG.KERNEL_NAMES) == expected


@needs_gpu
def test_gpu_kernel_launches_in_a_scan():
  """Four checkpointed layers in a ``scan``: launches scale with the layers
  (a compiled-HLO count would see one layer)."""
  gm, rules = PG.make_gelu_matmul(interpret=False, fused=False)
  x, _ = data(128, 128, 128, jnp.bfloat16)
  ws = jax.random.normal(jax.random.key(4), (4, 128, 128), jnp.bfloat16) / 12

  def stack(F):
    def total(x, ws):
      y, _ = jax.lax.scan(lambda h, w: (jax.checkpoint(F)(h, w), None), x, ws)
      return jnp.sum(y.astype(jnp.float32) ** 2)
    return jax.jit(jax.value_and_grad(total, (0, 1)))
  smart = K.gpu_rule_launches(stack(gm), x, ws, kernel_names=PG.KERNEL_NAMES)
  plain = K.gpu_rule_launches(stack(PG.custom_vjp_version(rules)), x, ws,
                              kernel_names=PG.KERNEL_NAMES)
  assert smart == {"f": 4, "fwd": 4, "bwd": 8}
  assert plain == {"fwd": 8, "bwd": 8}
