"""One GPU session, prepared: the checks that need a GPU, in one command.

Device time is short (about 15 minutes, start-up included), so everything a
session on the GPU machine should do runs from this one script, stage after
stage, each under its own time limit, and ``session.json`` is rewritten after
every stage: a run cut off at its limit still leaves what finished.

Stages (``--stages`` picks some; they run in this order, the ones the
issue's "done when" needs first, each under its own limit):

``env``
    nvidia-smi, Python, jax/jaxlib/triton/jax_triton versions, the devices.
``pallas-tests``
    the Pallas examples' tests: lowered through Triton (values and gradients
    in f32 and bf16 on ragged shapes, launches counted by the profiler), and
    in interpret mode.
``bench``
    ``benchmarks/accel_mlp.py`` (step time, compiled memory, largest batch),
    its JSON written as it goes.
``transformer``
    ``examples/pallas_ops_transformer.py`` as a user runs it: JAX's shipped
    Pallas attention and RMSNorm kernels through Triton, as shipped and
    swapped (``smartvjp.import_swapped``); launches, bitwise loss curves.
``transformer-bench``
    ``benchmarks/gpu_transformer.py`` (step time, compiled memory, launches,
    bitwise values, with a verdict per goal), its JSON written per policy.
``pallas-ops-tests``
    the shipped kernels' tests: the profiler's launches against the lowered
    program's and bitwise gradients of the real kernels (GPU-only tests), and
    the interpret-mode and lowering tests.
``triton-tests``
    the jax_triton example's tests (values, gradients, launches).
``triton-example``
    ``examples/triton_gelu_matmul.py`` as a user runs it.
``offload-tests``
    the tests that offload residuals to ``pinned_host``.
``full-tests``
    the whole suite with pytest-xdist, in what time is left.

Files under ``--out`` (the device tool brings back at most 8): ``session.json``
(every stage: command, status, seconds, the end of its output, and for test
stages the counts and failing tests), ``log.txt`` (all output),
``accel_mlp.json`` and ``gpu_transformer.json``.

jax-triton is not installed on the GPU machine and it cannot reach a package
registry: ``tools/gpu_wheels.sh`` downloads the wheel into ``.whl/`` here,
the device call carries ``.whl``, and this script installs it into
``/tmp/site`` first.

On the GPU machine (one ``run`` call, carry ``[".whl"]``, timeout 600)::

  PYTHONUNBUFFERED=1 python3 tools/gpu_session.py --out $OUT --budget 540

Dry run on a CPU (every stage, tiny shapes, GPU tests skip)::

  python tools/gpu_session.py --smoke --out /tmp/gpu_out
"""

from __future__ import annotations

import argparse
import glob
import importlib.util
import json
import os
import platform
import subprocess
import sys
import time
import xml.etree.ElementTree as ET

ROOT = os.path.abspath(os.path.join(os.path.dirname(__file__), os.pardir))
STAGES = ("env", "pallas-tests", "bench", "transformer", "transformer-bench",
          "pallas-ops-tests", "triton-tests", "triton-example", "offload-tests",
          "full-tests")
# test stage -> (pytest arguments, seconds)
TEST_STAGES = {
    "pallas-tests": (["tests/test_pallas_gelu_matmul.py",
                      "tests/test_pallas_rmsnorm_gelu.py"], 180),
    "pallas-ops-tests": (["tests/test_pallas_ops.py",
                          "tests/test_gpu_transformer.py"], 150),
    "triton-tests": (["tests/test_triton_gelu_matmul.py"], 150),
    "offload-tests": (["-k", "offload or pinned_host", "tests/test_contract.py",
                       "tests/test_shard_map_types.py"], 60),
}
# Files that a stage above runs whole: the full-suite stage leaves them out.
RUN_WHOLE = [f for stage in ("pallas-tests", "pallas-ops-tests",
                              "triton-tests")
             for f in TEST_STAGES[stage][0]]
ENV_SCRIPT = r"""
import json, platform, sys
info = {"python": sys.version.split()[0], "platform": platform.platform()}
try:
  import jax, jaxlib
  info.update(jax=jax.__version__, jaxlib=jaxlib.__version__,
              backend=jax.default_backend(),
              devices=[f"{d.platform}:{d.device_kind}" for d in jax.devices()])
except Exception as e:
  info["jax_error"] = repr(e)
for name in ("triton", "jax_triton", "equinox", "hypothesis", "xdist"):
  try:
    info[name] = getattr(__import__(name), "__version__", "present")
  except Exception as e:
    info[name] = f"missing ({type(e).__name__}: {e})"
print(json.dumps(info))
"""


