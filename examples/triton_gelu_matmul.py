"""Fused matmul + GELU in Triton: ``z = gelu(x @ w)`` through ``jax_triton``.

The same operation as ``pallas_gelu_matmul.py`` (tanh-approximate GELU,
``jax.nn.gelu``'s default), with each kernel written in ``triton.language``
and launched by ``jax_triton.triton_call``, wrapped in ``smart_custom_vjp``.
``x: [M, K]``, ``w: [K, N]``, both f32 or both bf16; every matmul accumulates
in f32 and every GELU is evaluated in f32.

Every kernel computes output tiles of ``block_m x block_n`` (of its own
output: ``z``/``y``/``dy`` are ``M x N``, ``dx`` is ``M x K``, ``dw`` is
``K x N``) and runs a loop over the contracted dimension in chunks of
``block_k``. Shapes need not be multiples of the blocks: loads are masked
(``other=0.0``) and so are stores. Seven kernels, each a separately named
``@triton.jit`` function so that a profiler tells their launches apart:

==========================  =====================  ===========================
kernel                      reads                  writes
==========================  =====================  ===========================
``tgm_f_kernel``            x, w                   z
``tgm_fwd_kernel``          x, w                   z, y (the residual ``x @ w``)
``tgm_dx_kernel``           g, y, w                dx = (g * gelu'(y)) @ w.T
``tgm_dw_kernel``           x, g, y                dw = x.T @ (g * gelu'(y))
``tgm_dy_kernel``           x, w, g                dy = g * gelu'(x @ w)
``tgm_dx_from_dy_kernel``   dy, w                  dx = dy @ w.T
``tgm_dw_from_dy_kernel``   x, dy                  dw = x.T @ dy
==========================  =====================  ===========================

``tgm_dx_kernel``/``tgm_dw_kernel`` compute ``dy`` tile by tile in registers
and never write it; ``tgm_dy_kernel`` recomputes ``y`` tile by tile (a loop
over ``K``) and writes only ``dy``. Which rule launches which kernels is
``KERNELS_PER_RULE``: ``f`` and ``fwd`` one each, ``bwd`` two (dx, dw), the
fused ``fwd_bwd`` three (dy, then dx and dw from it).

Cost per gradient step of ``sum(z**2)`` (``M x K`` times ``K x N``), counting
matmuls of that size and ``M x N`` arrays written to or read from memory
(``z``, ``y``, ``g``, ``dy``):

=====================  ==================================  ===================
path                   matmuls                             M x N arrays moved
=====================  ==================================  ===================
no remat               fwd 1 + dx 1 + dw 1 = 3             fwd writes z, y; dx
                                                           and dw read g, y: 6
remat, jax.custom_vjp  fwd 1 + fwd 1 + dx 1 + dw 1 = 4     fwd writes z, y
                                                           twice; dx, dw read
                                                           g, y: 8
remat, smartvjp        f 1 + fwd 1 + dx 1 + dw 1 = 4       f writes z; fwd z,
                                                           y; dx, dw read g,
                                                           y: 7
remat, smartvjp        f 1 + dy 1 + dx 1 + dw 1 = 4        f writes z; dy reads
+ fwd_bwd                                                  g, writes dy; dx, dw
                                                           read dy: 5
=====================  ==================================  ===================

As in the Pallas example, the fused rule recomputes ``y`` once, in the dy
kernel, so it runs as many matmuls as ``fwd`` + ``bwd`` and moves two fewer
``M x N`` arrays: nothing in the backward pass writes ``y`` or ``z`` (``fwd``
writes ``z`` there although nothing reads it). Its ``dy`` buffer is as large
as the ``y`` it replaces, and it never holds ``z``. Every path launches four
kernels under remat.

``tl.dot`` on f32 inputs uses TF32 by default in Triton; the kernels pass
``input_precision="ieee"`` for f32 unless told otherwise (bf16 ignores it).
IEEE f32 dots run on FMA units, not tensor cores: at the default 128x128x64
tiles (chosen for bf16) they spill registers, at 64x64x32 with 8 warps they
do not. The sizes ``M``, ``N``, ``K`` are constexprs, so each shape compiles
its own kernels (JAX lowers each shape separately anyway); known sizes give
the compiler the rows' alignment, which bf16 loads need to be vectorized and
the loops to be pipelined. Offsets are int32: each array must have fewer
than 2**31 elements.

Written for jax-triton 0.3.1 (``triton_call`` with ``kernel``, ``out_shape``,
``grid``, ``name``, ``num_warps``, ``num_stages`` and constexpr keywords; no
scalar operands), triton 3.6.0 and jax/jaxlib 0.11.2 with the CUDA 13 plugin,
for an H200 (sm_90). So far checked without a GPU only, by
``tools/triton_compile_check.py``: every kernel compiles for sm_90 within the
H200's shared memory, the kernels match a float64 reference in f32 in
Triton's interpreter (``--interpret``), and the gradient exported for CUDA
through jax_triton launches the kernels the tests expect (``--lower``).
``jax_triton`` is imported only when a rule is traced, and the kernels need
only ``triton``: without it the module still imports, and ``available()``
says what is missing.

Run:  python examples/triton_gelu_matmul.py   (on a GPU with jax-triton)
"""

