"""Runs the project's TPU measurements in one command, part by part.

Each part is a script of ``benchmarks/`` run in a process of its own (one
process at a time holds the chip), with its JSON written to ``--out`` (the
device tool's ``$OUT``) as soon as it ends and its output appended to
``--out``/session.log, so a run cut short keeps every part it finished.

Parts (``--parts``; by default the first four, in this order):

* ``tiles``: ``benchmarks/tpu_tiles.py``: the chip's measured peaks, the
  example kernels' accuracy against plain JAX in f32 and bf16, and the tile
  search (``benchmarks/results/tpu_tiles.json``);
* ``mlp``: ``benchmarks/accel_mlp.py``: the two kernels in a checkpointed
  scan, XLA only / ``jax.custom_vjp`` / ``optimize_remat`` / smartvjp /
  smartvjp with the fused rule, with the ideal step from the kernels' own
  times (``benchmarks/results/accel_mlp_tpu.json``);
* ``lm``: ``benchmarks/tpu_lm.py``: a decoder-only LM trained on the TPU
  with JAX's Pallas flash attention and the two kernels
  (``benchmarks/results/tpu_lm.json``);
* ``attention``: ``benchmarks/tpu_attention.py`` (shipped vs swapped flash
  attention);
* ``profile``: ``benchmarks/accel_profile.py``: where the stack's step time
  goes, op by op, from a profiler trace (and each row's optimized HLO);
* ``megablox``: ``tools/megablox_tpu.py``: JAX's megablox ``gmm`` swapped,
  its compiled program against the shipped one (``megablox_tpu.json``);
* ``figure``: ``design/upstream/tpu_figure.py``: the accelerator figure of
  ``design/upstream.md`` (``tpu_figure.json``);
* ``audit``: ``benchmarks/audit_tpu.py``: ``smartvjp.audit`` with
  ``measure=True`` on the stacks and the LM, predicted against measured
  savings (``audit_tpu.json``; ``--extra "audit=--budget S"`` stops
  starting audits after S seconds).

Run (through the device tool, from the repository root):
    SMARTVJP_COMMIT=<commit> python3 tools/tpu_session.py --out "$OUT"

Without ``--out`` the JSON and log go to a new folder under the system's
temporary folder, named when the run starts. Off a TPU it measures nothing:
it says so, names the parts' CPU checks (``tests/test_bench_scripts.py``)
and exits with status 0.
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
import tempfile
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
PARTS = {
    "tiles": ("benchmarks/tpu_tiles.py", "tpu_tiles.json"),
    "mlp": ("benchmarks/accel_mlp.py", "accel_mlp_tpu.json"),
    "lm": ("benchmarks/tpu_lm.py", "tpu_lm.json"),
    "attention": ("benchmarks/tpu_attention.py", "tpu_attention.json"),
    "profile": ("benchmarks/accel_profile.py", "accel_profile.json"),
    "megablox": ("tools/megablox_tpu.py", None),   # writes $OUT/megablox_tpu.json
    "figure": ("design/upstream/tpu_figure.py", "tpu_figure.json"),
    "audit": ("benchmarks/audit_tpu.py", "audit_tpu.json"),
}
DEFAULT_PARTS = ("tiles", "mlp", "lm", "attention")


def main(argv=None):
  p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  p.add_argument("--out", default=None,
                 help="folder for the JSON and log (default: a new one under "
                 "the system's temporary folder)")
  p.add_argument("--parts", nargs="+", default=list(DEFAULT_PARTS),
                 choices=PARTS)
  p.add_argument("--timeout", type=float, default=540,
                 help="seconds for all parts together")
  p.add_argument("--extra", action="append", default=[],
                 help="PART=ARGS: more arguments for a part's script")
  args = p.parse_args(argv)
  backend = _backend()
  if backend != "tpu":
    print(f"tools/tpu_session.py: no TPU here (JAX's backend is {backend}); "
          f"the parts ({', '.join(args.parts)}) measure on a TPU, so nothing "
          "ran. Their CPU checks (smoke modes, TPU lowering off-device): "
          "python -m pytest tests/test_bench_scripts.py")
    return 0
  if args.out is None:
    args.out = tempfile.mkdtemp(prefix="tpu_session_")
  print(f"== JSON and log: {args.out}", flush=True)
  os.makedirs(args.out, exist_ok=True)
  extra = {}
  for item in args.extra:
    part, _, rest = item.partition("=")
    extra[part] = rest.split()
  log = os.path.join(args.out, "session.log")
  t_end = time.monotonic() + args.timeout
  env = dict(os.environ, PYTHONUNBUFFERED="1", OUT=args.out)
  status = 0
  for part in args.parts:
    script, out = PARTS[part]
    left = t_end - time.monotonic()
    if left < 20:
      print(f"== {part}: skipped (time)", flush=True)
      continue
    cmd = [sys.executable, os.path.join(ROOT, script),
           *(["--out", os.path.join(args.out, out)] if out else []),
           *extra.get(part, [])]
    print(f"== {part}: {' '.join(cmd[1:])} (at most {left:.0f} s)", flush=True)
    t0 = time.monotonic()
    with open(log, "a") as fh:
      fh.write(f"\n== {part}: {' '.join(cmd[1:])}\n")
      fh.flush()
      try:
        done = subprocess.run(cmd, stdout=fh, stderr=subprocess.STDOUT,
                              env=env, cwd=ROOT, timeout=left)
        rc = done.returncode
      except subprocess.TimeoutExpired:
        rc = "timeout"
    print(f"== {part}: exit {rc} after {time.monotonic() - t0:.0f} s",
          flush=True)
    status = status or (rc != 0)
  return status


def _backend() -> str:
  """JAX's default backend, asked in a process of its own (this one must
  not hold the chip, which each part's process needs)."""
  done = subprocess.run(
      [sys.executable, "-c", "import jax; print(jax.default_backend())"],
      capture_output=True, text=True, cwd=ROOT, timeout=300)
  lines = done.stdout.split()
  return lines[-1] if done.returncode == 0 and lines else "unknown"


if __name__ == "__main__":
  sys.exit(main())
