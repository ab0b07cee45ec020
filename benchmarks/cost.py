"""Work per training step under every remat policy, measured by XLA and by
counting kernel launches.

Columns: ``jax.custom_vjp``, ``jax.custom_vjp(optimize_remat=True)``,
smartvjp, smartvjp with a fused ``fwd_bwd``. Rows: no checkpoint and
``jax.checkpoint`` with each of JAX's policies, each crossed with four kinds
of rule for the layer ``gelu(x @ w)``:

* ``saveable``: JAX-coded rules, ``fwd`` returns ``(x, w, y)``, ``y = x @ w``;
* ``mixed``: JAX-coded, ``fwd`` also returns ``gelu'(y)`` (not a dot);
* ``kernel``: opaque kernels that count their launches
  (``tests/kernels.py``): like a ``pallas_call`` whose output is used, they
  run whole, residual writes included;
* ``named``: JAX-coded, the residual ``gelu'(y)`` named ``"res"`` with
  ``checkpoint_name``.

Per cell, for ``jit(grad(loss))`` of a ``lax.scan`` over layers (or, with
``--unrolled``, a Python loop; at the top level of a program XLA may merge a
rematerialized computation with the forward one, hiding the difference): XLA's
flops and bytes accessed (``cost_analysis``), temporary memory
(``memory_analysis().temp_size_in_bytes``) and kernel launches counted when
the step runs. Deterministic: the same program gives the same numbers.

Goals, each printed with a verdict (met / not met), over every cell and both
smartvjp columns (``smartvjp``, ``smartvjp+fwd_bwd``):

* against ``jax.custom_vjp``, which follows the policy as smartvjp does: no
  more flops, bytes accessed, temporary memory or kernel launches;
* against ``jax.custom_vjp(optimize_remat=True)``: no more flops and no
  more kernel launches. Its memory is not a goal: it recomputes what the
  policy saves, trading flops for memory against the user's policy; a
  further goal checks that wherever smartvjp holds more bytes or temporary
  memory than it, ``optimize_remat`` pays for that with more flops or
  launches in the same cell;
* the mixed-residual case (last lines): smartvjp no more flops
  per loop trip than ``jax.custom_vjp``, and fewer than ``optimize_remat``.

Flops and bytes accessed are compared with a slack of ``XLA_SLACK`` (16) per
layer: XLA's count of the same program varies by a unit or two with the shapes
of the zero-flop custom calls around it (one flop and one byte, at the small
sizes of ``--smoke``), while every real operation here costs at least
``batch * width`` flops and bytes. Temporary memory and launches are compared
exactly.

The ``kernel`` rows' flops are n/a: their kernels are host callbacks, which
XLA's cost analysis counts as zero flops, so that column holds only the few
operations around them (the loss) and its ratio says nothing; compare their
launches, bytes and memory instead.

Run:    python benchmarks/cost.py [--batch 256 --width 512 --layers 4 --unrolled]
Smoke:  python benchmarks/cost.py --smoke   (batch 16, width 32, 2 layers,
        fast compile: checks the script and the goals at a small size)
"""

from __future__ import annotations

import argparse
import os
import sys
import time

import jax
import jax.numpy as jnp
import numpy as np
from jax.ad_checkpoint import checkpoint_name

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.join(HERE, os.pardir, "tests"))
sys.path.insert(1, HERE)
sys.path.insert(2, os.path.join(HERE, os.pardir))
import _report as R  # noqa: E402
import kernels as K  # noqa: E402

from smartvjp import smart_custom_vjp  # noqa: E402

