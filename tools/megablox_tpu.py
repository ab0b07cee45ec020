"""JAX's megablox ``gmm`` in a scanned, checkpointed MoE step: the program
``jax.custom_vjp`` (as shipped) gives against smartvjp's
(``import_swapped`` of the megablox package), counted in the lowered module
and, on a TPU, in the compiled one.

Each layer is ``x + gmm(gelu(gmm(x, w1, gs)), w2, gs)`` (two grouped matrix
products over ``G`` experts), ``L`` layers in a ``lax.scan``; the step is
``jit(grad(loss))`` over both weight stacks and the tokens. For every
variant (checkpointed or not, scanned or a single layer) it prints, for
both sides:

* the lowered module with every ``func.call`` inlined (so each operation is
  counted once per place it runs): the operations, and the Mosaic kernels
  (``tpu_custom_call``) among them. This needs no TPU
  (``lowering_platforms=("tpu",)``) and is what CI checks
  (``tests/test_megablox_lowered.py``);
* on a TPU only: the compiled program's instructions, custom-calls, fusions,
  gathers, scatters and reduce-windows, and whether the gradients are
  bitwise equal.

    python tools/megablox_tpu.py                 # prints JSON; on a TPU, compiles and runs
    OUT=/some/dir python tools/megablox_tpu.py   # also writes $OUT/megablox_tpu.json

Exit status 0 when smartvjp's program is nowhere larger than
``jax.custom_vjp``'s (lowered operations and kernels; compiled instructions,
custom-calls and fusions) and the gradients are equal; 1 otherwise.
"""

from __future__ import annotations

import collections
import importlib
import json
import os
import platform
import re
import subprocess
import sys

import jax
import jax.numpy as jnp

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)
import smartvjp  # noqa: E402

MODULE = "jax.experimental.pallas.ops.tpu.megablox"
# tokens, model width, expert width, experts, layers (a TPU-tile multiple)
SHAPES = dict(m=512, k=256, n=256, groups=4, layers=2)
GROUP_SIZES = (128, 256, 0, 128)   # one empty expert, as routing gives


def modules():
  """``{"jax.custom_vjp": shipped, "smartvjp": swapped}``: the megablox
  package as imported, and its swapped copy (the package, not ``ops``, which
  reads ``gmm`` from its package part-way through the package's import)."""
  return {"jax.custom_vjp": importlib.import_module(MODULE),
          "smartvjp": smartvjp.import_swapped(MODULE)}


def inputs(m, k, n, groups, layers):
  """``(w1 [L,G,k,n], w2 [L,G,n,k], x [m,k], group_sizes [G] int32)``."""
  k1, k2, k3 = jax.random.split(jax.random.PRNGKey(0), 3)
  w1 = jax.random.normal(k1, (layers, groups, k, n), jnp.float32) / 16
  w2 = jax.random.normal(k2, (layers, groups, n, k), jnp.float32) / 16
  x = jax.random.normal(k3, (m, k), jnp.float32)
  sizes = jnp.asarray(GROUP_SIZES, jnp.int32)
  assert int(sizes.sum()) == m and sizes.shape == (groups,)
  return w1, w2, x, sizes


def step(module, checkpoint=True, scan=True):
  """``jit(grad(loss, (w1, w2, x)))`` of the MoE layers."""
  def layer(x, p):
    w1, w2, gs = p
    h = jax.nn.gelu(module.gmm(x, w1, gs))
    return x + module.gmm(h, w2, gs)

  if checkpoint:
    layer = jax.checkpoint(layer)

  def loss(w1, w2, x, gs):
    if scan:
      x, _ = jax.lax.scan(lambda x, p: (layer(x, (p[0], p[1], gs)), None),
                          x, (w1, w2))
    else:
      x = layer(x, (w1[0], w2[0], gs))
    return jnp.mean(x ** 2)
  return jax.jit(jax.grad(loss, argnums=(0, 1, 2)))


# -- the lowered module, every call inlined ------------------------------------------

_FUNC = re.compile(r"^  func\.func (?:public |private )?@([\w.$-]+)\(")
_CALL = re.compile(r"\bcall @([\w.$-]+)\(")
_OP = re.compile(r"(?:=\s*|^\s*)\"?((?:stablehlo|chlo|mhlo|sdy)\.[a-z_]+)")


def lowered_ops(text: str) -> collections.Counter:
  """Operations of a lowered module (MLIR text) counted once per place they
  run: each ``func.call`` counts its callee's operations again (a region's
  operations, a loop body's, once). A Mosaic kernel is
  ``tpu_custom_call``."""
  funcs, body = {}, None
  for line in text.splitlines():
    head = _FUNC.match(line)
    if head:
      body = funcs.setdefault(head.group(1), ([], collections.Counter()))
      continue
    if line.startswith("  }"):
      body = None
      continue
    if body is None:
      continue
    body[0].extend(_CALL.findall(line))
    for op in _OP.findall(line):
      if op.endswith("custom_call") and "@tpu_custom_call" in line:
        op = "tpu_custom_call"
      body[1][op] += 1
  memo = {}

  def total(name):
    if name not in memo:
      calls, own = funcs[name]
      counts = collections.Counter(own)
      for callee in calls:
        counts.update(total(callee))
      memo[name] = counts
    return memo[name]
  return total("main")


