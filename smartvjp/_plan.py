"""The one decision: where each rule of a differentiated call runs.

Every path that differentiates a ``smart_custom_vjp`` call asks this module:
the partial evaluation of ``jax.checkpoint`` and the remat3 rule
(``_remat.py``), linearization (``jax.grad``/``jax.vjp`` under ``jit`` or
eagerly, ``_ad.py``), and the rules that meet the equations the plan placed
(``_remat.py``'s trace-time partial evaluation and dead-code elimination). Those adapters hand it the call's facts (``Facts``, gathered
once per traced ``fwd`` by ``_policy``) and the remat policy's answers
(``Answers``) and carry out the ``Plan``; nothing here traces or touches
JAX, so the decision is tested as a table (``tests/test_plan.py``).

A plan's ``Schedule`` (what runs forward, what runs backward) is a frozen,
hashable value that travels in the params of the equations that carry the
call on (``smartvjp_jvp``, ``smartvjp_rem``): the rules that meet them later
read it and do not decide again; where outputs nobody reads are removed,
:func:`prune` says what is left.

The schedule is the one jax-ml/jax#21303 asks for: under remat the forward
pass runs ``f`` and only the rematerialized backward region runs ``fwd`` (or
the fused ``fwd_bwd``), unless the policy saves what ``fwd`` computes.
"""

from __future__ import annotations

import dataclasses
import enum
from typing import Any


class Answer(enum.Enum):
  """What a remat policy says about one value."""
  SAVE = "save"
  RECOMPUTE = "recompute"
  OFFLOAD = "offload"


@dataclasses.dataclass(frozen=True)
class Asked:
  """One policy answer; ``space`` is the memory space of an ``OFFLOAD``."""
  answer: Answer
  space: Any = None


SAVE = Asked(Answer.SAVE)
RECOMPUTE = Asked(Answer.RECOMPUTE)


@dataclasses.dataclass(frozen=True)
class Facts:
  """What the decision needs to know about one call (none of it a policy's).

  ``num_computed``: residual leaves ``fwd`` computes (not inputs of the call,
  not Python scalars); ``None`` when ``fwd`` has not been traced (eager
  differentiation runs it on values instead). ``always_save``: the rules are
  ``defremat``'s, whose ``fwd`` keeps its residuals whatever the policy
  says. ``remat_rules``: ``defremat`` rules given beside ``defvjp``'s, for
  where the policy recomputes; ``remat_rules_usable``: ``False`` once the
  adapter found they cannot be (their ``fwd`` closes over a traced value),
  and asks again. ``splittable``: ``fwd`` is traced JAX code the policy may split equation
  by equation (no references among the inputs or effects). ``keeps_effects``:
  ``f`` or ``fwd`` has effects JAX keeps (a debug print), so which of them
  runs is observable. ``f_matches_fwd``: ``f``'s outputs have ``fwd``'s full
  types (sharding, varying manual axes), so ``f`` may stand in for a ``fwd``
  that computes nothing more. ``fwd_reads_saved``: ``fwd``'s leading
  inputs are values the forward pass saved (the backward side of a split,
  met again by a nested ``jax.checkpoint``): its part producing the primal
  outputs costs no more than ``f`` (``_policy.split_fwd`` made sure).
  """
  has_fwd: bool
  has_fwd_bwd: bool
  num_computed: int | None = 1
  always_save: bool = False
  remat_rules: bool = False
  remat_rules_usable: bool = True
  splittable: bool = True
  keeps_effects: bool = False
  f_matches_fwd: bool = True
  # for dead-code elimination: fwd itself has effects JAX keeps; f is
  # traced; f closes over traced values (which an equation of fwd alone does
  # not carry); references are involved; the backward side computes
  # residuals before bwd (False where fwd's residuals are all inputs or
  # saved values)
  fwd_keeps_effects: bool = False
  f_traced: bool = True
  f_closes_over: bool = False
  references: bool = False
  rebuilds: bool = True
  fwd_reads_saved: bool = False


ASK = "ask"   # Answers.split not known yet


@dataclasses.dataclass(frozen=True)
class Answers:
  """The remat policy's answers for one call: ``call`` for the call's own
  equation, ``residuals`` one per residual ``fwd`` computes (asked for the
  equation of ``fwd`` producing it, through ``checkpoint_name``), and
  ``split``: the split of ``fwd`` by the policy when one is worth doing
  (see ``_policy.split_fwd``), ``None`` when there is none, or ``ASK``:
  not computed yet, as it costs a partial evaluation of ``fwd``; a plan that
  needs it says so (:attr:`Plan.asks_split`) and is asked again with it."""
  call: Asked
  residuals: tuple = ()
  split: Any = None


class Kind(enum.Enum):
  FWD = "fwd's residuals kept (the schedule says whether f runs for it)"
  RECOMPUTE = "the call again in the backward region (its rules: the schedule)"
  SPLIT = "part of fwd forward, the rest of it rebuilt backward"
  REMAT_RULES = "the defremat rules instead"