from __future__ import annotations

import math
import time
import types

import jax
import jax.numpy as jnp

from smartvjp import smart_custom_vjp

try:
  import triton
  import triton.language as tl
  _jit = triton.jit
except ImportError:   # the kernels are defined but can never run
  triton = None
  tl = types.SimpleNamespace(constexpr=None)
  _jit = lambda fn: fn   # noqa: E731

KERNELS_PER_RULE = {
    "f": ["tgm_f_kernel"],
    "fwd": ["tgm_fwd_kernel"],
    "bwd": ["tgm_dx_kernel", "tgm_dw_kernel"],
    "fwd_bwd": ["tgm_dy_kernel", "tgm_dx_from_dy_kernel",
                "tgm_dw_from_dy_kernel"],
}
KERNEL_NAMES = [n for names in KERNELS_PER_RULE.values() for n in names]
RULES = ("f", "fwd", "bwd", "fwd_bwd")


# -- GELU in f32 ------------------------------------------------------------------
# 0.5 y (1 + tanh(u)) = y * s with s = sigmoid(2u), u = sqrt(2/pi) (y + 0.044715 y^3),
# written with exp so that it needs no platform library; 1.5957691216057308 is
# 2 sqrt(2/pi) and 0.134145 is 3 * 0.044715. For large |u| exp gives inf or 0
# and s exactly 0 or 1, never a NaN.

@_jit
def _gelu(y):
  s = 1.0 / (1.0 + tl.exp(-1.5957691216057308 * (y + 0.044715 * y * y * y)))
  return y * s


@_jit
def _gelu_grad(y):
  s = 1.0 / (1.0 + tl.exp(-1.5957691216057308 * (y + 0.044715 * y * y * y)))
  return s + y * s * (1.0 - s) * 1.5957691216057308 * (1.0 + 0.134145 * y * y)


# -- tile helpers (inlined into the kernels) --------------------------------------

@_jit
def _xw_tile(x_ptr, w_ptr, rm, rn, M: tl.constexpr, N: tl.constexpr,
             K: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
             BLOCK_K: tl.constexpr, PRECISION: tl.constexpr):
  """f32 tile ``(x @ w)[rm, rn]``, summed over K in chunks of BLOCK_K."""
  acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
  for k0 in range(0, K, BLOCK_K):
    rk = k0 + tl.arange(0, BLOCK_K)
    a = tl.load(x_ptr + rm[:, None] * K + rk[None, :],
                mask=(rm[:, None] < M) & (rk[None, :] < K), other=0.0)
    b = tl.load(w_ptr + rk[:, None] * N + rn[None, :],
                mask=(rk[:, None] < K) & (rn[None, :] < N), other=0.0)
    acc = tl.dot(a, b, acc, input_precision=PRECISION)
  return acc