IMPLS = ("jax.custom_vjp", "optimize_remat", "smartvjp", "smartvjp+fwd_bwd")
KINDS = ("saveable", "mixed", "kernel", "named")
_P = jax.checkpoint_policies
POLICIES = {
    "no checkpoint": None,
    "nothing_saveable": _P.nothing_saveable,
    "everything_saveable": _P.everything_saveable,
    "dots_saveable": _P.dots_saveable,
    "checkpoint_dots": _P.checkpoint_dots,
    "dots_with_no_batch_dims_saveable": _P.dots_with_no_batch_dims_saveable,
    "checkpoint_dots_with_no_batch_dims":
        _P.checkpoint_dots_with_no_batch_dims,
    "save_only_these_names(res)": _P.save_only_these_names("res"),
    "save_any_names_but_these(other)": _P.save_any_names_but_these("other"),
    "save_anything_except_these_names(res)":
        _P.save_anything_except_these_names("res"),
    "save_from_both_policies(dots, res)": _P.save_from_both_policies(
        _P.dots_saveable, _P.save_only_these_names("res")),
    "save_and_offload_only_these_names(res)":
        _P.save_and_offload_only_these_names(
            names_which_can_be_saved=[], names_which_can_be_offloaded=["res"],
            offload_src="device", offload_dst="pinned_host"),
}


# -- the layer's rules ----------------------------------------------------------

def _dgelu(y):
  """gelu'(y), elementwise."""
  return jax.jvp(jax.nn.gelu, (y,), (jnp.ones_like(y),))[1]


def _np_gelu(y):
  c = np.sqrt(2 / np.pi).astype(y.dtype)
  return 0.5 * y * (1 + np.tanh(c * (y + 0.044715 * y ** 3)))


def _np_dgelu(y):
  c = np.sqrt(2 / np.pi).astype(y.dtype)
  t = np.tanh(c * (y + 0.044715 * y ** 3))
  return 0.5 * (1 + t) + 0.5 * y * (1 - t ** 2) * c * (1 + 3 * 0.044715 * y ** 2)


def _backward(x, w, d, g):
  dy = g * d
  return dy @ w.T, x.T @ dy


def jax_rules(kind):
  """(f, fwd, bwd, fwd_bwd) in JAX for ``saveable``, ``mixed``, ``named``."""
  def f(x, w):
    return jax.nn.gelu(x @ w)

  def fwd(x, w):
    y = x @ w
    if kind == "saveable":
      return jax.nn.gelu(y), (x, w, y)
    d = _dgelu(y)
    if kind == "named":
      d = checkpoint_name(d, "res")
    return jax.nn.gelu(y), (x, w, d)

  def bwd(res, g):
    x, w, r = res
    return _backward(x, w, _dgelu(r) if kind == "saveable" else r, g)

  def fwd_bwd(x, w, g):
    return _backward(x, w, _dgelu(x @ w), g)

  return f, fwd, bwd, fwd_bwd


def kernel_rules():
  """(f, fwd, bwd, fwd_bwd), each one opaque counting kernel."""
  k = lambda *a: K.kernel(*a, never_dce=True)

  def f(x, w):
    (z,) = k("f", lambda x, w: (_np_gelu(x @ w),), [x @ w], x, w)
    return z

  def fwd(x, w):
    z, y = k("fwd", lambda x, w: (_np_gelu(x @ w), x @ w), [x @ w] * 2, x, w)
    return z, (x, w, y)

  def bwd(res, g):
    x, w, y = res

    def run(x, w, y, g):
      dy = g * _np_dgelu(y)
      return dy @ w.T, x.T @ dy
    return tuple(k("bwd", run, [x, w], x, w, y, g))

  def fwd_bwd(x, w, g):
    def run(x, w, g):
      dy = g * _np_dgelu(x @ w)
      return dy @ w.T, x.T @ dy
    return tuple(k("fwd_bwd", run, [x, w], x, w, g))

  return f, fwd, bwd, fwd_bwd


def make(impl, kind):
  f, fwd, bwd, fwd_bwd = kernel_rules() if kind == "kernel" else jax_rules(kind)
  if impl.startswith("smartvjp"):
    F = smart_custom_vjp(f)
    F.defvjp(fwd, bwd, fwd_bwd=fwd_bwd if impl.endswith("fwd_bwd") else None)
  else:
    F = jax.custom_vjp(f)
    F.defvjp(fwd, bwd, optimize_remat=impl == "optimize_remat")
  return F


