"""A small transformer on JAX's own Pallas kernels, as shipped and swapped.

The attention and RMSNorm of each layer are JAX's shipped Pallas GPU kernels,
``jax.experimental.pallas.ops.gpu.attention.mha`` and
``jax.experimental.pallas.ops.gpu.rms_norm.rms_norm``; the MLP is plain JAX.
Both kernels are ``jax.custom_vjp`` functions whose ``fwd`` is a kernel that
writes residuals (attention's log-sum-exp ``lse``, RMSNorm's ``rstd``) and
whose ``f`` is a kernel that does not. Each layer is under ``jax.checkpoint``
(``nothing_saveable``, then ``dots_saveable``), the layers are scanned, and
the model is trained a few SGD steps twice: with the kernels as shipped, and
with ``smartvjp.import_swapped`` copies of the two modules, in which
``jax.custom_vjp`` is ``smart_custom_vjp`` (nobody edits JAX's files).

As shipped, each checkpointed call runs the residual-writing kernel twice per
step: in the forward pass (its residuals dropped) and again in the backward
pass. Swapped, the forward pass runs the kernel without residual outputs and
the backward pass the residual-writing one, once. The script prints:

* kernel launches per training step, by kernel, side by side: counted in the
  program JAX lowers for the GPU (on a CPU it is lowered for an H200 without
  one), so what the counts show is what a GPU runs;
* the loss curves, which must be equal bit for bit, and the final
  parameters (also bitwise);
* the residual bytes each schedule's kernels write per step, from the
  kernels' output shapes.

On a CPU the kernels run in Pallas interpret mode at tiny sizes; on a GPU the
same script runs them through Pallas' Triton backend.

Run:  python examples/pallas_ops_transformer.py
"""

from __future__ import annotations

import collections
import dataclasses
import importlib
import importlib.util
import math
import re
import time
import warnings

import jax
import jax.numpy as jnp
import numpy as np

import smartvjp

ATTENTION = "jax.experimental.pallas.ops.gpu.attention"
RMS_NORM = "jax.experimental.pallas.ops.gpu.rms_norm"
POLICIES = {"nothing_saveable": jax.checkpoint_policies.nothing_saveable,
            "dots_saveable": jax.checkpoint_policies.dots_saveable}
SCHEDULES = ("shipped", "swapped")


# -- the kernels, as shipped and swapped ------------------------------------------

def load_kernels(swapped: bool):
  """``(attention module, rms_norm module)``: JAX's own modules, or fresh
  copies from ``smartvjp.import_swapped`` whose ``custom_vjp`` functions are
  ``smart_custom_vjp``. (JAX 0.10.2 and later mark both modules deprecated
  in favour of tokamax; the warning is silenced here.)"""
  with warnings.catch_warnings():
    warnings.simplefilter("ignore", DeprecationWarning)
    load = smartvjp.import_swapped if swapped else importlib.import_module
    return load(ATTENTION), load(RMS_NORM)


# -- the model --------------------------------------------------------------------

@dataclasses.dataclass(frozen=True)
class Config:
  layers: int = 2
  batch: int = 2
  seq: int = 32
  heads: int = 2
  head_dim: int = 16
  mlp: int = 64
  vocab: int = 16
  dtype: str = "float32"
  steps: int = 4
  learning_rate: float = 0.2

  @property
  def width(self) -> int:
    return self.heads * self.head_dim


def init_params(cfg: Config, key):
  """Parameters; the per-layer ones stacked along a leading ``[layers]``
  axis for ``lax.scan``."""
  d, L, dt = cfg.width, cfg.layers, jnp.dtype(cfg.dtype)
  ks = jax.random.split(key, 5)
  normal = lambda k, shape, fan_in: (
      jax.random.normal(k, shape, jnp.float32) / math.sqrt(fan_in)).astype(dt)
  return {
      "embed": normal(ks[0], (cfg.vocab, d), 1.0),
      "layers": {
          "norm1": jnp.ones((L, d), dt), "norm2": jnp.ones((L, d), dt),
          "wqkv": normal(ks[1], (L, d, 3 * d), d),
          "wo": normal(ks[2], (L, d, d), d),
          "w1": normal(ks[3], (L, d, cfg.mlp), d),
          "w2": normal(ks[4], (L, cfg.mlp, d), cfg.mlp),
      },
  }


