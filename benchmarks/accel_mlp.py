"""Accelerator benchmark (TPU or GPU): Pallas kernels in a checkpointed stack.

Two workloads, each a ``jax.lax.scan`` over ``L`` layers with
``jax.checkpoint`` per layer (``nothing_saveable``), differentiated with
``jax.jit(jax.grad(...))``:

* ``gelu_matmul``: ``x <- gelu(x @ w_l)`` (``examples/pallas_gelu_matmul.py``),
  compute-bound; throughput is TFLOP/s of the useful work (forward ``2MKN`` +
  backward ``4MKN`` per layer; remat recomputation not counted);
* ``rmsnorm_gelu``: ``x <- gelu(rmsnorm(x) * gamma_l)``
  (``examples/pallas_rmsnorm_gelu.py``), memory-bound; throughput is GB/s of
  the useful traffic (forward reads x, writes z; backward reads x, g, writes
  dx: 5 arrays of ``M x D`` per layer).

The kernels are the examples' for the backend JAX runs on (Mosaic on a TPU,
Triton on a GPU). Rows, side by side in one run: ``xla`` (the same math in
``jax.numpy``, no kernel: what a user picks instead of writing one),
``jax.custom_vjp``, ``jax.custom_vjp`` with ``optimize_remat=True``,
smartvjp, and smartvjp with the fused ``fwd_bwd``. For each workload, hidden
size and row:

* step time: ``--rounds`` interleaved rounds after a warm-up of each; round
  ``r`` runs every row once, in an order rotated by ``r``; each sample is
  ``inner`` back-to-back steps (chosen so a sample lasts at least
  ``--min-sample-ms``). Median, min/max, quartiles, and the ratio to
  ``jax.custom_vjp`` (of the medians, and the median of the per-round ratios);
* **ideal**: the step predicted from each rule's kernels timed alone at the
  same shapes (``--rounds`` rounds each): ``L x (fwd + fwd + bwd)`` for
  ``jax.custom_vjp``, ``L x (f + fwd + bwd)`` for ``optimize_remat`` and
  smartvjp, ``L x (f + fwd_bwd)`` with the fused rule; printed beside each
  row as step / ideal;
* throughput against **this chip's measured peak**: a bf16 ``8192^3`` matmul
  and a 1 GiB copy timed in the same run (not a vendor figure);
* memory of the compiled step, from XLA's ``memory_analysis()``: temporaries,
  arguments and outputs (each part, and their sum). It is per program and
  deterministic; the process-wide ``device.memory_stats()`` is recorded once,
  as context only;
* largest batch: the largest multiple of ``--granule`` whose compiled step
  (temp + arguments + outputs) fits in the budget (``bytes_limit`` of the
  device's ``memory_stats()``, or ``--budget-gib``). Compile-only: lowered
  from ``jax.ShapeDtypeStruct`` arguments, nothing is allocated or run at that
  batch. The step compiled for timing gives one point; a line
  ``memory = a + b * batch`` through the points nearest the budget predicts
  each next probe (the first from that one point and the batch-independent
  bytes: parameters in, gradients out), then bisection in granules if the
  line misses. Each search reports its compiles;
* gradients: the largest difference from ``jax.custom_vjp``'s, relative to
  its largest entry (the kernel rows are meant to be bitwise equal).

Goals, each printed with a verdict (met / not met; in the JSON as
``goals``), per workload and hidden size:

* smartvjp (both rows): step time at most ``jax.custom_vjp``'s, compiled
  memory no more, largest batch at least as large; within
  ``IDEAL_TOLERANCE`` (5%) of its ideal step;
* ``rmsnorm_gelu``: smartvjp at most ``RMS_SMART`` (0.92x) of
  ``jax.custom_vjp``'s step, the fused rule at most ``RMS_FUSED`` (0.70x), and
  the fused rule faster than ``xla``;
* ``gelu_matmul``: the kernels' step (smartvjp, each row) at least
  ``MATMUL_VS_XLA`` (0.95x) of ``xla``'s throughput.

On a CPU (``--smoke``, interpret mode) the step-time goals say nothing about
an accelerator; the script says so.

Compiles run in a thread pool (``--compile-workers``; XLA compiles without
the GIL), lowering stays on the main thread; timing runs only once no compile
is in flight. The JSON (``--out``) is rewritten after every finished
measurement (temporary file + rename), so a run cut off keeps what it
finished; ``--deadline`` stops starting new measurements after that many
seconds and marks the rest as skipped. ``--from-json`` prints the tables (and
with ``--markdown`` a table for the README) from a saved file.

Run on a TPU or GPU:  python benchmarks/accel_mlp.py [--hidden 2048 4096]
Smoke test:    python benchmarks/accel_mlp.py --smoke   (tiny shapes,
               interpret mode, a 1 MiB budget; CPU ok; JSON to a temporary
               file)
Tables only:   python benchmarks/accel_mlp.py --from-json FILE.json --markdown
"""

from __future__ import annotations

import argparse
import collections
import concurrent.futures
import datetime
import hashlib
import inspect
import json
import math
import os
import statistics
import sys
import tempfile
import time

import jax
import jax.numpy as jnp

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
sys.path.insert(0, os.path.join(ROOT, "examples"))
sys.path.insert(1, ROOT)   # smartvjp from this checkout where it is not installed
sys.path.insert(2, HERE)
import _report as R  # noqa: E402
import pallas_gelu_matmul as PG  # noqa: E402
import pallas_rmsnorm_gelu as RG  # noqa: E402

SCHEMA = "smartvjp/accel_mlp/4"   # 4: xla and ideal rows, measured peaks
IMPLS = ("xla", "jax.custom_vjp", "optimize_remat", "smartvjp",
         "smartvjp+fused")