# -- one cell -----------------------------------------------------------------

def _inputs(batch, width, layers):
  x = jnp.asarray(np.random.RandomState(0).randn(batch, width), jnp.float32)
  ws = tuple(jnp.full((width, width), 1.0 / width, jnp.float32) * (i + 1)
             for i in range(layers))
  return x, ws


def step(impl, kind, policy_name, scan=False):
  """``jit(grad(loss))`` of a stack of layers, unrolled or a ``lax.scan``."""
  F = make(impl, kind)
  policy = POLICIES[policy_name]
  layer = F if policy_name == "no checkpoint" else jax.checkpoint(
      F, policy=policy)

  def loss(x, ws):
    if scan:
      x, _ = jax.lax.scan(lambda h, w: (layer(h, w), None), x, ws)
    else:
      for w in ws:
        x = layer(x, w)
    return jnp.sum(x ** 2)
  return jax.jit(jax.grad(loss, argnums=(0, 1)))


def _first(d):
  return d[0] if isinstance(d, (list, tuple)) else d


# XLA options that make compilation faster without changing the optimized
# HLO that cost and memory analysis read (only machine-code generation)
FAST_COMPILE = {"xla_backend_optimization_level": 0,
                "xla_llvm_disable_expensive_passes": True}


def measure(impl, kind, policy_name, batch, width, layers, scan=False,
            compiler_options=None):
  """``dict(flops, bytes, temp, launches)``: XLA's flops and bytes accessed
  per layer (XLA counts a loop body once: per trip of a scan, the unrolled
  program's divided by its layers), temporary memory and kernel launches per
  step; ``None`` where this backend cannot compile the program (offloading
  on a backend without host memory spaces)."""
  x, ws = _inputs(batch, width, layers)
  if scan:
    ws = jnp.stack(ws)
  fn = step(impl, kind, policy_name, scan)
  try:
    compiled = fn.lower(x, ws).compile(compiler_options)
  except Exception:  # noqa: BLE001 - a backend without the memory space
    if "offload" in policy_name:
      return None
    raise
  cost = _first(compiled.cost_analysis())
  temp = compiled.memory_analysis().temp_size_in_bytes
  K.reset()
  jax.block_until_ready(compiled(x, ws))
  per = 1 if scan else layers
  return dict(flops=float(cost.get("flops", 0.0)) / per,
              bytes=float(cost.get("bytes accessed", 0.0)) / per,
              temp=int(temp),
              launches=sum(K.COUNTS.values()))


def table(batch=256, width=512, layers=4, kinds=KINDS, policies=None,
          scan=True, compiler_options=None):
  """``{(policy, kind): {impl: cell}}`` for every row and column."""
  policies = list(POLICIES) if policies is None else policies
  return {(p, k): {i: measure(i, k, p, batch, width, layers, scan,
                              compiler_options)
                   for i in IMPLS}
          for p in policies for k in kinds}


XLA_SLACK = 16   # flops or bytes per layer: see the module docstring
SLACK = {"flops": XLA_SLACK, "bytes": XLA_SLACK}
SMART = ("smartvjp", "smartvjp+fwd_bwd")
BASE, OPT = "jax.custom_vjp", "optimize_remat"
METRICS = ("flops", "bytes", "temp", "launches")


def _ratio(a, b):
  """``a / b`` for the table; n/a where ``b`` is 0 (nothing to compare)."""
  if b == 0:
    return "n/a" if a == 0 else "inf"
  return f"{a / b:.2f}"


def _at_most(c, anchor, metric):
  return c[metric] <= anchor[metric] + SLACK.get(metric, 0)


def _pays(c, opt):
  """``optimize_remat`` does more flops or launches than cell ``c``."""
  return opt["flops"] > c["flops"] + XLA_SLACK or opt["launches"] > c["launches"]


def _more_memory(c, opt):
  """Cell ``c`` accesses more bytes or holds more temporary memory."""
  return c["bytes"] > opt["bytes"] + XLA_SLACK or c["temp"] > opt["temp"]