@_jit
def _dy_tile(g_ptr, y_ptr, rm, rn, M: tl.constexpr, N: tl.constexpr,
             FROM_Y: tl.constexpr):
  """``dy[rm, rn]`` in f32: from g and the residual y when FROM_Y, else
  ``g_ptr`` points at dy itself."""
  mask = (rm[:, None] < M) & (rn[None, :] < N)
  offs = rm[:, None] * N + rn[None, :]
  g = tl.load(g_ptr + offs, mask=mask, other=0.0).to(tl.float32)
  if FROM_Y:
    y = tl.load(y_ptr + offs, mask=mask, other=0.0).to(tl.float32)
    g = g * _gelu_grad(y)
  return g


@_jit
def _dx_tile(g_ptr, y_ptr, w_ptr, M: tl.constexpr, N: tl.constexpr,
             K: tl.constexpr, FROM_Y: tl.constexpr, BLOCK_M: tl.constexpr,
             BLOCK_K: tl.constexpr, BLOCK_N: tl.constexpr,
             PRECISION: tl.constexpr):
  """This program's ``BLOCK_M x BLOCK_K`` tile of ``dy @ w.T``, over N in
  chunks of BLOCK_N; returns it with its row and column indices."""
  rm = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)
  rk = tl.program_id(1) * BLOCK_K + tl.arange(0, BLOCK_K)
  acc = tl.zeros((BLOCK_M, BLOCK_K), dtype=tl.float32)
  for n0 in range(0, N, BLOCK_N):
    rn = n0 + tl.arange(0, BLOCK_N)
    wt = tl.load(w_ptr + rk[None, :] * N + rn[:, None],      # (w.T)[rn, rk]
                 mask=(rn[:, None] < N) & (rk[None, :] < K), other=0.0)
    dy = _dy_tile(g_ptr, y_ptr, rm, rn, M, N, FROM_Y)
    acc = tl.dot(dy.to(wt.dtype), wt, acc, input_precision=PRECISION)
  return acc, rm, rk


@_jit
def _dw_tile(x_ptr, g_ptr, y_ptr, M: tl.constexpr, N: tl.constexpr,
             K: tl.constexpr, FROM_Y: tl.constexpr, BLOCK_K: tl.constexpr,
             BLOCK_N: tl.constexpr, BLOCK_M: tl.constexpr,
             PRECISION: tl.constexpr):
  """This program's ``BLOCK_K x BLOCK_N`` tile of ``x.T @ dy``, over M in
  chunks of BLOCK_M; returns it with its row and column indices."""
  rk = tl.program_id(0) * BLOCK_K + tl.arange(0, BLOCK_K)
  rn = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
  acc = tl.zeros((BLOCK_K, BLOCK_N), dtype=tl.float32)
  for m0 in range(0, M, BLOCK_M):
    rm = m0 + tl.arange(0, BLOCK_M)
    xt = tl.load(x_ptr + rm[None, :] * K + rk[:, None],      # (x.T)[rk, rm]
                 mask=(rk[:, None] < K) & (rm[None, :] < M), other=0.0)
    dy = _dy_tile(g_ptr, y_ptr, rm, rn, M, N, FROM_Y)
    acc = tl.dot(xt, dy.to(xt.dtype), acc, input_precision=PRECISION)
  return acc, rk, rn


@_jit
def _store(ptr, tile, rows, cols, n_rows: tl.constexpr, n_cols: tl.constexpr):
  mask = (rows[:, None] < n_rows) & (cols[None, :] < n_cols)
  tl.store(ptr + rows[:, None] * n_cols + cols[None, :],
           tile.to(ptr.dtype.element_ty), mask=mask)


# -- kernels ----------------------------------------------------------------------
# Argument order is jax_triton's: the arrays passed to triton_call, then the
# outputs, then the constexprs (keywords of triton_call, matched by name;
# the sizes M, N, K among them, see the module docstring).

