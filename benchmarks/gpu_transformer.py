"""GPU benchmark: a transformer on JAX's shipped Pallas kernels, as shipped
and swapped into smartvjp.

The model is ``examples/pallas_ops_transformer.py``'s: each layer's
attention and RMSNorm are JAX's Pallas GPU kernels
(``jax.experimental.pallas.ops.gpu.attention.mha``, ``...rms_norm``), the
MLP plain JAX, each layer under ``jax.checkpoint`` (``nothing_saveable`` and
``dots_saveable``), scanned; one step is ``jit(value_and_grad)`` plus SGD.
Schedules: the kernels as shipped (``jax.custom_vjp``), swapped
(``smartvjp.import_swapped``), the shipped rules rebuilt with
``optimize_remat=True``, and XLA alone (``jax.nn.dot_product_attention(...,
implementation="xla")`` and a ``jax.numpy`` RMSNorm: no kernel). With
``--attention mgpu`` the attention is JAX's Mosaic GPU kernel
(``attention_mgpu.attention``: a Hopper GPU, f16, non-causal) and the
RMSNorm XLA's. For each policy and schedule:

* kernel launches per step and the residual bytes the kernels write, counted
  in the lowered program (``examples/pallas_ops_transformer.py``);
* memory of the compiled step (XLA's ``memory_analysis()``: temporaries +
  arguments + outputs);
* step time: ``--rounds`` interleaved rounds after a warm-up, round ``r``
  running each schedule once in an order rotated by ``r``, each sample
  ``inner`` back-to-back steps (so a sample lasts ``--min-sample-ms``);
  median with min-max, and the median of the per-round ratios;
* values: ``--check-steps`` SGD steps from the same start, losses and
  parameters compared bit for bit with shipped's;
* the ideal swapped step: shipped's measured step less, per checkpointed
  call, the residual-writing kernel's time over the kernel without
  residuals, each timed alone at the model's shapes (``kernel_times_s``).

Goals, each printed with a verdict (met / not met): launches: swapped runs
the minimum (per checkpointed call: the kernel without residual outputs
forward, the residual-writing kernel once, backward) and writes half the
residual bytes of shipped; values: bitwise equal; memory: swapped <= shipped;
step time: swapped not slower than shipped beyond 2% (the saving is the
forward pass's residual writes, a small part of a step: a large speed-up is
not expected). The JSON (``--out``) is rewritten after each measurement.

Run on a GPU:  python benchmarks/gpu_transformer.py [--out FILE.json]
Smoke test:    python benchmarks/gpu_transformer.py --smoke  (the example's
               tiny sizes, interpret mode, CPU ok; JSON to a temporary file)
Tables only:   python benchmarks/gpu_transformer.py --from-json FILE.json
"""

from __future__ import annotations

import argparse
import dataclasses
import functools
import importlib
import importlib.util
import inspect
import json
import math
import os
import statistics
import sys
import tempfile
import time
import warnings

import jax
import jax.numpy as jnp

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
sys.path.insert(0, os.path.join(ROOT, "examples"))
sys.path.insert(1, HERE)
sys.path.insert(2, ROOT)   # smartvjp from this checkout where it is not installed
import _report as R  # noqa: E402
import accel_mlp  # noqa: E402  (machine_info, memory_parts, fmt_bytes, now)
import pallas_ops_transformer as EX  # noqa: E402
import smartvjp  # noqa: E402

SCHEMA = "smartvjp/gpu_transformer/2"   # 2: CPU model and commit
SCHEDULES = EX.SCHEDULES          # the kernel modules, shipped and swapped
ALL_SCHEDULES = SCHEDULES + ("optimize_remat", "xla")
STEP_TOLERANCE = 1.02
# the model on an H200: 4 layers, 8 x 2048 tokens, 16 heads of 64, bf16
GPU_CONFIG = EX.Config(layers=4, batch=8, seq=2048, heads=16, head_dim=64,
                       mlp=4096, vocab=8192, dtype="bfloat16", steps=3,
                       learning_rate=0.05)
