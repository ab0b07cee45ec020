"""How the audit measures seconds: programs run in interleaved rounds until
each estimate's 95% interval is narrow enough, or a time budget runs out.

The conventions of benchmark harnesses (pyperf, Criterion.rs,
``triton.testing.do_bench``): repeat until the estimate is stable, report an
interval and not a point, and time many runs per sample where one run is
short against the cost of dispatching it (``repeat_in_loop``).

The interval of a median is distribution-free, from order statistics: with
``n`` samples sorted, ``[x(j), x(k)]`` holds the true median with probability
``P(j <= B < k)``, ``B ~ Binomial(n, 1/2)`` (W. J. Conover, *Practical
Nonparametric Statistics*, 3rd ed., Wiley 1999, section 3.2). It needs no
model of the noise, which on a loaded machine is skewed and heavy-tailed.
"""

from __future__ import annotations

import dataclasses
import math
import time
from typing import Callable, Hashable, Sequence

import jax
import jax.numpy as jnp

LEVEL = 0.95


@dataclasses.dataclass(frozen=True)
class Interval:
  """A median and its ``LEVEL`` interval, over ``samples`` samples."""
  median: float
  low: float
  high: float
  samples: int

  @property
  def half_width(self) -> float:
    return (self.high - self.low) / 2

  def holds(self, x: float) -> bool:
    return self.low <= x <= self.high

  def as_dict(self) -> dict:
    return dataclasses.asdict(self)


def _ranks(n: int, level: float) -> tuple[int, int] | None:
  # 0-based ranks [j, n-1-j] of the interval's ends: the largest j with
  # P(B <= j) <= (1 - level) / 2, B ~ Binomial(n, 1/2) the samples below the
  # median (x(j) <= median needs B >= j + 1); None where even j = 0 fails
  tail, cdf, j = (1 - level) / 2, 0.0, -1
  while j + 1 < n:
    p = math.comb(n, j + 1) / 2.0 ** n
    if cdf + p > tail:
      break
    cdf += p
    j += 1
  return None if j < 0 else (j, n - 1 - j)


def median_interval(xs: Sequence[float], level: float = LEVEL) -> Interval:
  """The median of ``xs`` and its distribution-free ``level`` interval
  (order statistics; with too few samples for ``level``, the range)."""
  v = sorted(float(x) for x in xs)
  n = len(v)
  if n == 0:
    raise ValueError("median_interval of no samples")
  mid = (v[(n - 1) // 2] + v[n // 2]) / 2
  ranks = _ranks(n, level)
  if ranks is None:
    return Interval(mid, v[0], v[-1], n)
  return Interval(mid, v[ranks[0]], v[ranks[1]], n)


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


def repeat_in_loop(fn: Callable, k: int) -> Callable:
  """``fn`` (arrays in, a pytree of arrays out) run ``k`` times in one
  compiled loop, each run's inputs depending on the previous run's outputs
  so that XLA can neither hoist a run out of the loop nor merge two: each
  inexact input gets ``where(flag, s, 0)`` added, ``s`` one element of the
  previous outputs and ``flag`` a traced ``False``, so every run sees the
  original values. The result takes ``(flag, *args)``; pass
  ``jnp.asarray(False)``. Inputs that are not inexact arrays pass through
  unchanged (a rule with none still runs ``k`` times, chained by its
  outputs where XLA cannot prove them unused: a kernel, a callback)."""
  def looped(flag, *args):
    def body(_, carry):
      ins, acc = carry
      outs = jax.tree.leaves(fn(*ins))
      s = sum((jnp.ravel(o)[0].astype(jnp.float32) for o in outs
               if o.size and jnp.issubdtype(o.dtype, jnp.number)),
              jnp.float32(0))
      bump = jnp.where(flag, s, jnp.float32(0))
      ins = tuple(x + bump.astype(x.dtype)
                  if jnp.issubdtype(jnp.result_type(x), jnp.inexact) else x
                  for x in ins)
      return ins, acc + bump
    return jax.lax.fori_loop(0, k, body, (tuple(args), jnp.float32(0)))[1]
  return jax.jit(looped)