BASE = "jax.custom_vjp"
XLA = "xla"
SMART = ("smartvjp", "smartvjp+fused")
STEP_TOLERANCE = 1.00     # smartvjp at or below jax.custom_vjp
IDEAL_TOLERANCE = 1.05
RMS_SMART, RMS_FUSED = 0.92, 0.70
MATMUL_VS_XLA = 0.95
# rule kernels per step and layer, by row (the ideal step)
IDEAL_RULES = {"jax.custom_vjp": ("fwd", "fwd", "bwd"),
               "optimize_remat": ("f", "fwd", "bwd"),
               "smartvjp": ("f", "fwd", "bwd"),
               "smartvjp+fused": ("f", "fwd_bwd")}
WORKLOADS = ("gelu_matmul", "rmsnorm_gelu")
UNITS = {"gelu_matmul": "TFLOP/s", "rmsnorm_gelu": "GB/s"}
DEFAULT_OUT = os.path.join(HERE, "results", "accel_mlp.json")
MEMORY_PARTS = (("temp_bytes", "temp_size_in_bytes"),
                ("argument_bytes", "argument_size_in_bytes"),
                ("output_bytes", "output_size_in_bytes"),
                ("alias_bytes", "alias_size_in_bytes"),
                ("generated_code_bytes", "generated_code_size_in_bytes"),
                ("xla_peak_bytes", "peak_memory_in_bytes"))


# -- the programs -----------------------------------------------------------------

def _accepts(fn, name):
  params = inspect.signature(fn).parameters
  return name in params or any(p.kind is p.VAR_KEYWORD for p in params.values())


def kernel_options(workload, interpret, block=None, block_k=None, target=None):
  """Keyword arguments for the example's builder: ``block`` is ``block_m`` =
  ``block_n`` for the matmul and ``block_m`` for RMSNorm (None: the builder's
  default); ``block_k`` only where the matmul builder takes it."""
  kw = {"interpret": interpret}
  if target:
    kw["target"] = target
  if block:
    kw["block_m"] = block
    if workload == "gelu_matmul":
      kw["block_n"] = block
  if block_k and workload == "gelu_matmul" and _accepts(PG.make_gelu_matmul,
                                                         "block_k"):
    kw["block_k"] = block_k
  return kw


def xla_layer(workload):
  """The workload's math in ``jax.numpy`` (no kernel), in the kernels'
  precision: f32 accumulation and GELU, the result in the input dtype."""
  if workload == "gelu_matmul":
    return lambda x, w: PG.gelu(jax.lax.dot(
        x, w, preferred_element_type=jnp.float32)).astype(x.dtype)
  return RG.reference


def build(workload, impl, interpret, block=None, block_k=None, target=None,
          tpu_tiles=None):
  """One layer ``op(x, p)`` of ``workload`` under implementation ``impl``;
  ``tpu_tiles``: the matmul's TPU tiles (``make_gelu_matmul``'s)."""
  if impl == XLA:
    return xla_layer(workload)
  maker = PG.make_gelu_matmul if workload == "gelu_matmul" else RG.make_rmsnorm_gelu
  kw = kernel_options(workload, interpret, block, block_k, target)
  if tpu_tiles and workload == "gelu_matmul":
    kw["tpu_tiles"] = tpu_tiles
  op, rules = maker(fused=impl == "smartvjp+fused", **kw)
  if impl.startswith("smartvjp"):
    return op
  F = jax.custom_vjp(rules["f"])
  F.defvjp(rules["fwd"], rules["bwd"], optimize_remat=impl == "optimize_remat")
  return F


def stack_grad(op, workload=None):
  """``jit(grad(loss))`` of a scanned stack of checkpointed ``op`` layers."""
  layer = jax.checkpoint(op)

  def loss(params, x):
    def body(x, p):
      return layer(x, p), None
    x, _ = jax.lax.scan(body, x, params)
    return jnp.sum(x.astype(jnp.float32) ** 2)
  return jax.jit(jax.grad(loss))


def param_shape(workload, layers, d):
  return (layers, d, d) if workload == "gelu_matmul" else (layers, d)


def arg_shapes(workload, layers, m, d, dtype):
  return (jax.ShapeDtypeStruct(param_shape(workload, layers, d), dtype),
          jax.ShapeDtypeStruct((m, d), dtype))


def make_inputs(workload, layers, m, d, dtype):
  kx, kp = jax.random.split(jax.random.key(0))
  x = (jax.random.normal(kx, (m, d)) * 0.5).astype(dtype)
  if workload == "gelu_matmul":
    params = (jax.random.normal(kp, (layers, d, d)) / d ** 0.5).astype(dtype)
  else:
    params = (1.0 + 0.1 * jax.random.normal(kp, (layers, d))).astype(dtype)
  return params, x


def memory_parts(compiled):
  """XLA's ``memory_analysis()`` of a compiled step, by part, and ``total_bytes``
  = temp + arguments + outputs (the figure every comparison here uses)."""
  analysis = compiled.memory_analysis()
  if analysis is None:
    return None
  parts = {k: int(getattr(analysis, a)) for k, a in MEMORY_PARTS
           if getattr(analysis, a, None) is not None}
  parts["total_bytes"] = sum(parts.get(k, 0) for k in (
      "temp_bytes", "argument_bytes", "output_bytes"))
  return parts


def program_memory(compiled):
  """temp + argument + output bytes of the compiled step (None if unknown)."""
  parts = memory_parts(compiled)
  return None if parts is None else parts["total_bytes"]


def useful_work(workload, layers, m, d, itemsize):
  """(amount, scale) with amount / seconds / scale in ``UNITS[workload]``."""
  if workload == "gelu_matmul":
    return 6 * m * d * d * layers, 1e12     # fwd 2MKN + bwd 4MKN, K = N = d
  return 5 * m * d * itemsize * layers, 1e9  # x, z forward; x, g, dx backward


# -- largest batch ------------------------------------------------------------------

BatchSearch = R.BatchSearch   # the search lives in _report (tpu_lm uses it too)


# -- the results document ------------------------------------------------------------

def now():
  return datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds")


def file_sha256(path):
  try:
    with open(path, "rb") as fh:
      return hashlib.sha256(fh.read()).hexdigest()[:16]
  except OSError:
    return None


