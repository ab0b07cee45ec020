"""TPU: a decoder-only transformer LM trained with Pallas kernels, five ways.

The model (``Config``; 8 layers of width 1024, 8 heads of 128, sequence
2048, vocabulary 32768, MLP width 4096, bf16 compute with f32 master
parameters, layers scanned under ``jax.checkpoint``) trains with Adam on a
deterministic synthetic corpus: token streams of a fixed random Markov chain
(each token has ``BRANCHING`` possible successors), so the loss has a known
floor, ``log(BRANCHING)``. A layer:

    h = rmsnorm_gelu(x, g1)                 # examples/pallas_rmsnorm_gelu.py
    x = x + flash_attention(h @ wqkv) @ wo  # jax.experimental.pallas.ops.tpu
    h = rmsnorm_gelu(x, g2)
    x = x + gelu_matmul(h, w1) @ w2         # examples/pallas_gelu_matmul.py

(the norms are RMSNorm followed by GELU, the example kernel's function). The
columns, each one program:

* ``xla``: the same math in ``jax.numpy`` (``jax.nn.dot_product_attention``
  with XLA's implementation, the norms and the GELU matmul in jnp): what a
  user runs with no kernel;
* ``jax.custom_vjp``: the two kernels under ``jax.custom_vjp``, flash
  attention as JAX ships it;
* ``optimize_remat``: the two kernels with ``optimize_remat=True``, flash
  attention as shipped;
* ``smartvjp``: the two kernels under ``smart_custom_vjp`` and flash attention
  through ``smartvjp.import_swapped``;
* ``smartvjp+fused``: the same with the kernels' fused ``fwd_bwd`` rules.

The attention kernel (``--attention``) is one of JAX's shipped Pallas TPU
kernels with a ``custom_vjp`` (``ATTENTIONS``: flash attention, splash
attention with a causal mask). ``--attention auto`` takes the fastest,
measured first in the same run (``attention_trial``: forward + backward at
the LM's shape, each kernel's swapped copy's gradients compared bit for bit
with the shipped kernel's; ``attention_trial`` and ``attention`` in the
JSON). The default is ``flash``: on the TPU v5e at c420ac0 ``auto`` took
splash (17.3 ms against flash's 19.6 ms alone), and the kernel columns'
step was then 362 ms (``jax.custom_vjp``) where it is 332 ms with flash,
XLA only 323.7 ms in both runs (benchmarks/results/
tpu_lm_nothing_saveable_splash_c420ac0.json, audit_tpu_c420ac0.json): the
kernel alone is not the step. For one device call per policy, run with
``--policies`` naming one.

Under each policy (``nothing_saveable``, ``dots_saveable``,
``save_only_these_names("x_mid")``, the residual stream after attention, and
``save_kernel_outputs``: ``save_only_these_names("h1", "h2", "u")``, the
kernels' outputs):

* time to the first step: trace + lower + compile + the first step, each
  program alone, one after another;
* step time: ``--rounds`` interleaved rounds (a round runs each column's
  step once, in an order rotated by the round); median [min-max], tokens/s
  and MFU against this chip's measured bf16 matmul peak (the model's flops:
  ``6 N`` per token for the ``N`` matmul parameters, and causal attention's
  ``6 L T d``);
* memory of the compiled step (temp + arguments + outputs) and the largest
  batch that fits ``bytes_limit``: compiled at the timing batch and twice
  it, then searched (``_report.BatchSearch``: a line through the nearest
  points predicts each probe, then bisection) until a batch fits and the
  next one does not (or fails to compile);
* under ``nothing_saveable``, each column trains ``--steps`` steps from the
  same initial parameters and data; the loss curves of the kernel columns
  are compared bit for bit, ``xla``'s within ``XLA_LOSS_TOL``.

Goals (met / not met): smartvjp with fused rules faster than ``xla`` and than
``jax.custom_vjp`` under every policy; its largest batch at least
``jax.custom_vjp``'s; its time to the first step at most ``FIRST_STEP_TOL``
(1.02x) of ``jax.custom_vjp``'s; the kernel columns' losses bitwise equal.

Run on a TPU:  python benchmarks/tpu_lm.py --out FILE.json
Smoke (CPU):   python benchmarks/tpu_lm.py --smoke   (a tiny model; attention
               in jnp since Pallas' TPU interpret mode cannot be
               differentiated under checkpoint; the flash kernels' launch
               counts from the program lowered for a TPU)
"""