def lowered_for_tpu(fn, *args) -> str:
  traced = fn.trace(*args)
  if jax.default_backend() == "tpu":
    return traced.lower().as_text()
  return traced.lower(lowering_platforms=("tpu",)).as_text()


def lowered_summary(fn, *args) -> dict:
  ops = lowered_ops(lowered_for_tpu(fn, *args))
  return {"ops": sum(ops.values()), "kernels": ops["tpu_custom_call"],
          "by_op": dict(sorted(ops.items()))}


# -- the compiled program (a TPU) ------------------------------------------------------

_INSTR = re.compile(r"^\s*(?:ROOT )?%?[\w.-]+ = \S+ ([\w-]+)\(", re.M)


def compiled_summary(fn, *args) -> dict:
  """Instructions of the compiled (optimized) HLO, all computations."""
  text = fn.lower(*args).compile().as_text()
  ops = collections.Counter(_INSTR.findall(text))
  return {"instructions": sum(ops.values()),
          "custom-call": ops["custom-call"], "fusion": ops["fusion"],
          "gather": ops["gather"], "scatter": ops["scatter"],
          "reduce-window": ops["reduce-window"],
          "mosaic_kernels": text.count("tpu_custom_call"),
          "by_op": dict(sorted(ops.items()))}


def _commit():
  """The commit, with ``-dirty`` where ``smartvjp/`` has changes."""
  try:
    git = lambda *a: subprocess.run(["git", "-C", ROOT, *a], capture_output=True,
                                    text=True).stdout.strip()
    dirty = git("status", "--porcelain", "smartvjp")
    return git("rev-parse", "--short", "HEAD") + ("-dirty" if dirty else "")
  except OSError:
    return "unknown"


def measure(variants=((True, True), (True, False), (False, True))) -> dict:
  mods = modules()
  args = inputs(**SHAPES)
  on_tpu = jax.default_backend() == "tpu"
  doc = {"machine": platform.node(), "backend": jax.default_backend(),
         "devices": [str(d) for d in jax.devices()],
         "jax": jax.__version__, "python": platform.python_version(),
         "smartvjp_commit": _commit(), "shapes": SHAPES,
         "group_sizes": GROUP_SIZES, "variants": {}}
  for checkpoint, scan in variants:
    name = f"checkpoint={checkpoint} scan={scan}"
    rec = {}
    steps = {side: step(m, checkpoint, scan) for side, m in mods.items()}
    for side, fn in steps.items():
      rec[side] = {"lowered": lowered_summary(fn, *args)}
      if on_tpu:
        rec[side]["compiled"] = compiled_summary(fn, *args)
    if on_tpu:
      grads = {side: jax.block_until_ready(fn(*args))
               for side, fn in steps.items()}
      rec["bitwise_equal"] = all(
          bool((a == b).all()) for a, b in zip(grads["jax.custom_vjp"],
                                              grads["smartvjp"]))
    doc["variants"][name] = rec
  return doc


def no_larger(doc) -> bool:
  ok = True
  for rec in doc["variants"].values():
    mine, theirs = rec["smartvjp"], rec["jax.custom_vjp"]
    ok &= all(mine["lowered"][k] <= theirs["lowered"][k]
              for k in ("ops", "kernels"))
    if "compiled" in mine:
      ok &= all(mine["compiled"][k] <= theirs["compiled"][k]
                for k in ("instructions", "custom-call", "fusion"))
      ok &= rec["bitwise_equal"]
  return bool(ok)


def main() -> int:
  doc = measure()
  doc["smartvjp_no_larger"] = no_larger(doc)
  short = {}
  for name, variant in doc["variants"].items():
    short[name] = {k: v for k, v in variant.items() if not isinstance(v, dict)}
    for side in ("jax.custom_vjp", "smartvjp"):
      short[name][side] = {
          f"{part}_{k}": v for part in ("lowered", "compiled")
          for k, v in variant[side].get(part, {}).items() if k != "by_op"}
  print(json.dumps({"jax": doc["jax"], "backend": doc["backend"],
                    "commit": doc["smartvjp_commit"], "variants": short,
                    "smartvjp_no_larger": doc["smartvjp_no_larger"]}, indent=1))
  out = os.environ.get("OUT")
  if out:
    with open(os.path.join(out, "megablox_tpu.json"), "w") as fh:
      json.dump(doc, fh, indent=1)
  return 0 if doc["smartvjp_no_larger"] else 1


if __name__ == "__main__":
  sys.exit(main())