class Forward(enum.Enum):
  """What the forward pass runs for a call's primal outputs."""
  F = "f"
  FWD = "fwd"
  PART_OF_FWD = "part of fwd"


class Backward(enum.Enum):
  """What the backward side of a call runs."""
  BWD = "bwd"                  # alone: nothing is rebuilt (the residuals are
                               # kept, inputs of the call or saved values)
  FWD_THEN_BWD = "fwd+bwd"     # fwd (or what a split left of it), then bwd
  FWD_BWD = "fwd_bwd"          # the fused rule on the primal inputs


@dataclasses.dataclass(frozen=True)
class Schedule:
  """Where a differentiated call's rules run: ``forward`` for its primal
  outputs, ``backward`` for its cotangents."""
  forward: Forward
  backward: Backward

  @property
  def runs_fwd_bwd(self) -> bool:
    return self.backward is Backward.FWD_BWD

  @property
  def primal_by(self) -> Forward:
    """What computes the primal outputs where nothing else is needed: the
    part of ``fwd`` where it reads saved values, else ``f``."""
    return (Forward.PART_OF_FWD if self.forward is Forward.PART_OF_FWD
            else Forward.F)

  @property
  def recomputes(self) -> bool:
    """The whole call runs again in the backward region: ``f`` forward and
    the rules that rebuild the residuals backward."""
    return self.forward is Forward.F and self.backward is not Backward.BWD

  def __str__(self):
    return f"{self.forward.value} forward, {self.backward.value} backward"


# the backward side of a split: the rest of fwd rebuilt from the saved values
SPLIT_REBUILT = Schedule(Forward.PART_OF_FWD, Backward.FWD_THEN_BWD)
# remat3's rem side where everything is kept: the saved values replayed (the
# part of a fwd reading them), bwd on them
REPLAYED = Schedule(Forward.PART_OF_FWD, Backward.BWD)


@dataclasses.dataclass(frozen=True)
class Plan:
  """The decision. ``schedule``: what runs in each pass; ``spaces`` (for
  ``FWD``): one memory space, or ``None`` for device memory, per residual
  ``fwd`` computes; ``split`` (for ``SPLIT``): what ``Answers.split``
  returned."""
  kind: Kind
  schedule: Schedule
  spaces: tuple = ()
  split: Any = None

  @property
  def offloads(self) -> bool:
    return any(s is not None for s in self.spaces)

  @property
  def asks_split(self) -> bool:
    """The plan splits ``fwd`` if the policy's split is worth doing: ask
    :func:`plan` again with ``Answers.split``."""
    return self.kind is Kind.SPLIT and self.split is None

  @property
  def rem_schedule(self) -> Schedule:
    """The schedule of remat3's rem side: the plan's, or where everything
    is kept, the saved values replayed."""
    if self.kind in (Kind.RECOMPUTE, Kind.SPLIT):
      return self.schedule
    return REPLAYED


def _recompute(facts: Facts) -> Plan:
  if facts.fwd_reads_saved:   # recomputing a split's backward side again
    return Plan(Kind.RECOMPUTE, Schedule(
        Forward.PART_OF_FWD,
        Backward.FWD_THEN_BWD if facts.rebuilds else Backward.BWD))
  if not facts.has_fwd or facts.has_fwd_bwd:
    return Plan(Kind.RECOMPUTE, Schedule(Forward.F, Backward.FWD_BWD))
  if fwd_or_f(facts).schedule.forward is Forward.F:
    # fwd computes nothing f does not: the backward region runs bwd alone
    # on the inputs (f, standing in for fwd, for the primal outputs)
    return Plan(Kind.RECOMPUTE, Schedule(Forward.F, Backward.BWD))
  return Plan(Kind.RECOMPUTE, Schedule(Forward.F, Backward.FWD_THEN_BWD))


def fwd_or_f(facts: Facts, spaces: tuple = ()) -> Plan:
  """Where ``fwd`` is to run with its residuals kept (forward under remat,
  or in the rematerialized region): ``fwd``, or ``f`` in its place when
  ``fwd`` computes nothing ``f`` does not and neither has effects."""
  if (facts.num_computed == 0 and not facts.keeps_effects
      and facts.f_matches_fwd):
    return Plan(Kind.FWD, Schedule(Forward.F, Backward.BWD))
  return Plan(Kind.FWD, Schedule(Forward.FWD, Backward.BWD), spaces)


@dataclasses.dataclass(frozen=True)
class Pruned:
  """What is left of a differentiated call's equation once the outputs
  nobody reads are gone: ``primal`` computes the primal outputs (``None``:
  nothing does), and ``linear`` says whether the linear map stays."""
  primal: Forward | None
  linear: bool