def machine_info():
  """(machine, versions) for the JSON: ``_report.machine()`` (CPU model and
  cores, host, device kind and count, ``bytes_limit``) and
  ``_report.versions()`` (jax, jaxlib, Python, numpy, commit)."""
  return R.machine(), R.versions()


def save(doc, path):
  """Writes ``doc`` to ``path`` atomically (temporary file, then rename)."""
  derive(doc)
  doc["updated"] = now()
  folder = os.path.dirname(os.path.abspath(path))
  os.makedirs(folder, exist_ok=True)
  fd, tmp = tempfile.mkstemp(prefix=".accel_mlp.", suffix=".tmp", dir=folder)
  with os.fdopen(fd, "w") as fh:
    json.dump(doc, fh, indent=1)
  os.replace(tmp, path)


def _ok(section):
  return isinstance(section, dict) and section.get("status") == "ok"


def goals_of(doc):
  """The module docstring's goals, judged on the results there are (a goal
  whose measurements are missing, skipped or failed is not judged)."""
  goals = R.Goals()
  index = {(r["workload"], r["hidden"], r["impl"]): r for r in doc["results"]}
  median = lambda r: r["step"]["median_s"] if r and _ok(r.get("step")) else None
  for (workload, hidden, impl), r in index.items():
    base = index.get((workload, hidden, BASE))
    xla = index.get((workload, hidden, XLA))
    if impl not in SMART or base is None:
      continue
    where = f"{workload}/{hidden} {impl}"
    mem, bmem = r.get("memory"), base.get("memory")
    if _ok(mem) and _ok(bmem):
      goals.check(f"memory: {where} <= jax.custom_vjp ("
                  f"{fmt_bytes(mem['total_bytes'])} vs "
                  f"{fmt_bytes(bmem['total_bytes'])})",
                  mem["total_bytes"] <= bmem["total_bytes"])
    big, bbig = r.get("largest_batch"), base.get("largest_batch")
    if _ok(big) and _ok(bbig):
      goals.check(f"largest batch: {where} >= jax.custom_vjp ({big['batch']} "
                  f"vs {bbig['batch']})", big["batch"] >= bbig["batch"])
    mine, theirs = median(r), median(base)
    if mine is None or theirs is None:
      continue
    ratio = mine / theirs
    paired = r["step"].get("paired_ratio_median")
    said = (f"ratio {ratio:.3f}" + (f", paired {paired:.3f}" if paired is not
                                     None else ""))
    limit = STEP_TOLERANCE
    if workload == "rmsnorm_gelu":
      limit = RMS_FUSED if impl == "smartvjp+fused" else RMS_SMART
    goals.check(f"step time: {where} median <= {limit:.2f}x jax.custom_vjp "
                f"({said})", ratio <= limit)
    if r.get("ideal"):
      goals.check(f"ideal: {where} within {IDEAL_TOLERANCE:.2f}x of its ideal "
                  f"step ({mine / r['ideal']['step_s']:.3f}x)",
                  mine <= IDEAL_TOLERANCE * r["ideal"]["step_s"])
    if median(xla) is not None:
      if workload == "gelu_matmul":
        goals.check(f"vs XLA: {where} throughput >= {MATMUL_VS_XLA:.2f}x xla's "
                    f"({median(xla) / mine:.3f}x)",
                    median(xla) / mine >= MATMUL_VS_XLA)
      elif impl == "smartvjp+fused":
        goals.check(f"vs XLA: {where} faster than xla "
                    f"({mine / median(xla):.3f}x its step)",
                    mine < median(xla))
  return goals


def derive(doc):
  """Fills in the ratios to ``jax.custom_vjp`` (step time, memory, largest
  batch) for every record whose baseline is there, and the goals."""
  index = {(r["workload"], r["hidden"], r["impl"]): r for r in doc["results"]}
  for r in doc["results"]:
    base = index.get((r["workload"], r["hidden"], BASE))
    for name, field in (("step", "median_s"), ("memory", "total_bytes"),
                        ("largest_batch", "batch")):
      mine = r.get(name)
      if not _ok(mine):
        continue
      theirs = base.get(name) if base else None
      mine["ratio_to_custom_vjp"] = (
          mine[field] / theirs[field] if _ok(theirs) and theirs[field] else None)
  doc["goals"] = goals_of(doc).as_list()


# -- tables ------------------------------------------------------------------------

def fmt_bytes(n):
  if n is None:
    return "n/a"
  for unit, scale in (("GiB", 2**30), ("MiB", 2**20), ("KiB", 2**10)):
    if n >= scale:
      return f"{n / scale:.2f} {unit}"
  return f"{n} B"


def memory_unit(doc):
  """GiB, or MiB where every figure (and the budget) is under 1 GiB."""
  sizes = [r["memory"]["total_bytes"] for r in doc["results"] if _ok(r.get("memory"))]
  sizes.append(doc["config"].get("budget_bytes") or 0)
  return ("GiB", 2**30) if max(sizes) >= 2**30 else ("MiB", 2**20)


def _ratio(x):
  return "" if x is None else f"{x:.3f}x"


def _cell(r, name, fmt):
  s = r.get(name)
  if not isinstance(s, dict):
    return "-"
  if s.get("status") != "ok":
    return s.get("status", "-")
  return fmt(s)


def row_cells(r, scale):
  """The printed cells of one record (a section's status where it is not ok)."""
  ratio = lambda s: _ratio(s.get("ratio_to_custom_vjp"))
  rate = r.get("throughput") or {}
  diff = r.get("grad_max_rel_diff")
  return dict(
      step=_cell(r, "step", lambda s: f"{s['median_s'] * 1e3:.3f}"),
      spread=_cell(r, "step", lambda s: f"[{s['min_s'] * 1e3:.3f}-"
                   f"{s['max_s'] * 1e3:.3f}]"),
      step_ratio=_cell(r, "step", ratio),
      rate=_cell(r, "step", lambda s: f"{rate['value']:.2f}"),
      peak=_cell(r, "step",
                 lambda s: "-" if rate.get("fraction_of_peak") is None
                 else f"{100 * rate['fraction_of_peak']:.1f}%"),
      ideal=_cell(r, "step", lambda s: "-" if not r.get("ideal") else
                  f"{s['median_s'] / r['ideal']['step_s']:.3f}x"),
      memory=_cell(r, "memory", lambda s: f"{s['total_bytes'] / scale:.3f}"),
      memory_ratio=_cell(r, "memory", ratio),
      largest=_cell(r, "largest_batch", lambda s: f"{s['batch']}"),
      largest_ratio=_cell(r, "largest_batch", ratio),
      compiles=_cell(r, "largest_batch", lambda s: f"{s['compiles']}"),
      diff="-" if diff is None else f"{diff:.1e}")


