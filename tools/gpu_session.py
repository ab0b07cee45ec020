"""One GPU session, prepared: what needs a GPU, in one device call.

A session is lent an NVIDIA H200 for about 15 minutes of device time, the
machine's start included, each command at most 10. This script is that one
command. Its stages run in the order below, the mission first; each has a
cap (seconds), the caps add up to ``--budget`` (540 s by default: a
9-minute call), and a stage never starts past ``--budget``. ``--dry-plan``
prints each stage's cap and worst-case start without running anything.

``env`` (mission)
    Python, jax/jaxlib/triton/jax_triton versions, the devices,
    ``nvidia-smi``; the carried wheels installed; this chip's own bf16 matmul
    rate and copy bandwidth (``benchmarks/_report.measured_peaks``), which
    the later stages read (from a temporary ``env.json``; ``session.json``
    keeps it as ``environment``) instead of a datasheet.
``seed`` (mission)
    seed 000 (jax-ml/jax#21303) on its platform: the GPU tests
    (``-k test_gpu_``) of the two Pallas examples and ``tests/test_gpu_seed.py``
    (launches counted by the profiler against the lowered counts, as
    written, ``optimize_remat=True`` and swapped; values and gradients in
    bf16 and f32).
``jax-triton`` (mission)
    ``tests/test_triton_gelu_matmul.py``: the Triton example through
    jax-triton 0.3.1 (``tools/gpu_wheels.sh`` says why that version).
``shipped-tests`` (mission)
    the GPU tests of JAX's shipped kernels: the profiler's launches against
    the lowered program and bitwise gradients (``tests/test_pallas_ops.py``),
    ``attention_mgpu``'s bitwise gradients (``tests/test_attention_mgpu.py``).
``shipped-bench`` (mission)
    ``benchmarks/gpu_transformer.py``: the checkpointed transformer on the
    shipped kernels, as shipped, swapped, ``optimize_remat=True`` and XLA
    alone; paired step times, memory, bitwise values, the ideal step. First
    with the Triton attention and RMSNorm (bf16), then with the Mosaic GPU
    attention (``--attention mgpu``, f16).
``kernels-vs-xla`` (mission)
    ``benchmarks/accel_mlp.py`` at hidden 4096: the project's kernels
    against XLA alone, TFLOP/s and GB/s against ``env``'s measured rates.
``audit`` (mission)
    ``benchmarks/audit_gpu.py``: ``smartvjp.audit(..., measure=True)`` on the
    shipped-kernel step and one stack, ``peaks=`` the measured rates.
``rest``
    the rest of the suite (pytest-xdist), in whatever time is left.

What comes back (``--out``, the device tool's ``$OUT``; at most 8 files,
each written as it is made): ``session.json`` (rewritten after every
command: each stage's commands, status, seconds, the end of its output, and
for test stages the counts and failing tests), ``log.txt`` (all output),
``tests.jsonl`` (one line per test as it finishes, written by
``tools/pytest_results.py``: a stage cut off keeps the tests it finished),
``gpu_transformer.json``, ``gpu_transformer_mgpu.json``, ``accel_mlp.json``
and ``audit_gpu.json`` (each benchmark rewrites its own as it goes): 7, so
that a temporary file left by a write cut off still fits.

A test stage's pytest exit code 5 ("no tests collected") is recorded as
status ``no tests``, not as a failure; a stage cut off at its cap is
``cut off``.

jax-triton is not on the GPU machine, which reaches no package registry:
``tools/gpu_wheels.sh`` downloads its wheel into ``.whl/`` here, the device
call carries ``.whl``, and ``env`` installs it ``--no-deps --target
/tmp/site`` (leaving the machine's jax and CUDA plugin alone).

On the GPU machine (one ``run`` call, carry ``[".whl"]``, ``timeout_s``
600)::

  PYTHONUNBUFFERED=1 python3 tools/gpu_session.py --out $OUT

On a CPU (``tests/test_gpu_session.py``), the whole session at tiny sizes,
GPU tests skipping::

  python tools/gpu_session.py --smoke --out /tmp/gpu_out
"""

from __future__ import annotations

import argparse
import dataclasses
import glob
import importlib.util
import json
import os
import platform
import signal
import subprocess
import sys
import tempfile
import time