def make_loss(cfg: Config, attention, rms_norm, policy, interpret: bool):
  """``loss(params, tokens: int32[batch, seq + 1]) -> f32 scalar``: mean
  next-token cross-entropy of a pre-norm transformer whose layers are
  checkpointed with ``policy`` and scanned."""
  b, t, h, hd, d = cfg.batch, cfg.seq, cfg.heads, cfg.head_dim, cfg.width
  dt = jnp.dtype(cfg.dtype)
  no_bias = jnp.zeros((d,), dt)     # rms_norm's kernels take a bias; ours is 0

  def norm(x, weight):              # x: [batch, seq, width] (the kernel's 3-D)
    return rms_norm.rms_norm(x, weight, no_bias, interpret=interpret)

  def layer(x, p):
    qkv = (norm(x, p["norm1"]) @ p["wqkv"]).reshape(b, t, 3, h, hd)
    o = attention.mha(qkv[:, :, 0], qkv[:, :, 1], qkv[:, :, 2], None,
                      sm_scale=1 / math.sqrt(hd), causal=True,
                      interpret=interpret)
    x = x + o.reshape(b, t, d) @ p["wo"]
    return x + jax.nn.gelu(norm(x, p["norm2"]) @ p["w1"]) @ p["w2"]

  layer = jax.checkpoint(layer, policy=policy)

  def loss(params, tokens):
    x = params["embed"][tokens[:, :-1]]
    x, _ = jax.lax.scan(lambda x, p: (layer(x, p), None), x, params["layers"])
    x = x * jax.lax.rsqrt(jnp.mean(x * x, -1, keepdims=True) + 1e-5)
    logits = (x @ params["embed"].T).astype(jnp.float32) / math.sqrt(d)
    logp = jax.nn.log_softmax(logits)
    return -jnp.mean(jnp.take_along_axis(logp, tokens[:, 1:, None], -1))
  return loss


def make_step(cfg: Config, attention, rms_norm, policy, interpret: bool):
  """``step(params, tokens) -> (loss, params)``: one SGD step (not jitted)."""
  grad = jax.value_and_grad(make_loss(cfg, attention, rms_norm, policy,
                                      interpret))

  def step(params, tokens):
    loss, g = grad(params, tokens)
    lr = jnp.asarray(cfg.learning_rate, jnp.float32)
    new = jax.tree.map(lambda p, d: (p - lr * d).astype(p.dtype), params, g)
    return loss, new
  return step


def make_data(cfg: Config, key):
  return jax.random.randint(key, (cfg.batch, cfg.seq + 1), 0, cfg.vocab,
                            jnp.int32)


# -- counting launches in the program JAX lowers for a GPU (or a TPU) ---------

TRITON_CALL = "__gpu$xla.gpu.triton"
MOSAIC_CALL = "tpu_custom_call"
MOSAIC_GPU_CALL = "mosaic_gpu_v2"   # a Mosaic GPU kernel (plgpu.kernel)
# Single-operand ops that only annotate sharding: looked through when a loop
# bound is read.
_ANNOTATIONS = ("sdy.sharding_constraint", "mhlo.sharding")


class LaunchCountError(ValueError):
  """The lowered program launches kernels a number of times that is not
  known before it runs (a loop with a data-dependent trip count, or a
  conditional whose branches launch different kernels)."""


@dataclasses.dataclass(frozen=True)
class Kernel:
  """One kernel as lowered: its name and its outputs' (shape, dtype name)."""
  name: str
  outputs: tuple[tuple[tuple[int, ...], str], ...]

  def output_bytes(self, index: int) -> int:
    shape, dtype = self.outputs[index]
    return math.prod(shape) * _itemsize(dtype)