def tables(doc):
  """Human-readable tables, one per workload, with ratios to jax.custom_vjp."""
  cfg, lines = doc["config"], []
  m, v = doc["machine"], doc["versions"]
  unit_m, scale = memory_unit(doc)
  lines.append(R.header(m, v) + f"; status {doc['status']}")
  lines.append(
      f"{cfg['layers']} checkpointed layers in a scan, batch {cfg['batch']}, "
      f"{cfg['dtype']}; step: median [min-max] of {cfg['rounds']} interleaved "
      f"rounds; memory: compiled step temp + args + outputs ({unit_m}); largest "
      f"batch: under {fmt_bytes(cfg['budget_bytes'])} ({cfg['budget_source']}), "
      f"granule {cfg['granule']}" + (" (interpret mode)" if cfg["interpret"] else ""))
  if doc.get("peaks"):
    pk = doc["peaks"]
    lines.append(f"this chip's measured peaks: bf16 matmul "
                 f"{pk['TFLOP/s']:.1f} TFLOP/s, copy {pk['GB/s']:.1f} GB/s")
  for workload in cfg["workloads"]:
    unit = UNITS[workload]
    rules = doc.get("rule_times", {})
    for hidden in cfg["hiddens"]:
      rt = rules.get(f"{workload}/{hidden}")
      if rt:
        lines.append(f"\n{workload}/{hidden} rule kernels alone (ms, median): "
                     + ", ".join(f"{k} {v['median_s'] * 1e3:.3f}"
                                 for k, v in rt.items()))
      tiles = cfg.get("tpu_tiles", {}).get(str(hidden))
      if tiles and workload == "gelu_matmul":
        lines.append(f"{workload}/{hidden} TPU tiles (from "
                     f"{cfg.get('tiles_source')}): " + ", ".join(
                         f"{k} {tuple(v)}" for k, v in tiles.items()))
    lines.append(f"\n{workload} ({unit} of the useful work; "
                 "grad diff: max |g - g_custom_vjp| / max |g_custom_vjp|)")
    head = (f"{'hidden':>6s} {'implementation':15s} {'step ms':>9s} "
            f"{'[min-max]':>19s} {'vs jax':>7s} {'vs ideal':>8s} {unit:>8s} {'%peak':>6s} "
            f"{'mem ' + unit_m:>8s} {'vs jax':>7s} {'max batch':>9s} {'vs jax':>7s} "
            f"{'compiles':>8s} {'grad diff':>9s}")
    lines += [head, "-" * len(head)]
    for r in doc["results"]:
      if r["workload"] != workload:
        continue
      c = row_cells(r, scale)
      lines.append(
          f"{r['hidden']:6d} {r['impl']:15s} {c['step']:>9s} {c['spread']:>19s} "
          f"{c['step_ratio']:>7s} {c['ideal']:>8s} {c['rate']:>8s} "
          f"{c['peak']:>6s} {c['memory']:>8s} {c['memory_ratio']:>7s} {c['largest']:>9s} "
          f"{c['largest_ratio']:>7s} {c['compiles']:>8s} {c['diff']:>9s}")
  if doc.get("skipped"):
    lines.append(f"\nskipped (deadline): {len(doc['skipped'])} measurements")
  if doc.get("errors"):
    lines.append(f"errors: {len(doc['errors'])} (see the JSON)")
  goals = goals_of(doc)
  if goals.items:
    lines.append("")
    if cfg.get("interpret"):
      lines.append("(interpret mode: the step-time goals say nothing about an "
                   "accelerator here)")
    lines.append(goals.render())
  return "\n".join(lines)


def markdown(doc):
  """The README table: one row per (workload, hidden, implementation)."""
  cfg, m, v = doc["config"], doc["machine"], doc["versions"]
  unit_m, scale = memory_unit(doc)
  out = [f"{m['device_kind']}, jax {v['jax']}, smartvjp at commit "
         f"{v.get('commit') or 'unknown'}; {cfg['layers']} checkpointed "
         f"layers, batch {cfg['batch']}, {cfg['dtype']}; median [min-max] of "
         f"{cfg['rounds']} interleaved rounds; largest batch under "
         f"{fmt_bytes(cfg['budget_bytes'])} by compiled memory (temp + arguments "
         "+ outputs).", "",
         "| workload | hidden | implementation | step (ms) | vs `jax.custom_vjp` "
         f"| throughput | memory ({unit_m}) | vs `jax.custom_vjp` | largest batch "
         "| vs `jax.custom_vjp` |",
         "|---|---:|---|---:|---:|---:|---:|---:|---:|---:|"]
  for r in doc["results"]:
    c = row_cells(r, scale)
    rate = f"{c['rate']} {UNITS[r['workload']]}" if _ok(r.get("step")) else c["rate"]
    out.append(f"| {r['workload']} | {r['hidden']} | `{r['impl']}` | {c['step']} "
               f"{c['spread']} | {c['step_ratio']} | {rate} | {c['memory']} | "
               f"{c['memory_ratio']} | {c['largest']} | {c['largest_ratio']} |")
  goals = goals_of(doc)
  if goals.items:
    met = sum(ok for _, ok in goals.items)
    out += ["", f"Goals ({met} of {len(goals.items)} met):"]
    out += [f"- {text}: **{R.verdict(ok)}**" for text, ok in goals.items]
  return "\n".join(out)


# -- the run ------------------------------------------------------------------------

def _fields(key):
  """``{"workload", "hidden", "impl"}`` of a record's key."""
  return dict(zip(("workload", "hidden", "impl"), key))