# with attention_mgpu (f16: bf16 does not trace, design/upstream/bugs/)
MGPU_CONFIG = dataclasses.replace(GPU_CONFIG, dtype="float16")
SMOKE_CONFIG = EX.Config(steps=2)


verdict = R.verdict


def save(doc, path):
  doc["updated"] = accel_mlp.now()
  folder = os.path.dirname(os.path.abspath(path))
  os.makedirs(folder, exist_ok=True)
  fd, tmp = tempfile.mkstemp(prefix=".gpu_transformer.", suffix=".tmp",
                             dir=folder)
  with os.fdopen(fd, "w") as fh:
    json.dump(doc, fh, indent=1)
  os.replace(tmp, path)


class _Kernels:
  """A stand-in for the pair of kernel modules ``make_loss`` reads
  (``.mha``, ``.rms_norm``)."""

  def __init__(self, **fns):
    vars(self).update(fns)


def rewrapped(fn):
  """JAX's shipped ``custom_vjp`` ``fn`` rebuilt with the same rules and
  ``optimize_remat=True``, called positionally (jax 0.11.2's
  ``optimize_remat`` fails an assertion when ``mha``'s nondiff arguments
  come by keyword)."""
  g = jax.custom_vjp(fn.fun, nondiff_argnums=fn.nondiff_argnums)
  g.defvjp(fn.fwd, fn.bwd, optimize_remat=True)
  sig = inspect.signature(fn.fun)

  def call(*args, **kwargs):
    bound = sig.bind(*args, **kwargs)
    bound.apply_defaults()
    return g(*bound.args)
  return call


def xla_mha(q, k, v, segment_ids, sm_scale=None, causal=False,
            interpret=False):
  """Attention as XLA alone computes it (``jax.nn.dot_product_attention``,
  ``implementation="xla"``), for ``make_loss``'s call of ``mha``."""
  del segment_ids, interpret
  return jax.nn.dot_product_attention(q, k, v, scale=sm_scale,
                                      is_causal=causal, implementation="xla")


def xla_rms_norm(x, weight, bias, interpret=False, eps=1e-5):
  """RMSNorm in ``jax.numpy`` (f32 statistics, as the kernel's)."""
  del interpret
  x32 = x.astype(jnp.float32)
  y = x32 * jax.lax.rsqrt(jnp.mean(x32 * x32, -1, keepdims=True) + eps)
  return (y * weight + bias).astype(x.dtype)


MGPU = "jax.experimental.pallas.ops.gpu.attention_mgpu"


class MgpuAttention:
  """JAX's Mosaic GPU attention (``attention_mgpu.attention``, Hopper, f16)
  behind ``make_loss``'s call of ``mha``: non-causal (its backward pass
  refuses causal masking) and scaled as the kernel scales."""

  def __init__(self, module, block=64):
    self.module = module
    self.attention = module.attention
    self.config = module.TuningConfig(
        block_q=block, block_kv=block, max_concurrent_steps=2, causal=False,
        block_q_dkv=block, block_kv_dkv=block, block_q_dq=block,
        block_kv_dq=block)

  def mha(self, q, k, v, segment_ids, sm_scale, causal, interpret=False):
    del segment_ids, sm_scale, causal, interpret
    return self.module.attention(q, k, v, self.config)


def load_all_kernels(attention="triton"):
  """``{schedule: (attention, rms_norm)}`` for every schedule timed. With
  ``attention="mgpu"`` the attention is ``attention_mgpu`` and the RMSNorm
  XLA's in every schedule (the one kernel module is the attention's)."""
  if attention == "mgpu":
    with warnings.catch_warnings():
      warnings.simplefilter("ignore", DeprecationWarning)
      shipped = MgpuAttention(importlib.import_module(MGPU))
      swapped = MgpuAttention(smartvjp.import_swapped(MGPU))
    rms = _Kernels(rms_norm=xla_rms_norm)
    opt = rewrapped(shipped.attention)
    return {
        "shipped": (shipped, rms), "swapped": (swapped, rms),
        "optimize_remat": (_Kernels(mha=lambda q, k, v, *a, **kw: opt(
            q, k, v, shipped.config)), rms),
        "xla": (_Kernels(mha=functools.partial(xla_mha, causal=False)), rms),
    }
  shipped, swapped = EX.load_kernels(False), EX.load_kernels(True)
  return {
      "shipped": shipped, "swapped": swapped,
      "optimize_remat": (_Kernels(mha=rewrapped(shipped[0].mha)),
                         _Kernels(rms_norm=rewrapped(shipped[1].rms_norm))),
      "xla": (_Kernels(mha=xla_mha), _Kernels(rms_norm=xla_rms_norm)),
  }