ROOT = os.path.abspath(os.path.join(os.path.dirname(__file__), os.pardir))
BUDGET_S = 540.0
MAX_FILES = 8
RESULTS = "tests.jsonl"


@dataclasses.dataclass(frozen=True)
class Stage:
  name: str
  cap_s: float             # seconds of the default budget (BUDGET_S)
  mission: bool
  what: str


STAGES = (
    Stage("env", 45, True, "versions, nvidia-smi, wheels, measured peaks"),
    Stage("seed", 90, True, "seed 000's GPU tests"),
    Stage("jax-triton", 60, True, "the Triton example's tests"),
    Stage("shipped-tests", 45, True, "JAX's shipped kernels' GPU tests"),
    Stage("shipped-bench", 130, True, "benchmarks/gpu_transformer.py"),
    Stage("kernels-vs-xla", 90, True, "benchmarks/accel_mlp.py, hidden 4096"),
    Stage("audit", 60, True, "benchmarks/audit_gpu.py"),
    Stage("rest", 20, False, "the rest of the suite, in what is left"),
)
NAMES = tuple(s.name for s in STAGES)

# test stage -> pytest arguments (files, and a -k selection)
TESTS = {
    "seed": ["-k", "test_gpu_", "tests/test_gpu_seed.py",
             "tests/test_pallas_gelu_matmul.py",
             "tests/test_pallas_rmsnorm_gelu.py"],
    "jax-triton": ["tests/test_triton_gelu_matmul.py"],
    "shipped-tests": ["-k", "test_gpu_", "tests/test_pallas_ops.py",
                      "tests/test_attention_mgpu.py"],
}
# files whose every test a stage above ran: the rest leaves them out
RUN_BEFORE = ["tests/test_triton_gelu_matmul.py", "tests/test_gpu_seed.py"]


def plan(budget_s: float = BUDGET_S):
  """``[(stage, cap, worst-case start)]``: the caps scaled so they add up
  to ``budget_s`` (at the default budget, ``Stage.cap_s`` itself), and the
  second each stage starts at the latest, every stage before it having run
  to its cap. The last stage also takes what earlier ones leave unused."""
  total = sum(s.cap_s for s in STAGES)
  out, start = [], 0.0
  for stage in STAGES:
    cap = stage.cap_s * budget_s / total
    out.append((stage, cap, start))
    start += cap
  return out


def print_plan(budget_s):
  print(f"budget {budget_s:.0f} s; stages in order (cap, worst-case start):")
  for stage, cap, start in plan(budget_s):
    print(f"  {stage.name:15s} cap {cap:5.0f} s  starts by {start:5.0f} s  "
          f"{'mission' if stage.mission else 'if time is left':15s} "
          f"{stage.what}")


class Session:
  """Runs commands under caps and the budget; keeps ``session.json``."""

  def __init__(self, out, budget_s, smoke):
    self.out, self.budget_s, self.smoke = out, budget_s, smoke
    self.t0 = time.monotonic()
    self.log_path = os.path.join(out, "log.txt")
    self.record = dict(started=time.strftime("%Y-%m-%dT%H:%M:%S%z"),
                       host=platform.node(), smoke=smoke, budget_s=budget_s,
                       argv=sys.argv[1:], plan=[
                           dict(stage=s.name, cap_s=c, worst_start_s=t)
                           for s, c, t in plan(budget_s)], stages={})
    self.save()

  def elapsed(self):
    return time.monotonic() - self.t0

  def save(self):
    path = os.path.join(self.out, "session.json")
    with open(path + ".tmp", "w") as fh:
      json.dump(self.record, fh, indent=1)
    os.replace(path + ".tmp", path)

  def command(self, stage, argv, deadline, env=None):
    """Runs ``argv`` until the monotonic ``deadline`` (its process group
    killed then), output appended to ``log.txt``; records and returns
    ``(status, rc, output)``."""
    entry = self.record["stages"].setdefault(stage, dict(commands=[]))
    limit = deadline - time.monotonic()
    cmd = dict(command=" ".join(argv), limit_s=round(limit, 1))
    entry["commands"].append(cmd)
    if limit < 1:
      cmd.update(status="skipped", reason="out of time")
      self.save()
      print(f"[{stage}] skipped (out of time): {cmd['command']}", flush=True)
      return "skipped", None, ""
    print(f"[{stage}] {cmd['command']}  (limit {limit:.0f} s)", flush=True)
    with open(self.log_path, "a") as log:
      log.write(f"\n===== {stage}: {cmd['command']}\n")
      log.flush()
      start = log.tell()
      t = time.monotonic()
      try:
        proc = subprocess.Popen(argv, cwd=ROOT, env=env, stdout=log,
                                stderr=subprocess.STDOUT,
                                start_new_session=True)
      except OSError as e:      # e.g. no nvidia-smi on this machine
        log.write(f"{type(e).__name__}: {e}\n")
        rc = "not run"
      else:
        try:
          rc = proc.wait(timeout=limit)
        except subprocess.TimeoutExpired:
          stop(proc)
          rc = "cut off"
    with open(self.log_path, errors="replace") as log:
      log.seek(start)
      output = log.read()
    status = ("ok" if rc == 0 else "cut off" if rc == "cut off" else
              "not run" if rc == "not run" else "failed")
    cmd.update(status=status, rc=rc, seconds=round(time.monotonic() - t, 1),
               tail=output[-3000:])
    self.save()
    print(f"[{stage}] {status} (rc {rc}) in {cmd['seconds']} s", flush=True)
    return status, rc, output


