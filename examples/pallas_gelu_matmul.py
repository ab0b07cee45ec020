"""Fused matmul + GELU in Pallas: ``z = gelu(x @ w)``, the kernel of the seed.

The seed (seed 000) is jax-ml/jax#21303, the report this project answers:
under ``jax.remat`` a ``jax.custom_vjp`` runs ``fwd`` twice. In that thread
this kernel is the concrete case: for inference it writes ``z`` only, for
training ``y`` and ``z``.

``x: [M, K]``, ``w: [K, N]``, f32 or bf16, accumulated in f32. Every kernel
works on ``block_m x block_n`` (or ``block_k``) tiles and loops over the
contracted dimension inside the kernel, so the tiles stay the same size at
any ``K`` (a GPU's shared memory and registers hold them):

* ``f``: one kernel, writes only ``z`` (inference);
* ``fwd``: one kernel, writes ``z`` and the residual ``y = x @ w``;
* ``bwd``: two kernels, ``dx = dy @ w.T`` and ``dw = x.T @ dy``, each
  computing ``dy = g * gelu'(y)`` tile by tile from ``g`` and ``y``;
* ``fwd_bwd`` (fused): three kernels. The first recomputes ``y`` tile by
  tile and writes ``dy`` (never ``y`` or ``z``); the other two are the
  ``dx`` and ``dw`` matmuls reading ``dy``.

Rule calls and kernel launches differ: one call of ``bwd`` is two launches,
one of ``fwd_bwd`` three (``KERNELS_PER_RULE``). The script prints both.

Cost per gradient step, counting ``M x K x N`` matmuls and ``M x N`` arrays
written or read by the rules (``g`` counted where a kernel reads it):

=====================  =======================  ===============================
path                   matmuls                  M x N arrays moved
=====================  =======================  ===============================
no remat               fwd 1 + bwd 2 = 3        fwd writes z, y; bwd reads
                                                y, g twice (6)
remat, jax.custom_vjp  fwd 2 + bwd 2 = 4        fwd twice writes z, y; bwd
                                                reads y, g twice (8)
remat, smartvjp        f 1 + fwd 1 + bwd 2 = 4  f writes z; fwd writes z, y;
                                                bwd reads y, g twice (7)
remat, fwd_bwd         f 1 + fwd_bwd 3 = 4      f writes z; fwd_bwd reads g,
                                                writes dy, reads dy twice (5)
=====================  =======================  ===============================

The fused rule does the same matmuls as ``fwd`` + ``bwd`` and moves two
fewer ``M x N`` arrays: it never writes the ``z`` that the backward pass
does not read, and it writes ``dy`` once where ``bwd`` reads ``y`` and ``g``
twice. It also holds one ``M x N`` buffer (``dy``) where ``fwd`` + ``bwd``
hold two (``z``, ``y``).

Shapes that are not multiples of the tiles are zero-padded outside the
kernels (``gelu(0) = 0`` and zero rows or columns add nothing to ``dx`` or
``dw``), so the kernels never read or write out of bounds; Pallas' Triton
lowering does not mask block edges. Tiles are powers of two, at least 16
(Triton's dot needs both).

Two kernel sets, chosen by ``target`` (default: the backend's): the GPU
kernels above lower through Pallas' Triton backend; on a TPU the Mosaic
kernels (``_tpu_rules``) use a grid with ``K`` innermost and an f32
accumulator in VMEM, tiles from ``TPU_TILES``. Elsewhere either set runs in
interpret mode (``interpret=True``), which is how the CPU tests run them.

Run:  python examples/pallas_gelu_matmul.py
"""

from __future__ import annotations

import collections
import functools
import math
import time

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import tpu as pltpu
from jax.experimental.pallas import triton as pl_triton

from smartvjp import smart_custom_vjp

LAUNCHES: collections.Counter = collections.Counter()
_C = math.sqrt(2.0 / math.pi)

# Kernel names, per rule, as a GPU profiler shows them (``pallas_call``'s
# ``name``); a call of the rule launches each once.
KERNEL_NAMES = {
    "f": ("gelu_matmul_f",),
    "fwd": ("gelu_matmul_fwd",),
    "bwd": ("gelu_matmul_bwd_dx", "gelu_matmul_bwd_dw"),
    "fwd_bwd": ("gelu_matmul_fused_dy", "gelu_matmul_fused_dx",
                "gelu_matmul_fused_dw"),
}
KERNELS_PER_RULE = {rule: len(names) for rule, names in KERNEL_NAMES.items()}
RULES = ("f", "fwd", "bwd", "fwd_bwd")


def gelu(y):
  """tanh-approximate GELU (``jax.nn.gelu``'s default), in f32."""
  return 0.5 * y * (1.0 + jnp.tanh(_C * (y + 0.044715 * y ** 3)))


def gelu_grad(y):
  t = jnp.tanh(_C * (y + 0.044715 * y ** 3))
  return (0.5 * (1.0 + t)
          + 0.5 * y * (1.0 - t * t) * _C * (1.0 + 3 * 0.044715 * y * y))


