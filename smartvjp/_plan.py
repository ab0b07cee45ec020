"""The one decision: where each rule of a differentiated call runs.

Pure (nothing traced), so ``tests/test_plan.py`` tests it as a table. A
plan's ``Schedule`` travels in the params of the equations that carry the
call on (``smartvjp_jvp``, ``smartvjp_rem``); the rules that meet them read
it, and :func:`prune` says what is left where outputs are unused.

Forward mode (``jax.jvp``, ``jax.jacfwd``, a ``linearize`` evaluated) runs
a ``smartvjp_jvp`` equation whole, whatever its schedule: the forward rule
where given, else ``fwd`` and the linear map's forward mode; the schedule
is for the reverse passes only."""

from __future__ import annotations

import dataclasses
import enum
from typing import Any


class Answer(enum.Enum):
  SAVE = "save"
  RECOMPUTE = "recompute"
  OFFLOAD = "offload"


@dataclasses.dataclass(frozen=True)
class Asked:
  """``space``: the memory space of an ``OFFLOAD``."""
  answer: Answer
  space: Any = None


SAVE = Asked(Answer.SAVE)
RECOMPUTE = Asked(Answer.RECOMPUTE)


@dataclasses.dataclass(frozen=True)
class Facts:
  """What the plan knows about one call, gathered once by ``_policy``.

  ``num_computed``: residual leaves ``fwd`` computes (``None``: not traced).
  ``always_save``: ``defremat``'s rules. ``remat_rules``: ``defremat`` rules
  beside ``defvjp``'s (``remat_rules_usable=False`` once found unusable).
  ``splittable``: ``fwd`` is JAX code a policy may split. ``keeps_effects``:
  ``f`` or ``fwd`` has effects JAX keeps. ``f_matches_fwd``: ``f`` may stand
  in for a ``fwd`` that computes nothing more. ``fwd_reads_saved``: ``fwd``'s
  leading inputs are saved values (a split's backward side)."""
  has_fwd: bool
  has_fwd_bwd: bool
  num_computed: int | None = 1
  always_save: bool = False
  remat_rules: bool = False
  remat_rules_usable: bool = True
  splittable: bool = True
  keeps_effects: bool = False
  f_matches_fwd: bool = True
  # inputs_only: fwd computes nothing but its inputs (every residual an input,
  # through checkpoint_name at most): nothing to rebuild before bwd, and f
  # may stand in for it
  inputs_only: bool = False
  # for prune
  fwd_keeps_effects: bool = False
  f_traced: bool = True
  f_closes_over: bool = False
  references: bool = False
  fwd_reads_saved: bool = False
  # defvjp(..., fused=...): True or False forces the backward pair
  fused: bool | None = None


ASK = "ask"   # Answers.split not known yet


@dataclasses.dataclass(frozen=True)
class Answers:
  """A policy's answers: about the call's own equation, one per
  computed residual, and the split of ``fwd`` (``None``: none worth doing;
  ``ASK``: not computed yet, see :attr:`Plan.asks_split`)."""
  call: Asked
  residuals: tuple = ()
  split: Any = None


class Kind(enum.Enum):
  FWD = "fwd's residuals kept (the schedule says whether f runs for it)"
  RECOMPUTE = "the call again in the backward region (its rules: the schedule)"
  SPLIT = "part of fwd forward, the rest of it rebuilt backward"
  REMAT_RULES = "the defremat rules instead"


class Forward(enum.Enum):
  F = "f"
  FWD = "fwd"
  PART_OF_FWD = "part of fwd"


class Backward(enum.Enum):
  BWD = "bwd"                  # alone: nothing is rebuilt
  FWD_THEN_BWD = "fwd+bwd"     # fwd (or what a split left of it), then bwd
  FWD_BWD = "fwd_bwd"


@dataclasses.dataclass(frozen=True)
class Schedule:
  """What each pass runs (and, derived, what the rules ask of it); ``why``:
  the reason :func:`backward_pair` gave, once it chose (``""``: not asked)."""
  forward: Forward
  backward: Backward
  why: str = ""
  runs_fwd_bwd: bool = dataclasses.field(init=False, compare=False,
                                         repr=False)
  # the part of fwd where it reads saved values, else f
  primal_by: Forward = dataclasses.field(init=False, compare=False,
                                         repr=False)
  recomputes: bool = dataclasses.field(init=False, compare=False, repr=False)
  # f + fwd_bwd not yet weighed against fwd + bwd (backward_pair)
  asks_pair: bool = dataclasses.field(init=False, compare=False, repr=False)

  def __post_init__(self):
    fused = self.backward is Backward.FWD_BWD
    object.__setattr__(self, "runs_fwd_bwd", fused)
    object.__setattr__(self, "primal_by", (
        Forward.PART_OF_FWD if self.forward is Forward.PART_OF_FWD
        else Forward.F))
    object.__setattr__(self, "recomputes", (
        self.forward is Forward.F and self.backward is not Backward.BWD))
    object.__setattr__(self, "asks_pair", fused and not self.why)

  @property
  def shown_backward(self) -> str:
    return (f"{self.backward.value} ({self.why})" if self.why
            else self.backward.value)

  def __str__(self):
    return f"{self.forward.value} forward, {self.shown_backward} backward"


