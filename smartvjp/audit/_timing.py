"""How the audit measures seconds: programs run in interleaved rounds until
each estimate's 95% interval is narrow enough, or a time budget runs out.

The conventions of benchmark harnesses (pyperf, Criterion.rs,
``triton.testing.do_bench``): repeat until the estimate is stable, report an
interval and not a point, and time many runs per sample where one run is
short against the cost of dispatching it (``loop_program``).

The interval of a median is distribution-free, from order statistics: with
``n`` samples sorted, ``[x(j), x(k)]`` holds the true median with probability
``P(j <= B < k)``, ``B ~ Binomial(n, 1/2)`` (W. J. Conover, *Practical
Nonparametric Statistics*, 3rd ed., Wiley 1999, section 3.2). It needs no
model of the noise, which on a loaded machine is skewed and heavy-tailed.
"""

from __future__ import annotations

import dataclasses
import math
import statistics
import time
from typing import Callable, Hashable, Sequence

import jax
import jax.numpy as jnp

LEVEL = 0.95
# beyond this many samples the ranks come from the normal approximation
EXACT_UP_TO = 400


@dataclasses.dataclass(frozen=True)
class Interval:
  """A median and its interval, over ``samples`` samples; ``level``: the
  probability that the interval holds the true median (``LEVEL`` asked;
  less where there were too few samples for it; a point estimate, with
  ``samples == 0``, keeps the default)."""
  median: float
  low: float
  high: float
  samples: int
  level: float = LEVEL

  @property
  def half_width(self) -> float:
    return (self.high - self.low) / 2

  def holds(self, x: float) -> bool:
    return self.low <= x <= self.high


def _ranks(n: int, level: float) -> tuple[int, int] | None:
  # 0-based ranks [j, n-1-j] of the interval's ends: the largest j with
  # P(B <= j) <= (1 - level) / 2, B ~ Binomial(n, 1/2) the samples below the
  # median (x(j) <= median needs B >= j + 1); None where even j = 0 fails
  if n > EXACT_UP_TO:   # the normal approximation to the binomial
    z = statistics.NormalDist().inv_cdf((1 + level) / 2)
    j = math.floor((n - z * math.sqrt(n)) / 2) - 1
    return (j, n - 1 - j) if j >= 0 else None
  tail, cdf, j = (1 - level) / 2, 0.0, -1
  while j + 1 < n:
    p = math.comb(n, j + 1) / (1 << n)   # exact ints: no overflow past n = 1023
    if cdf + p > tail:
      break
    cdf += p
    j += 1
  return None if j < 0 else (j, n - 1 - j)


def coverage(n: int, j: int) -> float:
  """The probability that ``[x(j), x(n-1-j)]`` (0-based order statistics
  of ``n`` samples) holds the median: ``1 - 2 P(B <= j)``."""
  if n > EXACT_UP_TO:
    return 1.0 - 2.0 * statistics.NormalDist(n / 2, math.sqrt(n) / 2).cdf(
        j + 0.5)
  return 1.0 - 2.0 * (sum(math.comb(n, i) for i in range(j + 1)) / (1 << n))