def prune(facts: Facts, schedule: Schedule | None, outputs_used: bool,
          tangents_used: bool, carries_f: bool = True) -> Pruned:
  """What is left of a ``smartvjp_jvp`` (``schedule`` its own) with unused
  outputs, or of a ``smartvjp_fwd`` none of whose residuals is read
  (``tangents_used`` false, ``carries_f`` false: it lacks what ``f`` closes
  over).

  * Tangents read, primal outputs not: the linear map alone where nothing
    computes its inputs (``fwd_bwd`` reads the primal inputs, or ``fwd``'s
    residuals are inputs or saved values) and no effect or reference would
    be skipped (eagerly, as in ``jax.checkpoint``'s backward region, nothing
    else removes what nobody reads). Else all of it.
  * No tangent read: ``fwd`` where it has effects ``jax.custom_vjp`` would
    run; nothing where no primal output is read either (unless ``f``, given
    only ``fwd_bwd``, has effects); the part of ``fwd`` producing the
    primal outputs where ``fwd`` reads saved values (what JAX runs of the
    inlined ``fwd``); else ``f``, as ``optimize_remat=True`` does under
    ``jit``, where it can stand in: traced (a call linearized where it is
    made keeps ``fwd``, as with ``jax.custom_vjp``), carried, no
    references, the same output types.
  """
  if tangents_used:
    alone = (not outputs_used and not facts.keeps_effects
             and not facts.references
             and (schedule.runs_fwd_bwd or not facts.rebuilds))
    return Pruned(None if alone else schedule.forward, True)
  if facts.fwd_keeps_effects:
    return Pruned(Forward.FWD, False)
  if not outputs_used and (facts.has_fwd or not facts.keeps_effects):
    return Pruned(None, False)
  if facts.fwd_reads_saved:
    return Pruned(Forward.PART_OF_FWD, False)
  if not carries_f and (not facts.f_traced or facts.f_closes_over
                        or facts.references or not facts.f_matches_fwd):
    return Pruned(Forward.FWD, False)
  return Pruned(Forward.F, False)


def plan(facts: Facts, answers: Answers | None) -> Plan:
  """Where the rules of one differentiated call run.

  ``answers`` is ``None`` where no remat policy applies (``jax.grad``,
  ``jax.vjp``, ``jax.linearize``, inside ``jit`` or not, and ``jax.jvp``):
  ``fwd`` runs now and ``bwd`` in the transpose, as with ``jax.custom_vjp``
  (``f`` in ``fwd``'s place where a traced ``fwd`` computes nothing more);
  with ``fwd_bwd`` alone, ``f`` now and ``fwd_bwd`` in the transpose.

  Under remat (a ``jax.checkpoint`` policy, on JAX's default path or its
  remat3 path), in this order:

  * only ``fwd_bwd`` given: recompute (``f`` forward, ``fwd_bwd`` backward);
  * ``defremat`` rules: ``fwd`` forward, residuals kept;
  * a residual the policy does not save, or the call recomputed when it
    computes no residual: some value is to be recomputed. Otherwise every
    residual is kept (offloaded where the policy says);
  * unless something is offloaded, a JAX-coded ``fwd`` is split by the
    policy when the split is worth it (saved values and the primal outputs
    forward, the rest rebuilt backward: primal outputs follow the policy
    like any other value);
  * something recomputed and ``defremat`` rules usable: those instead;
  * everything kept: ``fwd`` forward (``f`` in its place when ``fwd``
    computes nothing more); else recompute the whole call, whose backward
    region runs ``fwd_bwd`` where it is given, else ``fwd`` then ``bwd``;
    where ``fwd`` reads saved values (a split's backward side, recomputed by
    a nested ``jax.checkpoint``), its part producing the primal outputs
    forward and all of it, then ``bwd``, backward.
  """
  if not facts.has_fwd:
    return _recompute(facts)
  if answers is None:
    return fwd_or_f(facts, (None,) * (facts.num_computed or 0))
  if facts.always_save:
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
      and facts.num_computed):
    if answers.split is ASK:
      return Plan(Kind.SPLIT, SPLIT_REBUILT)
    if answers.split is not None:
      return Plan(Kind.SPLIT, SPLIT_REBUILT, split=answers.split)
  if kept is None and facts.remat_rules and facts.remat_rules_usable:
    # the schedule is the defremat rules' own: ask fwd_or_f with their facts
    return Plan(Kind.REMAT_RULES, Schedule(Forward.FWD, Backward.BWD))
  if kept is not None:
    return fwd_or_f(facts, kept)
  return _recompute(facts)


def answer_for_chain(call: Asked, chain_answers) -> Asked:
  """A residual's answer: the call's own, unless it recomputes; then the
  first answer along the residual's producers (its ``checkpoint_name``
  equation, then the named value's producer) that does not recompute, or the
  last one asked. ``chain_answers`` is an iterable, asked lazily."""
  answer, chain = call, iter(chain_answers)
  while answer.answer is Answer.RECOMPUTE:
    asked = next(chain, None)
    if asked is None:
      break
    answer = asked
  return answer
