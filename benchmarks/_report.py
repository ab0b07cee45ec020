"""What every benchmark here prints: where it ran, with which versions and at
which commit; each timed figure as the median with the range of its rounds;
and a verdict, "met" or "not met", for each goal it names.

The scripts of this folder import it as ``_report`` (their folder is on
``sys.path`` when they run). Nothing here changes JAX's state; ``machine()``
and ``versions()`` only read it.
"""

from __future__ import annotations

import math
import os
import platform
import socket
import statistics
import subprocess
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


# -- where and with what ------------------------------------------------------

def cpu_model() -> str:
  """The CPU's marketing name (``/proc/cpuinfo`` on Linux, ``sysctl`` on
  macOS), else what ``platform`` knows."""
  try:
    with open("/proc/cpuinfo", encoding="utf-8") as fh:
      for line in fh:
        if line.lower().startswith(("model name", "hardware", "cpu model")):
          return line.split(":", 1)[1].strip()
  except OSError:
    pass
  try:
    done = subprocess.run(["sysctl", "-n", "machdep.cpu.brand_string"],
                          capture_output=True, text=True, timeout=5)
    if done.returncode == 0 and done.stdout.strip():
      return done.stdout.strip()
  except (OSError, subprocess.SubprocessError):
    pass
  return platform.processor() or platform.machine() or "unknown CPU"


def usable_cores() -> int | None:
  """Cores this process may run on (its affinity), where the OS says."""
  try:
    return len(os.sched_getaffinity(0))
  except (AttributeError, OSError):
    return os.cpu_count()


def commit() -> str | None:
  """``git rev-parse --short HEAD`` of this checkout, with ``+changes`` when
  tracked files differ from it; None outside a git checkout. Where
  ``$SMARTVJP_COMMIT`` is set (a copy of the tree sent to an accelerator,
  whose ``.git`` may be stale) that instead."""
  if os.environ.get("SMARTVJP_COMMIT"):   # a copy sent to an accelerator
    return os.environ["SMARTVJP_COMMIT"]

  def git(*args):
    return subprocess.run(["git", "-C", ROOT, *args], capture_output=True,
                          text=True, timeout=10)
  try:
    head = git("rev-parse", "--short", "HEAD")
    if head.returncode != 0:
      return None
    dirty = git("status", "--porcelain", "--untracked-files=no")
  except (OSError, subprocess.SubprocessError):
    return None
  return head.stdout.strip() + ("+changes" if dirty.stdout.strip() else "")


def machine() -> dict:
  """The host and the first JAX device. The keys ``device_kind``,
  ``platform``, ``device_count``, ``host``, ``cpu_count`` and
  ``bytes_limit`` are those of the JSON files of ``accel_mlp.py`` and
  ``gpu_transformer.py``."""
  import jax
  devices = jax.devices()
  stats = getattr(devices[0], "memory_stats", lambda: None)() or {}
  return dict(cpu_model=cpu_model(), cpu_count=os.cpu_count(),
              cpus_usable=usable_cores(), host=socket.gethostname(),
              os=platform.platform(), device_kind=devices[0].device_kind,
              platform=devices[0].platform, device_count=len(devices),
              bytes_limit=stats.get("bytes_limit"))


def versions() -> dict:
  """JAX, jaxlib, Python and numpy versions, and this checkout's commit."""
  import jax
  import jaxlib
  import numpy
  return dict(jax=jax.__version__, jaxlib=jaxlib.__version__,
              python=platform.python_version(), numpy=numpy.__version__,
              commit=commit())


def header(mach: dict | None = None, vers: dict | None = None) -> str:
  """Two lines: the machine, then the versions and the commit."""
  m = machine() if mach is None else mach
  v = versions() if vers is None else vers
  usable = m.get("cpus_usable")
  cores = f"{m.get('cpu_count')} cores" + (
      f" ({usable} usable)" if usable and usable != m.get("cpu_count") else "")
  device = (f"{m['device_kind']} x{m['device_count']} ({m['platform']})"
            if m.get("platform") != "cpu" else "JAX on the CPU")
  return (f"machine: {m.get('cpu_model', 'unknown CPU')}, {cores}; {device}; "
          f"host {m.get('host')}\n"
          f"versions: jax {v['jax']}, jaxlib {v['jaxlib']}, Python "
          f"{v['python']}" + (f", numpy {v['numpy']}" if v.get("numpy") else "")
          + f"; smartvjp at commit {v.get('commit') or 'unknown (no git)'}")