@_jit
def tgm_f_kernel(x_ptr, w_ptr, z_ptr, M: tl.constexpr, N: tl.constexpr,
                 K: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                 BLOCK_K: tl.constexpr, PRECISION: tl.constexpr):
  rm = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)
  rn = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
  y = _xw_tile(x_ptr, w_ptr, rm, rn, M, N, K, BLOCK_M, BLOCK_N, BLOCK_K,
               PRECISION)
  _store(z_ptr, _gelu(y), rm, rn, M, N)


@_jit
def tgm_fwd_kernel(x_ptr, w_ptr, z_ptr, y_ptr, M: tl.constexpr,
                   N: tl.constexpr, K: tl.constexpr, BLOCK_M: tl.constexpr,
                   BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
                   PRECISION: tl.constexpr):
  rm = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)
  rn = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
  y = _xw_tile(x_ptr, w_ptr, rm, rn, M, N, K, BLOCK_M, BLOCK_N, BLOCK_K,
               PRECISION)
  _store(z_ptr, _gelu(y), rm, rn, M, N)
  _store(y_ptr, y, rm, rn, M, N)


@_jit
def tgm_dy_kernel(x_ptr, w_ptr, g_ptr, dy_ptr, M: tl.constexpr,
                  N: tl.constexpr, K: tl.constexpr, BLOCK_M: tl.constexpr,
                  BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
                  PRECISION: tl.constexpr):
  rm = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)
  rn = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
  y = _xw_tile(x_ptr, w_ptr, rm, rn, M, N, K, BLOCK_M, BLOCK_N, BLOCK_K,
               PRECISION)
  g = tl.load(g_ptr + rm[:, None] * N + rn[None, :],
              mask=(rm[:, None] < M) & (rn[None, :] < N), other=0.0)
  _store(dy_ptr, g.to(tl.float32) * _gelu_grad(y), rm, rn, M, N)


@_jit
def tgm_dx_kernel(g_ptr, y_ptr, w_ptr, dx_ptr, M: tl.constexpr,
                  N: tl.constexpr, K: tl.constexpr, BLOCK_M: tl.constexpr,
                  BLOCK_K: tl.constexpr, BLOCK_N: tl.constexpr,
                  PRECISION: tl.constexpr):
  acc, rm, rk = _dx_tile(g_ptr, y_ptr, w_ptr, M, N, K, True, BLOCK_M, BLOCK_K,
                         BLOCK_N, PRECISION)
  _store(dx_ptr, acc, rm, rk, M, K)


@_jit
def tgm_dx_from_dy_kernel(dy_ptr, w_ptr, dx_ptr, M: tl.constexpr,
                          N: tl.constexpr, K: tl.constexpr,
                          BLOCK_M: tl.constexpr, BLOCK_K: tl.constexpr,
                          BLOCK_N: tl.constexpr, PRECISION: tl.constexpr):
  acc, rm, rk = _dx_tile(dy_ptr, dy_ptr, w_ptr, M, N, K, False, BLOCK_M,
                         BLOCK_K, BLOCK_N, PRECISION)
  _store(dx_ptr, acc, rm, rk, M, K)


@_jit
def tgm_dw_kernel(x_ptr, g_ptr, y_ptr, dw_ptr, M: tl.constexpr,
                  N: tl.constexpr, K: tl.constexpr, BLOCK_K: tl.constexpr,
                  BLOCK_N: tl.constexpr, BLOCK_M: tl.constexpr,
                  PRECISION: tl.constexpr):
  acc, rk, rn = _dw_tile(x_ptr, g_ptr, y_ptr, M, N, K, True, BLOCK_K, BLOCK_N,
                         BLOCK_M, PRECISION)
  _store(dw_ptr, acc, rk, rn, K, N)