def _dot(a, b, trans_a=False, trans_b=False, precision=None):
  dims = (((0,) if trans_a else (1,), (1,) if trans_b else (0,)), ((), ()))
  return jax.lax.dot_general(a, b, dims, precision=precision,
                             preferred_element_type=jnp.float32)


def _chunk(i, size):
  return pl.ds(pl.multiple_of(i * size, size), size)


def _loop_sum(n, term, shape):
  """``sum(term(i) for i in range(n))`` in f32, a loop inside the kernel."""
  return jax.lax.fori_loop(0, n, lambda i, acc: acc + term(i),
                           jnp.zeros(shape, jnp.float32))


def _dy(g, y):
  return g.astype(jnp.float32) * gelu_grad(y.astype(jnp.float32))


# -- kernels ------------------------------------------------------------------
# Blocks that span the contracted dimension are read a chunk at a time.

def _y_tile(x_ref, w_ref, bk):        # x: (bm, K), w: (K, bn) -> (bm, bn)
  return _loop_sum(
      x_ref.shape[1] // bk,
      lambda k: _dot(x_ref[:, _chunk(k, bk)], w_ref[_chunk(k, bk), :]),
      (x_ref.shape[0], w_ref.shape[1]))


def _f_kernel(x_ref, w_ref, z_ref, *, bk):
  z_ref[...] = gelu(_y_tile(x_ref, w_ref, bk)).astype(z_ref.dtype)


def _fwd_kernel(x_ref, w_ref, z_ref, y_ref, *, bk):
  y = _y_tile(x_ref, w_ref, bk)
  z_ref[...] = gelu(y).astype(z_ref.dtype)
  y_ref[...] = y.astype(y_ref.dtype)


def _dy_kernel(x_ref, w_ref, g_ref, dy_ref, *, bk):
  dy_ref[...] = _dy(g_ref[...], _y_tile(x_ref, w_ref, bk)).astype(dy_ref.dtype)


def _dx_kernel(*refs, bn, from_y):
  """``dx`` tile ``(bm, bk) = dy (bm, N) @ w (bk, N).T``, ``N`` in chunks.
  ``refs``: ``g, y, w, dx`` (``dy`` from ``g`` and ``y``) or ``dy, w, dx``."""
  g_ref, *y_ref, w_ref, dx_ref = refs

  def term(j):
    cols = _chunk(j, bn)
    dy = _dy(g_ref[:, cols], y_ref[0][:, cols]) if from_y else g_ref[:, cols]
    return _dot(dy.astype(w_ref.dtype), w_ref[:, cols], trans_b=True)
  dx_ref[...] = _loop_sum(g_ref.shape[1] // bn, term, dx_ref.shape
                          ).astype(dx_ref.dtype)


def _dw_kernel(*refs, bm, from_y):
  """``dw`` tile ``(bk, bn) = x (M, bk).T @ dy (M, bn)``, ``M`` in chunks.
  ``refs``: ``x, g, y, dw`` or ``x, dy, dw``."""
  x_ref, g_ref, *y_ref, dw_ref = refs

  def term(i):
    rows = _chunk(i, bm)
    dy = _dy(g_ref[rows, :], y_ref[0][rows, :]) if from_y else g_ref[rows, :]
    return _dot(x_ref[rows, :], dy.astype(x_ref.dtype), trans_a=True)
  dw_ref[...] = _loop_sum(x_ref.shape[0] // bm, term, dw_ref.shape
                          ).astype(dw_ref.dtype)


def _counted(rule, kernel, grid_rank):
  """Counts one launch (at the first grid point) in ``LAUNCHES[rule]``."""
  def wrapped(*refs):
    first = functools.reduce(
        jnp.logical_and, [pl.program_id(a) == 0 for a in range(grid_rank)])

    @pl.when(first)
    def _():
      jax.debug.callback(lambda: LAUNCHES.update([rule]))
    kernel(*refs)
  return wrapped


# -- tiles and padding --------------------------------------------------------

def _estimate(arith, args, out_shape):
  """``pl.CostEstimate`` of one kernel launch: the operations of ``arith``
  (the kernel's arithmetic on its whole inputs, in f32, counted by
  ``pl.estimate_cost``) and its memory traffic, each input read and each
  output written once. XLA's TPU compiler reads it as the custom call's
  cost, and smartvjp weighs rules with it."""
  f32 = [jax.ShapeDtypeStruct(a.shape, jnp.float32) for a in args]
  ops = pl.estimate_cost(arith, *f32)
  moved = sum(math.prod(a.shape) * jnp.dtype(a.dtype).itemsize
              for a in [*args, *jax.tree.leaves(out_shape)])
  return pl.CostEstimate(flops=ops.flops, transcendentals=ops.transcendentals,
                         bytes_accessed=moved)


def _tile(block, size):
  """The tile along one axis: ``block`` (a power of two), or for a smaller
  axis the next power of two, at least 16."""
  return min(block, max(16, 1 << max(0, size - 1).bit_length()))