from __future__ import annotations

import argparse
import concurrent.futures
import dataclasses
import importlib
import json
import math
import os
import sys
import time

import jax
import jax.numpy as jnp
import numpy as np
from jax.ad_checkpoint import checkpoint_name

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
sys.path.insert(0, os.path.join(ROOT, "examples"))
sys.path.insert(1, HERE)
sys.path.insert(2, ROOT)
import _report as R  # noqa: E402
import pallas_gelu_matmul as PG  # noqa: E402
import pallas_ops_transformer as EX  # noqa: E402
import pallas_rmsnorm_gelu as RG  # noqa: E402

import smartvjp  # noqa: E402

FLASH = "jax.experimental.pallas.ops.tpu.flash_attention"
SPLASH = ("jax.experimental.pallas.ops.tpu.splash_attention."
          "splash_attention_kernel")
SPLASH_MASKS = ("jax.experimental.pallas.ops.tpu.splash_attention."
                "splash_attention_mask")
# JAX's shipped Pallas TPU attention kernels with a custom_vjp, by name:
# the module import_swapped copies for the smartvjp columns
ATTENTIONS = {"flash": FLASH, "splash": SPLASH}
COLUMNS = ("xla", "jax.custom_vjp", "optimize_remat", "smartvjp",
           "smartvjp+fused")
KERNEL_COLUMNS = COLUMNS[1:]
POLICIES = {
    "nothing_saveable": jax.checkpoint_policies.nothing_saveable,
    "dots_saveable": jax.checkpoint_policies.dots_saveable,
    "save_only_x_mid": jax.checkpoint_policies.save_only_these_names("x_mid"),
    # the kernels' outputs by name: both norms' (h1, h2) and the matmul's (u)
    "save_kernel_outputs": jax.checkpoint_policies.save_only_these_names(
        "h1", "h2", "u"),
}
BRANCHING = 4
XLA_LOSS_TOL = 0.05       # relative, per step: bf16 kernels vs XLA's fusions
FIRST_STEP_TOL = 1.02


@dataclasses.dataclass(frozen=True)
class Config:
  layers: int = 8
  width: int = 1024
  heads: int = 8
  seq: int = 2048
  vocab: int = 32768
  mlp: int = 4096
  batch: int = 8
  lr: float = 3e-4

  @property
  def head_dim(self):
    return self.width // self.heads

  def matmul_params(self):
    """Parameters that take part in matmuls (embedding lookup excluded)."""
    per_layer = 4 * self.width ** 2 + 2 * self.width * self.mlp
    return self.layers * per_layer + self.width * self.vocab

  def flops_per_token(self):
    return 6 * self.matmul_params() + 6 * self.layers * self.seq * self.width


TPU_CONFIG = Config()
SMOKE_CONFIG = Config(layers=2, width=128, heads=1, seq=128, vocab=512,
                      mlp=256, batch=2)


def init_params(cfg, key):
  """f32 master parameters: embeddings, per-layer stacks, final norm."""
  ks = jax.random.split(key, 6)
  L, d, f, v = cfg.layers, cfg.width, cfg.mlp, cfg.vocab
  normal = lambda k, shape, fan_in: (jax.random.normal(k, shape, jnp.float32)
                                     / math.sqrt(fan_in))
  return dict(
      embed=normal(ks[0], (v, d), 1.0) * 0.02,
      unembed=normal(ks[1], (d, v), d),
      g_out=jnp.ones((d,), jnp.float32),
      layers=dict(g1=jnp.ones((L, d), jnp.float32),
                  g2=jnp.ones((L, d), jnp.float32),
                  wqkv=normal(ks[2], (L, d, 3 * d), d),
                  wo=normal(ks[3], (L, d, d), d),
                  w1=normal(ks[4], (L, d, f), d),
                  w2=normal(ks[5], (L, f, d), f)))


