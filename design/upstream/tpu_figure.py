#!/usr/bin/env python3
"""The accelerator figure of ``../upstream.md``: launches and step time of a
Pallas kernel under ``jax.checkpoint``, per way of scheduling its rules, on
the JAX installed (the TPU machine has jax 0.10.2 only).

The patches of this folder do not apply to jax 0.10.2: its
``CustomVJPTraced`` has no ``remat`` rule that reads the checkpoint policy
(a ``custom_vjp`` under remat3 is fully rematerialized there) and its
``remat_transform`` takes no ``custom_vjp_rules``; the series changes a method
that 0.10.2 does not have. So the series itself is not measured here. What is:
JAX's shipped Pallas TPU flash attention (a ``jax.custom_vjp`` whose ``f``
launches the forward kernel with one output, ``fwd`` the same kernel writing
the softmax statistics ``l`` and ``m`` too, ``bwd`` the dkv and dq kernels),
in ``benchmarks/tpu_attention.py``'s model (scanned self-attention layers,
each under ``jax.checkpoint``), scheduled

* ``False``: as shipped (the default rule);
* ``True``: the same rules with ``optimize_remat=True``, which is what the
  series keeps wherever the policy keeps no residual of ``fwd`` (here under
  ``nothing_saveable`` and ``dots_saveable``: no policy saves a Pallas call's
  outputs), by its rule;
* ``smartvjp``: smartvjp's swapped copy of the module;

each without and with the ``jax_remat3`` + ``jax_custom_vjp3`` flags. Per
cell: kernel launches per step read from the program lowered for the TPU,
and on a TPU the step time (interleaved rounds, median and min-max) and
whether the loss and gradients equal the shipped ones bit for bit. A cell
that fails records its exception.

Run from the repository root:  python design/upstream/tpu_figure.py
It writes ``$OUT/tpu_figure.json`` (``--out`` to name another file). Without
a TPU it runs the smoke sizes and counts launches only.
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import importlib
import json
import os
import sys
import time
import traceback

import jax

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, os.path.join(ROOT, "benchmarks"))
import tpu_attention as TA  # noqa: E402  (puts examples/ and the root on the path)

MODES = ("False", "True", "smartvjp")
FLAGS = ("off", "on")


@contextlib.contextmanager
def remat3_flags(on: bool):
  old = jax.config.jax_remat3, jax.config.jax_custom_vjp3
  jax.config.update("jax_remat3", on)
  jax.config.update("jax_custom_vjp3", on)
  try:
    yield
  finally:
    jax.config.update("jax_remat3", old[0])
    jax.config.update("jax_custom_vjp3", old[1])


class OptimizeRematTrue:
  """The shipped module's ``flash_attention``, its custom_vjp rebuilt from the
  same rules with ``optimize_remat=True`` (swapped in while it traces)."""

  def __init__(self):
    self.mod = importlib.import_module(TA.MODULE)
    shipped = self.mod._flash_attention
    self.rebuilt = jax.custom_vjp(shipped.fun, nondiff_argnums=tuple(range(5, 10)))
    self.rebuilt.defvjp(self.mod._flash_attention_fwd,
                        self.mod._flash_attention_bwd, optimize_remat=True)

  def flash_attention(self, *args, **kwargs):
    shipped = self.mod._flash_attention
    self.mod._flash_attention = self.rebuilt
    try:
      # unjitted: the jit of the shipped function would reuse its trace
      return self.mod.flash_attention.__wrapped__(*args, **kwargs)
    finally:
      self.mod._flash_attention = shipped


def module(mode):
  if mode == "False":
    return importlib.import_module(TA.MODULE)
  if mode == "True":
    return OptimizeRematTrue()
  return TA.load("swapped")


def main(argv=None):
  p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  p.add_argument("--rounds", type=int, default=10)
  p.add_argument("--inner", type=int, default=5)
  p.add_argument("--out", default=os.path.join(os.environ.get("OUT", "."),
                                               "tpu_figure.json"))
  args = p.parse_args(argv)
  t_start = time.perf_counter()
  on_tpu = jax.default_backend() == "tpu"
  cfg = TA.TPU_CONFIG if on_tpu else TA.SMOKE_CONFIG
  params, x = TA.init_params(cfg, jax.random.key(0))
  doc = dict(config=dataclasses.asdict(cfg), jax=jax.__version__,
             backend=jax.default_backend(),
             devices=[str(d) for d in jax.devices()], cells=[])
  print(f"jax {jax.__version__}, {jax.default_backend()}, {cfg}", flush=True)

  def save():
    os.makedirs(os.path.dirname(os.path.abspath(args.out)), exist_ok=True)
    with open(args.out, "w") as fh:
      json.dump(doc, fh, indent=1)

  for pname, policy in TA.POLICIES.items():
    compiled, cells = {}, {}
    for flags in FLAGS:
      for mode in MODES:
        cell = dict(policy=pname, flags=flags, mode=mode)
        doc["cells"].append(cell)
        cells[flags, mode] = cell
        try:
          with remat3_flags(flags == "on"):
            step = TA.make_step(cfg, module(mode), policy)
            cell["launches"] = TA.launches(step, params, x)
            if on_tpu:
              compiled[flags, mode] = step.trace(params, x).lower().compile()
        except Exception as e:  # noqa: BLE001 -- the table records it
          cell["error"] = f"{type(e).__name__}: {str(e)[:300]}"
          cell["traceback"] = traceback.format_exc()[-2000:]
        print(pname, flags, mode, cell.get("launches", cell.get("error")),
              flush=True)
        save()
    if not on_tpu:
      continue
    outs = {}
    for key, fn in compiled.items():
      try:
        outs[key] = jax.block_until_ready(fn(params, x))
      except Exception as e:  # noqa: BLE001
        cells[key]["error"] = f"{type(e).__name__}: {str(e)[:300]}"
    ref = outs.get(("off", "False"))
    for key, out in outs.items():
      cells[key]["bitwise_equal_to_shipped"] = (
          None if ref is None else TA.EX.bitwise_equal(ref, out))
    keys = list(outs)
    times = {k: [] for k in keys}
    for r in range(args.rounds):  # interleaved, the order rotated per round
      for k in keys[r % len(keys):] + keys[:r % len(keys)]:
        t0 = time.perf_counter()
        for _ in range(args.inner):
          out = compiled[k](params, x)
        jax.block_until_ready(out)
        times[k].append((time.perf_counter() - t0) / args.inner)
    for k, ts in times.items():
      ts = sorted(ts)
      cells[k]["step_ms"] = dict(median=1e3 * ts[len(ts) // 2], min=1e3 * ts[0],
                                 max=1e3 * ts[-1], samples=len(ts),
                                 inner=args.inner)
      print(pname, *k, "step ms", cells[k]["step_ms"], flush=True)
    save()
  doc["seconds"] = round(time.perf_counter() - t_start, 1)
  save()
  print(f"wrote {args.out} in {doc['seconds']} s")


if __name__ == "__main__":
  main()
