"""TPU benchmark: JAX's shipped Pallas TPU flash attention, as shipped and
swapped into smartvjp.

``jax.experimental.pallas.ops.tpu.flash_attention.flash_attention`` is a
``jax.custom_vjp`` around Mosaic kernels: its ``f`` launches
``_flash_attention_kernel`` with one output (``o``), its ``fwd`` launches the
same kernel with ``save_residuals`` on, which also writes the softmax
statistics ``l`` and ``m``, and its ``bwd`` launches
``_flash_attention_dkv_kernel`` and ``_flash_attention_dq_kernel``. The
model: ``--layers`` self-attention layers (``x @ wqkv``, causal flash
attention, ``@ wo``, a residual connection), each under ``jax.checkpoint``
(``nothing_saveable``, then ``dots_saveable``), scanned; one step is
``jit(value_and_grad)`` of ``mean(x ** 2)``. Two schedules: the module as
shipped (``jax.custom_vjp``), and ``smartvjp.import_swapped``'s copy of it.

For each policy and schedule:

* kernel launches per step, by kernel, and the bytes of ``l`` and ``m`` the
  kernels write, counted in the program lowered for the TPU
  (``examples/pallas_ops_transformer.py``'s ``kernel_launches``; Pallas
  lowers Mosaic kernels in Python, so this part runs on any machine);
* on a TPU only (Pallas' TPU interpret mode runs callbacks, which
  ``jax.checkpoint`` refuses to differentiate): the loss and gradients of
  both schedules from the same parameters, compared bit for bit, and step
  time: ``--rounds`` interleaved rounds after a warm-up,
  round ``r`` running each schedule once in an order rotated by ``r``, each
  sample ``--inner`` back-to-back steps; the median with min-max, and the
  median of the per-round ratios (swapped / shipped).

Goals, each printed with a verdict (met / not met): swapped launches the
residual-writing kernel half as often as shipped and no kernel more often
in total; the gradients are bitwise equal; on a TPU, a swapped step is not
slower than a shipped one beyond 2% (median per-round ratio; the saving is
the forward pass's writes of ``l`` and ``m``, a small part of a step).

Run on a TPU:  python benchmarks/tpu_attention.py [--out FILE.json]
Elsewhere:     python benchmarks/tpu_attention.py   (the smoke sizes; the
               launch counts only)
"""

from __future__ import annotations

import argparse
import collections
import dataclasses
import importlib
import json
import math
import os
import sys
import time

import jax
import jax.numpy as jnp

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
sys.path.insert(0, os.path.join(ROOT, "examples"))
sys.path.insert(1, HERE)
sys.path.insert(2, ROOT)   # smartvjp from this checkout where it is not installed
import _report as R  # noqa: E402
import pallas_ops_transformer as EX  # noqa: E402

import smartvjp  # noqa: E402

MODULE = "jax.experimental.pallas.ops.tpu.flash_attention"
SCHEDULES = ("shipped", "swapped")
POLICIES = {"nothing_saveable": jax.checkpoint_policies.nothing_saveable,
            "dots_saveable": jax.checkpoint_policies.dots_saveable}
STEP_TOLERANCE = 1.02
FWD_KERNEL = "_flash_attention_kernel"


@dataclasses.dataclass(frozen=True)
class Config:
  layers: int = 4
  batch: int = 4
  heads: int = 8
  seq: int = 2048
  head_dim: int = 128
  dtype: str = "bfloat16"

  @property
  def width(self) -> int:
    return self.heads * self.head_dim


# one chip of a TPU v5e: 4 layers of 4 x 2048 tokens, 8 heads of 128, bf16
TPU_CONFIG = Config()
SMOKE_CONFIG = Config(layers=2, batch=1, heads=2, seq=256, head_dim=128,
                      dtype="float32")


