"""Seed 000 (jax-ml/jax#21303) on its own platform, a CUDA GPU: the Pallas
examples through Triton under ``jax.checkpoint``, as written
(``jax.custom_vjp``), with ``optimize_remat=True``, and swapped (smartvjp,
with and without the fused ``fwd_bwd``).

* launches per step, counted on the device by the profiler
  (``kernels.gpu_kernel_launches``), equal the program's lowered counts
  (``examples/pallas_ops_transformer.py``'s counter), kernel by kernel;
  for the schedules ``tests/test_gpu_lowering.py`` tabulates, also that table;
* values and gradients of every schedule against plain JAX, in bf16 and f32.

GPU only: every test is named ``test_gpu_*`` (``tools/gpu_session.py``
selects them with ``-k test_gpu_``) and skips without a GPU. The lowering
half runs on a CPU in ``tests/test_gpu_lowering.py``.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import kernels as K
import shipped_kernels as SK
from test_gpu_lowering import PG, RG

pytestmark = [
    pytest.mark.skipif(jax.default_backend() != "gpu", reason="needs a GPU"),
    pytest.mark.filterwarnings("ignore::DeprecationWarning")]

EX = SK.load_example()
IMPLS = ("jax.custom_vjp", "optimize_remat", "smartvjp", "smartvjp+fused")
# per-rule launches of one checkpointed call, lowered (test_gpu_lowering.py)
TABLE = {
    "gelu_matmul": {"jax.custom_vjp": {"fwd": 2, "bwd": 2},
                    "smartvjp": {"f": 1, "fwd": 1, "bwd": 2},
                    "smartvjp+fused": {"f": 1, "fwd_bwd": 3}},
    "rmsnorm_gelu": {"jax.custom_vjp": {"fwd": 2, "bwd": 1},
                     "smartvjp": {"f": 1, "fwd": 1, "bwd": 1},
                     "smartvjp+fused": {"f": 1, "fwd_bwd": 1}},
}
EXAMPLES = {"gelu_matmul": PG, "rmsnorm_gelu": RG}
TOL = {jnp.float32: 1e-4, jnp.bfloat16: 3e-2}


def build(example, impl):
  """The example's op as ``impl`` writes it."""
  fused = impl == "smartvjp+fused"
  if example == "gelu_matmul":
    op, rules = PG.make_gelu_matmul(interpret=False, fused=fused)
  else:
    op, rules = RG.make_rmsnorm_gelu(interpret=False, fused=fused)
  if impl in ("jax.custom_vjp", "optimize_remat"):
    op = jax.custom_vjp(rules["f"])
    op.defvjp(rules["fwd"], rules["bwd"],
              optimize_remat=impl == "optimize_remat")
  return op


def data(example, dtype, ragged=False):
  if example == "gelu_matmul":
    return K.matmul_data(*((200, 72, 136) if ragged else (256, 128, 256)),
                         dtype)
  m, d = (45, 200) if ragged else (256, 512)
  x = jax.random.normal(jax.random.key(0), (m, d), dtype)
  gamma = (1.0 + 0.1 * jax.random.normal(jax.random.key(1), (d,))).astype(dtype)
  return x, gamma


def loss(F):
  return K.square_loss(F, remat=True)


@pytest.mark.parametrize("impl", IMPLS)
@pytest.mark.parametrize("example", list(EXAMPLES))
def test_gpu_launches_on_the_device_equal_the_lowered_counts(example, impl):
  F = build(example, impl)
  args = data(example, jnp.bfloat16)
  step = jax.jit(jax.value_and_grad(loss(F), (0, 1)))
  lowered = {}
  for kernel, n in EX.kernel_launches(EX.lower_for_gpu(step, *args)).items():
    lowered[kernel.name] = lowered.get(kernel.name, 0) + n
  names = [n for ns in EXAMPLES[example].KERNEL_NAMES.values() for n in ns]
  on_device = K.gpu_kernel_launches(step, *args, names=names)
  assert on_device == {n: lowered.get(n, 0) for n in names}
  if impl in TABLE[example]:
    assert K.per_rule(on_device, EXAMPLES[example].KERNEL_NAMES) == (
        TABLE[example][impl])


@pytest.mark.parametrize("ragged", [False, True], ids=["multiple", "ragged"])
@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16],
                         ids=["f32", "bf16"])
@pytest.mark.parametrize("impl", IMPLS)
@pytest.mark.parametrize("example", list(EXAMPLES))
def test_gpu_values_and_gradients(example, impl, dtype, ragged):
  F = build(example, impl)
  ref = EXAMPLES[example].reference
  args = data(example, dtype, ragged)
  tol = TOL[dtype]
  np.testing.assert_allclose(np.float32(jax.jit(F)(*args)),
                             np.float32(ref(*args)), rtol=tol, atol=tol)
  got = jax.jit(jax.grad(loss(F), (0, 1)))(*args)
  want = jax.jit(jax.grad(K.square_loss(ref, False), (0, 1)))(*args)
  for a, b in zip(got, want, strict=True):
    assert a.dtype == dtype
  K.assert_grads_close(got, want, tol)