SPLIT_REBUILT = Schedule(Forward.PART_OF_FWD, Backward.FWD_THEN_BWD)
REPLAYED = Schedule(Forward.PART_OF_FWD, Backward.BWD)


@dataclasses.dataclass(frozen=True)
class Plan:
  """``spaces`` (``FWD``): a memory space or ``None`` per computed residual;
  ``split`` (``SPLIT``): ``Answers.split``."""
  kind: Kind
  schedule: Schedule
  spaces: tuple = ()
  split: Any = None

  @property
  def offloads(self) -> bool:
    return any(s is not None for s in self.spaces)

  @property
  def asks_split(self) -> bool:
    return self.kind is Kind.SPLIT and self.split is None

  @property
  def rem_schedule(self) -> Schedule:
    """Where everything is kept, remat3's rem side replays the saved values."""
    if self.kind in (Kind.RECOMPUTE, Kind.SPLIT):
      return self.schedule
    return REPLAYED


def _recompute(facts: Facts) -> Plan:
  if facts.fwd_reads_saved:   # recomputing a split's backward side again
    return Plan(Kind.RECOMPUTE, Schedule(
        Forward.PART_OF_FWD,
        Backward.BWD if facts.inputs_only else Backward.FWD_THEN_BWD))
  if not facts.has_fwd or facts.has_fwd_bwd:
    return Plan(Kind.RECOMPUTE, Schedule(Forward.F, Backward.FWD_BWD))
  if fwd_or_f(facts).schedule.forward is Forward.F:
    # fwd computes nothing f does not: the backward region runs bwd alone
    # on the inputs (f, standing in for fwd, for the primal outputs)
    return Plan(Kind.RECOMPUTE, Schedule(Forward.F, Backward.BWD))
  return Plan(Kind.RECOMPUTE, Schedule(Forward.F, Backward.FWD_THEN_BWD))


def fwd_or_f(facts: Facts, spaces: tuple = ()) -> Plan:
  """``fwd`` with its residuals kept, or ``f`` in its place where ``fwd``
  computes nothing more and neither has effects."""
  if (facts.inputs_only and not facts.keeps_effects and facts.f_matches_fwd
      and not any(s is not None for s in spaces)):
    return Plan(Kind.FWD, Schedule(Forward.F, Backward.BWD))
  return Plan(Kind.FWD, Schedule(Forward.FWD, Backward.BWD), spaces)


class FwdLeft(enum.Enum):
  WHOLE = "fwd's equation as it is"
  CODE = "fwd's traced code pruned to the outputs read"
  RESIDUALS = "fwd computing only the residuals read"


@dataclasses.dataclass(frozen=True)
class Pruned:
  """``primal``: what computes the primal outputs (``None``: nothing);
  ``linear``: whether the linear map stays (for ``fwd``'s own equation:
  whether a residual is read); ``fwd``: what is left of ``fwd``'s own
  equation where a residual is read."""
  primal: Forward | None
  linear: bool
  fwd: FwdLeft | None = None


def prune(facts: Facts, schedule: Schedule | None, outputs_used: bool,
          tangents_used: bool, carries_f: bool = True, *,
          all_outputs_used: bool = True, all_tangents_used: bool = True,
          offloaded: bool = False) -> Pruned:
  """What is left of a ``smartvjp_jvp`` with unused outputs, or of a
  ``fwd``'s own equation (``carries_f=False``; its residuals in place of
  tangents).

  Tangents read, primal outputs not: the linear map alone where nothing
  computes its inputs and no effect or reference would be skipped. No tangent
  read: ``fwd`` where it has effects; nothing where no output is read; the
  primal part of a ``fwd`` reading saved values; else ``f`` where it can
  stand in (traced, carried, no references, the same output types).
  ``fwd``'s own equation with residuals read (``fwd`` traced): its code
  pruned to the outputs read where a primal output is unread and nothing
  is offloaded (as JAX prunes the inlined ``fwd`` of a ``jax.custom_vjp``);
  else only the residuals read where some are not; else whole."""
  if not carries_f and tangents_used:
    traced = facts.num_computed is not None
    if traced and not all_outputs_used and not offloaded:
      left = FwdLeft.CODE
    elif traced and not all_tangents_used:
      left = FwdLeft.RESIDUALS
    else:
      left = FwdLeft.WHOLE
    return Pruned(Forward.FWD, True, left)
  if tangents_used:
    alone = (not outputs_used and not facts.keeps_effects
             and not facts.references
             and (schedule.runs_fwd_bwd or facts.inputs_only))
    return Pruned(None if alone else schedule.forward, True)
  if facts.fwd_keeps_effects:
    return Pruned(Forward.FWD, False)
  if not outputs_used and (facts.has_fwd or not facts.keeps_effects):
    return Pruned(None, False)
  if facts.fwd_reads_saved:
    return Pruned(Forward.PART_OF_FWD, False)
  if not carries_f and (not facts.f_traced or facts.f_closes_over
                        or facts.references or not facts.f_matches_fwd
                        or facts.num_computed is None):
    return Pruned(Forward.FWD, False)
  return Pruned(Forward.F, False)