def load(schedule: str):
  """The flash attention module as shipped, or smartvjp's swapped copy."""
  if schedule == "swapped":
    return smartvjp.import_swapped(MODULE)
  return importlib.import_module(MODULE)


def init_params(cfg: Config, key):
  """``{"wqkv": [layers, width, 3 * width], "wo": [layers, width, width]}``
  and an input ``x: [batch, seq, width]``, all of ``cfg.dtype``."""
  d, dt = cfg.width, jnp.dtype(cfg.dtype)
  k1, k2, k3 = jax.random.split(key, 3)
  normal = lambda k, shape: (jax.random.normal(k, shape, jnp.float32)
                             / math.sqrt(d)).astype(dt)
  params = {"wqkv": normal(k1, (cfg.layers, d, 3 * d)),
            "wo": normal(k2, (cfg.layers, d, d))}
  x = jax.random.normal(k3, (cfg.batch, cfg.seq, d), jnp.float32).astype(dt)
  return params, x


def make_loss(cfg: Config, module, policy):
  """``loss(params, x) -> f32 scalar``: ``mean(x_out ** 2)`` after the
  scanned, checkpointed attention layers."""
  b, t, h, hd = cfg.batch, cfg.seq, cfg.heads, cfg.head_dim

  def heads(a):                         # [b, t, h * hd] -> [b, h, t, hd]
    return a.reshape(b, t, h, hd).transpose(0, 2, 1, 3)

  def layer(x, p):
    q, k, v = jnp.split(x @ p["wqkv"], 3, axis=-1)
    o = module.flash_attention(heads(q), heads(k), heads(v), causal=True,
                               sm_scale=1 / math.sqrt(hd))
    return x + o.transpose(0, 2, 1, 3).reshape(b, t, h * hd) @ p["wo"]

  layer = jax.checkpoint(layer, policy=policy)

  def loss(params, x):
    x, _ = jax.lax.scan(lambda x, p: (layer(x, p), None), x, params)
    return jnp.mean(jnp.square(x.astype(jnp.float32)))
  return loss


def make_step(cfg, module, policy):
  """``jit(value_and_grad(loss))``: one step's loss and gradients."""
  return jax.jit(jax.value_and_grad(make_loss(cfg, module, policy)))


def lowered_for_tpu(step, *args):
  """The jitted ``step`` lowered for the TPU, as an MLIR module (no TPU
  needed)."""
  traced = step.trace(*args)
  if jax.default_backend() == "tpu":
    return traced.lower().compiler_ir()
  return traced.lower(lowering_platforms=("tpu",)).compiler_ir()


def launches(step, params, x) -> dict:
  """``{"by_kernel": {"name (outputs)": n}, "residual_launches",
  "residual_bytes", "total"}`` per step of the jitted ``step``."""
  counts = EX.kernel_launches(lowered_for_tpu(step, params, x))
  by_kernel = collections.Counter()
  residual_launches = residual_bytes = 0
  for kernel, n in counts.items():
    outs = len(kernel.outputs)
    by_kernel[f"{kernel.name} ({outs} output{'s' * (outs != 1)})"] += n
    if kernel.name == FWD_KERNEL and outs == 3:   # o, l, m: fwd's launch
      residual_launches += n
      residual_bytes += n * (kernel.output_bytes(1) + kernel.output_bytes(2))
  return dict(by_kernel=dict(sorted(by_kernel.items())),
              residual_launches=residual_launches,
              residual_bytes=residual_bytes, total=sum(counts.values()))


def step_times(steps, params, x, rounds, inner):
  """``{schedule: [seconds per step, one per round]}``, interleaved (the
  ``steps`` already compiled and run once)."""
  times = {s: [] for s in SCHEDULES}
  for r in range(rounds):
    for s in SCHEDULES[r % 2:] + SCHEDULES[:r % 2]:
      t0 = time.perf_counter()
      for _ in range(inner):
        out = steps[s](params, x)
      jax.block_until_ready(out)
      times[s].append((time.perf_counter() - t0) / inner)
  return times