@_jit
def tgm_dw_from_dy_kernel(x_ptr, dy_ptr, dw_ptr, M: tl.constexpr,
                          N: tl.constexpr, K: tl.constexpr,
                          BLOCK_K: tl.constexpr, BLOCK_N: tl.constexpr,
                          BLOCK_M: tl.constexpr, PRECISION: tl.constexpr):
  acc, rk, rn = _dw_tile(x_ptr, dy_ptr, dy_ptr, M, N, K, False, BLOCK_K,
                         BLOCK_N, BLOCK_M, PRECISION)
  _store(dw_ptr, acc, rk, rn, K, N)


KERNELS = {name: globals()[name] for name in KERNEL_NAMES}

# For each kernel: the dimensions of its output tile (rows, columns) and the
# one it loops over, named as in x: [M, K], w: [K, N].
KERNEL_DIMS = {
    "tgm_f_kernel": ("M", "N", "K"),
    "tgm_fwd_kernel": ("M", "N", "K"),
    "tgm_dy_kernel": ("M", "N", "K"),
    "tgm_dx_kernel": ("M", "K", "N"),
    "tgm_dx_from_dy_kernel": ("M", "K", "N"),
    "tgm_dw_kernel": ("K", "N", "M"),
    "tgm_dw_from_dy_kernel": ("K", "N", "M"),
}