@dataclasses.dataclass(frozen=True, order=True)
class Cost:
  """What a rule (or a pair of them) costs, compared field by field:
  collectives, then operations (XLA's or a Pallas kernel's estimate), then
  opaque kernels (a callback or kernel no estimate sees into), then the
  bytes the kernels' own estimates access; ``written``, the bytes of the
  outputs, breaks ties."""
  collectives: int = 0
  flops: float = 0.0
  kernels: int = 0
  written: int = 0
  kernel_bytes: float = 0.0

  def __add__(self, other: "Cost") -> "Cost":
    return Cost(*(a + b for a, b in zip(dataclasses.astuple(self),
                                        dataclasses.astuple(other))))

  @property
  def work(self) -> tuple:
    return (self.collectives, self.flops, self.kernels, self.kernel_bytes)


def unfused_schedule(facts: Facts) -> Schedule:
  """What the rematerialized backward region runs without ``fwd_bwd``:
  ``fwd`` + ``bwd``, or ``bwd`` alone where ``fwd`` computes nothing ``f``
  does not (:func:`backward_pair`'s unfused pair)."""
  return _recompute(dataclasses.replace(facts, has_fwd_bwd=False)).schedule


def backward_pair(facts: Facts, output_read: bool | None,
                  fused: Cost | None, unfused: Cost | None) -> Schedule:
  """The rematerialized backward region's pair for a call whose plan says
  ``f`` forward, ``fwd_bwd`` backward and which has ``fwd`` too.

  ``output_read``: whether that region reads the call's primal output
  (``None``: not known, taken as read). Where it is not read ``fwd_bwd``
  runs alone; where it is, ``f`` + ``fwd_bwd`` (``fused``) and ``fwd`` +
  ``bwd`` (``unfused``) are weighed (:class:`Cost`; ``None``: not known),
  ties going to the one writing fewer bytes, and unknown costs to
  ``fwd`` + ``bwd``. ``defvjp(..., fused=...)`` forces either."""
  apart = unfused_schedule(facts)

  def chosen(fuse: bool, why: str) -> Schedule:
    if fuse:
      return Schedule(Forward.F, Backward.FWD_BWD, why)
    return dataclasses.replace(apart, why=why)
  if facts.fused is not None:
    return chosen(facts.fused, f"defvjp fused={facts.fused}")
  if output_read is False:
    return chosen(True, "output not read")
  read = "output read" if output_read else "output maybe read"
  if fused is None or unfused is None:
    return chosen(False, f"{read}; cost not known")
  if fused.work != unfused.work:
    cheaper = fused.work < unfused.work
    return chosen(cheaper, f"{read}; fused costs {'less' if cheaper else 'more'}")
  fewer = fused.written <= unfused.written
  return chosen(fewer, f"{read}; same cost, "
                       f"{'fused' if fewer else 'unfused'} writes less")


def plan(facts: Facts, answers: Answers | None) -> Plan:
  """Where the rules of one differentiated call run.

  ``answers`` is ``None`` without a remat policy: ``fwd`` now and ``bwd`` in
  the transpose (``f`` for a ``fwd`` that computes nothing; with ``fwd_bwd``
  alone, ``f`` and ``fwd_bwd``). Under remat, in this order: only
  ``fwd_bwd``: recompute; ``defremat``: keep; a splittable ``fwd`` with
  something recomputed and nothing offloaded: split where worth it; else
  ``defremat`` rules where usable; everything kept: ``fwd`` (or ``f``)
  forward; else recompute the whole call."""
  if not facts.has_fwd:
    return _recompute(facts)
  if answers is None or facts.always_save:
    return fwd_or_f(facts, (None,) * (facts.num_computed or 0))
  if facts.num_computed == 0:
    kept = None if answers.call.answer is Answer.RECOMPUTE else ()
  elif any(a.answer is Answer.RECOMPUTE for a in answers.residuals):
    kept = None
  else:
    kept = tuple(a.space if a.answer is Answer.OFFLOAD else None
                 for a in answers.residuals)
  offloads = kept is not None and any(s is not None for s in kept)
  if (not offloads and facts.splittable and not facts.remat_rules
      and facts.num_computed and answers.split is not None):
    return Plan(Kind.SPLIT, SPLIT_REBUILT,
                split=None if answers.split is ASK else answers.split)
  if kept is None and facts.remat_rules and facts.remat_rules_usable:
    # the schedule is the defremat rules' own: ask fwd_or_f with their facts
    return Plan(Kind.REMAT_RULES, Schedule(Forward.FWD, Backward.BWD))
  if kept is not None:
    return fwd_or_f(facts, kept)
  return _recompute(facts)


def answer_for_chain(call: Asked, chain_answers) -> Asked:
  """The call's answer, unless it recomputes; then the first answer along
  the residual's producers that does not (asked lazily)."""
  answer, chain = call, iter(chain_answers)
  while answer.answer is Answer.RECOMPUTE:
    asked = next(chain, None)
    if asked is None:
      break
    answer = asked
  return answer