def corpus(cfg, steps, seed=0):
  """``[steps, batch, seq + 1]`` int32 tokens of a fixed Markov chain whose
  every token has ``BRANCHING`` successors, picked uniformly."""
  rng = np.random.default_rng(seed)
  succ = rng.integers(0, cfg.vocab, size=(cfg.vocab, BRANCHING))
  out = np.empty((steps, cfg.batch, cfg.seq + 1), np.int32)
  tok = rng.integers(0, cfg.vocab, size=(steps, cfg.batch))
  picks = rng.integers(0, BRANCHING, size=(steps, cfg.batch, cfg.seq + 1))
  for t in range(cfg.seq + 1):
    out[:, :, t] = tok
    tok = succ[tok, picks[:, :, t]]
  return out


def attention_op(name, swapped, heads, seq, interpret=False):
  """Causal attention ``(q, k, v: [b, h, t, hd]) -> [b, h, t, hd]`` with
  JAX's shipped kernel ``name`` (``ATTENTIONS``), from its module as shipped
  or through ``smartvjp.import_swapped`` (``swapped``); scaled by
  ``1 / sqrt(hd)``. ``interpret``: splash attention's interpret mode (a
  CPU runs it; flash attention has none that can be differentiated)."""
  module = (smartvjp.import_swapped(ATTENTIONS[name]) if swapped
            else importlib.import_module(ATTENTIONS[name]))
  if name == "flash":
    return lambda q, k, v: module.flash_attention(
        q, k, v, causal=True, sm_scale=1 / math.sqrt(q.shape[-1]))
  masks = importlib.import_module(SPLASH_MASKS)
  kernel = module.make_splash_mha(
      masks.MultiHeadMask([masks.CausalMask((seq, seq))] * heads),
      head_shards=1, q_seq_shards=1, interpret=interpret)
  return lambda q, k, v: jax.vmap(kernel)(
      (q / math.sqrt(q.shape[-1])).astype(q.dtype), k, v)


def attention_trial(cfg, rounds, inner=3, interpret=False, names=None):
  """Each shipped attention kernel's forward + backward at the LM's shape
  (``[batch, heads, seq, head_dim]`` bf16, a jitted gradient of a sum of
  squares), timed, and its swapped copy's gradients compared bitwise with
  the shipped kernel's: ``{"kernels": {name: {...}}, "fastest": name}``."""
  b, h, t, hd = cfg.batch, cfg.heads, cfg.seq, cfg.head_dim
  keys = jax.random.split(jax.random.key(11), 3)
  q, k, v = (jax.random.normal(key, (b, h, t, hd), jnp.bfloat16)
             for key in keys)
  out = {}
  for name in names or ATTENTIONS:
    rec = out[name] = {}
    try:
      grads = {}
      for swapped in (False, True):
        op = attention_op(name, swapped, h, t, interpret)
        g = jax.jit(jax.grad(lambda q, k, v, op=op: jnp.sum(
            op(q, k, v).astype(jnp.float32) ** 2), (0, 1, 2)))
        grads[swapped] = jax.device_get(g(q, k, v))
        if not swapped:
          rec["fwd_bwd_s"] = R.timed(g, q, k, v, rounds=rounds, inner=inner)
      rec["swapped_grads_bitwise_equal"] = all(
          np.array_equal(np.asarray(a).view(np.uint16),
                         np.asarray(c).view(np.uint16))
          for a, c in zip(grads[False], grads[True]))
    except Exception as e:  # noqa: BLE001 - a kernel that fails is data
      rec["error"] = f"{type(e).__name__}: {e}"[:500]
  timed = {n: r["fwd_bwd_s"]["median_s"] for n, r in out.items()
           if "fwd_bwd_s" in r}
  return dict(kernels=out, fastest=min(timed, key=timed.get) if timed
              else "flash")