def _name(key):
  return "/".join(map(str, key))


class Bench:
  def __init__(self, args, cfg, doc, out, t0):
    self.args, self.cfg, self.doc, self.out, self.t0 = args, cfg, doc, out, t0
    self.deadline, self.said_late = args.deadline, False
    self.dtype = jnp.dtype(cfg["dtype"])
    self.pool = concurrent.futures.ThreadPoolExecutor(cfg["compile_workers"])
    self.fns = {}
    self.records = {}
    for workload in cfg["workloads"]:
      for hidden in cfg["hiddens"]:
        for impl in IMPLS:
          r = dict(workload=workload, hidden=hidden, impl=impl,
                   memory=dict(status="pending"), step=dict(status="pending"),
                   largest_batch=dict(status="pending" if cfg["largest_batch"]
                                      else "not requested"))
          doc["results"].append(r)
          self.records[workload, hidden, impl] = r

  # bookkeeping
  def elapsed(self):
    return time.perf_counter() - self.t0

  def out_of_time(self):
    late = self.deadline is not None and self.elapsed() >= self.deadline
    if late and not self.said_late:
      self.said_late = True
      self.log(f"deadline ({self.deadline:g} s) reached: no new measurements")
    return late

  def log(self, msg):
    print(f"[{self.elapsed():7.1f}s] {msg}", flush=True)

  def save(self):
    save(self.doc, self.out)

  def skip(self, key, what):
    self.records[key][what] = dict(status="skipped", reason="deadline")
    self.doc["skipped"].append(dict(_fields(key), what=what))

  def fail(self, key, what, err):
    msg = f"{type(err).__name__}: {err}"[:2000]
    self.records[key][what] = dict(status="error", error=msg)
    self.doc["errors"].append(dict(_fields(key), what=what, error=msg))
    self.log(f"{_name(key)} {what}: ERROR {msg[:300]}")

  # compiling
  def tiles(self, workload, hidden):
    return self.cfg["tpu_tiles"].get(str(hidden)) if workload == "gelu_matmul" \
        else None

  def lower(self, key, batch):
    workload, hidden, impl = key
    if key not in self.fns:
      block = self.cfg["kernel_block"][workload]
      self.fns[key] = stack_grad(build(
          workload, impl, self.cfg["interpret"], block, self.cfg["block_k"],
          self.cfg["target"], self.tiles(workload, hidden)))
    return self.fns[key].lower(*arg_shapes(
        workload, self.cfg["layers"], batch, hidden, self.dtype))

  def submit(self, key, batch):
    """Lowers here, compiles in the pool; the future gives (compiled, parts,
    lower_s, compile_s)."""
    t = time.perf_counter()
    lowered = self.lower(key, batch)
    lower_s = time.perf_counter() - t

    def work():
      t = time.perf_counter()
      compiled = lowered.compile()
      parts = memory_parts(compiled)
      if parts is None:
        raise RuntimeError("this backend gives no memory_analysis()")
      return compiled, parts, lower_s, time.perf_counter() - t
    return self.pool.submit(work)

  def const_bytes(self, key, parts):
    """Bytes of the step that do not depend on the batch: parameters in,
    gradients out (the one-point slope's intercept)."""
    workload, hidden, _ = key
    params = math.prod(param_shape(workload, self.cfg["layers"], hidden))
    return params * self.dtype.itemsize + parts["output_bytes"]

  # phase 1: compile at the timing batch, then time
  def phase_compile(self):
    batch, futures = self.cfg["batch"], {}
    for key in self.records:
      if self.out_of_time():
        self.skip(key, "memory")
        self.skip(key, "step")
        continue
      try:
        futures[self.submit(key, batch)] = key
      except Exception as e:   # noqa: BLE001 -- recorded, the run goes on
        self.fail(key, "memory", e)
        self.records[key]["step"] = dict(status="error", error="did not lower")
    self.save()
    compiled = {}
    for fut in concurrent.futures.as_completed(futures):
      key = futures[fut]
      try:
        exe, parts, lower_s, compile_s = fut.result()
      except Exception as e:   # noqa: BLE001
        self.fail(key, "memory", e)
        self.records[key]["step"] = dict(status="error", error="did not compile")
        self.save()
        continue
      compiled[key] = exe
      self.records[key]["memory"] = dict(status="ok", batch=batch, **parts)
      self.records[key]["compile"] = dict(lower_s=lower_s, compile_s=compile_s)
      self.log(f"compiled {_name(key)} at batch {batch}: lower "
               f"{lower_s:.1f} s, compile {compile_s:.1f} s; memory "
               f"{fmt_bytes(parts['total_bytes'])} (temp "
               f"{fmt_bytes(parts['temp_bytes'])} + args "
               f"{fmt_bytes(parts['argument_bytes'])} + out "
               f"{fmt_bytes(parts['output_bytes'])})")
      self.save()
    return compiled

  def phase_rules(self):
    """Each rule's kernels timed alone at the timing batch, and from them the
    ideal step of each kernel row (``IDEAL_RULES``)."""
    cfg = self.cfg
    self.doc.setdefault("rule_times", {})
    for workload in cfg["workloads"]:
      maker = (PG.make_gelu_matmul if workload == "gelu_matmul"
               else RG.make_rmsnorm_gelu)
      for hidden in cfg["hiddens"]:
        if self.out_of_time():
          return
        try:
          kw = kernel_options(workload, cfg["interpret"],
                              cfg["kernel_block"][workload], cfg["block_k"],
                              cfg["target"])
          if self.tiles(workload, hidden):
            kw["tpu_tiles"] = self.tiles(workload, hidden)
          _, rules = maker(fused=True, **kw)
          params, x = make_inputs(workload, 1, cfg["batch"], hidden, self.dtype)
          p = params[0]
          g = (0.5 * jax.random.normal(jax.random.key(9), x.shape)
               ).astype(x.dtype)
          _, res = jax.jit(rules["fwd"])(x, p)
          calls = {"f": (rules["f"], (x, p)),
                   "fwd": (R.new_outputs(rules["fwd"]), (x, p)),
                   "bwd": (rules["bwd"], (res, g)),
                   "fwd_bwd": (rules["fwd_bwd"], (x, p, g))}
          times = {}
          for name, (fn, args) in calls.items():
            fn = jax.jit(fn)
            jax.block_until_ready(fn(*args))        # compiles
            t = time.perf_counter()
            jax.block_until_ready(fn(*args))
            once = time.perf_counter() - t
            inner = max(1, math.ceil(cfg["min_sample_s"] / max(once, 1e-6)))
            times[name] = R.timed(fn, *args, rounds=cfg["rounds"],
                                  inner=min(inner, 50))
          del res
          self.doc["rule_times"][f"{workload}/{hidden}"] = times
          for impl, names in IDEAL_RULES.items():
            rec = self.records.get((workload, hidden, impl))
            if rec is not None:
              rec["ideal"] = dict(rules=list(names), step_s=cfg["layers"] * sum(
                  times[n]["median_s"] for n in names))
          self.log(f"rule kernels alone {workload}/{hidden}: " + ", ".join(
              f"{k} {v['median_s'] * 1e3:.3f} ms" for k, v in times.items()))
        except Exception as e:   # noqa: BLE001 -- recorded, the run goes on
          self.doc["errors"].append(dict(workload=workload, hidden=hidden,
                                         what="rule_times",
                                         error=f"{type(e).__name__}: {e}"[:2000]))
          self.log(f"rule kernels {workload}/{hidden}: ERROR {e}"[:300])
        self.save()

  def phase_time(self, compiled):
    cfg = self.cfg
    for workload in cfg["workloads"]:
      for hidden in cfg["hiddens"]:
        keys = [(workload, hidden, impl) for impl in IMPLS]
        ready = [k for k in keys if k in compiled]
        if not ready:
          continue
        if self.out_of_time():
          for k in ready:
            self.skip(k, "step")
          self.save()
          continue
        try:
          self.time_group(workload, hidden, ready, compiled)
        except Exception as e:   # noqa: BLE001
          for k in ready:
            self.fail(k, "step", e)
        for k in ready:
          del compiled[k]
        self.save()
        print(tables_for(self.doc, workload, hidden), flush=True)

  def time_group(self, workload, hidden, keys, compiled):
    cfg = self.cfg
    params, x = make_inputs(workload, cfg["layers"], cfg["batch"], hidden,
                            self.dtype)
    fns = {k: compiled[k] for k in keys}
    grads, warm = {}, {}
    for k, fn in fns.items():   # warm-up, and one gradient for the check
      grads[k] = jax.block_until_ready(fn(params, x))
      for _ in range(max(cfg["warmup"] - 1, 0)):
        t = time.perf_counter()
        jax.block_until_ready(fn(params, x))
        warm[k] = time.perf_counter() - t
    base_key = (workload, hidden, BASE)
    if base_key in grads:
      g0 = grads[base_key].astype(jnp.float32)
      scale = float(jnp.max(jnp.abs(g0)))
      for k, g in grads.items():
        diff = float(jnp.max(jnp.abs(g.astype(jnp.float32) - g0)))
        self.records[k]["grad_max_rel_diff"] = diff / scale if scale else None
    del grads
    shortest = min(warm.values()) if warm else 0.0
    inner = max(1, math.ceil(cfg["min_sample_s"] / shortest)) if shortest else 1
    samples = collections.defaultdict(list)
    order = list(keys)
    rounds = 0
    for r in range(cfg["rounds"]):
      if rounds >= 3 and self.out_of_time():
        break
      for k in order[r % len(order):] + order[:r % len(order)]:
        fn = fns[k]
        t = time.perf_counter()
        for _ in range(inner):
          out = fn(params, x)
        jax.block_until_ready(out)
        samples[k].append((time.perf_counter() - t) / inner)
      rounds += 1
    work, scale = useful_work(workload, cfg["layers"], cfg["batch"], hidden,
                              self.dtype.itemsize)
    unit = UNITS[workload]
    for k in keys:
      s = samples[k]
      q = statistics.quantiles(s, n=4) if len(s) >= 2 else [s[0]] * 3
      step = dict(status="ok", median_s=statistics.median(s), min_s=min(s),
                  max_s=max(s), q1_s=q[0], q3_s=q[2], iqr_s=q[2] - q[0],
                  rounds=rounds, inner=inner, samples_s=s)
      if base_key in samples:
        step["paired_ratio_median"] = statistics.median(
            a / b for a, b in zip(s, samples[base_key]))
      rate = work / step["median_s"] / scale
      self.records[k]["step"] = step
      self.records[k]["throughput"] = dict(
          value=rate, unit=unit, useful_work=work,
          fraction_of_peak=(rate / self.doc["peaks"][unit]
                            if self.doc.get("peaks") else None))
    self.log(f"timed {workload}/{hidden}: {rounds} rounds x {inner} steps")

  # phase 2: largest batch
  def phase_largest(self):
    cfg, searches, futures = self.cfg, {}, {}
    for key, r in self.records.items():
      if r["largest_batch"]["status"] != "pending":
        continue
      mem = r["memory"]
      if not _ok(mem):
        r["largest_batch"] = dict(status="skipped", reason=f"no memory at "
                                  f"batch {cfg['batch']} ({mem['status']})")
        continue
      s = BatchSearch(cfg["budget_bytes"], cfg["granule"], cfg["max_batch"],
                      const_bytes=self.const_bytes(key, mem))
      s.add(mem["batch"], mem["total_bytes"], compiled_here=False)
      searches[key] = s
    self.save()

    def launch(key):
      s = searches[key]
      if s.done():
        return self.finish_search(key, s)
      if self.out_of_time():
        self.skip(key, "largest_batch")
        self.records[key]["largest_batch"].update(s.partial())
        return self.save()
      batch = s.next_probe()
      try:
        futures[self.submit(key, batch)] = (key, batch)
      except Exception as e:   # noqa: BLE001
        self.fail(key, "largest_batch", e)
        self.records[key]["largest_batch"].update(s.partial())

    # searches run in the order of the records, at most one compile each in
    # flight and workers + 1 at a time: under a deadline the first ones finish
    waiting = collections.deque(searches)

    def fill():
      while waiting and len(futures) <= cfg["compile_workers"]:
        launch(waiting.popleft())

    fill()
    while futures:
      done, _ = concurrent.futures.wait(
          futures, return_when=concurrent.futures.FIRST_COMPLETED)
      for fut in done:
        key, batch = futures.pop(fut)
        s = searches[key]
        try:
          _, parts, _, compile_s = fut.result()
        except Exception as e:   # noqa: BLE001
          if "RESOURCE_EXHAUSTED" in str(e):   # XLA: does not fit at this batch
            s.add(batch, math.inf)
            self.log(f"probe {_name(key)} batch {batch}: over (out of memory "
                     f"at compile)")
            launch(key)
            fill()
            continue
          self.fail(key, "largest_batch", e)
          self.records[key]["largest_batch"].update(s.partial())
          self.save()
          fill()
          continue
        s.add(batch, parts["total_bytes"])
        self.log(f"probe {_name(key)} batch {batch}: "
                 f"{fmt_bytes(parts['total_bytes'])} "
                 f"({'fits' if parts['total_bytes'] <= s.budget else 'over'}; "
                 f"compile {compile_s:.1f} s)")
        r = self.records[key]["largest_batch"]
        r.update(status="searching", **s.partial())
        self.save()
        launch(key)
        fill()

  def finish_search(self, key, s):
    self.records[key]["largest_batch"] = dict(status="ok", **s.summary())
    self.log(f"largest batch {_name(key)}: {s.answer()} "
             f"({s.compiles} compiles)")
    self.save()


