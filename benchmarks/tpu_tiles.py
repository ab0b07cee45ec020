"""TPU: the example kernels' tiles, measured; their accuracy; the chip's peaks.

For ``examples/pallas_gelu_matmul.py`` and ``examples/pallas_rmsnorm_gelu.py``
with ``target="tpu"`` (Mosaic kernels), on the TPU JAX runs on:

* **peaks of this chip, measured here** (not a vendor figure): a bf16
  ``8192 x 8192 x 8192`` matmul (TFLOP/s) and a copy of a 1 GiB bf16 array
  (GB/s: bytes read + written), each the best of ``--rounds`` timed rounds;
* **accuracy**: each kernel family against plain JAX in f32 and bf16, on a
  tile-multiple and a ragged shape, value and gradients with and without
  ``jax.checkpoint``, with and without the fused rule (f32 references at
  ``Precision.HIGHEST``);
* **tile search**: at ``M = 8192`` rows and each ``--hidden`` (``K = N = d``),
  bf16, each candidate tile set is compiled and its rules timed alone
  (``f``, ``fwd``, ``bwd``, ``fwd_bwd``: median of ``--rounds`` rounds of
  ``--inner`` calls), beside XLA's time for the same math in ``jax.numpy``.
  The fastest candidate per rule is printed and recorded; the tables
  ``TPU_TILES`` / ``TPU_TILE_BYTES`` in the examples are set from it. The
  example's own ``TPU_TILES`` are always among the candidates, so a choice
  is never slower than them in the same run;
* **chosen tiles, checked in the step** (``chosen`` in the JSON, by hidden
  size): per kind the fastest candidate (``fwd`` by ``f + fwd``, ``dx`` and
  ``dw`` by ``bwd``), then the checkpointed 8-layer step of
  ``accel_mlp.py`` compiled with them for every kernel row; where XLA's
  fusions around a kernel run out of VMEM there (alone the kernel fits),
  the kind falls back to the next candidate, then to ``TPU_TILES``.
  ``accel_mlp.py --tiles-json`` runs with them.

``--matmul-only`` skips the accuracy checks and the RMSNorm search.

Run on a TPU:  python benchmarks/tpu_tiles.py --out FILE.json
Elsewhere it stops, saying so (the kernels' CPU checks are in tests/).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time

import jax
import jax.numpy as jnp
import numpy as np

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
sys.path.insert(0, os.path.join(ROOT, "examples"))
sys.path.insert(1, HERE)
sys.path.insert(2, ROOT)
import _report as R  # noqa: E402
import accel_mlp as A  # noqa: E402
import pallas_gelu_matmul as PG  # noqa: E402
import pallas_rmsnorm_gelu as RG  # noqa: E402

# Whole-K / whole-N blocks keep an operand's block index fixed along the
# grid, so Pallas fetches it once (weight-stationary dx: all of w in VMEM).
MM_CANDIDATES = {
    "fwd": [(512, 1024, 512), (1024, 1024, 512), (1024, 1024, 2048),
            (512, 2048, 2048)],
    "dx": [(512, 4096, 512), (512, 2048, 2048), (1024, 2048, 1024),
           (256, 2048, 2048), (1024, 1024, 1024)],
    "dw": [(4096, 512, 512), (1024, 1024, 1024), (2048, 1024, 512),
           (2048, 2048, 256), (1024, 2048, 512), (2048, 1024, 1024)],
}
# the rules whose time ranks a kind's candidates
RANK_BY = {"fwd": ("f", "fwd"), "dx": ("bwd",), "dw": ("bwd",)}
RMS_TILE_BYTES = [2**20, 2**21, 2**22, 2**23]
# M x D arrays each RMSNorm+GELU rule reads or writes (as the example counts)
RMS_ARRAYS = {"f": 2, "fwd": 3, "bwd": 3, "fwd_bwd": 3}
RMS_ROWS = [8192, 16384, 32768, 65536]
RMS_GOAL = 0.8     # of the measured copy bandwidth, per rule


def _rel(a, b):
  a, b = np.float32(a), np.float32(b)
  return float(np.max(np.abs(a - b)) / (np.max(np.abs(b)) + 1e-30))


def _errors(make, reference, a, b, **where):
  """Rows of value and gradient errors of ``make(fused)``'s op against
  ``reference`` at ``(a, b)``, with and without the fused rule and remat."""
  loss = lambda F, remat: (lambda a, b: jnp.sum(
      (jax.checkpoint(F) if remat else F)(a, b).astype(jnp.float32) ** 2))
  want = jax.grad(loss(reference, False), (0, 1))(a, b)
  rows = []
  for fused in (False, True):
    op, _ = make(fused)
    for remat in (False, True):
      got = jax.jit(jax.grad(loss(op, remat), (0, 1)))(a, b)
      err = dict(value=_rel(op(a, b), reference(a, b)),
                 grad=max(_rel(g, w) for g, w in zip(got, want)))
      rows.append(dict(where, fused=fused, remat=remat,
                       ok=max(err.values()) < where["tol"], **err))
  return rows


def accuracy():
  """Errors of both kernel families against plain JAX (max relative)."""
  rows = []
  with jax.default_matmul_precision("highest"):
    for dtype, tol in ((jnp.float32, 1e-4), (jnp.bfloat16, 3e-2)):
      name = jnp.dtype(dtype).name
      for shape in ((1024, 1024, 2048), (1000, 700, 900)):
        m, k, n = shape
        kx, kw = jax.random.split(jax.random.key(2))
        x = jax.random.normal(kx, (m, k), jnp.float32).astype(dtype)
        w = (jax.random.normal(kw, (k, n), jnp.float32) / k ** 0.5).astype(dtype)
        rows += _errors(lambda fused: PG.make_gelu_matmul(target="tpu",
                                                          fused=fused),
                        PG.reference, x, w, kernel="gelu_matmul", dtype=name,
                        shape=shape, tol=tol)
      for shape in ((2048, 1024), (1000, 700)):
        x = jax.random.normal(jax.random.key(3), shape, jnp.float32).astype(dtype)
        gamma = (1 + 0.1 * jax.random.normal(jax.random.key(4), shape[1:])
                 ).astype(dtype)
        for form in RG.TPU_GELU_FORMS:
          rows += _errors(
              lambda fused, form=form: RG.make_rmsnorm_gelu(
                  target="tpu", fused=fused, gelu=form),
              RG.reference, x, gamma, kernel="rmsnorm_gelu", gelu=form,
              dtype=name, shape=shape, tol=tol)
  return rows


def _xla_matmul_rules():
  """The matmul+GELU math in jax.numpy: what XLA does with no kernel."""
  gelu = lambda y: jax.nn.gelu(y.astype(jnp.float32))
  f = lambda x, w: gelu(x @ w).astype(x.dtype)

  def fwd(x, w):
    y = x @ w
    return gelu(y).astype(x.dtype), y

  def bwd(x, w, y, g):
    dy = (g.astype(jnp.float32) * jax.vmap(jax.vmap(jax.grad(jax.nn.gelu)))(
        y.astype(jnp.float32))).astype(x.dtype)
    return dy @ w.T, x.T @ dy
  return dict(f=f, fwd=fwd, bwd=bwd)


def search_matmul(d, rounds, inner, m=8192):
  kx, kw, kg = jax.random.split(jax.random.key(5), 3)
  x = jax.random.normal(kx, (m, d), jnp.bfloat16)
  w = (jax.random.normal(kw, (d, d)) / d ** 0.5).astype(jnp.bfloat16)
  g = jax.random.normal(kg, (m, d), jnp.bfloat16)
  flop = 2 * m * d * d
  out = dict(hidden=d, rows=m, flop_per_matmul=flop, candidates=[])
  xla = _xla_matmul_rules()
  _, y = jax.jit(xla["fwd"])(x, w)
  out["xla"] = dict(
      f=R.timed(jax.jit(xla["f"]), x, w, rounds=rounds, inner=inner),
      fwd=R.timed(jax.jit(xla["fwd"]), x, w, rounds=rounds, inner=inner),
      bwd=R.timed(jax.jit(xla["bwd"]), x, w, y, g, rounds=rounds, inner=inner))
  for kind, cands in MM_CANDIDATES.items():
    default = tuple(PG.TPU_TILES[kind])
    for tiles in cands + ([default] if default not in cands else []):
      rec = dict(kind=kind, tiles=tiles)
      try:
        _, rules = PG.make_gelu_matmul(target="tpu", tpu_tiles={kind: tiles})
        if kind == "fwd":
          rec["f"] = R.timed(jax.jit(rules["f"]), x, w, rounds=rounds, inner=inner)
          rec["fwd"] = R.timed(jax.jit(R.new_outputs(rules["fwd"])), x, w,
                               rounds=rounds, inner=inner)
          rec["fwd_bwd"] = R.timed(jax.jit(rules["fwd_bwd"]), x, w, g,
                                 rounds=rounds, inner=inner)
        else:
          _, res = jax.jit(rules["fwd"])(x, w)
          rec["bwd"] = R.timed(jax.jit(rules["bwd"]), res, g, rounds=rounds,
                             inner=inner)
      except Exception as e:  # noqa: BLE001 - a candidate that fails is data
        rec["error"] = f"{type(e).__name__}: {str(e)[:300]}"
      out["candidates"].append(rec)
      print(f"  gelu_matmul d={d} {kind} {tiles}: " + (
          rec.get("error") or ", ".join(
              f"{r} {rec[r]['median_s'] * 1e3:.3f} ms" for r in
              ("f", "fwd", "bwd", "fwd_bwd") if r in rec)), flush=True)
  return out


def _pallas_copy(tile_bytes):
  """``y = 2 x`` as a Pallas TPU kernel with the RMSNorm kernels' row blocks:
  the bandwidth a Pallas kernel of this tiling reaches with no arithmetic."""
  from jax.experimental import pallas as pl
  from jax.experimental.pallas import tpu as pltpu

  def kernel(x_ref, y_ref):
    y_ref[...] = x_ref[...] * 2

  def copy(x):
    m, d = x.shape
    bm = RG._tpu_rows(m, d, tile_bytes)   # noqa: SLF001 - the same rows
    spec = pl.BlockSpec((bm, d), lambda i: (i, 0))
    return pl.pallas_call(
        kernel, grid=(m // bm,), in_specs=[spec], out_specs=spec,
        out_shape=jax.ShapeDtypeStruct(x.shape, x.dtype),
        compiler_params=pltpu.CompilerParams(
            dimension_semantics=("parallel",),
            vmem_limit_bytes=RG.TPU_VMEM_LIMIT))(x)
  return copy


def _rms_data(m, d):
  x = jax.random.normal(jax.random.key(6), (m, d), jnp.bfloat16)
  gamma = (1 + 0.1 * jax.random.normal(jax.random.key(7), (d,))
           ).astype(jnp.bfloat16)
  g = jax.random.normal(jax.random.key(8), (m, d), jnp.bfloat16)
  return x, gamma, g


# Calls per timed program: a memory-bound kernel of 8192 x 1024 bf16 runs in
# about 50 us, less than the host takes to dispatch one jitted call on the
# TPU machine (a Pallas copy timed call by call reached 196 GB/s there where
# the chip copies at 644: benchmarks/results/tpu_tiles_rms_dispatched_*.json),
# so each rule is timed as LOOP calls chained in one program.
LOOP = 10


def _looped(step, carry, *fixed, n=LOOP):
  """Seconds per call of ``carry = step(carry, *fixed)``, ``n`` calls chained
  in a ``fori_loop`` of one jitted program (each call reads the previous
  one's output, so none is hoisted or merged), as ``R.timed``'s dict."""
  prog = jax.jit(lambda c, *f: jax.lax.fori_loop(
      0, n, lambda _, c: step(c, *f), c))
  return prog, carry, fixed


def _timed_loop(step, carry, *fixed, rounds, inner, n=LOOP):
  prog, carry, fixed = _looped(step, carry, *fixed, n=n)
  t = R.timed(prog, carry, *fixed, rounds=rounds, inner=inner)
  return {k: v / n for k, v in t.items()}


def _rms_rule_times(rules, x, gamma, g, rounds, inner):
  """Each rule's seconds per call, ``LOOP`` calls chained on device (its
  output of x's shape feeds the next call; ``fwd``'s ``n`` and ``r`` are
  written by each call all the same: a kernel writes all its outputs)."""
  _, res = jax.jit(rules["fwd"])(x, gamma)
  kw = dict(rounds=rounds, inner=inner)
  return dict(
      f=_timed_loop(lambda c, gm: rules["f"](c, gm), x, gamma, **kw),
      fwd=_timed_loop(lambda c, gm: rules["fwd"](c, gm)[0], x, gamma, **kw),
      bwd=_timed_loop(lambda c, res: rules["bwd"](res, c)[0], g, res, **kw),
      fwd_bwd=_timed_loop(lambda c, x, gm: rules["fwd_bwd"](x, gm, c)[0], g,
                          x, gamma, **kw))


def _gbs(rec, array_bytes):
  """GB/s of each timed rule in ``rec`` (its arrays moved / median time)."""
  return {r: RMS_ARRAYS[r] * array_bytes / rec[r]["median_s"] / 1e9
          for r in RMS_ARRAYS if r in rec}


def search_rmsnorm(d, rounds, inner, m=8192):
  """Every (tile_bytes, gelu form) at ``m`` rows, beside XLA and a Pallas
  copy; ``chosen``: the candidate with the least total time of the four
  rules."""
  x, gamma, g = _rms_data(m, d)
  out = dict(hidden=d, rows=m, array_bytes=m * d * 2, candidates=[],
             pallas_copy=[])
  ref = lambda x, gm: RG.reference(x, gm)
  out["xla"] = dict(
      f=_timed_loop(ref, x, gamma, rounds=rounds, inner=inner),
      fwd_bwd=_timed_loop(lambda c, x, gm: jax.vjp(ref, x, gm)[1](c)[0], g, x,
                          gamma, rounds=rounds, inner=inner))
  t = _timed_loop(lambda c: c * 2, x, rounds=rounds, inner=inner)
  out["xla_copy"] = dict(time=t, gbs=2 * x.nbytes / t["median_s"] / 1e9)
  for tb in RMS_TILE_BYTES:
    try:
      t = _timed_loop(_pallas_copy(tb), x, rounds=rounds, inner=inner)
      out["pallas_copy"].append(dict(tile_bytes=tb, time=t,
                                     gbs=2 * x.nbytes / t["median_s"] / 1e9))
    except Exception as e:  # noqa: BLE001 - a candidate that fails is data
      out["pallas_copy"].append(dict(tile_bytes=tb, error=str(e)[:300]))
    for form in RG.TPU_GELU_FORMS:
      rec = dict(tile_bytes=tb, gelu=form)
      try:
        _, rules = RG.make_rmsnorm_gelu(target="tpu", tile_bytes=tb,
                                        gelu=form)
        rec.update(_rms_rule_times(rules, x, gamma, g, rounds, inner))
      except Exception as e:  # noqa: BLE001
        rec["error"] = f"{type(e).__name__}: {str(e)[:300]}"
      out["candidates"].append(rec)
      print(f"  rmsnorm_gelu d={d} tile {tb} {form}: " + (
          rec.get("error") or ", ".join(
              f"{r} {rec[r]['median_s'] * 1e6:.1f} us ({v:.0f} GB/s)"
              for r, v in _gbs(rec, out["array_bytes"]).items())), flush=True)
  ok = [c for c in out["candidates"] if all(r in c for r in RMS_ARRAYS)]
  if ok:
    best_c = min(ok, key=lambda c: sum(c[r]["median_s"] for r in RMS_ARRAYS))
    out["chosen"] = dict(tile_bytes=best_c["tile_bytes"], gelu=best_c["gelu"])
  return out


def rmsnorm_tokens(search, copy_gbs, rounds, inner, rows=RMS_ROWS):
  """The chosen candidate of ``search`` at each token count: GB/s per rule
  and its fraction of ``copy_gbs``, with the goal's verdict."""
  d, chosen = search["hidden"], search.get("chosen")
  out = []
  if not chosen:
    return out
  _, rules = RG.make_rmsnorm_gelu(target="tpu", **chosen)
  for m in rows:
    x, gamma, g = _rms_data(m, d)
    rec = dict(hidden=d, rows=m, array_bytes=m * d * 2, **chosen)
    try:
      t = _timed_loop(lambda c: c * 2, x, rounds=rounds, inner=inner)
      rec["xla_copy_gbs"] = 2 * x.nbytes / t["median_s"] / 1e9
      rec.update(_rms_rule_times(rules, x, gamma, g, rounds, inner))
      rec["gbs"] = _gbs(rec, rec["array_bytes"])
      rec["of_copy"] = {r: v / copy_gbs for r, v in rec["gbs"].items()}
      rec["met"] = all(v >= RMS_GOAL for v in rec["of_copy"].values())
    except Exception as e:  # noqa: BLE001
      rec["error"] = f"{type(e).__name__}: {str(e)[:300]}"
    del x, g
    out.append(rec)
    print(f"  rmsnorm_gelu d={d} M={m} {chosen}: " + (
        rec.get("error") or ", ".join(
            f"{r} {rec['gbs'][r]:.0f} GB/s ({rec['of_copy'][r]:.0%} of copy)"
            for r in RMS_ARRAYS) + f"; XLA's copy here {rec['xla_copy_gbs']:.0f}"
        f" GB/s: goal {R.verdict(rec['met'])}"),
        flush=True)
  return out