def kernels(column, smoke, attention="flash"):
  """``(rmsnorm_gelu, gelu_matmul, attention)`` for a column: functions of
  ``[tokens, d]`` arrays (attention of ``[b, h, t, hd]`` q, k, v, with the
  shipped kernel ``attention`` of ``ATTENTIONS``)."""
  if column == "xla":
    xla_attention = lambda q, k, v: jax.nn.dot_product_attention(
        q.transpose(0, 2, 1, 3), k.transpose(0, 2, 1, 3),
        v.transpose(0, 2, 1, 3), is_causal=True,
        implementation="xla").transpose(0, 2, 1, 3)
    return (RG.reference,
            lambda h, w: PG.gelu(jax.lax.dot(
                h, w, preferred_element_type=jnp.float32)).astype(h.dtype),
            xla_attention)
  fused = column == "smartvjp+fused"
  target = dict(target="tpu", interpret=False) if not smoke else {}
  norm, norm_rules = RG.make_rmsnorm_gelu(fused=fused, **target)
  mm, mm_rules = PG.make_gelu_matmul(fused=fused, **target)
  if not column.startswith("smartvjp"):
    opt = column == "optimize_remat"
    norm = jax.custom_vjp(norm_rules["f"])
    norm.defvjp(norm_rules["fwd"], norm_rules["bwd"], optimize_remat=opt)
    mm = jax.custom_vjp(mm_rules["f"])
    mm.defvjp(mm_rules["fwd"], mm_rules["bwd"], optimize_remat=opt)
  if smoke:   # TPU interpret mode cannot be differentiated under checkpoint
    attention = kernels("xla", smoke)[2]
  else:
    swapped = column.startswith("smartvjp")
    attention = (attention_op("flash", swapped, None, None)
                 if attention == "flash" else _splash_for_heads(swapped))
  return norm, mm, attention


def _splash_for_heads(swapped):
  """Splash attention built at the first call's heads and length (its mask
  is static)."""
  return lambda q, k, v: attention_op("splash", swapped, q.shape[1],
                                      q.shape[2])(q, k, v)


def make_loss(cfg, column, policy, smoke, attention="flash"):
  norm, mm, attention = kernels(column, smoke, attention)
  b, t, h, hd, d = cfg.batch, cfg.seq, cfg.heads, cfg.head_dim, cfg.width
  bf = jnp.bfloat16

  def heads(a):
    return a.reshape(b, t, h, hd).transpose(0, 2, 1, 3)

  def layer(x, p):                      # x: [b * t, d] bf16
    a = checkpoint_name(norm(x, p["g1"].astype(bf)), "h1") @ \
        p["wqkv"].astype(bf)
    q, k, v = jnp.split(a, 3, axis=-1)
    o = attention(heads(q), heads(k), heads(v))
    x = x + o.transpose(0, 2, 1, 3).reshape(b * t, d) @ p["wo"].astype(bf)
    x = checkpoint_name(x, "x_mid")
    u = checkpoint_name(mm(checkpoint_name(norm(x, p["g2"].astype(bf)), "h2"),
                           p["w1"].astype(bf)), "u")
    return x + u @ p["w2"].astype(bf)

  layer = jax.checkpoint(layer, policy=policy)

  def loss(params, tokens):             # tokens: [b, t + 1]
    x = params["embed"].astype(bf)[tokens[:, :-1]].reshape(b * t, d)
    x, _ = jax.lax.scan(lambda x, p: (layer(x, p), None), x, params["layers"])
    x32 = x.astype(jnp.float32)
    x32 = x32 * jax.lax.rsqrt(jnp.mean(x32 * x32, -1, keepdims=True) + 1e-6)
    logits = jax.lax.dot(
        (x32 * params["g_out"]).astype(bf), params["unembed"].astype(bf),
        preferred_element_type=jnp.float32)
    logp = jax.nn.log_softmax(logits, axis=-1)
    target = tokens[:, 1:].reshape(b * t)
    return -jnp.mean(jnp.take_along_axis(logp, target[:, None], axis=-1))
  return loss


def make_train_step(cfg, column, policy, smoke, attention="flash"):
  """``step(state, tokens) -> (state, loss)``: Adam (b1 0.9, b2 0.95);
  ``attention``: the shipped kernel (``ATTENTIONS``) of the kernel columns."""
  grad = jax.value_and_grad(make_loss(cfg, column, policy, smoke, attention))

  def step(state, tokens):
    params, m, v, n = state
    loss, g = grad(params, tokens)
    n = n + 1
    m = jax.tree.map(lambda m, g: 0.9 * m + 0.1 * g, m, g)
    v = jax.tree.map(lambda v, g: 0.95 * v + 0.05 * g * g, v, g)
    c1, c2 = 1 - 0.9 ** n, 1 - 0.95 ** n
    params = jax.tree.map(
        lambda p, m, v: p - cfg.lr * (m / c1) / (jnp.sqrt(v / c2) + 1e-8),
        params, m, v)
    return (params, m, v, n), loss
  return jax.jit(step)