def cell_failures(row):
  """``{impl: [goals it misses]}`` for the smartvjp columns of one row (by the
  module docstring's goals; an empty list where every goal holds)."""
  out = {}
  base, opt = row[BASE], row[OPT]
  for impl in SMART:
    c, bad = row[impl], []
    if c is not None and base is not None:
      bad += [f"{m} > {BASE}" for m in METRICS if not _at_most(c, base, m)]
      bad += [f"{m} > {OPT}" for m in ("flops", "launches")
              if not _at_most(c, opt, m)]
      if _more_memory(c, opt) and not _pays(c, opt):
        bad.append(f"memory > {OPT} without fewer flops or launches")
    out[impl] = bad
  return out


def check_goals(results, goals, issue=None):
  """Adds the module docstring's goals, judged over every cell of
  ``results`` (``table()``'s) and the ``issue`` case (``issue_cells()``'s),
  to ``goals`` (an ``R.Goals``)."""
  cells = [(p, k, impl, row) for (p, k), row in results.items()
           for impl in SMART if row[BASE] is not None and row[impl] is not None]
  n = len(cells)

  def where(bad):
    shown = ", ".join(f"{impl} {p}/{k}" for p, k, impl, _ in bad[:4])
    return f"; missed in {len(bad)}: {shown}{' ...' if len(bad) > 4 else ''}"

  for anchor, metrics in ((BASE, METRICS), (OPT, ("flops", "launches"))):
    for m in metrics:
      bad = [(p, k, impl, row) for p, k, impl, row in cells
             if not _at_most(row[impl], row[anchor], m)]
      slack = (f" + {SLACK[m]} (XLA's counting slack per layer)"
               if m in SLACK else "")
      goals.check(f"{m}: smartvjp <= {anchor}{slack} in every cell ({n} "
                  f"cells, both smartvjp columns{where(bad) if bad else ''})", not bad)
  trade = [(p, k, impl, row) for p, k, impl, row in cells
           if _more_memory(row[impl], row[OPT])]
  unpaid = [c for c in trade if not _pays(c[3][c[2]], c[3][OPT])]
  goals.check(f"memory: where smartvjp holds more than {OPT} ({len(trade)} "
              f"cells), {OPT} does more flops or launches"
              f"{where(unpaid) if unpaid else ''}", not unpaid)
  for p, c in (issue or {}).items():
    goals.check(f"mixed-residual case, {p}: smartvjp flops <= {BASE} + "
                f"{XLA_SLACK} and < {OPT} ({c['smartvjp']['flops']:.4g} vs "
                f"{c[BASE]['flops']:.4g} and {c[OPT]['flops']:.4g} flops per "
                "trip)",
                _at_most(c["smartvjp"], c[BASE], "flops")
                and c["smartvjp"]["flops"] + XLA_SLACK < c[OPT]["flops"])


def _units(cells):
  """(flop unit, scale, byte unit, scale): G and M, or M and K where every
  figure is under one of the larger unit."""
  cells = [c for c in cells if c is not None]
  big_f = max((c["flops"] for c in cells), default=0) >= 1e8
  big_b = max((max(c["bytes"], c["temp"]) for c in cells), default=0) >= 1e6
  return (("GFLOP", 1e9) if big_f else ("MFLOP", 1e6)) + (
      ("MB", 1e6) if big_b else ("KB", 1e3))