def launch_params(name, shape, dtype, block_m=128, block_n=128, block_k=64,
                  input_precision="ieee"):
  """``(grid, constexprs)`` of kernel ``name`` for ``shape = (M, K, N)``.

  The output tile is ``block_m x block_n`` and the loop chunk ``block_k``;
  where a dimension is smaller than its block, the block shrinks to the
  smallest power of two >= 16 that covers it.
  """
  sizes = dict(zip("MKN", shape))
  rows, cols, loop = KERNEL_DIMS[name]
  fit = lambda b, d: max(16, min(b, 1 << max(0, d - 1).bit_length()))  # noqa: E731
  br, bc, bl = fit(block_m, sizes[rows]), fit(block_n, sizes[cols]), fit(
      block_k, sizes[loop])
  grid = (-(-sizes[rows] // br), -(-sizes[cols] // bc))
  precision = input_precision if jnp.dtype(dtype) == jnp.float32 else "ieee"
  consts = {**sizes, f"BLOCK_{rows}": br, f"BLOCK_{cols}": bc,
            f"BLOCK_{loop}": bl, "PRECISION": precision}
  return grid, consts


def _jax_triton():
  import jax_triton   # imported here: the kernels need only triton
  return jax_triton


def available():
  """``(True, versions)`` where the kernels can run here, else ``(False,
  what is missing)``: a GPU, triton and jax_triton."""
  missing = []
  if jax.default_backend() != "gpu":
    missing.append(f"a GPU (JAX's default backend is {jax.default_backend()})")
  if triton is None:
    missing.append("triton (not installed)")
  try:
    jt = _jax_triton()
  except Exception as e:   # jax_triton raises ImportError without GPU jaxlib
    missing.append(f"jax_triton ({type(e).__name__}: "
                   f"{str(e).splitlines()[0] if str(e) else ''})")
  if missing:
    return False, "missing " + "; ".join(missing)
  return True, (f"jax_triton {jt.__version__}, triton {triton.__version__}, "
                f"jax {jax.__version__}")


# -- the smart_custom_vjp -----------------------------------------------------

def make_gelu_matmul(block_m=128, block_n=128, block_k=64, num_warps=8,
                     num_stages=3, fused=True, residual_dtype=None,
                     input_precision="ieee"):
  """``gelu_matmul(x, w) -> gelu(x @ w)`` as a ``smart_custom_vjp``.

  Args:
    block_m, block_n: output tile of every kernel (powers of two >= 16).
    block_k: chunk of each kernel's loop over its contracted dimension.
    num_warps, num_stages: Triton launch and pipelining parameters.
    fused: also define the fused ``fwd_bwd`` rule.
    residual_dtype: dtype of the residual ``y`` (default: ``x``'s dtype).
    input_precision: ``tl.dot``'s precision for f32 inputs ("ieee",
      "tf32" or "tf32x3"); bf16 inputs ignore it.

  Returns:
    ``(gelu_matmul, rules)`` where ``rules`` holds the four rule functions.
    ``x: [M, K]``, ``w: [K, N]``, same float dtype; result ``[M, N]``.
  """
  for b in (block_m, block_n, block_k):
    if b < 16 or b & (b - 1):
      raise ValueError(f"blocks must be powers of two >= 16, got {b}")

  def call(name, x, w, *args, out):
    (m, k), n = x.shape, w.shape[1]
    if x.dtype != w.dtype or x.dtype not in (jnp.float32, jnp.bfloat16):
      raise TypeError(f"x and w must be both float32 or both bfloat16, got "
                      f"{x.dtype} and {w.dtype}")
    grid, consts = launch_params(name, (m, k, n), x.dtype, block_m, block_n,
                                 block_k, input_precision)
    return _jax_triton().triton_call(
        *args, kernel=KERNELS[name], out_shape=out, grid=grid,
        name=name, num_warps=num_warps, num_stages=num_stages, **consts)

  def shape(a, rows, cols, dtype=None):
    return jax.ShapeDtypeStruct((rows, cols), dtype or a.dtype)

  def f(x, w):
    m, n = x.shape[0], w.shape[1]
    return call("tgm_f_kernel", x, w, x, w, out=shape(x, m, n))

  def fwd(x, w):
    m, n = x.shape[0], w.shape[1]
    z, y = call("tgm_fwd_kernel", x, w, x, w,
                out=[shape(x, m, n), shape(x, m, n, residual_dtype)])
    return z, (x, w, y)

  def bwd(res, g):
    x, w, y = res
    dx = call("tgm_dx_kernel", x, w, g, y, w, out=shape(x, *x.shape))
    dw = call("tgm_dw_kernel", x, w, x, g, y, out=shape(w, *w.shape))
    return dx, dw

  def fwd_bwd(x, w, g):
    m, n = x.shape[0], w.shape[1]
    dy = call("tgm_dy_kernel", x, w, x, w, g, out=shape(x, m, n))
    dx = call("tgm_dx_from_dy_kernel", x, w, dy, w, out=shape(x, *x.shape))
    dw = call("tgm_dw_from_dy_kernel", x, w, x, dy, out=shape(w, *w.shape))
    return dx, dw

  gelu_matmul = smart_custom_vjp(f)
  gelu_matmul.defvjp(fwd, bwd, fwd_bwd=fwd_bwd if fused else None)
  return gelu_matmul, dict(f=f, fwd=fwd, bwd=bwd, fwd_bwd=fwd_bwd)


def reference(x, w):
  """``jax.nn.gelu(x @ w)``, the matmul at full f32 precision (JAX's default
  on a GPU would use TF32 for f32)."""
  return jax.nn.gelu(jnp.matmul(x, w, precision=jax.lax.Precision.HIGHEST))


def custom_vjp_version(rules, optimize_remat=False):
  """The same kernels under ``jax.custom_vjp`` (for side-by-side runs)."""
  F = jax.custom_vjp(rules["f"])
  F.defvjp(rules["fwd"], rules["bwd"], optimize_remat=optimize_remat)
  return F


def _loss(F, remat):
  G = jax.checkpoint(F) if remat else F
  return lambda x, w: jnp.sum(G(x, w).astype(jnp.float32) ** 2)


def _max_rel(got, want):
  return max(float(jnp.max(jnp.abs(a.astype(jnp.float32) - b.astype(jnp.float32)))
                   / (jnp.max(jnp.abs(b.astype(jnp.float32))) + 1e-9))
             for a, b in zip(got, want))


def main():
  t0 = time.perf_counter()
  ok, why = available()
  if not ok:
    print(f"Triton matmul+GELU (jax_triton.triton_call): not run here, {why}. "
          "It needs a GPU and jax-triton (pip install -e '.[triton]').")
    print("\nWhat to conclude: nothing was measured on this machine; "
          "python examples/pallas_gelu_matmul.py shows the same schedule "
          "(f forward, the fused rule backward) with the same kernel in "
          "Pallas, on any machine.")
    print(f"Finished in {time.perf_counter() - t0:.1f} s.")
    return
  print(f"Triton matmul+GELU (jax_triton.triton_call) on "
        f"{jax.devices()[0].device_kind}; {why}\n")
  print("Accuracy against the plain-JAX reference jax.nn.gelu(x @ w) (its matmul "
        "at HIGHEST precision) and")
  print("gradients of sum(z**2) against jax.grad of it, each as max |ours - "
        "reference| / max |reference|")
  print("(gradient: the larger of dx's and dw's), plain and under jax.checkpoint, "
        "without and with fwd_bwd.")
  print(f"  {'dtype':8s} {'tiles':10s} {'x @ w':18s} {'output':>8s}  "
        f"{'gradient: plain / remat':>23s}  {'fused: plain / remat':>20s}"
        "  tolerance")
  small = dict(block_m=32, block_n=32, block_k=16, num_warps=4, num_stages=2)
  verdicts = []
  cases = [(dict(), "128x128x64", (300, 200, 170)),
           (small, "32x32x16", (50, 37, 45)),
           (small, "32x32x16", (64, 32, 96))]
  for dtype, tol in ((jnp.float32, 2e-5), (jnp.bfloat16, 3e-2)):
    for blocks, tiles, (m, k, n) in cases:
      kx, kw = jax.random.split(jax.random.key(0))
      x = jax.random.normal(kx, (m, k), dtype)
      w = (jax.random.normal(kw, (k, n)) / math.sqrt(k)).astype(dtype)
      want = jax.grad(_loss(reference, False), (0, 1))(x, w)
      errs = []
      for fused in (False, True):
        gm, _ = make_gelu_matmul(fused=fused, **blocks)
        if not fused:
          err = _max_rel([gm(x, w)], [reference(x, w)])
        for remat in (False, True):
          got = jax.jit(jax.grad(_loss(gm, remat), (0, 1)))(x, w)
          errs.append(_max_rel(got, want))
      verdict = "ok" if max(errs + [err]) < tol else "TOO LARGE"
      verdicts.append(verdict == "ok")
      shape = f"{m}x{k} @ {k}x{n}"
      print(f"  {jnp.dtype(dtype).name:8s} {tiles:10s} {shape:18s} {err:8.1e}  "
            f"{errs[0]:15.1e} / {errs[1]:.1e}  {errs[2]:12.1e} / {errs[3]:.1e}"
            f"  {tol:.0e} {verdict}")

  print("\nKernels launched per rule call (KERNELS_PER_RULE): "
        + "; ".join(f"{r}: {', '.join(KERNELS_PER_RULE[r])}" for r in RULES))
  print("Per checkpointed gradient step: jax.custom_vjp launches fwd twice + dx "
        "+ dw, smartvjp f + fwd + dx + dw,")
  print("smartvjp with fwd_bwd f + dy + dx_from_dy + dw_from_dy (four matmuls "
        "each; the fused path moves 5 M x N")
  print("arrays instead of 7; tests/test_triton_gelu_matmul.py counts the "
        "launches with the JAX profiler).")
  print("\nWhat to conclude: " + (
      f"all {len(verdicts)} cases are within their tolerance" if all(verdicts)
      else f"{verdicts.count(False)} of {len(verdicts)} cases are TOO LARGE")
      + ": Triton kernels launched by jax_triton work as smartvjp rules,\n"
      "plain and under jax.checkpoint, with the fused fwd_bwd saving the "
      "residual writes of fwd in the backward pass.")
  print(f"Finished in {time.perf_counter() - t0:.1f} s.")


if __name__ == "__main__":
  main()