def ranked(search, kind):
  """``kind``'s candidates that ran, fastest first (by ``RANK_BY``)."""
  ok = [c for c in search["candidates"] if c["kind"] == kind
        and all(r in c for r in RANK_BY[kind])]
  return sorted(ok, key=lambda c: sum(c[r]["median_s"] for r in RANK_BY[kind]))


def step_compiles(d, tiles, m=8192, layers=8):
  """Whether accel_mlp's checkpointed step at hidden ``d`` compiles for every
  kernel row with ``tiles`` (None, or the first error)."""
  for impl in A.IMPLS:
    if impl == A.XLA:
      continue
    try:
      fn = A.stack_grad(A.build("gelu_matmul", impl, False, tpu_tiles=tiles))
      fn.lower(*A.arg_shapes("gelu_matmul", layers, m, d, jnp.bfloat16)
               ).compile()
    except Exception as e:  # noqa: BLE001 -- the answer is the error
      return f"{impl}: {type(e).__name__}: {str(e)[:300]}"
  return None


def choose(search):
  """Per kind the fastest candidate whose step compiles (see the module
  docstring); ``{"tiles": {kind: tiles}, "rejected": [...]}``."""
  d = search["hidden"]
  default = {k: tuple(PG.TPU_TILES[k]) for k in MM_CANDIDATES}
  order = {k: [tuple(c["tiles"]) for c in ranked(search, k)]
           for k in MM_CANDIDATES}
  fastest = {k: (order[k] or [default[k]])[0] for k in MM_CANDIDATES}
  err = step_compiles(d, fastest)
  if err is None:          # the usual case: one check
    return dict(tiles={k: list(v) for k, v in fastest.items()}, rejected=[])
  print(f"  d={d} {fastest}: the step does not compile: {err[:200]}",
        flush=True)
  rejected = [dict(kind="all", tiles=fastest, error=err)]
  chosen = default
  for kind in MM_CANDIDATES:
    for tiles in order[kind]:
      trial = dict(chosen, **{kind: tiles})
      err = step_compiles(d, trial)
      if err is None:
        chosen = trial
        break
      rejected.append(dict(kind=kind, tiles=tiles, error=err))
      print(f"  d={d} {kind} {tiles}: the step does not compile: {err[:200]}",
            flush=True)
  return dict(tiles={k: list(v) for k, v in chosen.items()}, rejected=rejected)