def stop(proc):
  """Ends ``proc``'s process group (pytest-xdist workers included): SIGTERM,
  then SIGKILL after 5 s."""
  for sig, wait in ((signal.SIGTERM, 5), (signal.SIGKILL, 5)):
    try:
      os.killpg(proc.pid, sig)
    except ProcessLookupError:
      return
    try:
      proc.wait(timeout=wait)
      return
    except subprocess.TimeoutExpired:
      continue


def test_results(path, stage):
  """Counts by outcome and the failing test ids of ``stage`` in the
  per-test results file (``tools/pytest_results.py``)."""
  counts, failing = {}, []
  if os.path.exists(path):
    with open(path) as fh:
      for line in fh:
        try:
          r = json.loads(line)
        except ValueError:          # a line cut off by a kill
          continue
        if r.get("stage") != stage:
          continue
        counts[r["outcome"]] = counts.get(r["outcome"], 0) + 1
        if r["outcome"] in ("failed", "error"):
          failing.append(r["nodeid"])
  return dict(counts=counts, failing=failing[:50])


def run_tests(session, stage, arguments, deadline, env, results):
  """pytest with ``arguments`` as ``stage``, each test's result appended to
  ``results`` as it finishes (``tools/pytest_results.py``); records the
  stage's status (exit 5, no test collected, is ``no tests``) and counts."""
  env = {k: v for k, v in env.items()        # not an outer pytest's
         if not k.startswith(("PYTEST_XDIST", "PYTEST_CURRENT"))}
  status, rc, _ = session.command(
      stage, [sys.executable, "-m", "pytest", "-rs", "-p", "no:cacheprovider",
              "-p", "pytest_results", *arguments], deadline,
      env=dict(env, SMARTVJP_TEST_RESULTS=results, SMARTVJP_TEST_STAGE=stage,
               PYTHONPATH=os.pathsep.join(
                   [q for q in (os.path.join(ROOT, "tools"),
                                env.get("PYTHONPATH")) if q])))
  entry = session.record["stages"][stage]
  entry.update(status="no tests" if rc == 5 else status,
               tests=test_results(results, stage))
  session.save()
  return entry["status"]


def install_wheels(session, deadline):
  """The carried wheels (``.whl/*.whl``) installed into ``/tmp/site``
  (``--no-deps``: the machine's jax, jaxlib and CUDA plugin stay)."""
  wheels = sorted(glob.glob(os.path.join(ROOT, ".whl", "*.whl")))
  if not wheels:
    session.record["wheels"] = "none carried"
    return None
  site = (tempfile.mkdtemp(prefix="gpu_session_site_") if session.smoke
          else os.path.join("/tmp", "site"))
  status, _, _ = session.command(
      "env", [sys.executable, "-m", "pip", "install", "--isolated", "-q",
              "--no-index", "--no-deps", "--no-compile", "--no-cache-dir",
              "--upgrade", "--target", site, *wheels], deadline,
      env=dict(os.environ, PIP_CONFIG_FILE=os.devnull))
  session.record["wheels"] = dict(installed=[os.path.basename(w)
                                             for w in wheels], status=status)
  return site


