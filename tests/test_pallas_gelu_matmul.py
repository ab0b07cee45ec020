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
import shipped_kernels as SK

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


# -- the TPU kernels (Mosaic): interpret mode here, lowered for a TPU ---------

EX = SK.load_example()      # kernel_launches: Mosaic calls in a lowered module

# tiles small enough that every grid has several steps on each axis
SMALL_TPU_TILES = {"fwd": (16, 128, 128), "dx": (16, 128, 128),
                   "dw": (128, 128, 16)}


@pytest.mark.parametrize("dtype,tol", [(jnp.float32, 1e-5), (jnp.bfloat16, 3e-2)])
@pytest.mark.parametrize("shape,remat,fused", [
    ((48, 256, 384), False, False), ((48, 256, 384), True, True),
    ((37, 200, 150), True, False)],
    ids=["multiple-plain", "multiple-remat-fwd_bwd", "ragged-remat"])
def test_tpu_kernels_values_and_gradients(dtype, tol, shape, remat, fused):
  gm, _ = PG.make_gelu_matmul(target="tpu", interpret=True, fused=fused,
                              tpu_tiles=SMALL_TPU_TILES)
  x, w = data(*shape, dtype)
  np.testing.assert_allclose(np.float32(gm(x, w)), np.float32(PG.reference(x, w)),
                             rtol=tol, atol=tol)
  got = jax.jit(jax.grad(loss(gm, remat), (0, 1)))(x, w)
  want = jax.grad(loss(PG.reference, False), (0, 1))(x, w)
  for a, b in zip(got, want):
    assert a.dtype == dtype and a.shape == b.shape
    scale = float(jnp.max(jnp.abs(b.astype(jnp.float32))))
    np.testing.assert_allclose(np.float32(a), np.float32(b), rtol=tol,
                               atol=tol * scale)


# the shapes of TPU_TILES_BY_SHAPE's entries, scaled down: the forward kernels
# with K in one block (no accumulator), dx over all of K and all of N
WHOLE_K_TILES = {"fwd": (16, 128, 256), "dx": (16, 256, 384),
                 "dw": (256, 128, 16)}


@pytest.mark.parametrize("dtype,tol", [(jnp.float32, 1e-5), (jnp.bfloat16, 3e-2)])
@pytest.mark.parametrize("fused", [False, True])
def test_tpu_kernels_with_whole_k_tiles(dtype, tol, fused):
  gm, _ = PG.make_gelu_matmul(target="tpu", interpret=True, fused=fused,
                              tpu_tiles=WHOLE_K_TILES)
  x, w = data(48, 256, 384, dtype)
  np.testing.assert_allclose(np.float32(gm(x, w)), np.float32(PG.reference(x, w)),
                             rtol=tol, atol=tol)
  K.assert_grads_close(jax.jit(jax.grad(loss(gm, True), (0, 1)))(x, w),
                       jax.grad(loss(PG.reference, False), (0, 1))(x, w), tol)


def test_tpu_fused_rule_is_bitwise_fwd_then_bwd():
  """The fused rule rounds ``y`` to the residual dtype before GELU', so its
  gradients are those of ``fwd`` + ``bwd`` bit for bit (the LM benchmark's
  loss curves rely on it)."""
  x, w = data(64, 256, 256, jnp.bfloat16)
  grads = []
  for fused in (False, True):
    gm, _ = PG.make_gelu_matmul(target="tpu", interpret=True, fused=fused,
                                tpu_tiles=SMALL_TPU_TILES)
    grads.append(jax.jit(jax.grad(loss(gm, True), (0, 1)))(x, w))
  for a, b in zip(*grads):
    assert np.array_equal(np.asarray(a).view(np.uint16),
                          np.asarray(b).view(np.uint16))


@pytest.mark.parametrize("impl,expected", [
    ("jax", {"fwd": 2, "bwd": 2}),
    ("smart", {"f": 1, "fwd": 1, "bwd": 2}),
    ("fused", {"f": 1, "fwd_bwd": 3}),
])
def test_tpu_kernel_launches_interpreted(impl, expected):
  gm, rules = PG.make_gelu_matmul(target="tpu", interpret=True, count=True,
                                  fused=impl == "fused",
                                  tpu_tiles=SMALL_TPU_TILES)
  F = PG.custom_vjp_version(rules) if impl == "jax" else gm
  x, w = data(32, 128, 128, jnp.float32)
  PG.LAUNCHES.clear()
  jax.block_until_ready(jax.jit(jax.grad(loss(F, True), (0, 1)))(x, w))
  jax.effects_barrier()
  assert dict(PG.LAUNCHES) == expected