def best(search, rule):
  ok = [c for c in search["candidates"] if rule in c]
  return min(ok, key=lambda c: c[rule]["median_s"]) if ok else None


def main(argv=None):
  p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  p.add_argument("--hidden", type=int, nargs="+", default=[2048, 4096])
  p.add_argument("--rounds", type=int, default=5)
  p.add_argument("--inner", type=int, default=5)
  p.add_argument("--matmul-only", action="store_true",
                 help="no accuracy checks, no RMSNorm search")
  p.add_argument("--rms-only", action="store_true",
                 help="no matmul search (accuracy checks and RMSNorm only)")
  p.add_argument("--no-accuracy", action="store_true",
                 help="skip the accuracy checks")
  p.add_argument("--rms-tiles", type=int, nargs="+", default=RMS_TILE_BYTES)
  p.add_argument("--rms-hidden", type=int, nargs="+",
                 default=[1024, 2048, 4096])
  p.add_argument("--rms-rows", type=int, nargs="+", default=RMS_ROWS)
  p.add_argument("--out")
  args = p.parse_args(argv)
  if jax.default_backend() != "tpu":
    print("tpu_tiles: no TPU here; nothing measured (the kernels' CPU checks "
          "are in tests/test_pallas_*.py)")
    return None
  t0 = time.perf_counter()
  print(R.header())
  doc = dict(machine=R.machine(), versions=R.versions(), args=vars(args))

  def save():
    if args.out:
      with open(args.out, "w") as fh:
        json.dump(doc, fh, indent=1)
  doc["peaks"] = R.measured_peaks(args.rounds)
  print(f"peaks: bf16 matmul {doc['peaks']['TFLOP/s']:.1f} TFLOP/s, "
        f"copy {doc['peaks']['GB/s']:.1f} GB/s", flush=True)
  save()
  RMS_TILE_BYTES[:] = args.rms_tiles
  if not (args.matmul_only or args.no_accuracy):
    doc["accuracy"] = accuracy()
    bad = [r for r in doc["accuracy"] if not r["ok"]]
    print(f"accuracy: {len(doc['accuracy']) - len(bad)} of "
          f"{len(doc['accuracy'])} within tolerance; worst "
          + ", ".join(f"{r['kernel']} {r['dtype']} {r['shape']} "
                      f"fused={r['fused']} remat={r['remat']}: "
                      f"{r['value']:.1e}/{r['grad']:.1e}" for r in bad[:6]),
          flush=True)
    save()
  doc["gelu_matmul"], doc["rmsnorm_gelu"], doc["chosen"] = [], [], {}
  doc["rmsnorm_tokens"] = []
  if not args.matmul_only:
    for d in args.rms_hidden:
      doc["rmsnorm_gelu"].append(search_rmsnorm(d, args.rounds, args.inner))
      save()
      doc["rmsnorm_tokens"] += rmsnorm_tokens(
          doc["rmsnorm_gelu"][-1], doc["peaks"]["GB/s"], args.rounds,
          args.inner, args.rms_rows)
      save()
    done = [r for r in doc["rmsnorm_tokens"] if "met" in r]
    doc["rmsnorm_goal"] = dict(
        goal=f"each rule >= {RMS_GOAL:.0%} of the measured copy bandwidth",
        met=bool(done) and all(r["met"] for r in done),
        rows_met=sum(r["met"] for r in done), rows=len(done))
    print(f"goal rmsnorm_gelu rules >= {RMS_GOAL:.0%} of copy "
          f"({doc['peaks']['GB/s']:.0f} GB/s): "
          f"{R.verdict(doc['rmsnorm_goal']['met'])} "
          f"({doc['rmsnorm_goal']['rows_met']} of {len(done)} rows)",
          flush=True)
    save()
  for d in ([] if args.rms_only else args.hidden):
    doc["gelu_matmul"].append(search_matmul(d, args.rounds, args.inner))
    save()
    doc["chosen"][str(d)] = choose(doc["gelu_matmul"][-1])
    print(f"chosen at d={d}: {doc['chosen'][str(d)]['tiles']}", flush=True)
    save()
  for workload, what in (("gelu_matmul", lambda b: f"{b['kind']} {b['tiles']}"),
                         ("rmsnorm_gelu",
                          lambda b: f"tile {b['tile_bytes']} {b['gelu']}")):
    for s in doc[workload]:
      for rule in ("f", "fwd", "bwd", "fwd_bwd"):
        b = best(s, rule)
        if b:
          print(f"best {workload} d={s['hidden']} {rule}: {what(b)} "
                f"{b[rule]['median_s'] * 1e3:.3f} ms")
  print(f"Finished in {time.perf_counter() - t0:.1f} s.")
  return doc


if __name__ == "__main__":
  main()