def init_state(cfg):
  params = init_params(cfg, jax.random.key(0))
  zeros = jax.tree.map(jnp.zeros_like, params)
  return (params, zeros, jax.tree.map(jnp.zeros_like, params),
          jnp.zeros((), jnp.float32))


def state_shapes(cfg):
  return jax.eval_shape(lambda: init_state(cfg))


def memory_bytes(compiled):
  a = compiled.memory_analysis()
  return None if a is None else int(a.temp_size_in_bytes
                                    + a.argument_size_in_bytes
                                    + a.output_size_in_bytes)


def compile_at(cfg, column, policy, smoke, batch):
  c = dataclasses.replace(cfg, batch=batch)
  step = make_train_step(c, column, policy, smoke)
  tokens = jax.ShapeDtypeStruct((batch, c.seq + 1), jnp.int32)
  return step.trace(state_shapes(c), tokens).lower().compile()


MAX_BATCH = 1024


def largest_batch(cfg, column, policy, smoke, mem_at_batch, budget):
  """(batch, search summary): the largest batch whose compiled step fits
  ``budget`` (``_report.BatchSearch`` in steps of one sequence, from the
  timing batch and twice it; a compile that fails does not fit)."""
  s = R.BatchSearch(budget, 1, MAX_BATCH)
  s.add(cfg.batch, mem_at_batch, compiled_here=False)
  batch = 2 * cfg.batch
  while True:
    try:
      mem = memory_bytes(compile_at(cfg, column, policy, smoke, batch))
    except Exception:   # noqa: BLE001 -- a compile that fails does not fit
      mem = None
    s.add(batch, math.inf if mem is None else mem)
    if s.done():
      return s.answer(), s.summary()
    batch = s.next_probe()


def flash_launches(cfg, policy):
  """Flash-attention kernel launches per step in the program lowered for a
  TPU, shipped vs swapped (no TPU needed)."""
  out = {}
  for column in ("jax.custom_vjp", "smartvjp"):
    module = (smartvjp.import_swapped(FLASH) if column == "smartvjp"
              else importlib.import_module(FLASH))
    b, t, h, hd = 1, 256, 2, 128

    def loss(q, k, v):
      f = jax.checkpoint(lambda q, k, v: module.flash_attention(
          q, k, v, causal=True), policy=policy)
      return jnp.sum(f(q, k, v).astype(jnp.float32) ** 2)
    q = jax.ShapeDtypeStruct((b, h, t, hd), jnp.float32)
    step = jax.jit(jax.grad(loss, (0, 1, 2)))
    traced = step.trace(q, q, q)
    ir = (traced.lower() if jax.default_backend() == "tpu" else
          traced.lower(lowering_platforms=("tpu",))).compiler_ir()
    counts = EX.kernel_launches(ir)
    out[column] = {f"{k.name} ({len(k.outputs)} out)": n
                   for k, n in counts.items()}
  return out