# -- a median with its range -------------------------------------------------

class Spread:
  """The median, min and max of a list of samples (one per round)."""

  def __init__(self, samples):
    self.samples = [float(s) for s in samples]
    if not self.samples:
      raise ValueError("a spread needs at least one sample")
    self.median = statistics.median(self.samples)
    self.min = min(self.samples)
    self.max = max(self.samples)

  def __len__(self):
    return len(self.samples)

  def fmt(self, scale: float = 1.0, digits: int = 1, unit: str = "") -> str:
    """``median [min-max]`` of the samples times ``scale``; ``unit`` follows
    the median (``1.02x [0.98-1.10]``)."""
    f = lambda x: f"{x * scale:.{digits}f}"
    return f"{f(self.median)}{unit} [{f(self.min)}-{f(self.max)}]"

  def as_dict(self, scale: float = 1.0) -> dict:
    return dict(median=self.median * scale, min=self.min * scale,
                max=self.max * scale, samples=[s * scale for s in self.samples])


def spread(samples, scale: float = 1.0, digits: int = 1, unit: str = "") -> str:
  """``median [min-max]`` of ``samples`` (times ``scale``)."""
  return Spread(samples).fmt(scale, digits, unit)


def paired_ratios(samples, base):
  """Round by round ``samples[r] / base[r]``: the spread of a ratio measured
  in the same rounds."""
  return [a / b for a, b in zip(samples, base)]


def timed(fn, *args, rounds: int, inner: int) -> dict:
  """Seconds per call of ``fn(*args)``: median, min and max over ``rounds``
  rounds of ``inner`` back-to-back calls, after one warm-up call."""
  import jax
  jax.block_until_ready(fn(*args))
  samples = []
  for _ in range(rounds):
    t0 = time.perf_counter()
    for _ in range(inner):
      out = fn(*args)
    jax.block_until_ready(out)
    samples.append((time.perf_counter() - t0) / inner)
  return dict(median_s=statistics.median(samples), min_s=min(samples),
              max_s=max(samples))


def new_outputs(rule):
  """``rule`` returning only the leaves of its output that are not its
  arguments passed through: timed alone under ``jax.jit``, a ``fwd`` that
  returns its inputs among its residuals would otherwise be charged a copy of
  them, which it never makes inside a step."""
  import jax

  def wrapped(*args):
    ins = jax.tree.leaves(args)
    return [leaf for leaf in jax.tree.leaves(rule(*args))
            if not any(leaf is a for a in ins)]
  return wrapped


def measured_peaks(rounds: int = 5, n: int = 8192,
                   copy_elements: int = 2 ** 29) -> dict:
  """This chip's bf16 matmul rate and copy bandwidth, measured now:
  ``{"TFLOP/s", "GB/s", "matmul", "copy"}``. The matmul is ``n^3``
  (``2 * n^3`` flops; 8192 by default), the copy ``y = 2 * x`` of a bf16
  array of ``copy_elements`` (1 GiB by default; bytes read + written); each
  rate is from the fastest round."""
  import jax
  import jax.numpy as jnp
  a = jax.random.normal(jax.random.key(0), (n, n), jnp.bfloat16)
  b = jax.random.normal(jax.random.key(1), (n, n), jnp.bfloat16)
  mm = timed(jax.jit(lambda a, b: a @ b), a, b, rounds=rounds, inner=10)
  del a, b
  big = jnp.ones((copy_elements,), jnp.bfloat16)
  cp = timed(jax.jit(lambda x: x * 2), big, rounds=rounds, inner=10)
  nbytes = big.nbytes
  del big
  return {"TFLOP/s": 2 * n ** 3 / mm["min_s"] / 1e12,
          "GB/s": 2 * nbytes / cp["min_s"] / 1e9, "matmul": mm, "copy": cp}


# -- goals and verdicts ------------------------------------------------------

def verdict(ok: bool) -> str:
  return "met" if ok else "not met"