def kernel_modules(attention):
  """The model's kernel modules, as ``EX.expected_launches`` names them."""
  return ("attention_mgpu",) if attention == "mgpu" else ("attention",
                                                          "rms_norm")


def kernel_times(cfg, kernels, args, interpret):
  """Each shipped kernel rule timed alone at the model's shapes: ``{"attention",
  "rms_norm"}: {"f", "fwd"}`` seconds (median over ``--rounds``)."""
  attention, rms = kernels["shipped"]
  dt = jnp.dtype(cfg.dtype)
  qkv = jnp.ones((cfg.batch, cfg.seq, cfg.heads, cfg.head_dim), dt)
  x = jnp.ones((cfg.batch, cfg.seq, cfg.width), dt)
  w, b = jnp.ones((cfg.width,), dt), jnp.zeros((cfg.width,), dt)
  if isinstance(attention, MgpuAttention):
    calls = (("attention_mgpu", attention.attention,
              (qkv, qkv, qkv, attention.config), {}),)
  else:
    calls = (("attention", attention.mha, (qkv, qkv, qkv, None),
              dict(sm_scale=1 / math.sqrt(cfg.head_dim), causal=True,
                   interpret=interpret)),
             ("rms_norm", rms.rms_norm, (x, w, b), dict(interpret=interpret)))
  out = {}
  for name, fn, positional, keywords in calls:
    bound = inspect.signature(fn.fun).bind(*positional, **keywords)
    bound.apply_defaults()      # as make_loss calls it, every argument
    a = bound.args
    nd = set(fn.nondiff_argnums)
    static = [i for i in range(len(a)) if i in nd]
    rules = {"f": fn.fun, "fwd": R.new_outputs(fn.fwd)}
    out[name] = {}
    for rule, r in rules.items():
      jitted = jax.jit(r, static_argnums=static)
      out[name][rule] = R.timed(jitted, *a, rounds=max(args.rounds, 1),
                                inner=1)["median_s"]
  return out


def ideal_swapped(cfg, shipped_s, times):
  """The swapped step if only the kernels changed: shipped's measured step
  less, per checkpointed call, the residual-writing kernel's time over the
  kernel without residuals (attention once per layer, RMSNorm twice)."""
  saved = sum(EX.CALLS_PER_LAYER[k] * cfg.layers * (t["fwd"] - t["f"])
              for k, t in times.items())
  return shipped_s - saved