def render(results) -> str:
  fu, fs, bu, bs = _units(c for row in results.values() for c in row.values())
  head = (f"{'policy':40} {'rules':9} " + " ".join(
      f"{i:>27}" for i in IMPLS))
  lines = [f"per cell: {fu} per layer / {bu} accessed per layer / temp {bu} / "
           "kernel launches (flops ratio to jax.custom_vjp);",
           "kernel rows: flops n/a (their kernels are host callbacks, which "
           "XLA's cost analysis counts as 0 flops);",
           "* after a smartvjp cell: it misses a goal (listed at the end)",
           head, "-" * len(head)]
  for (p, k), row in results.items():
    base = row[BASE]
    failures = cell_failures(row)
    cells = []
    for i in IMPLS:
      c = row[i]
      if c is None:
        cells.append(f"{'n/a':>27}")
        continue
      if k == "kernel":
        flops, ratio = "n/a", "n/a"
      else:
        flops = f"{c['flops'] / fs:.3f}"
        ratio = _ratio(c["flops"], base["flops"]) if base else "n/a"
      mark = "*" if failures.get(i) else " "
      text = (f"{flops}/{c['bytes'] / bs:.1f}/{c['temp'] / bs:.1f}/"
              f"{c['launches']} ({ratio}){mark}")
      cells.append(f"{text:>27}")
    lines.append(f"{p:40} {k:9} " + " ".join(cells))
  return "\n".join(lines)


def issue_cells(batch=256, width=512, layers=8, compiler_options=None):
  """``{policy: {impl: cell}}`` of the mixed-residual case."""
  return {p: {i: measure(i, "mixed", p, batch, width, layers, scan=True,
                         compiler_options=compiler_options) for i in IMPLS}
          for p in ("dots_saveable", "dots_with_no_batch_dims_saveable")}


def issue_case(batch=256, width=512, layers=8, cells=None) -> str:
  """The mixed-residual case: a ``lax.scan`` of ``layers``
  checkpointed layers under ``dots_saveable`` and
  ``dots_with_no_batch_dims_saveable``, GFLOP per loop trip."""
  cells = issue_cells(batch, width, layers) if cells is None else cells
  fu, fs, _, _ = _units(c for row in cells.values() for c in row.values())
  lines = [f"the mixed-residual case: lax.scan of {layers} checkpointed gelu(x @ w) "
           f"layers, batch {batch}, width {width}, fwd returns (x, w, y, "
           f"gelu'(y)); {fu} per loop trip:"]
  for p, row in cells.items():
    base = row[BASE]["flops"]
    lines.append(f"  {p:34} " + "  ".join(
        f"{i} {c['flops'] / fs:.3f} ({c['flops'] / base:.2f}x)"
        for i, c in row.items()))
  return "\n".join(lines)


def main(argv=None):
  ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  ap.add_argument("--batch", type=int, default=None, help="default 256 (smoke 16)")
  ap.add_argument("--width", type=int, default=None, help="default 512 (smoke 32)")
  ap.add_argument("--layers", type=int, default=None,
                  help="layers of the table (default 4; smoke 2); the "
                  "mixed-residual case has 8 (smoke 2)")
  ap.add_argument("--unrolled", action="store_true",
                  help="a Python loop of layers instead of a lax.scan")
  ap.add_argument("--smoke", action="store_true",
                  help="small sizes and fast compilation (same cost analysis)")
  args = ap.parse_args(argv)
  t0 = time.perf_counter()
  pick = lambda given, full, small: given if given is not None else (
      small if args.smoke else full)
  batch, width = pick(args.batch, 256, 16), pick(args.width, 512, 32)
  layers = pick(args.layers, 4, 2)
  issue_layers = 2 if args.smoke else 8
  options = FAST_COMPILE if args.smoke else None
  print(R.header())
  print(f"jit(grad(loss)) of {layers} layers gelu(x @ w), batch {batch}, width "
        f"{width}, {'unrolled' if args.unrolled else 'in a lax.scan'}; "
        "deterministic (XLA's cost and memory\nanalysis, launches counted at "
        "run time): one run, no spread")
  results = table(batch, width, layers, scan=not args.unrolled,
                  compiler_options=options)
  print(render(results))
  print()
  issue = issue_cells(batch, width, issue_layers, options)
  print(issue_case(batch, width, issue_layers, cells=issue))
  goals = R.Goals()
  check_goals(results, goals, issue)
  print()
  print(goals.render())
  print(f"\nFinished in {time.perf_counter() - t0:.1f} s.")
  return results, goals


if __name__ == "__main__":
  main()