def probe_env(path, smoke):
  """(``--probe-env``, in a subprocess) versions, devices and this chip's
  measured peaks, to ``path``."""
  info = {"python": sys.version.split()[0], "platform": platform.platform()}
  for name in ("jax", "jaxlib", "triton", "jax_triton", "equinox", "xdist"):
    try:
      info[name] = getattr(__import__(name), "__version__", "present")
    except Exception as e:   # noqa: BLE001 -- recorded
      info[name] = f"missing ({type(e).__name__}: {e})"
  import jax
  info.update(backend=jax.default_backend(),
              devices=[f"{d.platform}:{d.device_kind}" for d in jax.devices()])
  sys.path.insert(0, os.path.join(ROOT, "benchmarks"))
  import _report
  peaks = (_report.measured_peaks(rounds=2, n=256, copy_elements=2 ** 20)
           if smoke else _report.measured_peaks())
  info["peaks"] = peaks
  info["audit_peaks"] = {"flops": peaks["TFLOP/s"] * 1e12,
                         "bytes": peaks["GB/s"] * 1e9}
  with open(path, "w") as fh:
    json.dump(info, fh, indent=1)
  print(f"{info['devices']}: bf16 matmul {peaks['TFLOP/s']:.1f} TFLOP/s, "
        f"copy {peaks['GB/s']:.1f} GB/s")


def stage_commands(stage, args, py, cap):
  """The commands of a non-test stage (``cap``: its seconds)."""
  out = lambda name: os.path.join(args.out, name)
  env_json = args.env_json
  peaks = ["--peaks", env_json] if os.path.exists(env_json) else []
  if stage == "shipped-bench":
    extra = (["--smoke", "--layers", "1", "--batch", "1", "--seq", "16",
              "--policies", "nothing_saveable", "--rounds", "1",
              "--schedules", "shipped", "swapped",
              "--check-steps", "1"] if args.smoke else [])
    if args.smoke:
      return [[py, "benchmarks/gpu_transformer.py", "--out",
               out("gpu_transformer.json"), *extra]]
    # Triton attention and RMSNorm (bf16), then Mosaic GPU attention (f16)
    return [[py, "benchmarks/gpu_transformer.py", "--out",
             out("gpu_transformer.json"), "--rounds", "6"],
            [py, "benchmarks/gpu_transformer.py", "--attention", "mgpu",
             "--policies", "nothing_saveable", "--rounds", "6", "--out",
             out("gpu_transformer_mgpu.json")]]
  if stage == "kernels-vs-xla":
    extra = (["--smoke", "--workload", "rmsnorm_gelu", "--layers", "1",
              "--batch", "16", "--no-largest-batch", "--rounds", "1"]
             if args.smoke else
             ["--hidden", "4096", "--no-largest-batch", "--compile-workers",
              "8"])
    # stop starting measurements in time to write the JSON before the cap
    deadline = ["--deadline", str(int(max(10, cap - 20)))]
    return [[py, "benchmarks/accel_mlp.py", "--out", out("accel_mlp.json"),
             *extra, *peaks, *deadline]]
  if stage == "audit":
    return [[py, "benchmarks/audit_gpu.py", "--out", out("audit_gpu.json"),
             *(["--smoke", "--only", "accel_mlp"] if args.smoke else []),
             *peaks]]
  raise ValueError(stage)