def main(argv=None):
  p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  p.add_argument("--smoke", action="store_true")
  p.add_argument("--steps", type=int, default=None, help="default 100 (smoke 3)")
  p.add_argument("--rounds", type=int, default=None, help="default 9 (smoke 2)")
  p.add_argument("--policies", nargs="+", default=list(POLICIES),
                 choices=list(POLICIES))
  p.add_argument("--columns", nargs="+", default=list(COLUMNS),
                 choices=list(COLUMNS))
  p.add_argument("--no-largest-batch", action="store_true")
  p.add_argument("--attention", default="flash",
                 choices=["auto", *ATTENTIONS],
                 help="the kernel columns' attention (default flash); auto: "
                 "the fastest forward + backward at the LM's shape alone, "
                 "measured first (which is not the fastest step: see above)")
  p.add_argument("--out")
  args = p.parse_args(argv)
  t_start = time.perf_counter()
  on_tpu = jax.default_backend() == "tpu"
  smoke = args.smoke or not on_tpu
  cfg = SMOKE_CONFIG if smoke else TPU_CONFIG
  steps = args.steps or (3 if smoke else 100)
  rounds = args.rounds or (2 if smoke else 9)
  print(R.header())
  print(f"model: {cfg}; {'smoke (CPU, attention in jnp)' if smoke else 'TPU'}",
        flush=True)
  doc = dict(config=dataclasses.asdict(cfg), machine=R.machine(),
             versions=R.versions(), steps=steps, rounds=rounds, smoke=smoke,
             policies={}, flops_per_token=cfg.flops_per_token())

  def save():
    if args.out:
      with open(args.out, "w") as fh:
        json.dump(doc, fh, indent=1)
  if not smoke:
    doc["peaks"] = R.measured_peaks()
    print(f"measured peaks: {doc['peaks']['TFLOP/s']:.1f} TFLOP/s, "
          f"{doc['peaks']['GB/s']:.1f} GB/s", flush=True)
    doc["attention_trial"] = attention_trial(cfg, rounds) \
        if args.attention == "auto" else None
    if doc["attention_trial"]:
      for n, r in doc["attention_trial"]["kernels"].items():
        print(f"attention {n}: " + (r.get("error") or (
            f"forward + backward {r['fwd_bwd_s']['median_s'] * 1e3:.3f} ms, "
            f"swapped gradients bitwise equal: "
            f"{r['swapped_grads_bitwise_equal']}")), flush=True)
  attention = (args.attention if args.attention != "auto" else
               doc["attention_trial"]["fastest"] if not smoke else "flash")
  doc["attention"] = attention
  print(f"attention kernel of the kernel columns: {attention}", flush=True)
  budget = R.machine().get("bytes_limit")
  data = jnp.asarray(corpus(cfg, steps))
  tokens0 = data[0]
  goals = R.Goals()
  for pname in args.policies:
    policy = POLICIES[pname]
    res = doc["policies"][pname] = dict(columns={})
    try:
      res["flash_launches"] = flash_launches(cfg, policy)
    except Exception as e:   # noqa: BLE001
      res["flash_launches"] = f"{type(e).__name__}: {e}"[:500]
    steps_by = {}
    for column in args.columns:
      rec = res["columns"][column] = {}
      state = jax.block_until_ready(init_state(cfg))
      t0 = time.perf_counter()
      step = make_train_step(cfg, column, policy, smoke, attention)
      traced = step.trace(state, tokens0)
      t1 = time.perf_counter()
      lowered = traced.lower()
      t2 = time.perf_counter()
      try:
        compiled = lowered.compile()
      except Exception as e:   # noqa: BLE001 -- e.g. out of memory: recorded
        rec["error"] = f"{type(e).__name__}: {e}"[:500]
        print(f"[{pname}] {column}: {rec['error'][:200]}", flush=True)
        save()
        continue
      t3 = time.perf_counter()
      state, loss = compiled(state, tokens0)
      jax.block_until_ready(loss)
      t4 = time.perf_counter()
      rec["first_step_s"] = dict(trace=t1 - t0, lower=t2 - t1, compile=t3 - t2,
                                 run=t4 - t3, total=t4 - t0)
      rec["memory_bytes"] = memory_bytes(compiled)
      steps_by[column] = compiled
      print(f"[{pname}] {column}: first step {t4 - t0:.1f} s (trace "
            f"{t1 - t0:.1f}, lower {t2 - t1:.1f}, compile {t3 - t2:.1f}); "
            f"memory {rec['memory_bytes'] / 2**30:.2f} GiB", flush=True)
      save()
    # step time, interleaved; the loss curve under nothing_saveable
    state0 = init_state(cfg)
    times = {c: [] for c in steps_by}
    order = list(steps_by)
    for r in range(rounds):
      for c in order[r % len(order):] + order[:r % len(order)]:
        t = time.perf_counter()
        jax.block_until_ready(steps_by[c](state0, tokens0))
        times[c].append(time.perf_counter() - t)
    for c, s in times.items():
      rec = res["columns"][c]
      sp = R.Spread(s)
      rec["step_s"] = sp.as_dict()
      rec["tokens_per_s"] = cfg.batch * cfg.seq / sp.median
      if doc.get("peaks"):
        rec["mfu"] = (cfg.flops_per_token() * rec["tokens_per_s"]
                      / (doc["peaks"]["TFLOP/s"] * 1e12))
      print(f"[{pname}] {c}: step {sp.fmt(1e3, 2)} ms, "
            f"{rec['tokens_per_s']:.0f} tokens/s"
            + (f", MFU {100 * rec['mfu']:.1f}%" if "mfu" in rec else ""),
            flush=True)
    save()
    if pname == "nothing_saveable":
      curves = {}
      for c, fn in steps_by.items():
        state, losses = init_state(cfg), []
        for i in range(steps):
          state, loss = fn(state, data[i])
          losses.append(loss)
        curves[c] = np.asarray(jax.device_get(losses), np.float32)
        res["columns"][c]["loss"] = curves[c].tolist()
        print(f"[{pname}] {c}: loss {curves[c][0]:.4f} -> {curves[c][-1]:.4f} "
              f"over {steps} steps", flush=True)
      ref = curves.get("jax.custom_vjp")
      if ref is not None:
        for c in KERNEL_COLUMNS:
          if c in curves and c != "jax.custom_vjp":
            same = np.array_equal(curves[c].view(np.uint32),
                                  ref.view(np.uint32))
            res["columns"][c]["loss_bitwise_equal_custom_vjp"] = same
            goals.check(f"{pname}: {c} loss curve bitwise equal to "
                        "jax.custom_vjp's", same)
        if "xla" in curves:
          rel = float(np.max(np.abs(curves["xla"] - ref) / np.abs(ref)))
          res["columns"]["xla"]["loss_max_rel_diff_custom_vjp"] = rel
          goals.check(f"{pname}: xla loss curve within {XLA_LOSS_TOL} of the "
                      f"kernels' (max relative {rel:.4f})", rel <= XLA_LOSS_TOL)
      save()
    del steps_by
    if budget and not args.no_largest_batch:
      # compiles only: XLA compiles without the GIL, so columns search at once
      with concurrent.futures.ThreadPoolExecutor(len(args.columns)) as pool:
        futs = {c: pool.submit(largest_batch, cfg, c, policy, smoke,
                               res["columns"][c]["memory_bytes"], budget)
                for c in args.columns if "memory_bytes" in res["columns"][c]}
        for c, fut in futs.items():
          rec = res["columns"][c]
          try:
            big, summary = fut.result()
            rec["largest_batch"] = summary
            print(f"[{pname}] {c}: largest batch {big}", flush=True)
          except Exception as e:   # noqa: BLE001
            rec["largest_batch"] = dict(error=f"{type(e).__name__}: {e}"[:500])
      save()
    cols = res["columns"]
    ok = lambda c: c if c and "step_s" in c else None
    fused, base, xla = (ok(cols.get("smartvjp+fused")),
                        ok(cols.get("jax.custom_vjp")), ok(cols.get("xla")))
    med = lambda r: r["step_s"]["median"]
    if fused and base:
      goals.check(f"{pname}: smartvjp+fused step faster than jax.custom_vjp's "
                  f"({med(fused) / med(base):.3f}x)", med(fused) < med(base))
      goals.check(f"{pname}: smartvjp+fused time to first step <= "
                  f"{FIRST_STEP_TOL}x jax.custom_vjp's "
                  f"({fused['first_step_s']['total'] / base['first_step_s']['total']:.3f}x)",
                  fused["first_step_s"]["total"]
                  <= FIRST_STEP_TOL * base["first_step_s"]["total"])
      fb, bb = fused.get("largest_batch", {}), base.get("largest_batch", {})
      if "batch" in fb and "batch" in bb:
        goals.check(f"{pname}: smartvjp+fused largest batch >= "
                    f"jax.custom_vjp's ({fb['batch']} vs {bb['batch']})",
                    fb["batch"] >= bb["batch"])
    if fused and xla:
      goals.check(f"{pname}: smartvjp+fused step faster than xla's "
                  f"({med(fused) / med(xla):.3f}x)", med(fused) < med(xla))
    doc["goals"] = goals.as_list()
    save()
  print()
  if smoke:
    print("(smoke: a tiny model on the CPU; the step-time goals say nothing "
          "about a TPU here)")
  print(goals.render())
  doc["goals"] = goals.as_list()
  doc["elapsed_s"] = time.perf_counter() - t_start
  save()
  print(f"Finished in {doc['elapsed_s']:.1f} s.")
  return doc, goals


if __name__ == "__main__":
  main()