def main(argv=None):
  p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  p.add_argument("--smoke", action="store_true",
                 help="tiny sizes: checks the script; figures mean nothing")
  p.add_argument("--rounds", type=int, default=15)
  p.add_argument("--inner", type=int, default=10)
  p.add_argument("--out", help="also write the results as JSON here")
  args = p.parse_args(argv)
  t_start = time.perf_counter()
  on_tpu = jax.default_backend() == "tpu"
  cfg = SMOKE_CONFIG if args.smoke or not on_tpu else TPU_CONFIG
  print(R.header())
  print(f"model: {cfg}; flash attention from {MODULE}"
        + ("" if on_tpu else " -- no TPU: launch counts from the program "
           "lowered for the TPU only"))
  modules = {s: load(s) for s in SCHEDULES}
  params, x = init_params(cfg, jax.random.key(0))
  goals = R.Goals()
  doc = dict(config=dataclasses.asdict(cfg), machine=R.machine(),
             versions=R.versions(), policies={})
  for name, policy in POLICIES.items():
    res = doc["policies"][name] = {}
    steps = {s: make_step(cfg, modules[s], policy) for s in SCHEDULES}
    counted = {s: launches(steps[s], params, x) for s in SCHEDULES}
    res["launches"] = counted
    print(f"\n== policy {name}: kernel launches per step ==")
    kernels = sorted(set().union(*(c["by_kernel"] for c in counted.values())))
    print(f"{'kernel':44s} {'shipped':>8s} {'swapped':>8s}")
    for k in kernels:
      print(f"{k:44s} " + " ".join(
          f"{counted[s]['by_kernel'].get(k, 0):8d}" for s in SCHEDULES))
    print(f"{'l and m written (bytes)':44s} " + " ".join(
        f"{counted[s]['residual_bytes']:8d}" for s in SCHEDULES))
    sh, sw = counted["shipped"], counted["swapped"]
    goals.check(f"{name}: swapped writes l and m in "
                f"{sw['residual_launches']} launches, half of shipped's "
                f"{sh['residual_launches']}",
                sh["residual_launches"] > 0
                and 2 * sw["residual_launches"] == sh["residual_launches"])
    goals.check(f"{name}: swapped launches {sw['total']} kernels per step, "
                f"no more than shipped's {sh['total']}",
                sw["total"] <= sh["total"])

    if on_tpu:
      grads = {s: jax.block_until_ready(steps[s](params, x))  # compiles
               for s in SCHEDULES}
      same = EX.bitwise_equal(grads["shipped"], grads["swapped"])
      res["bitwise_equal"] = same
      goals.check(f"{name}: loss and gradients bitwise equal", same)
      times = step_times(steps, params, x, args.rounds, args.inner)
      ratio = R.Spread(R.paired_ratios(times["swapped"], times["shipped"]))
      res["step_s"] = {s: R.Spread(times[s]).as_dict() for s in SCHEDULES}
      res["ratio"] = ratio.as_dict()
      print(f"step time (ms): shipped {R.spread(times['shipped'], 1e3, 3)}, "
            f"swapped {R.spread(times['swapped'], 1e3, 3)}; ratio "
            f"{ratio.fmt(digits=3, unit='x')} ({args.rounds} rounds of "
            f"{args.inner} steps)")
      goals.check(f"{name}: swapped step <= {STEP_TOLERANCE:.2f}x shipped "
                  f"(median ratio {ratio.fmt(digits=3, unit='x')})",
                  ratio.median <= STEP_TOLERANCE)
  print()
  print(goals.render())
  doc["goals"] = goals.as_list()
  if args.out:
    with open(args.out, "w") as fh:
      json.dump(doc, fh, indent=1)
  print(f"\nFinished in {time.perf_counter() - t_start:.1f} s.")
  return doc, goals


if __name__ == "__main__":
  main()