@pytest.mark.parametrize("impl,expected", [
    ("jax", {"gelu_matmul_fwd": 2, "gelu_matmul_bwd_dx": 1,
             "gelu_matmul_bwd_dw": 1}),
    ("smart", {"gelu_matmul_f": 1, "gelu_matmul_fwd": 1,
               "gelu_matmul_bwd_dx": 1, "gelu_matmul_bwd_dw": 1}),
    ("fused", {"gelu_matmul_f": 1, "gelu_matmul_fused_dy": 1,
               "gelu_matmul_fused_dx": 1, "gelu_matmul_fused_dw": 1}),
])
@pytest.mark.parametrize("shape", [(8192, 4096, 4096), (1000, 700, 900)],
                         ids=["benchmark", "ragged"])
def test_tpu_kernels_lower_for_a_tpu(impl, expected, shape):
  """Mosaic accepts every block at the table's tiles (checked where Pallas
  lowers for a TPU, no TPU needed); launches per checkpointed step."""
  gm, rules = PG.make_gelu_matmul(target="tpu", interpret=False,
                                  fused=impl == "fused")
  F = PG.custom_vjp_version(rules) if impl == "jax" else gm
  m, k, n = shape
  x = jax.ShapeDtypeStruct((m, k), jnp.bfloat16)
  w = jax.ShapeDtypeStruct((k, n), jnp.bfloat16)
  lowered = jax.jit(jax.grad(loss(F, True), (0, 1))).trace(x, w).lower(
      lowering_platforms=("tpu",))
  launches = EX.kernel_launches(lowered.compiler_ir())
  assert {k.name: n for k, n in launches.items()} == expected


def test_target_is_checked():
  with pytest.raises(ValueError, match="target must be 'tpu' or 'gpu'"):
    PG.make_gelu_matmul(target="cuda")


needs_tpu = pytest.mark.skipif(jax.default_backend() != "tpu",
                               reason="needs a TPU")


@needs_tpu
@pytest.mark.parametrize("dtype,tol", [(jnp.float32, 1e-4), (jnp.bfloat16, 3e-2)])
@pytest.mark.parametrize("remat,fused", [(False, False), (True, True)])
def test_tpu_compiled_values_and_gradients(dtype, tol, remat, fused):
  gm, _ = PG.make_gelu_matmul(fused=fused)        # Mosaic, the table's tiles
  x, w = data(1000, 700, 900, dtype)
  with jax.default_matmul_precision("highest"):
    want = jax.grad(loss(PG.reference, False), (0, 1))(x, w)
    ref = PG.reference(x, w)
  np.testing.assert_allclose(np.float32(gm(x, w)), np.float32(ref), rtol=tol,
                             atol=tol)
  got = jax.jit(jax.grad(loss(gm, remat), (0, 1)))(x, w)
  for a, b in zip(got, want):
    scale = float(jnp.max(jnp.abs(b.astype(jnp.float32))))
    np.testing.assert_allclose(np.float32(a), np.float32(b), rtol=tol,
                               atol=tol * scale)


def _tpu_grids(rule_args, **kw):
  """The pallas_call grids of the TPU rules, traced (nothing compiled)."""
  _, rules = PG.make_gelu_matmul(target="tpu", interpret=False, **kw)
  out = {}
  for rule, args in rule_args.items():
    jaxpr = jax.jit(rules[rule]).trace(*args).jaxpr
    out[rule] = [e.params["grid_mapping"].grid for e in jaxpr.eqns
                 if e.primitive.name == "pallas_call"]
  return out


@pytest.mark.parametrize("d", [2048, 1024])
def test_tpu_tiles_by_shape(d):
  """Where ``TPU_TILES_BY_SHAPE`` has ``(K, N)``, its tiles set the grids;
  elsewhere ``TPU_TILES``; ``tpu_tiles=`` overrides both."""
  m = 8192
  x = jax.ShapeDtypeStruct((m, d), jnp.bfloat16)
  w = jax.ShapeDtypeStruct((d, d), jnp.bfloat16)
  tiles = {**PG.TPU_TILES, **PG.TPU_TILES_BY_SHAPE.get((d, d), {})}
  assert ((d, d) in PG.TPU_TILES_BY_SHAPE) == (d == 2048)
  bm, bn, bk = tiles["fwd"]
  dm, dk, dn = tiles["dx"]
  wk, wn, wm = tiles["dw"]
  cdiv = lambda a, b: -(-a // min(a, b))
  grids = _tpu_grids({"f": (x, w), "bwd": ((x, w, x), x)})
  assert grids["f"] == [(cdiv(m, bm), cdiv(d, bn), cdiv(d, bk))]
  assert grids["bwd"] == [(cdiv(m, dm), cdiv(d, dk), cdiv(d, dn)),
                          (cdiv(d, wk), cdiv(d, wn), cdiv(m, wm))]
  forced = _tpu_grids({"f": (x, w)}, tpu_tiles={"fwd": (512, 512, 512)})
  assert forced["f"] == [(m // 512, d // 512, d // 512)]