class Goals:
  """Goals checked in one run; each printed as ``goal <text>: met`` (or
  ``not met``), then one summary line."""

  def __init__(self):
    self.items: list[tuple[str, bool]] = []

  def check(self, text: str, ok: bool) -> bool:
    self.items.append((text, bool(ok)))
    return bool(ok)

  @property
  def all_met(self) -> bool:
    return all(ok for _, ok in self.items)

  def lines(self) -> list[str]:
    return [f"goal {text}: {verdict(ok)}" for text, ok in self.items]

  def summary(self) -> str:
    n = len(self.items)
    met = sum(ok for _, ok in self.items)
    if met == n:
      return f"verdict: all {n} goals met"
    return (f"verdict: {met} of {n} goals met ({n - met} marked "
            "\"not met\" above)")

  def render(self) -> str:
    return "\n".join(self.lines() + [self.summary()])

  def as_list(self) -> list[dict]:
    return [dict(goal=text, met=ok) for text, ok in self.items]


# -- largest batch -------------------------------------------------------------

class BatchSearch:
  """The largest multiple of ``granule`` whose step needs at most ``budget``
  bytes, over probes ``batch -> bytes`` (assumed to grow with the batch).

  Each probe is the granule below the budget on a line ``a + b * batch``
  through the two points nearest the answer (one on each side once there
  are), clamped inside the bracket; with one point only, ``a`` is
  ``const_bytes`` (bytes that do not depend on the batch). After
  ``model_probes`` such probes it tries the granule above the largest fit
  once, then bisects (doubling while nothing is over).
  """

  def __init__(self, budget, granule, max_batch, const_bytes=None,
               model_probes=3):
    self.budget, self.g = budget, granule
    self.max_k = max_batch // granule
    self.const_bytes = const_bytes
    self.points = {}
    self.compiles = 0
    self.model_left = model_probes
    self.stepped = False

  def add(self, batch, total, compiled_here=True):
    self.points[batch] = total
    self.compiles += bool(compiled_here)

  def bracket(self):
    """(lo, hi) in granules: the answer is in ``[lo, hi - 1]``; hi None:
    nothing probed is over the budget."""
    g, budget = self.g, self.budget
    lo = max((b // g for b, v in self.points.items() if v <= budget), default=0)
    hi = min((-(-b // g) for b, v in self.points.items() if v > budget),
             default=None)
    return lo, hi

  def done(self):
    lo, hi = self.bracket()
    return lo >= self.max_k or (hi is not None and hi - lo <= 1)

  def answer(self):
    return min(self.bracket()[0], self.max_k) * self.g

  def model(self):
    """(a, b) of ``bytes = a + b * batch``, or None. Probes that XLA refused
    to compile (out of memory: ``inf``) bound the answer but give no line."""
    pts = sorted(p for p in self.points.items() if math.isfinite(p[1]))
    below = [p for p in pts if p[1] <= self.budget]
    above = [p for p in pts if p[1] > self.budget]
    if below and above:
      pair = (below[-1], above[0])
    elif len(pts) >= 2:
      pair = tuple(pts[-2:]) if below else tuple(pts[:2])
    elif pts and self.const_bytes is not None:
      (b0, v0), = pts
      return float(self.const_bytes), (v0 - self.const_bytes) / b0
    else:
      return None
    (b0, v0), (b1, v1) = pair
    slope = (v1 - v0) / (b1 - b0)
    return v0 - slope * b0, slope

  def next_probe(self):
    lo, hi = self.bracket()
    top = self.max_k if hi is None else hi - 1
    k = None
    if self.model_left > 0:
      fit = self.model()
      if fit is not None and fit[1] > 0:
        self.model_left -= 1
        k = math.floor((self.budget - fit[0]) / fit[1] / self.g)
    if k is None:
      if hi is not None:
        k = (lo + hi) // 2
      elif not self.stepped:   # the line was close: try one granule above
        self.stepped, k = True, lo + 1
      else:
        k = max(2 * lo, 1)
    return min(max(k, lo + 1), top) * self.g

  def summary(self):
    lo, hi = self.bracket()
    fit = self.model()
    return dict(
        batch=self.answer(), granule=self.g, budget_bytes=self.budget,
        bytes_at_batch=self.points.get(self.answer()),
        compiles=self.compiles, bracket=[lo * self.g,
                                         None if hi is None else hi * self.g],
        capped=lo >= self.max_k, monotonic=hi is None or lo < hi,
        fit=None if fit is None else dict(a_bytes=fit[0],
                                          b_bytes_per_row=fit[1]),
        probes=[[b, v if math.isfinite(v) else "out of memory at compile"]
                for b, v in sorted(self.points.items())])

  def partial(self):
    """``summary()`` of a search that has not finished: its answer so far is
    a lower bound, ``batch_at_least``."""
    summary = self.summary()
    summary["batch_at_least"] = summary.pop("batch")
    return summary