def measure_policy(cfg, kernels, policy, params, tokens, interpret, args, log):
  """Launches, memory, values and paired step times of every schedule."""
  rec = {s: {} for s in args.schedules}
  steps = {}
  for s in args.schedules:
    launches = EX.count_step(cfg, kernels[s], policy, params, tokens)
    rec[s]["launches"] = EX.by_label(launches)
    rec[s]["residual_bytes"] = EX.residual_bytes(launches)
    t = time.perf_counter()
    step = jax.jit(EX.make_step(cfg, *kernels[s], policy, interpret))
    compiled = step.lower(params, tokens).compile()
    rec[s]["compile_s"] = time.perf_counter() - t
    rec[s]["memory"] = accel_mlp.memory_parts(compiled)
    steps[s] = compiled
    log(f"{s}: compiled in {rec[s]['compile_s']:.1f} s, memory "
        f"{accel_mlp.fmt_bytes((rec[s]['memory'] or {}).get('total_bytes'))}")
  # values: the same SGD steps from the same start
  finals = {}
  for s in args.schedules:
    p, losses = params, []
    for _ in range(args.check_steps):
      loss, p = steps[s](p, tokens)
      losses.append(loss)
    finals[s] = (jax.block_until_ready(losses), p)
    rec[s]["losses"] = [float(x) for x in losses]
  for s in args.schedules:
    rec[s]["bitwise_equal_shipped"] = EX.bitwise_equal(finals["shipped"],
                                                       finals[s])
  bitwise = rec["swapped"]["bitwise_equal_shipped"]
  # step time, interleaved
  warm = {}
  for s in args.schedules:
    for _ in range(max(args.warmup, 1)):
      t = time.perf_counter()
      jax.block_until_ready(steps[s](params, tokens))
      warm[s] = time.perf_counter() - t
  inner = max(1, math.ceil(args.min_sample_ms / 1e3 / min(warm.values())))
  samples = {s: [] for s in args.schedules}
  n = len(args.schedules)
  for r in range(args.rounds):
    order = args.schedules[r % n:] + args.schedules[:r % n]
    for s in order:
      t = time.perf_counter()
      for _ in range(inner):
        out = steps[s](params, tokens)
      jax.block_until_ready(out)
      samples[s].append((time.perf_counter() - t) / inner)
  for s in args.schedules:
    xs = samples[s]
    ratios = [a / b for a, b in zip(xs, samples["shipped"])]
    rec[s]["step"] = dict(median_s=statistics.median(xs), min_s=min(xs),
                          max_s=max(xs), samples_s=xs, inner=inner)
    rec[s]["paired_to_shipped"] = dict(
        median=statistics.median(ratios), min=min(ratios), max=max(ratios))
  paired = rec["swapped"]["paired_to_shipped"]["median"]
  return rec, bitwise, paired


def goals(cfg, rec, bitwise, paired, modules=("attention", "rms_norm")):
  want = EX.expected_launches(cfg, modules)
  sh, sw = rec["shipped"], rec["swapped"]
  mem = lambda r: (r["memory"] or {}).get("total_bytes")
  ratio = sw["step"]["median_s"] / sh["step"]["median_s"]
  return {
      "launches: swapped runs the minimum (shipped as expected too)":
          sw["launches"] == want["swapped"] and sh["launches"] == want["shipped"],
      "residual writes: swapped <= 1/2 of shipped":
          2 * sw["residual_bytes"] <= sh["residual_bytes"],
      "values: losses and parameters bitwise equal": bitwise,
      "memory: swapped compiled step <= shipped":
          mem(sw) is not None and mem(sh) is not None and mem(sw) <= mem(sh),
      f"step time: swapped median <= {STEP_TOLERANCE:.2f}x shipped "
      f"(ratio {ratio:.3f}, paired {paired:.3f})":
          ratio <= STEP_TOLERANCE,
  }