class Session:
  """Runs stages under a total budget and keeps ``session.json`` current."""

  def __init__(self, out, budget_s, smoke):
    self.out, self.budget_s, self.smoke = out, budget_s, smoke
    self.t0 = time.monotonic()
    self.log = open(os.path.join(out, "log.txt"), "a", buffering=1)
    self.record = dict(started=time.strftime("%Y-%m-%dT%H:%M:%S%z"),
                       host=platform.node(), smoke=smoke, budget_s=budget_s,
                       argv=sys.argv[1:], stages={})
    self.save()

  def left(self):
    return self.budget_s - (time.monotonic() - self.t0)

  def save(self):
    path = os.path.join(self.out, "session.json")
    with open(path + ".tmp", "w") as fh:
      json.dump(self.record, fh, indent=1)
    os.replace(path + ".tmp", path)

  def run(self, stage, argv, limit_s, env=None, **extra):
    """Runs ``argv`` for at most ``limit_s`` seconds (and never past the
    budget), logs its output, records the stage, and returns its output."""
    limit = max(0.0, min(limit_s, self.left() - 5))
    entry = dict(command=" ".join(argv), limit_s=round(limit, 1), **extra)
    if limit < 10:
      entry.update(status="skipped", reason="out of time")
      self.record["stages"][stage] = entry
      self.save()
      print(f"[{stage}] skipped: out of time", flush=True)
      return ""
    print(f"[{stage}] {entry['command']}  (limit {limit:.0f} s)", flush=True)
    self.log.write(f"\n===== {stage}: {entry['command']}\n")
    t = time.monotonic()
    try:
      done = subprocess.run(argv, cwd=ROOT, env=env, text=True,
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                            timeout=limit)
      output, rc = done.stdout, done.returncode
    except subprocess.TimeoutExpired as e:
      output = e.stdout if isinstance(e.stdout, str) else (
          (e.stdout or b"").decode(errors="replace"))
      rc = "timeout"
    except OSError as e:      # e.g. no nvidia-smi on this machine
      output, rc = f"{type(e).__name__}: {e}\n", "not run"
    self.log.write(output)
    entry.update(status="ok" if rc == 0 else "failed", rc=rc,
                 seconds=round(time.monotonic() - t, 1),
                 tail=output[-3000:])
    self.record["stages"][stage] = entry
    self.save()
    print(f"[{stage}] rc={rc} in {entry['seconds']} s", flush=True)
    return output


def junit_summary(path):
  """Counts and failing test ids from a pytest JUnit XML file."""
  if not os.path.exists(path):
    return None
  root = ET.parse(path).getroot()
  suites = [root] if root.tag == "testsuite" else list(root)
  counts = {k: sum(int(s.get(k, 0)) for s in suites)
            for k in ("tests", "failures", "errors", "skipped")}
  failing = []
  for case in root.iter("testcase"):
    if case.find("failure") is not None or case.find("error") is not None:
      failing.append(f"{case.get('classname')}::{case.get('name')}")
  counts["failing"] = failing[:50]
  return counts


def bench(session, args, py, env):
  """``benchmarks/accel_mlp.py``, told to stop starting work in time."""
  out_json = os.path.join(args.out, "accel_mlp.json")
  argv = [py, "benchmarks/accel_mlp.py", "--out", out_json]
  argv += ["--smoke"] if args.smoke else ["--compile-workers", "8",
                                          "--markdown"]
  argv += args.bench_args.split()
  limit = 300 if not args.smoke else 600
  if "--deadline" not in args.bench_args:
    argv += ["--deadline", str(int(max(30, min(limit, session.left()) - 20)))]
  session.run("bench", argv, limit, env=env)


def transformer_bench(session, args, py, env):
  """``benchmarks/gpu_transformer.py``; its JSON is saved after each policy,
  so a run cut off at the limit keeps the policies it finished."""
  out_json = os.path.join(args.out, "gpu_transformer.json")
  argv = [py, "benchmarks/gpu_transformer.py", "--out", out_json]
  argv += ["--smoke"] if args.smoke else []
  argv += args.transformer_args.split()
  session.run("transformer-bench", argv, 150 if not args.smoke else 300,
              env=env)