def tables_for(doc, workload, hidden):
  sub = dict(doc, results=[r for r in doc["results"] if r["workload"] == workload
                           and r["hidden"] == hidden])
  sub["config"] = dict(doc["config"], workloads=[workload])
  return tables(sub).split("\n", 3)[3]   # without the machine and config lines


def parse(argv):
  p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  p.add_argument("--smoke", action="store_true",
                 help="tiny shapes, Pallas interpret mode, 1 MiB budget (CPU ok)")
  p.add_argument("--workload", nargs="+", choices=WORKLOADS, default=None)
  p.add_argument("--hidden", "--width", nargs="+", type=int, default=None,
                 help="hidden sizes (default: 4096 8192; smoke: 32)")
  p.add_argument("--layers", type=int, default=None, help="default 8 (smoke 2)")
  p.add_argument("--batch", type=int, default=None,
                 help="batch for timing (default 8192; smoke 64)")
  p.add_argument("--rounds", "--repeats", type=int, default=None,
                 help="interleaved timing rounds (default 10; smoke 3)")
  p.add_argument("--warmup", type=int, default=2,
                 help="warm-up calls of each implementation (default 2)")
  p.add_argument("--min-sample-ms", type=float, default=None,
                 help="back-to-back steps per sample so one lasts this long "
                 "(default 20; smoke 0)")
  p.add_argument("--block", type=int, default=None,
                 help="matmul block_m = block_n (default 128; smoke 16; "
                 "RMSNorm's block_m is passed in smoke mode only)")
  p.add_argument("--block-k", type=int, default=None,
                 help="matmul block_k, where the builder takes it (default: "
                 "the builder's; smoke 16)")
  p.add_argument("--target", choices=("tpu", "gpu"), default=None,
                 help="which kernels (default: the backend's; on a CPU the "
                 "GPU-shaped ones in interpret mode)")
  p.add_argument("--no-largest-batch", action="store_true")
  p.add_argument("--budget-gib", type=float, default=None,
                 help="memory budget for the largest batch (default: the "
                 "device's bytes_limit; smoke: 1/1024 = 1 MiB)")
  p.add_argument("--granule", type=int, default=None,
                 help="largest batch is a multiple of this (default 256; smoke 16)")
  p.add_argument("--max-batch", type=int, default=2 ** 23)
  p.add_argument("--compile-workers", type=int,
                 default=max(1, min(8, (os.cpu_count() or 2) // 2)))
  p.add_argument("--peaks", metavar="PATH", default=None,
                 help="a JSON whose \"peaks\" ({\"TFLOP/s\", \"GB/s\"}) this "
                 "chip's rates, measured earlier (tools/gpu_session.py's "
                 "env.json), instead of measuring them here")
  p.add_argument("--deadline", type=float, default=None,
                 help="seconds after start (of main(), backend start-up "
                 "included) past which no new measurement starts")
  p.add_argument("--out", default=None,
                 help=f"JSON (default {os.path.relpath(DEFAULT_OUT)}; smoke: "
                 "a temporary file)")
  p.add_argument("--from-json", metavar="PATH",
                 help="only print the tables from a saved JSON")
  p.add_argument("--tiles-json", metavar="PATH",
                 help="the matmul's TPU tiles per hidden size: the 'chosen' "
                 "of a tpu_tiles.py run (default: the example's TPU_TILES)")
  p.add_argument("--markdown", action="store_true",
                 help="also print a markdown table (for the README)")
  return p.parse_args(argv)


def main(argv=None):
  """Runs the benchmark (or prints a saved one); returns the JSON document."""
  t0 = time.perf_counter()   # --deadline counts from here
  argv = sys.argv[1:] if argv is None else list(argv)
  args = parse(argv)
  if args.from_json:
    with open(args.from_json) as fh:
      doc = json.load(fh)
    derive(doc)
    print(tables(doc))
    if args.markdown:
      print("\n" + markdown(doc))
    return doc

  backend = jax.default_backend()
  on_accel = backend in ("gpu", "tpu")
  smoke = args.smoke
  if not (smoke or on_accel):
    print("accel_mlp.py: no TPU or GPU here; use --smoke for a CPU run of tiny "
          "shapes. Exiting.")
    return None
  pick = lambda given, full, small: given if given is not None else (
      small if smoke else full)
  machine, versions = machine_info()
  if args.budget_gib is not None:
    budget, source = int(args.budget_gib * 2**30), "--budget-gib"
  elif smoke:
    budget, source = 2**20, "smoke default (1 MiB)"
  elif machine["bytes_limit"]:
    budget, source = int(machine["bytes_limit"]), "memory_stats()['bytes_limit']"
  elif not args.no_largest_batch:
    print("accel_mlp.py: the device has no memory_stats()['bytes_limit']; give "
          "--budget-gib or --no-largest-batch.")
    return None
  else:
    budget, source = None, None
  block = pick(args.block, 128, 16)
  cfg = dict(
      workloads=list(args.workload or WORKLOADS),
      hiddens=list(pick(args.hidden, [2048, 4096] if backend == "tpu"
                        else [4096, 8192], [32])),
      layers=pick(args.layers, 8, 2), batch=pick(args.batch, 8192, 64),
      dtype="bfloat16", impls=list(IMPLS), rounds=pick(args.rounds, 10, 3),
      warmup=max(args.warmup, 1),
      min_sample_s=pick(args.min_sample_ms, 20.0, 0.0) / 1e3,
      interpret=not on_accel, smoke=smoke, target=args.target,
      kernel_block={"gelu_matmul": block,
                    "rmsnorm_gelu": block if smoke else None},
      block_k=pick(args.block_k, None, 16),
      largest_batch=not args.no_largest_batch, budget_bytes=budget,
      budget_source=source, granule=pick(args.granule, 256, 16),
      max_batch=args.max_batch, compile_workers=max(1, args.compile_workers),
      deadline_s=args.deadline, tpu_tiles={}, tiles_source="TPU_TILES")
  if args.tiles_json:
    with open(args.tiles_json) as fh:
      chosen = json.load(fh).get("chosen", {})
    cfg["tpu_tiles"] = {h: {k: tuple(v) for k, v in c["tiles"].items()}
                        for h, c in chosen.items()}
    cfg["tiles_source"] = args.tiles_json
    with open(args.tiles_json) as fh:
      searched = json.load(fh).get("rmsnorm_gelu", [])
    # the RMSNorm kernels' (tile_bytes, gelu) per width, as the search chose
    RG.TPU_BY_WIDTH.update({s["hidden"]: (s["chosen"]["tile_bytes"],
                                          s["chosen"]["gelu"])
                            for s in searched if "chosen" in s})
    cfg["rmsnorm_by_width"] = dict(RG.TPU_BY_WIDTH)
  cfg["kernel_kwargs"] = {
      w: {k: v for k, v in kernel_options(w, cfg["interpret"],
                                          cfg["kernel_block"][w],
                                          cfg["block_k"], cfg["target"]).items()
          if k != "interpret"} for w in cfg["workloads"]}
  cfg["builders"] = {
      "gelu_matmul": dict(signature=str(inspect.signature(PG.make_gelu_matmul)),
                          sha256_16=file_sha256(PG.__file__)),
      "rmsnorm_gelu": dict(signature=str(inspect.signature(RG.make_rmsnorm_gelu)),
                           sha256_16=file_sha256(RG.__file__))}
  if cfg["block_k"] and "block_k" not in cfg["kernel_kwargs"].get("gelu_matmul", {}):
    cfg["block_k_note"] = "this make_gelu_matmul takes no block_k; not passed"
  out = args.out or (os.path.join(tempfile.gettempdir(),
                                  f"accel_mlp_smoke_{os.getpid()}.json")
                     if smoke else DEFAULT_OUT)
  doc = dict(schema=SCHEMA, status="running", started=now(), updated=None,
             machine=machine, versions=versions, argv=argv, args=vars(args),
             config=cfg, results=[], skipped=[], errors=[], device_memory_stats=None)
  print(f"jax {versions['jax']} on {machine['device_kind']} "
        f"({'interpret mode' if cfg['interpret'] else 'compiled kernels'}); "
        f"{cfg['layers']} checkpointed layers, batch {cfg['batch']}, hidden "
        f"{cfg['hiddens']}, {cfg['compile_workers']} compile workers; JSON: {out}",
        flush=True)
  bench = Bench(args, cfg, doc, out, t0)
  try:
    if args.peaks:      # measured earlier in the same session
      with open(args.peaks) as fh:
        doc["peaks"] = json.load(fh)["peaks"]
      bench.log(f"peaks from {args.peaks}: bf16 matmul "
                f"{doc['peaks']['TFLOP/s']:.1f} TFLOP/s, copy "
                f"{doc['peaks']['GB/s']:.1f} GB/s")
    elif on_accel and not smoke:
      doc["peaks"] = R.measured_peaks()
      bench.log(f"measured peaks: bf16 matmul {doc['peaks']['TFLOP/s']:.1f} "
                f"TFLOP/s, copy {doc['peaks']['GB/s']:.1f} GB/s")
    compiled = bench.phase_compile()
    bench.phase_time(compiled)
    del compiled
    bench.phase_rules()
    if cfg["largest_batch"]:
      bench.phase_largest()
    doc["status"] = "deadline" if doc["skipped"] else "complete"
  except KeyboardInterrupt:
    doc["status"] = "interrupted"
    raise
  except Exception:
    doc["status"] = "error"
    raise
  finally:
    stats = getattr(jax.devices()[0], "memory_stats", lambda: None)()
    doc["device_memory_stats"] = stats   # process-wide; context only
    doc["elapsed_s"] = bench.elapsed()
    bench.pool.shutdown(wait=False, cancel_futures=True)
    save(doc, out)
  print("\n" + tables(doc))
  if args.markdown:
    print("\n" + markdown(doc))
  print(f"\nJSON: {out}; finished in {bench.elapsed():.1f} s.")
  return doc


if __name__ == "__main__":
  import signal

  def _terminate(signum, frame):   # a timeout's SIGTERM: save, then leave
    raise KeyboardInterrupt
  signal.signal(signal.SIGTERM, _terminate)
  try:
    main()
  except KeyboardInterrupt:
    print("interrupted; the JSON holds every finished measurement", flush=True)
    os._exit(130)   # compiles still running in the pool would delay exit