def median_interval(xs: Sequence[float], level: float = LEVEL) -> Interval:
  """The median of ``xs`` and its distribution-free ``level`` interval
  (order statistics; with too few samples for ``level``, the range, and
  ``Interval.level`` says how likely it is to hold the median)."""
  v = sorted(float(x) for x in xs)
  n = len(v)
  if n == 0:
    raise ValueError("median_interval of no samples")
  mid = (v[(n - 1) // 2] + v[n // 2]) / 2
  ranks = _ranks(n, level)
  if ranks is None:
    return Interval(mid, v[0], v[-1], n, coverage(n, 0))
  return Interval(mid, v[ranks[0]], v[ranks[1]], n, coverage(n, ranks[0]))


def ratio_interval(num: Sequence[float], den: Sequence[float],
                   level: float = LEVEL) -> Interval:
  """The median of the paired ratios ``num[i] / den[i]`` (samples taken in
  the same round) and its interval."""
  return median_interval([a / b for a, b in zip(num, den)], level)


def narrow(rel: float) -> Callable[[dict], bool]:
  """A stopping rule for ``rounds``: every program's median interval lies
  within ``±rel`` of its median."""
  def done(samples: dict) -> bool:
    for xs in samples.values():
      iv = median_interval(xs)
      if iv.samples < 2 or iv.half_width > rel * abs(iv.median):
        return False
    return True
  return done


def rounds(programs: dict[Hashable, Callable[[], object]], *,
           done: Callable[[dict], bool], budget_s: float,
           min_rounds: int = 5, max_rounds: int = 10_000,
           clock: Callable[[], float] = time.perf_counter
           ) -> tuple[dict[Hashable, list[float]], str]:
  """Runs each of ``programs`` (callables of no arguments; what they return
  is waited for with ``jax.block_until_ready``) once per round, the order
  rotated each round so that none always follows another, until ``done``
  (of the samples so far) after at least ``min_rounds`` rounds, or
  ``budget_s`` seconds have passed (the first round always completes).

  Returns ``({name: [seconds per run, one per round]}, why)``, ``why``:
  ``"converged"``, ``"budget"`` or ``"max_rounds"``.
  """
  names = list(programs)
  samples: dict[Hashable, list[float]] = {k: [] for k in names}
  start, r = clock(), 0
  while True:
    order = names[r % len(names):] + names[:r % len(names)]
    for k in order:
      t = clock()
      jax.block_until_ready(programs[k]())
      samples[k].append(clock() - t)
    r += 1
    if r >= min_rounds and done(samples):
      return samples, "converged"
    if r >= max_rounds:
      return samples, "max_rounds"
    if clock() - start >= budget_s:
      return samples, "budget"


# a sample of a looped program is made this long (seconds) where one run is
# shorter: long against a dispatch (tens of microseconds on a CPU, a few on
# an accelerator), so that no subtraction is needed
TARGET_S = 5e-3
MAX_LOOP = 100_000


def loop_program(fn: Callable, sets: int = 1) -> Callable:
  """``fn`` (arrays in, a pytree of arrays out) run ``k`` times in one
  compiled loop: the result takes ``(k, flag, *args)`` (``k`` a traced
  int32, so that one compile serves every ``k``; ``flag``: pass
  ``jnp.asarray(False)``) and returns a float32 scalar.

  Each run's inputs depend on the previous run's outputs, so that XLA can
  neither hoist a run out of the loop nor merge two: each inexact input
  gets ``where(flag, s, 0)`` added, ``s`` the first element of each of the
  previous run's outputs, and ``flag`` is a traced ``False``, so every run
  sees the original values. The outputs are carried by the loop, so that
  each run computes all of them (a fused consumer of one element alone
  would compute one element of an elementwise rule). The added term is
  fused into the rule's first operations where XLA can (a JAX-coded rule);
  a kernel's operand is materialized, as in the step.

  ``sets > 1``: each argument has a leading axis of ``sets`` input sets,
  and run ``i`` takes set ``i % sets`` (a rule timed on several calls'
  values at once: its mean time over them). Inputs that are not inexact
  arrays pass through unchanged."""
  def looped(k, flag, *args):
    pick = ((lambda i, x: jax.lax.dynamic_index_in_dim(
        x, i % sets, keepdims=False)) if sets > 1 else (lambda i, x: x))
    shapes = jax.eval_shape(fn, *[pick(0, x) for x in args])
    first = jax.tree.map(lambda a: jnp.zeros(a.shape, a.dtype), shapes)

    def body(i, carry):
      outs, acc = carry
      s = sum((jnp.ravel(o)[0].astype(jnp.float32)
               for o in jax.tree.leaves(outs)
               if o.size and jnp.issubdtype(o.dtype, jnp.number)),
              jnp.float32(0))
      bump = jnp.where(flag, s, jnp.float32(0))
      ins = tuple(pick(i, x) + bump.astype(x.dtype)
                  if jnp.issubdtype(jnp.result_type(x), jnp.inexact)
                  else pick(i, x) for x in args)
      return fn(*ins), acc + bump
    return jax.lax.fori_loop(0, k, body, (first, jnp.float32(0)))[1]
  return jax.jit(looped)


def loop_length(run: Callable[[int], object], target_s: float = TARGET_S,
                max_loop: int = MAX_LOOP, tries: int = 3,
                clock: Callable[[], float] = time.perf_counter
                ) -> tuple[int, float]:
  """The ``k`` for which one sample of ``run(k)`` (a looped program;
  waited for) lasts at least ``target_s``: from ``k = 1`` up, each guess
  scaled by the target over the last sample (at least doubled), at most
  ``max_loop``; each sample the least of ``tries`` (a sample the machine's
  load interrupted would otherwise stop the search early). Returns ``(k,
  seconds of the last sample)``; ``run(1)`` first runs once more (a first
  run may compile or allocate)."""
  jax.block_until_ready(run(1))
  k = 1
  while True:
    took = math.inf
    for _ in range(tries):
      t = clock()
      jax.block_until_ready(run(k))
      took = min(took, clock() - t)
    if took >= target_s or k >= max_loop:
      return k, took
    k = min(max_loop, max(2 * k, math.ceil(k * 1.2 * target_s
                                            / max(took, 1e-9))))