def _round_up(n, tile):
  return -(-n // tile) * tile


def _pad(a, rows, cols):
  """Zero-pads a 2-D array to ``rows x cols``; no copy when it already is."""
  pr, pc = rows - a.shape[0], cols - a.shape[1]
  return a if pr == pc == 0 else jnp.pad(a, ((0, pr), (0, pc)))


# -- TPU (Mosaic) kernels -------------------------------------------------------
# The TPU's own pattern: a 3-D grid whose last (innermost, "arbitrary") axis
# walks the contracted dimension, an f32 accumulator in VMEM that lives across
# it, and the epilogue (GELU, its derivative, the cast) on the last step. The
# other axes are "parallel". Every block's last two dimensions are multiples of
# (16, 128) (bf16 packs 16 rows per vreg sublane group), so operands are
# zero-padded outside the kernels to whole tiles.

# Tiles for a TPU. Forward kernels (f, fwd, the fused dy): (bm, bn, bk) over
# (M, N, K). dx = dy @ w.T: (bm, bk_out, bn_in) over (M, K, N), N contracted.
# dw = x.T @ dy: (bk_out, bn, bm_in) over (K, N, M), M contracted. A backward
# tile that spans the whole of K computes dy once per element; a narrower one
# recomputes it K / bk times. From the measured search of benchmarks/
# tpu_tiles.py on a TPU v5e (benchmarks/results/tpu_tiles.json; M = 8192,
# K = N in 2048 / 4096, bf16): the largest forward tiles were fastest; dw
# tiles of 1024-2048 rows of K within 3% of the whole-K ones, dx tiles 4-9%
# behind. In a checkpointed scan XLA fuses dw's kernel with the update of the
# stacked gradient, and that fusion ran out of VMEM with dw tiles of
# (4096, 512) and (2048, 512) (accel_mlp_tpu.json as of commit 5871593, at
# K = 4096, and at K = 2048 for batches past 8192; every larger dw tile at
# K = 4096 in tpu_tiles_matmul2.json's "rejected"); hence (1024, 512).
TPU_TILES = {
    "fwd": (1024, 1024, 1024),
    "dx": (512, 2048, 512),
    "dw": (1024, 512, 512),
}
# Per (K, N), from the second search (benchmarks/results/tpu_tiles_matmul2.json,
# ``chosen``): whole-K forward blocks (one K step: no accumulator, and at
# K = N = 2048 all of w stays in VMEM), and a dx block over all of K. With
# them the 8-layer step at M = 8192 took 0.89x (K = 2048) and 0.97x
# (K = 4096) of the step with TPU_TILES (accel_mlp_tpu.json). The search
# picked dw (2048, 512) at K = 2048 too; it is not kept here (see above).
TPU_TILES_BY_SHAPE = {
    (2048, 2048): {"fwd": (1024, 1024, 2048), "dx": (1024, 2048, 1024)},
    (4096, 4096): {"fwd": (512, 2048, 2048), "dx": (512, 2048, 2048)},
}
# The scoped VMEM a kernel asks for: twice what its double-buffered blocks,
# scratch and f32 temporaries take, within these bounds. Asking for far more
# than a kernel needs leaves too little for the XLA fusions around it (a
# checkpointed scan on a v5e failed to compile with 100 MiB asked for).
TPU_VMEM_BOUNDS = (16 * 2**20, 64 * 2**20)


def _tpu_dot(a, b, trans_a=False, trans_b=False):
  """``_dot`` at full precision for f32 operands (Mosaic's default for f32
  is fewer bf16 passes) and at the operands' own for bf16, whatever
  ``jax.default_matmul_precision`` says (Mosaic refuses fp32 passes on
  bf16)."""
  return _dot(a, b, trans_a, trans_b,
              jax.lax.Precision.HIGHEST if a.dtype == jnp.float32
              else jax.lax.Precision.DEFAULT)


def _write_to(ref):
  def write(total):
    ref[...] = total.astype(ref.dtype)
  return write


def _accumulate(acc_ref, step, steps, product, finish):
  """One step of a reduction over a grid axis: the f32 VMEM accumulator
  zeroed on the first step, ``product`` added, ``finish(total)`` on the
  last."""
  @pl.when(step == 0)
  def _():
    acc_ref[...] = jnp.zeros_like(acc_ref)
  acc_ref[...] += product

  @pl.when(step == steps - 1)
  def _():
    finish(acc_ref[...])


def _fit(block, size, align):
  """A tile no larger than ``size`` rounded up to ``align``."""
  return min(block, _round_up(size, align))


def _tpu_params(semantics, vmem_limit):
  return pltpu.CompilerParams(dimension_semantics=semantics,
                              vmem_limit_bytes=vmem_limit)


def _vmem_need(in_specs, args, out_specs, out_shape, scratch):
  """Bytes of VMEM a kernel holds: each block twice (double buffering), the
  scratch, and three f32 temporaries the size of the largest output tile."""
  size = lambda shape, dtype: math.prod(shape) * jnp.dtype(dtype).itemsize
  blocks = sum(2 * size(s.block_shape, a.dtype) for s, a in zip(in_specs, args))
  blocks += sum(2 * size(s.block_shape, o.dtype)
                for s, o in zip(out_specs, out_shape))
  blocks += sum(size(v.shape, v.dtype) for v in scratch)
  return blocks + 3 * max(size(s.block_shape, jnp.float32) for s in out_specs)


def _tpu_rules(interpret, tiles, residual_dtype, count, vmem_limit):
  """(f, fwd, bwd, fwd_bwd) with Mosaic kernels."""
  overrides = tiles or {}

  def tiles_for(k, n):
    return {**TPU_TILES, **TPU_TILES_BY_SHAPE.get((k, n), {}), **overrides}

  def call(rule, name, kernel, grid, in_specs, out_specs, out_shape, scratch,
           semantics, *args, arith):
    if count:
      kernel = _counted(rule, kernel, len(grid))
    outs = out_specs if isinstance(out_specs, list) else [out_specs]
    shapes = out_shape if isinstance(out_shape, list) else [out_shape]
    limit = vmem_limit or min(max(
        2 * _vmem_need(in_specs, args, outs, shapes, scratch),
        TPU_VMEM_BOUNDS[0]), TPU_VMEM_BOUNDS[1])
    return pl.pallas_call(
        kernel, grid=grid, in_specs=in_specs, out_specs=out_specs,
        out_shape=out_shape, scratch_shapes=scratch, interpret=interpret,
        compiler_params=None if interpret else _tpu_params(semantics, limit),
        cost_estimate=_estimate(arith, args, out_shape), name=name)(*args)

  def fwd_tiles(x, w):
    (m, k), n = x.shape, w.shape[1]
    bm, bn, bk = tiles_for(k, n)["fwd"]
    return _fit(bm, m, 16), _fit(bn, n, 128), _fit(bk, k, 128)

  def matmul_epilogue(rule, x, w, epilogue, out_dtypes, *extra):
    """``epilogue(y, *extra_tiles)`` of the ``M x N`` tiles of ``y = x @ w``
    (``K`` innermost); ``extra`` are ``M x N`` inputs, padded here."""
    bm, bn, bk = fwd_tiles(x, w)
    (m, k), n = x.shape, w.shape[1]
    mp, np_, kp = _round_up(m, bm), _round_up(n, bn), _round_up(k, bk)
    nk = kp // bk

    def finish(out_refs, extra_refs, y):
      for ref, value in zip(out_refs, epilogue(y, *(r[...] for r in extra_refs))):
        ref[...] = value.astype(ref.dtype)

    def kernel(x_ref, w_ref, *refs):
      extra_refs = refs[:len(extra)]
      if nk == 1:                 # K in one block: no accumulator
        finish(refs[len(extra):], extra_refs, _tpu_dot(x_ref[...], w_ref[...]))
        return
      out_refs, acc_ref = refs[len(extra):-1], refs[-1]
      _accumulate(acc_ref, pl.program_id(2), nk,
                  _tpu_dot(x_ref[...], w_ref[...]),
                  lambda y: finish(out_refs, extra_refs, y))

    tile = pl.BlockSpec((bm, bn), lambda i, j, kk: (i, j))
    outs = call(rule, KERNEL_NAMES[rule][0], kernel, (mp // bm, np_ // bn, nk),
                [pl.BlockSpec((bm, bk), lambda i, j, kk: (i, kk)),
                 pl.BlockSpec((bk, bn), lambda i, j, kk: (kk, j))]
                + [tile] * len(extra),
                [tile] * len(out_dtypes),
                [jax.ShapeDtypeStruct((mp, np_), d) for d in out_dtypes],
                [pltpu.VMEM((bm, bn), jnp.float32)] if nk > 1 else [],
                ("parallel", "parallel", "arbitrary"),
                _pad(x, mp, kp), _pad(w, kp, np_),
                *(_pad(e, mp, np_) for e in extra),
                arith=lambda x, w, *extra: epilogue(x @ w, *extra))
    return [o[:m, :n] for o in outs]

  def res_dtype(x):
    return residual_dtype or x.dtype

  def f(x, w):
    [z] = matmul_epilogue("f", x, w, lambda y: [gelu(y)], [x.dtype])
    return z

  def fwd(x, w):
    z, y = matmul_epilogue("fwd", x, w, lambda y: [gelu(y), y],
                           [x.dtype, res_dtype(x)])
    return z, (x, w, y)

  def dx_dw(rule, x, w, g, y):
    """``dx = dy @ w.T`` and ``dw = x.T @ dy``; ``dy = g * gelu'(y)`` tile by
    tile (``bwd``), or ``g`` is ``dy`` itself (``y`` None, the fused rule)."""
    (m, k), n = x.shape, w.shape[1]
    from_y = y is not None
    names = KERNEL_NAMES[rule][-2:]

    def dy_tile(g_ref, y_refs, dtype):
      dy = _dy(g_ref[...], y_refs[0][...]) if from_y else g_ref[...]
      return dy.astype(dtype)

    # dx: grid (M / bm, K / bk, N / bn), N contracted innermost
    tiles = tiles_for(k, n)
    bm, bk, bn = tiles["dx"]
    bm, bk, bn = _fit(bm, m, 16), _fit(bk, k, 128), _fit(bn, n, 128)
    mp, kp, np_ = _round_up(m, bm), _round_up(k, bk), _round_up(n, bn)
    nj = np_ // bn

    def dx_kernel(g_ref, *refs):
      *y_refs, w_ref, dx_ref, acc_ref = refs
      _accumulate(acc_ref, pl.program_id(2), nj,
                  _tpu_dot(dy_tile(g_ref, y_refs, w_ref.dtype), w_ref[...],
                           trans_b=True),
                  _write_to(dx_ref))

    mn = pl.BlockSpec((bm, bn), lambda i, kk, j: (i, j))
    ys = [_pad(y, mp, np_)] if from_y else []
    dx = call(rule, names[0], dx_kernel, (mp // bm, kp // bk, nj),
              [mn] * (1 + from_y)
              + [pl.BlockSpec((bk, bn), lambda i, kk, j: (kk, j))],
              pl.BlockSpec((bm, bk), lambda i, kk, j: (i, kk)),
              jax.ShapeDtypeStruct((mp, kp), x.dtype),
              [pltpu.VMEM((bm, bk), jnp.float32)],
              ("parallel", "parallel", "arbitrary"),
              _pad(g, mp, np_), *ys, _pad(w, kp, np_),
              arith=lambda g, *yw: (_dy(g, yw[0]) if from_y else g) @ yw[-1].T)

    # dw: grid (K / bk, N / bn, M / bm), M contracted innermost
    bk, bn, bm = tiles["dw"]
    bk, bn, bm = _fit(bk, k, 128), _fit(bn, n, 128), _fit(bm, m, 16)
    mp, kp, np_ = _round_up(m, bm), _round_up(k, bk), _round_up(n, bn)
    ni = mp // bm

    def dw_kernel(x_ref, g_ref, *refs):
      *y_refs, dw_ref, acc_ref = refs
      _accumulate(acc_ref, pl.program_id(2), ni,
                  _tpu_dot(x_ref[...], dy_tile(g_ref, y_refs, x_ref.dtype),
                           trans_a=True),
                  _write_to(dw_ref))

    mn = pl.BlockSpec((bm, bn), lambda kk, j, i: (i, j))
    ys = [_pad(y, mp, np_)] if from_y else []
    dw = call(rule, names[1], dw_kernel, (kp // bk, np_ // bn, ni),
              [pl.BlockSpec((bm, bk), lambda kk, j, i: (i, kk))]
              + [mn] * (1 + from_y),
              pl.BlockSpec((bk, bn), lambda kk, j, i: (kk, j)),
              jax.ShapeDtypeStruct((kp, np_), w.dtype),
              [pltpu.VMEM((bk, bn), jnp.float32)],
              ("parallel", "parallel", "arbitrary"),
              _pad(x, mp, kp), _pad(g, mp, np_), *ys,
              arith=lambda x, g, *y: x.T @ (_dy(g, y[0]) if from_y else g))
    return dx[:m, :k], dw[:k, :n]

  def bwd(res, g):
    x, w, y = res
    return dx_dw("bwd", x, w, g, y)

  def fwd_bwd(x, w, g):
    # y rounded to the residual dtype first, as fwd stores it: the fused
    # rule's gradients are then bitwise those of fwd + bwd
    dt = res_dtype(x)
    [dy] = matmul_epilogue(
        "fwd_bwd", x, w, lambda y, g: [_dy(g, y.astype(dt))], [x.dtype], g)
    return dx_dw("fwd_bwd", x, w, dy, None)

  return f, fwd, bwd, fwd_bwd


# -- the smart_custom_vjp -----------------------------------------------------

def make_gelu_matmul(block_m=128, block_n=128, block_k=None, interpret=None,
                     fused=True, count=False, residual_dtype=None,
                     num_warps=None, num_stages=None, target=None,
                     tpu_tiles=None, vmem_limit=None):
  """``gelu_matmul(x, w) -> gelu(x @ w)`` as a ``smart_custom_vjp``.

  Args:
    block_m, block_n, block_k: the GPU kernels' tiles (powers of two) over
      the rows of ``x``, the columns of ``w`` and the contracted dimension;
      ``block_k`` defaults to 64 for 2-byte dtypes and 32 for f32 (the same
      bytes per tile).
    interpret: Pallas interpret mode; default: on unless the kernels are for
      the backend JAX runs on (``target``).
    target: ``"tpu"`` (Mosaic kernels: a K-innermost grid with an f32 VMEM
      accumulator, ``TPU_TILES``) or ``"gpu"`` (Triton-shaped kernels that
      loop over K inside); default: ``"tpu"`` on a TPU, else ``"gpu"``.
    tpu_tiles: overrides of the TPU tiles (``"fwd"``, ``"dx"``, ``"dw"``
      entries), for a tile search; otherwise ``TPU_TILES_BY_SHAPE`` for the
      call's ``(K, N)`` where it has them, else ``TPU_TILES``.
    vmem_limit: the TPU kernels' scoped VMEM limit in bytes (default: twice
      each kernel's estimated need, within ``TPU_VMEM_BOUNDS``).
    fused: also define the fused ``fwd_bwd`` rule.
    count: count kernel launches per rule in ``LAUNCHES`` (interpret mode
      only: a GPU kernel cannot call the host; count on a GPU with the
      profiler and ``KERNEL_NAMES``).
    residual_dtype: dtype of the residual ``y`` (default: ``x``'s dtype).
    num_warps, num_stages: Triton's launch parameters on a GPU (default
      8 warps and 3 pipeline stages).

  Returns:
    ``(gelu_matmul, rules)`` where ``rules`` holds the four rule functions.
    ``x: [M, K]``, ``w: [K, N]``, same float dtype; result ``[M, N]`` of that
    dtype. ``bwd`` returns ``(dx, dw)`` in the dtypes of ``x`` and ``w``.

  Raises:
    ValueError: a block that is not a power of two, or an unknown target.
  """
  target = target or ("tpu" if jax.default_backend() == "tpu" else "gpu")
  if target not in ("tpu", "gpu"):
    raise ValueError(f"make_gelu_matmul: target must be 'tpu' or 'gpu', got "
                     f"{target!r}")
  if interpret is None:
    interpret = jax.default_backend() != target
  if target == "tpu":
    rules = _tpu_rules(interpret, tpu_tiles, residual_dtype,
                       count and interpret, vmem_limit)
    return _assemble(*rules, fused=fused)
  for b in (block_m, block_n, block_k):
    if b is not None and (b < 1 or b & (b - 1)):
      raise ValueError(f"make_gelu_matmul: tiles must be powers of two, got "
                       f"block_m={block_m}, block_n={block_n}, "
                       f"block_k={block_k}")
  if interpret is None:
    interpret = jax.default_backend() != "gpu"
  count = count and interpret
  params = None if interpret else pl_triton.CompilerParams(
      num_warps=num_warps or 8, num_stages=num_stages or 3)

  def call(rule, name, kernel, grid, in_specs, out_specs, out_shape, *args,
           arith):
    if count:
      kernel = _counted(rule, kernel, len(grid))
    return pl.pallas_call(kernel, grid=grid, in_specs=in_specs,
                          out_specs=out_specs, out_shape=out_shape,
                          interpret=interpret, compiler_params=params,
                          cost_estimate=_estimate(arith, args, out_shape),
                          name=name)(*args)

  def tiles(x, w):
    """Tiles and padded sizes for ``x: [M, K] @ w: [K, N]``."""
    (m, k), n = x.shape, w.shape[1]
    bk = block_k or (32 if jnp.dtype(x.dtype).itemsize >= 4 else 64)
    bm, bn, bk = _tile(block_m, m), _tile(block_n, n), _tile(bk, k)
    return bm, bn, bk, _round_up(m, bm), _round_up(n, bn), _round_up(k, bk)

  def operands(x, w):
    """``tiles(x, w)`` and ``x``, ``w`` zero-padded to them."""
    t = tiles(x, w)
    _, _, _, mp, np_, kp = t
    return t, _pad(x, mp, kp), _pad(w, kp, np_)

  def tile_kernel(rule, kernel, ops, out_dtypes, *extra):
    """``kernel`` over the ``M x N`` tiles of ``x @ w`` (``K`` in chunks),
    with ``extra`` padded ``M x N`` inputs read tile by tile."""
    (bm, bn, bk, mp, np_, kp), xp, wp = ops
    tile = pl.BlockSpec((bm, bn), lambda i, j: (i, j))
    return call(rule, KERNEL_NAMES[rule][0],
                functools.partial(kernel, bk=bk), (mp // bm, np_ // bn),
                [pl.BlockSpec((bm, kp), lambda i, j: (i, 0)),
                 pl.BlockSpec((kp, bn), lambda i, j: (0, j))]
                + [tile] * len(extra),
                [tile] * len(out_dtypes),
                [jax.ShapeDtypeStruct((mp, np_), d) for d in out_dtypes],
                xp, wp, *extra,
                arith=lambda x, w, *g: _dy(g[0], x @ w) if g else gelu(x @ w))

  def f(x, w):
    [z] = tile_kernel("f", _f_kernel, operands(x, w), [x.dtype])
    return z[:x.shape[0], :w.shape[1]]

  def fwd(x, w):
    z, y = tile_kernel("fwd", _fwd_kernel, operands(x, w),
                       [x.dtype, residual_dtype or x.dtype])
    return z[:x.shape[0], :w.shape[1]], (x, w, y)   # y stays padded

  def dx_dw(rule, x, w, ops, g, y):
    """``dx, dw`` from ``g`` and ``y`` (``bwd``) or from ``dy`` (``y=None``);
    ``ops`` is ``operands(x, w)``; ``g`` and ``y`` are padded to the tiles."""
    (bm, bn, bk, mp, np_, kp), xp, wp = ops
    from_y = y is not None
    ys = [y] if from_y else []
    names = KERNEL_NAMES[rule][-2:]
    dx = call(rule, names[0], functools.partial(_dx_kernel, bn=bn,
                                                from_y=from_y),
              (mp // bm, kp // bk),
              [pl.BlockSpec((bm, np_), lambda i, k: (i, 0))] * (1 + from_y)
              + [pl.BlockSpec((bk, np_), lambda i, k: (k, 0))],
              pl.BlockSpec((bm, bk), lambda i, k: (i, k)),
              jax.ShapeDtypeStruct((mp, kp), x.dtype), g, *ys, wp,
              arith=lambda g, *yw: (_dy(g, yw[0]) if from_y else g) @ yw[-1].T)
    dw = call(rule, names[1], functools.partial(_dw_kernel, bm=bm,
                                                from_y=from_y),
              (kp // bk, np_ // bn),
              [pl.BlockSpec((mp, bk), lambda k, j: (0, k))]
              + [pl.BlockSpec((mp, bn), lambda k, j: (0, j))] * (1 + from_y),
              pl.BlockSpec((bk, bn), lambda k, j: (k, j)),
              jax.ShapeDtypeStruct((kp, np_), w.dtype), xp, g, *ys,
              arith=lambda x, g, *y: x.T @ (_dy(g, y[0]) if from_y else g))
    return dx[:x.shape[0], :x.shape[1]], dw[:w.shape[0], :w.shape[1]]

  def bwd(res, g):
    x, w, y = res
    return dx_dw("bwd", x, w, operands(x, w), _pad(g, *y.shape), y)

  def fwd_bwd(x, w, g):
    ops = operands(x, w)            # padded once, for all three kernels
    _, _, _, mp, np_, _ = ops[0]
    [dy] = tile_kernel("fwd_bwd", _dy_kernel, ops, [x.dtype],
                       _pad(g, mp, np_))
    return dx_dw("fwd_bwd", x, w, ops, dy, None)

  return _assemble(f, fwd, bwd, fwd_bwd, fused=fused)


def _assemble(f, fwd, bwd, fwd_bwd, fused):
  gelu_matmul = smart_custom_vjp(f)
  gelu_matmul.defvjp(fwd, bwd, fwd_bwd=fwd_bwd if fused else None)
  return gelu_matmul, dict(f=f, fwd=fwd, bwd=bwd, fwd_bwd=fwd_bwd)


def reference(x, w):
  """``jax.nn.gelu(x @ w)``, the matmul at full precision: on a GPU, JAX's
  default for f32 would be TF32, and the kernels' f32 dots are IEEE."""
  return jax.nn.gelu(jnp.matmul(x, w, precision=jax.lax.Precision.HIGHEST))


def custom_vjp_version(rules, optimize_remat=False):
  """The same kernels under ``jax.custom_vjp`` (for side-by-side runs)."""
  F = jax.custom_vjp(rules["f"])
  F.defvjp(rules["fwd"], rules["bwd"], optimize_remat=optimize_remat)
  return F


def _loss(F, remat):
  G = jax.checkpoint(F) if remat else F
  return lambda x, w: jnp.sum(G(x, w).astype(jnp.float32) ** 2)


# M x N arrays moved per call of each rule (the module docstring's table
# gives them per path; main() prints what each rule moves).
ARRAYS_MOVED = {"f": 1, "fwd": 2, "bwd": 4, "fwd_bwd": 4}


def rule_calls(launches):
  """Rule calls from kernel launches: each call of a rule launches all of its
  kernels once (``KERNELS_PER_RULE``)."""
  calls = {}
  for rule, n in launches.items():
    assert n % KERNELS_PER_RULE[rule] == 0, (rule, n)
    calls[rule] = n // KERNELS_PER_RULE[rule]
  return calls


def fmt(counts):
  return ", ".join(f"{k} {counts[k]}" for k in RULES if counts.get(k)) or "none"


def main():
  t0 = time.perf_counter()
  mode = "Triton" if jax.default_backend() == "gpu" else "interpret mode"
  print(f"Pallas matmul+GELU on {jax.default_backend()} ({mode})\n")
  print("Accuracy of the smartvjp kernels (16 x 16 x 16 tiles) against the "
        "plain-JAX reference jax.nn.gelu(x @ w),")
  print("gradients against jax.grad of it. Output: max |ours - reference|. "
        "Gradient: max |ours - reference|")
  print("over dx and dw, divided by max |reference gradient|; it must be below "
        "the tolerance.")
  print(f"  {'dtype':8s} {'x @ w':14s} {'output':>8s}  "
        f"{'gradient: no remat / remat':>26s}  tolerance")
  for dtype, tol in ((jnp.float32, 2e-5), (jnp.bfloat16, 2e-2)):
    for (m, k, n) in ((64, 32, 64), (50, 20, 37)):   # multiple / not of 16
      gm, _ = make_gelu_matmul(block_m=16, block_n=16, block_k=16)
      kx, kw = jax.random.split(jax.random.key(0))
      x = jax.random.normal(kx, (m, k), dtype)
      w = (jax.random.normal(kw, (k, n)) / math.sqrt(k)).astype(dtype)
      err = jnp.max(jnp.abs(gm(x, w).astype(jnp.float32)
                            - reference(x, w).astype(jnp.float32)))
      want = jax.grad(_loss(reference, False), (0, 1))(x, w)
      gerr = []
      for remat in (False, True):
        got = jax.jit(jax.grad(_loss(gm, remat), (0, 1)))(x, w)
        gerr.append(max(float(jnp.max(jnp.abs(a.astype(jnp.float32)
                                               - b.astype(jnp.float32)))
                              / (jnp.max(jnp.abs(b.astype(jnp.float32))) + 1e-9))
                        for a, b in zip(got, want)))
      verdict = "ok" if max(gerr) < tol else "TOO LARGE"
      shape = f"{m}x{k} @ {k}x{n}"
      print(f"  {jnp.dtype(dtype).name:8s} {shape:14s} {float(err):8.1e}  "
            f"{gerr[0]:18.1e} / {gerr[1]:.1e}  {tol:.0e} {verdict}")

  print("\nPer jitted gradient step of sum(gelu(x @ w)**2), x 64x32, w 32x48, "
        "counted by a callback in each kernel")
  print("(interpret mode on every backend: a GPU kernel cannot call the host).")
  print("Rule calls count calls of f, fwd, bwd, fwd_bwd; kernel launches count "
        "kernels: bwd launches two")
  print("(dx, dw), fwd_bwd three (dy, dx, dw), f and fwd one. Arrays moved: "
        "M x N arrays the rules write or read")
  print("per call: f writes z (1); fwd writes z and y (2); bwd reads y and "
        "g in each of its two kernels (4);")
  print("fwd_bwd reads g, writes dy, and its two matmul kernels read dy (4).")
  print(f"  {'remat':8s} {'implementation':20s} {'rule calls':20s} "
        f"{'kernel launches':24s} arrays moved")
  x = jax.random.normal(jax.random.key(1), (64, 32))
  w = jax.random.normal(jax.random.key(2), (32, 48)) / 6
  moved_by = {}
  for remat in (False, True):
    for name in ("jax.custom_vjp", "optimize_remat", "smartvjp",
                 "smartvjp + fwd_bwd"):
      gm, rules = make_gelu_matmul(block_m=32, block_n=16, block_k=16,
                                   count=True, interpret=True,
                                   fused=name.endswith("fwd_bwd"))
      F = gm if name.startswith("smartvjp") else custom_vjp_version(
          rules, optimize_remat=name == "optimize_remat")
      LAUNCHES.clear()
      jax.block_until_ready(jax.jit(jax.grad(_loss(F, remat), (0, 1)))(x, w))
      jax.effects_barrier()
      launches = dict(LAUNCHES)
      calls = rule_calls(launches)
      moved = sum(ARRAYS_MOVED[r] * c for r, c in calls.items())
      moved_by[remat, name] = moved
      print(f"  {'remat' if remat else 'no remat':8s} {name:20s} "
            f"{fmt(calls):20s} {fmt(launches):24s} {moved}")

  print("\nWhen the fused rule pays: under remat it replaces fwd + bwd in the "
        "backward pass with the same")
  print("number of matmuls and two fewer M x N arrays moved (it never writes "
        "the z nobody reads, and writes dy")
  print("once where bwd reads y and g twice), and it holds one M x N buffer "
        "instead of two. By these counts")
  print("it never does more work; what it saves is memory traffic, so it "
        "gains most where the step is bound")
  print("by memory rather than by the matmuls (small K). The kernels here run "
        f"in {mode}, so this machine's")
  print("times say nothing about it; benchmarks/accel_mlp.py measures it on a "
        "TPU or GPU.")
  print("\nWhat to conclude: the smartvjp kernels match jax.nn.gelu(x @ w) "
        "within the tolerances above; under remat")
  base = moved_by[True, "jax.custom_vjp"]
  print(f"smartvjp runs f + fwd where jax.custom_vjp runs fwd twice "
        f"({moved_by[True, 'smartvjp']} M x N arrays moved instead of {base}), "
        "and with fwd_bwd")
  print(f"{moved_by[True, 'smartvjp + fwd_bwd']} instead of {base}, with the "
        "same number of matmuls.")
  print(f"Finished in {time.perf_counter() - t0:.1f} s.")


if __name__ == "__main__":
  main()