def main(argv=None):
  p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  p.add_argument("--out", default=os.environ.get("OUT", "gpu_out"))
  p.add_argument("--budget", type=float, default=BUDGET_S,
                 help="seconds for all stages together")
  p.add_argument("--stages", default=",".join(NAMES),
                 help=f"comma-separated, run in the plan's order: "
                 f"{', '.join(NAMES)}")
  p.add_argument("--smoke", action="store_true",
                 help="a CPU dry run of every stage at tiny sizes")
  p.add_argument("--dry-plan", action="store_true",
                 help="print the stages' caps and worst-case starts; run "
                 "nothing")
  p.add_argument("--probe-env", metavar="PATH", help=argparse.SUPPRESS)
  args = p.parse_args(argv)
  if args.probe_env:
    probe_env(args.probe_env, args.smoke)
    return 0
  if args.dry_plan:
    print_plan(args.budget)
    return 0
  chosen = [s for s in args.stages.split(",") if s]
  unknown = set(chosen) - set(NAMES)
  if unknown:
    p.error(f"unknown stages {sorted(unknown)}; known: {', '.join(NAMES)}")
  os.makedirs(args.out, exist_ok=True)
  session = Session(args.out, args.budget, args.smoke)
  # the env stage's measurements, read by later stages; they come back in
  # session.json ("environment"), so the file stays out of --out
  args.env_json = os.path.join(tempfile.mkdtemp(prefix="gpu_session_"),
                               "env.json")
  py = sys.executable
  results = os.path.join(args.out, RESULTS)
  env = dict(os.environ)
  env["PYTHONPATH"] = os.pathsep.join(
      [q for q in (ROOT, env.get("PYTHONPATH")) if q])
  test_env = None
  budget_end = session.t0 + args.budget

  for stage, cap, _ in plan(args.budget):
    if stage.name not in chosen:
      continue
    deadline = (budget_end if stage is STAGES[-1] else
                min(time.monotonic() + cap, budget_end))
    entry = session.record["stages"].setdefault(stage.name, dict(commands=[]))
    entry.update(cap_s=cap, started_s=round(session.elapsed(), 1))
    if stage.name == "env":
      site = install_wheels(session, deadline)
      if site:     # after the machine's own packages: its jax stays first
        env["PYTHONPATH"] = os.pathsep.join([env["PYTHONPATH"], site])
      status, _, _ = session.command(
          "env", [py, "tools/gpu_session.py", "--probe-env", args.env_json,
                  *(["--smoke"] if args.smoke else [])], deadline, env=env)
      try:
        with open(args.env_json) as fh:
          session.record["environment"] = json.load(fh)
      except (OSError, ValueError):
        pass
      session.command("env", ["nvidia-smi", "--query-gpu=name,memory.total,"
                              "driver_version,clocks.sm,clocks.max.sm",
                              "--format=csv"], deadline, env=env)
      entry["status"] = status    # nvidia-smi's own status is its command's
    elif stage.name in TESTS or stage.name == "rest":
      if test_env is None:
        # several test processes share the GPU: none takes 75% up front
        test_env = dict(env, XLA_PYTHON_CLIENT_PREALLOCATE="false")
      if stage.name == "rest":
        if args.smoke:
          selection, workers = ["tests/test_versions.py"], 0
        else:
          selection = ["tests", *[f"--ignore={f}" for f in RUN_BEFORE]]
          workers = 12
        parallel = (["-n", str(workers)] if workers and
                    importlib.util.find_spec("xdist") else [])
        arguments = ["-q", "--maxfail=50", *parallel, *selection]
      else:     # 4 processes compile Triton kernels side by side
        parallel = (["-n", "4"] if not args.smoke and
                    importlib.util.find_spec("xdist") else [])
        arguments = ["-v", *parallel, *TESTS[stage.name]]
      run_tests(session, stage.name, arguments, deadline, test_env, results)
    else:
      for argv_ in stage_commands(stage.name, args, py, cap):
        session.command(stage.name, argv_, deadline, env=env)
    commands = entry["commands"]
    entry.setdefault("status", "ok" if commands and all(
        c["status"] == "ok" for c in commands) else
        commands[-1]["status"] if commands else "skipped")
    entry["seconds"] = round(session.elapsed() - entry["started_s"], 1)
    session.save()

  session.record["seconds"] = round(session.elapsed(), 1)
  session.record["files"] = sorted(os.listdir(args.out))
  session.save()
  print("\nsummary:")
  for name, entry in session.record["stages"].items():
    tests = entry.get("tests", {}).get("counts")
    print(f"  {name:15s} {entry.get('status'):9s} {entry.get('seconds')} s"
          + (f"  tests {tests}" if tests is not None else ""))
  return 0


if __name__ == "__main__":
  sys.exit(main())