def table(doc):
  lines = []
  m, v, cfg = doc["machine"], doc["versions"], doc["config"]
  lines.append(R.header(m, v)
               + (" -- interpret mode" if doc["interpret"] else ""))
  lines.append(f"model: {cfg['layers']} layers, batch {cfg['batch']} x seq "
               f"{cfg['seq']}, {cfg['heads']} heads x {cfg['head_dim']}, MLP "
               f"{cfg['mlp']}, vocab {cfg['vocab']}, {cfg['dtype']}; step "
               f"time: median [min-max] of {doc['args']['rounds']} "
               "interleaved rounds")
  for pname, r in doc["policies"].items():
    lines.append(f"\n== {pname} ==")
    lines.append(f"  {'schedule':14s} {'step ms':>10s} {'[min-max]':>21s} "
                 f"{'memory':>11s} {'launches':>8s} {'residual B':>11s} "
                 "paired/shipped [min-max]")
    for s in [s for s in ALL_SCHEDULES if s in r]:
      x = r[s]
      st = x["step"]
      pair = x.get("paired_to_shipped") or {}
      launches = (f"{sum(x['launches'].values()):8d} "
                  f"{x['residual_bytes']:11d}" if "launches" in x else
                  f"{'-':>8s} {'-':>11s}")
      lines.append(
          f"  {s:14s} {st['median_s'] * 1e3:10.3f} "
          f"[{st['min_s'] * 1e3:8.3f}-{st['max_s'] * 1e3:8.3f}] "
          f"{accel_mlp.fmt_bytes((x['memory'] or {}).get('total_bytes')):>11s} "
          f"{launches} paired {pair.get('median', float('nan')):.3f} "
          f"[{pair.get('min', float('nan')):.3f}-"
          f"{pair.get('max', float('nan')):.3f}] bitwise "
          f"{'yes' if x.get('bitwise_equal_shipped') else 'no'}")
    if r.get("ideal_swapped_s") is not None:
      lines.append(f"  ideal swapped step (shipped less the kernels' "
                   f"residual writes, timed alone): "
                   f"{r['ideal_swapped_s'] * 1e3:.3f} ms")
    shown = [s for s in ALL_SCHEDULES if s in r and s != "xla"]
    lines.append(f"  launches per step by kernel ({' / '.join(shown)}):")
    names = sorted(set().union(*(r[s]["launches"] for s in shown)))
    for name in names:
      lines.append(f"    {name:44s} " + " / ".join(
          f"{r[s]['launches'].get(name, 0):4d}" for s in shown))
    for goal, ok in r["goals"].items():
      lines.append(f"  goal {goal}: {verdict(ok)}")
  goals = R.Goals()
  for pname, r in doc["policies"].items():
    for goal, ok in r["goals"].items():
      goals.check(f"{pname}: {goal}", ok)
  if goals.items:
    lines.append("")
    if doc["interpret"]:
      lines.append("(interpret mode: the step-time goal says nothing about a "
                   "GPU here)")
    lines.append(goals.summary())
  return "\n".join(lines)


def parse(argv):
  p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  p.add_argument("--smoke", action="store_true",
                 help="the example's tiny sizes, interpret mode (CPU ok)")
  for field in ("layers", "batch", "seq", "heads", "head_dim", "mlp", "vocab"):
    p.add_argument(f"--{field.replace('_', '-')}", type=int, default=None)
  p.add_argument("--dtype", default=None)
  p.add_argument("--policies", nargs="+", choices=list(EX.POLICIES),
                 default=list(EX.POLICIES))
  p.add_argument("--attention", choices=("triton", "mgpu"), default="triton",
                 help="triton: JAX's Triton attention and RMSNorm (bf16 on "
                 "a GPU); mgpu: JAX's Mosaic GPU attention (attention_mgpu, "
                 "a Hopper GPU only, f16, non-causal) with XLA's RMSNorm")
  p.add_argument("--schedules", nargs="+", choices=ALL_SCHEDULES,
                 default=list(ALL_SCHEDULES),
                 help="shipped and swapped always run; optimize_remat: the "
                 "shipped rules in jax.custom_vjp(optimize_remat=True); xla: "
                 "jax.nn.dot_product_attention(implementation='xla') and a "
                 "jax.numpy RMSNorm")
  p.add_argument("--rounds", type=int, default=None,
                 help="interleaved timing rounds (default 10; smoke 3)")
  p.add_argument("--warmup", type=int, default=2)
  p.add_argument("--min-sample-ms", type=float, default=None,
                 help="steps per sample so one lasts this long (default 20; "
                 "smoke 0)")
  p.add_argument("--check-steps", type=int, default=None,
                 help="SGD steps compared bit for bit (default 3; smoke 2)")
  p.add_argument("--out", default=None, help="JSON (default: a temporary file)")
  p.add_argument("--from-json", metavar="PATH",
                 help="only print the tables of a saved JSON")
  return p.parse_args(argv)