def install_wheels(session):
  """Installs the carried wheels (``.whl/*.whl``) into ``/tmp/site``."""
  wheels = sorted(glob.glob(os.path.join(ROOT, ".whl", "*.whl")))
  if not wheels:
    session.record["wheels"] = "none carried"
    return None
  session.run("wheels", [sys.executable, "-m", "pip", "install", "-q",
                         "--no-index", "--no-deps", "--no-compile",
                         "--no-cache-dir", "--upgrade", "--target",
                         "/tmp/site", *wheels], 60)
  session.record["wheels"] = [os.path.basename(w) for w in wheels]
  return "/tmp/site"


def main(argv=None):
  p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  p.add_argument("--out", default=os.environ.get("OUT", "gpu_out"))
  p.add_argument("--budget", type=float, default=540,
                 help="seconds for all stages together")
  p.add_argument("--stages", default=",".join(STAGES),
                 help=f"comma-separated, from {', '.join(STAGES)}")
  p.add_argument("--smoke", action="store_true",
                 help="a CPU dry run: tiny benchmark, a few full-suite files")
  p.add_argument("--bench-args", default="",
                 help="extra arguments for benchmarks/accel_mlp.py")
  p.add_argument("--transformer-args", default="",
                 help="extra arguments for benchmarks/gpu_transformer.py")
  args = p.parse_args(argv)
  stages = [s for s in args.stages.split(",") if s]
  unknown = set(stages) - set(STAGES)
  if unknown:
    p.error(f"unknown stages {sorted(unknown)}; known: {', '.join(STAGES)}")
  os.makedirs(args.out, exist_ok=True)
  session = Session(args.out, args.budget, args.smoke)

  site = install_wheels(session)
  env = dict(os.environ)
  env["PYTHONPATH"] = os.pathsep.join(
      [p for p in (site, ROOT, env.get("PYTHONPATH")) if p])
  # Several test processes share the GPU: none may take 75% of it up front.
  test_env = dict(env, XLA_PYTHON_CLIENT_PREALLOCATE="false")
  py = sys.executable

  def pytest_stage(stage, arguments, limit, extra=(), verbosity="-v"):
    xml = os.path.join(args.out, f"{stage}.xml")
    session.run(stage, [py, "-m", "pytest", verbosity, "-rs", "-p",
                        "no:cacheprovider", f"--junitxml={xml}", *extra,
                        *arguments], limit, env=test_env)
    if stage in session.record["stages"]:
      session.record["stages"][stage]["junit"] = junit_summary(xml)
      session.save()
    if os.path.exists(xml):   # summarized in session.json; keep 8 files
      os.remove(xml)

  for stage in [s for s in STAGES if s in stages]:
    if stage in TEST_STAGES:
      arguments, limit = TEST_STAGES[stage]
      pytest_stage(stage, arguments, limit if not args.smoke else 300)
    elif stage == "env":
      out = session.run("env", [py, "-c", ENV_SCRIPT], 120, env=env)
      try:
        session.record["environment"] = json.loads(
            out.strip().splitlines()[-1])
      except (ValueError, IndexError):
        pass
      session.run("nvidia-smi", ["nvidia-smi", "--query-gpu=name,memory.total,"
                                 "driver_version,clocks.sm,clocks.max.sm",
                                 "--format=csv"], 20)
    elif stage == "bench":
      bench(session, args, py, env)
    elif stage == "transformer":
      session.run("transformer", [py, "examples/pallas_ops_transformer.py"],
                  90 if not args.smoke else 300, env=env)
    elif stage == "transformer-bench":
      transformer_bench(session, args, py, env)
    elif stage == "triton-example":
      session.run("triton-example", [py, "examples/triton_gelu_matmul.py"],
                  90, env=env)
    elif stage == "full-tests":
      if args.smoke:
        selection, workers = ["tests/test_api.py", "tests/test_policy.py"], 2
      else:
        selection = ["tests"] + [f"--ignore={f}" for f in RUN_WHOLE]
        workers = 12
      parallel = (["-n", str(workers)] if importlib.util.find_spec("xdist")
                  else [])
      pytest_stage("full-tests", selection, session.left(),
                   extra=["--maxfail=50", *parallel], verbosity="-q")

  session.record["seconds"] = round(time.monotonic() - session.t0, 1)
  session.save()
  print("\nsummary:")
  for name, entry in session.record["stages"].items():
    junit = entry.get("junit") or {}
    counts = (f" tests {junit.get('tests')} failures {junit.get('failures')} "
              f"errors {junit.get('errors')} skipped {junit.get('skipped')}"
              if junit else "")
    print(f"  {name:18s} {entry.get('status'):8s} {entry.get('seconds', '-')}"
          f" s{counts}")
  return 0


if __name__ == "__main__":
  sys.exit(main())