def _itemsize(mlir_dtype: str) -> int:
  m = re.fullmatch(r"[a-z]+(\d+)(?:[A-Za-z0-9]*)", mlir_dtype)
  if not m:
    raise ValueError(f"unknown element type {mlir_dtype}")
  return max(1, int(m.group(1)) // 8)


def _tensor(type_str: str) -> tuple[tuple[int, ...], str]:
  m = re.fullmatch(r"tensor<((?:\d+x)*)(\w+)>", type_str)
  if not m:
    raise ValueError(f"not a static tensor type: {type_str}")
  dims = tuple(int(d) for d in m.group(1).split("x") if d)
  return dims, m.group(2)


def lower_for_gpu(fn, *args):
  """``jax.jit(fn)`` lowered for the GPU, as an MLIR module. Without a GPU
  it lowers for an abstract H200 (``lowering_platforms=("cuda",)``): Pallas
  lowers its kernels to Triton in Python, so no GPU is needed."""
  if jax.default_backend() == "gpu":
    return jax.jit(fn).trace(*args).lower().compiler_ir()
  try:
    device = jax.sharding.AbstractDevice(device_kind="NVIDIA H200",
                                         num_cores=132, platform="gpu")
  except TypeError:   # jax 0.10.0's AbstractDevice has no platform field
    device = jax.sharding.AbstractDevice(device_kind="NVIDIA H200",
                                         num_cores=132)
  mesh = jax.sharding.AbstractMesh((1,), ("gpu",), abstract_device=device)
  with jax.sharding.use_abstract_mesh(mesh):
    traced = jax.jit(fn).trace(*args)
    return traced.lower(lowering_platforms=("cuda",)).compiler_ir()


def kernel_launches(module) -> collections.Counter:
  """``{Kernel: launches}`` for one run of a lowered program's ``main``.

  Walks the MLIR module JAX produced (after JAX's dead-code elimination, so
  a ``pallas_call`` whose outputs are all unused is already gone; a kernel
  with one used output runs whole): each Triton (GPU) or Mosaic (TPU)
  custom call counts once per execution, a ``func.call`` adds its callee's
  launches, and the body of a ``stablehlo.while`` (what ``lax.scan`` and
  ``lax.fori_loop`` with static bounds lower to) counts its trip count
  times, read from the loop: ``i < N`` on a counter that starts at a
  constant and steps by 1. A custom call none of whose results is used is
  not counted (XLA removes it).

  Raises:
    LaunchCountError: a loop whose trip count is not such a constant, or a
      conditional whose branches launch different kernels.
  """
  funcs = {_attr_str(op, "sym_name"): op for op in _ops(module.body)
           if op.name == "func.func"}
  memo: dict[str, collections.Counter] = {}

  def func(name):
    if name not in memo:
      memo[name] = block(funcs[name].regions[0].blocks[0])
    return memo[name]

  def block(b):
    counts = collections.Counter()
    for op in _ops(b):
      if op.name == "stablehlo.custom_call":
        name = _kernel_name(op)
        if name is not None and any(
            any(True for _ in r.uses) for r in op.results):
          kernel = Kernel(name,
                          tuple(_tensor(str(r.type)) for r in op.results))
          counts[kernel] += 1
      elif op.name == "func.call":
        counts.update(func(str(op.attributes["callee"]).lstrip("@")))
      elif op.name == "stablehlo.while":
        cond, body = (r.blocks[0] for r in op.regions)
        if block(cond):
          raise LaunchCountError("a kernel in a while loop's condition")
        inner = block(body)
        if inner:
          trips = _trip_count(op)
          counts.update({k: v * trips for k, v in inner.items()})
      else:
        branches = [block(r.blocks[0]) for r in op.regions if len(r.blocks)]
        if any(branches):
          if all(x == branches[0] for x in branches) and op.name in (
              "stablehlo.case", "stablehlo.if"):
            counts.update(branches[0])
          else:
            raise LaunchCountError(
                f"kernels inside {op.name}, whose regions launch different "
                "kernels: the count depends on run-time values")
    return counts

  return func("main")


def _kernel_name(op):
  """The kernel a custom call launches: a Triton kernel (GPU; its name in
  the backend config), a Mosaic GPU one (which carries no name, only a hash
  of its module: ``mosaic_gpu/<operands>``, its operand count, tells JAX's
  attention_mgpu kernels apart) or a Mosaic TPU one (its ``kernel_name``
  attribute); ``None`` for any other custom call."""
  target = _attr_str(op, "call_target_name")
  if target == TRITON_CALL:
    return str(op.attributes["mhlo.backend_config"]["name"]).strip('"')
  if target == MOSAIC_GPU_CALL:
    return f"mosaic_gpu/{len(op.operands)}"
  if target == MOSAIC_CALL and "kernel_name" in op.attributes:
    return _attr_str(op, "kernel_name")
  return None


def _ops(block):
  return [op.operation for op in block.operations]


def _attr_str(op, name):
  return str(op.attributes[name]).strip('"')


def _kind(value):
  return type(value).__name__   # "OpResult" or "BlockArgument"


def _source(value):
  while _kind(value) == "OpResult" and value.owner.name in _ANNOTATIONS:
    value = value.owner.operands[0]
  return value


def _constant(value):
  value = _source(value)
  if _kind(value) != "OpResult" or value.owner.name != "stablehlo.constant":
    return None
  m = re.fullmatch(r"dense<(-?\d+)> : tensor<[iu]\d+>",
                   str(value.owner.attributes["value"]))
  return int(m.group(1)) if m else None


def _trip_count(op) -> int:
  cond, body = (r.blocks[0] for r in op.regions)
  pred = _source(_ops(cond)[-1].operands[0])
  if _kind(pred) == "OpResult" and pred.owner.name == "stablehlo.compare":
    direction = str(pred.owner.attributes["comparison_direction"])
    counter, bound = (_source(v) for v in pred.owner.operands)
    if "LT" in direction and _kind(counter) == "BlockArgument":
      k = counter.arg_number
      start, stop = _constant(op.operands[k]), _constant(bound)
      step = _source(_ops(body)[-1].operands[k])
      if (_kind(step) == "OpResult" and step.owner.name == "stablehlo.add"
          and start is not None and stop is not None):
        a, b = (_source(v) for v in step.owner.operands)
        if (_kind(a) == "BlockArgument" and a.arg_number == k
            and _constant(b) == 1) or (
                _kind(b) == "BlockArgument" and b.arg_number == k
                and _constant(a) == 1):
          return max(0, stop - start)
  raise LaunchCountError("a while loop whose trip count is not a constant "
                         "bound on a counter stepping by 1")


# -- what the kernels are ------------------------------------------------------------

# (kernel name, number of outputs) -> (label, rule, residual outputs). The
# rule is what launches the kernel: the custom_vjp's f (output only), fwd
# (output and residuals: attention's ``lse``, ``_mha_forward``; RMSNorm's
# ``rstd``, ``rms_norm_forward``) or bwd.
KERNELS = {
    ("mha_forward", 1): ("attention mha_forward (o)", "f", ()),
    ("mha_forward", 2): ("attention mha_forward (o, lse)", "fwd", (1,)),
    ("mha_preprocess_backward", 1): ("attention mha_preprocess_backward",
                                     "bwd", ()),
    ("mha_backward", 3): ("attention mha_backward (dq, dk, dv)", "bwd", ()),
    ("rms_norm_forward_kernel", 1): ("rms_norm rms_norm_forward_kernel (o)",
                                     "f", ()),
    ("rms_forward", 2): ("rms_norm rms_forward (o, rstd)", "fwd", (1,)),
    ("ln_backward_dx", 1): ("rms_norm ln_backward_dx", "bwd", ()),
    ("ln_backward_dw_db", 2): ("rms_norm ln_backward_dw_db", "bwd", ()),
    # JAX's Mosaic GPU attention (attention_mgpu; its kernels carry no name)
    ("mosaic_gpu/3", 1): ("attention_mgpu forward (o)", "f", ()),
    ("mosaic_gpu/3", 2): ("attention_mgpu forward (o, lse)", "fwd", (1,)),
    ("mosaic_gpu/6", 1): ("attention_mgpu backward (dq)", "bwd", ()),
    ("mosaic_gpu/6", 2): ("attention_mgpu backward (dk, dv)", "bwd", ()),
}
CALLS_PER_LAYER = {"attention": 1, "rms_norm": 2, "attention_mgpu": 1}
# Rule calls per checkpointed call and step: jax.custom_vjp runs fwd in the
# forward pass and again in the backward pass; smartvjp f, then fwd once.
RULE_CALLS = {"shipped": {"fwd": 2, "bwd": 1},
              "swapped": {"f": 1, "fwd": 1, "bwd": 1}}


def describe(kernel: Kernel) -> tuple[str, str, tuple[int, ...]]:
  """``(label, rule, residual output indices)`` of a kernel of this model."""
  n = len(kernel.outputs)
  return KERNELS.get((kernel.name, n),
                     (f"{kernel.name} ({n} outputs)", "?", ()))


def by_label(launches) -> dict[str, int]:
  out = collections.Counter()
  for kernel, n in launches.items():
    out[describe(kernel)[0]] += n
  return dict(out)


def residual_bytes(launches) -> int:
  """Bytes of residual outputs (``lse``, ``rstd``) the kernels write."""
  return sum(n * kernel.output_bytes(i) for kernel, n in launches.items()
             for i in describe(kernel)[2])


def expected_launches(cfg: Config, modules=("attention", "rms_norm")
                      ) -> dict[str, dict[str, int]]:
  """``{schedule: {label: launches per step}}``: every kernel of a rule runs
  once per rule call, for each call of its module (of ``modules``, the
  kernel modules the model uses) in each layer."""
  out = {}
  for schedule, rule_calls in RULE_CALLS.items():
    want = collections.Counter()
    for label, rule, _ in KERNELS.values():
      if label.split()[0] not in modules:
        continue
      calls = cfg.layers * CALLS_PER_LAYER[label.split()[0]]
      want[label] += rule_calls.get(rule, 0) * calls
    out[schedule] = {k: v for k, v in want.items() if v}
  return out


# -- the run ------------------------------------------------------------------------

def bits(x) -> np.ndarray:
  a = np.asarray(x)
  return a.view(np.dtype(f"u{a.dtype.itemsize}"))


def bitwise_equal(a, b) -> bool:
  la, lb = jax.tree.leaves(a), jax.tree.leaves(b)
  return len(la) == len(lb) and all(
      x.shape == y.shape and x.dtype == y.dtype
      and np.array_equal(bits(x), bits(y)) for x, y in zip(la, lb))


def count_step(cfg, kernels, policy, params, tokens):
  """Launches per step of ``kernels`` under ``policy``, in the GPU program."""
  step = make_step(cfg, *kernels, policy, interpret=False)
  return kernel_launches(lower_for_gpu(step, params, tokens))


def train(cfg, kernels, policy, params, tokens, interpret):
  step = jax.jit(make_step(cfg, *kernels, policy, interpret))
  losses = []
  for _ in range(cfg.steps):
    loss, params = step(params, tokens)
    losses.append(loss)
  return jax.block_until_ready(losses), params


# a JAX that ships the kernels, in a virtualenv of its own (one command)
GET_A_JAX = ('python3 -m venv /tmp/jax-0.12.0.1 && . /tmp/jax-0.12.0.1/bin/activate '
             '&& pip install -e ".[examples]" "jax==0.12.0.1" "jaxlib==0.12.0.1" '
             '&& python examples/pallas_ops_transformer.py')


def main(cfg: Config | None = None):
  """Runs the comparison; returns ``{policy: {"launches", "losses",
  "residual_bytes", "params_equal"}}`` with per-schedule entries."""
  t0 = time.perf_counter()
  if importlib.util.find_spec(ATTENTION) is None:
    print(f"JAX {jax.__version__} no longer ships the Triton Pallas kernels "
          f"this example swaps ({ATTENTION} and {RMS_NORM}; jax 0.12.1 removed "
          "them). To run it, in the clone, with a JAX that ships them "
          "(Python 3.11 gets jax 0.10.2, which does):")
    print(f"\n  {GET_A_JAX}\n")
    print("What to conclude: nothing was measured on this JAX; run the "
          "command above. For a kernel that every JAX ships, see "
          "benchmarks/tpu_attention.py (TPU flash attention).")
    print(f"Finished in {time.perf_counter() - t0:.1f} s.")
    return None
  cfg = cfg or Config()
  interpret = jax.default_backend() != "gpu"
  kernels = {s: load_kernels(s == "swapped") for s in SCHEDULES}
  params = init_params(cfg, jax.random.key(0))
  tokens = make_data(cfg, jax.random.key(1))

  print(f"JAX {jax.__version__}: a {cfg.layers}-layer transformer (batch "
        f"{cfg.batch}, sequence {cfg.seq}, {cfg.heads} heads of "
        f"{cfg.head_dim}, MLP {cfg.mlp}, {cfg.dtype}) on JAX's shipped Pallas "
        f"kernels {ATTENTION}.mha and {RMS_NORM}.rms_norm,")
  print(f"each layer under jax.checkpoint, scanned; {cfg.steps} SGD steps, "
        + ("Pallas interpret mode (no GPU here)." if interpret else
           "kernels through Pallas' Triton backend."))
  report = {s: smartvjp.swap_report(kernels[s][0])[f"{ATTENTION}.mha"]
            and smartvjp.swap_report(kernels[s][1])[f"{RMS_NORM}.rms_norm"]
            for s in SCHEDULES}
  print("swapped with smartvjp.import_swapped; smartvjp.swap_report says "
        f"mha and rms_norm are smart_custom_vjp: shipped {report['shipped']}, "
        f"swapped {report['swapped']}"
        + ("" if report == {"shipped": False, "swapped": True} else "  WRONG"))

  want = expected_launches(cfg)
  results, launches = {}, {}
  for pname, policy in POLICIES.items():
    launches[pname] = {s: count_step(cfg, kernels[s], policy, params, tokens)
                       for s in SCHEDULES}
    runs = {s: train(cfg, kernels[s], policy, params, tokens, interpret)
            for s in SCHEDULES}
    results[pname] = dict(
        launches={s: by_label(launches[pname][s]) for s in SCHEDULES},
        residual_bytes={s: residual_bytes(launches[pname][s])
                        for s in SCHEDULES},
        losses={s: [float(x) for x in runs[s][0]] for s in SCHEDULES},
        losses_equal=bitwise_equal(runs["shipped"][0], runs["swapped"][0]),
        params_equal=bitwise_equal(runs["shipped"][1], runs["swapped"][1]))

  columns = [(p, s) for p in POLICIES for s in SCHEDULES]
  print("\nKernel launches per training step, counted in the program JAX "
        "lowers for the GPU (rule: f, fwd or bwd of the kernel's custom_vjp):")
  print(f"  {'':44s} {'':4s}" + "".join(f" {p:>33s}" for p in POLICIES))
  print(f"  {'kernel (outputs)':44s} {'rule':4s}" + "".join(
      f" {s:>16s}" for _, s in columns))
  rule = {describe(k)[0]: describe(k)[1] for by_schedule in launches.values()
          for counts in by_schedule.values() for k in counts}
  labels = sorted(rule, key=lambda n: (n.split()[0],
                                       _RULE_ORDER.get(rule[n], 3), n))
  for name in labels:
    got = [results[p]["launches"][s].get(name, 0) for p, s in columns]
    expected = [want[s].get(name, 0) for _, s in columns]
    flag = "" if got == expected else f"  WRONG (expected {expected})"
    print(f"  {name:44s} {rule[name]:4s}"
          + "".join(f" {n:16d}" for n in got) + flag)
  print(f"  {'total':44s} {'':4s}" + "".join(
      f" {sum(results[p]['launches'][s].values()):16d}" for p, s in columns))
  print(f"  {'residual bytes written (lse, rstd)':44s} {'':4s}" + "".join(
      f" {results[p]['residual_bytes'][s]:16d}" for p, s in columns))
  print(f"\nLoss per SGD step (shipped and swapped must be equal bit for bit):")
  print(f"  {'':4s}" + "".join(f" {p:>33s}" for p in POLICIES))
  print(f"  {'step':>4s}" + "".join(f" {s:>16s}" for _, s in columns))
  for i in range(cfg.steps):
    print(f"  {i:4d}" + "".join(f" {results[p]['losses'][s][i]:16.9f}"
                                for p, s in columns))
  for p in POLICIES:
    r = results[p]
    print(f"  {p}: losses bitwise equal "
          f"{'yes' if r['losses_equal'] else 'no  WRONG'}, parameters after "
          f"the last step bitwise equal "
          f"{'yes' if r['params_equal'] else 'no  WRONG'}; residual bytes "
          f"swapped / shipped {r['residual_bytes']['swapped'] / r['residual_bytes']['shipped']:.2f}")
  print("\nThe launch totals are equal: swapped, each checkpointed call's "
        "forward pass runs the kernel without\nresidual outputs (f) and its "
        "backward pass the residual-writing one (fwd), once; as shipped, "
        "fwd runs in\nboth passes, so every residual is written twice. The "
        "MLP's matmuls, saved under dots_saveable,\nare plain JAX; the "
        "kernels' residuals are not dots, so both policies recompute them.")
  same = all(r["losses_equal"] and r["params_equal"] for r in results.values())
  half = max(r["residual_bytes"]["swapped"] / r["residual_bytes"]["shipped"]
             for r in results.values())
  equal_launches = all(
      len({sum(r["launches"][s].values()) for s in SCHEDULES}) == 1
      for r in results.values())
  print(f"\nWhat to conclude: swapping JAX's own shipped Pallas kernels into "
        "smartvjp (smartvjp.import_swapped) "
        + ("trains the\nsame model bit for bit" if same else
           "CHANGES the training: WRONG") + f" and writes {half:.2f} of the "
        "residual bytes written as shipped, with "
        + ("the same number\nof kernel launches." if equal_launches else
           "a different number\nof kernel launches (see the totals)."))
  print(f"Finished in {time.perf_counter() - t0:.1f} s.")
  return results


_RULE_ORDER = {"f": 0, "fwd": 1, "bwd": 2}


if __name__ == "__main__":
  main()