def main(argv=None):
  """Runs the benchmark (or prints a saved one); returns the JSON document
  (None without a GPU and without ``--smoke``)."""
  t0 = time.perf_counter()
  argv = sys.argv[1:] if argv is None else list(argv)
  args = parse(argv)
  if args.from_json:
    with open(args.from_json) as fh:
      doc = json.load(fh)
    print(table(doc))
    return doc
  on_gpu = jax.default_backend() == "gpu"
  msg = None
  if args.attention == "mgpu" and not on_gpu:
    msg = ("attention_mgpu runs on a Hopper GPU only (no interpret mode "
           "here); tests/test_attention_mgpu.py lowers this model for CUDA")
  elif args.attention == "triton" and importlib.util.find_spec(
      EX.ATTENTION) is None:
    msg = (f"jax {jax.__version__} ships no Triton Pallas kernels "
           f"({EX.ATTENTION}: jax 0.12.1 removed them); nothing to measure")
  if msg:
    print(f"gpu_transformer.py: {msg}.")
    if args.out:
      save(dict(schema=SCHEMA, status="skipped", reason=msg, argv=argv),
           args.out)
    return None
  if not (args.smoke or on_gpu):
    print("gpu_transformer.py: no GPU here; use --smoke for a CPU run of tiny "
          "shapes. Exiting.")
    return None
  base = SMOKE_CONFIG if args.smoke else (
      MGPU_CONFIG if args.attention == "mgpu" else GPU_CONFIG)
  cfg = dataclasses.replace(base, **{
      f: getattr(args, f) for f in ("layers", "batch", "seq", "heads",
                                     "head_dim", "mlp", "vocab", "dtype")
      if getattr(args, f) is not None})
  pick = lambda given, full, small: given if given is not None else (
      small if args.smoke else full)
  args.rounds = pick(args.rounds, 10, 3)
  args.min_sample_ms = pick(args.min_sample_ms, 20.0, 0.0)
  args.check_steps = pick(args.check_steps, 3, 2)
  interpret = not on_gpu
  out = args.out or os.path.join(tempfile.gettempdir(),
                                 f"gpu_transformer_{os.getpid()}.json")
  machine, versions = accel_mlp.machine_info()
  doc = dict(schema=SCHEMA, started=accel_mlp.now(), updated=None,
             machine=machine, versions=versions, argv=argv, args=vars(args),
             config=dataclasses.asdict(cfg), interpret=interpret,
             policies={}, status="running")
  log = lambda msg: print(f"[{time.perf_counter() - t0:7.1f}s] {msg}",
                          flush=True)
  print(f"jax {versions['jax']} on {machine['device_kind']} "
        f"({'interpret mode' if interpret else 'Triton'}); {cfg}; JSON: {out}",
        flush=True)
  args.schedules = list(SCHEDULES) + [s for s in args.schedules
                                      if s not in SCHEDULES]
  kernels = load_all_kernels(args.attention)
  params = EX.init_params(cfg, jax.random.key(0))
  tokens = EX.make_data(cfg, jax.random.key(1))
  try:
    doc["kernel_times_s"] = times = kernel_times(cfg, kernels, args,
                                                 interpret)
    save(doc, out)
    for pname in args.policies:
      log(f"policy {pname}")
      rec, bitwise, paired = measure_policy(
          cfg, kernels, EX.POLICIES[pname], params, tokens, interpret, args,
          log)
      rec["values_bitwise_equal"] = bitwise
      rec["paired_step_ratio"] = paired
      rec["ideal_swapped_s"] = ideal_swapped(
          cfg, rec["shipped"]["step"]["median_s"], times)
      rec["goals"] = goals(cfg, rec, bitwise, paired,
                           kernel_modules(args.attention))
      doc["policies"][pname] = rec
      save(doc, out)
    doc["status"] = "complete"
  except BaseException:
    doc["status"] = "error"
    raise
  finally:
    doc["elapsed_s"] = time.perf_counter() - t0
    save(doc, out)
  print("\n" + table(doc))
  print(f"\nJSON: {out}; finished in {doc['elapsed_s']:.1f} s.")
  return doc


if __name__ == "__main__":
  main()
