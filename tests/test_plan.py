"""The one decision (``smartvjp._plan``) as a table: facts and policy answers
in, plan out, nothing traced.

Rows: every row of the README's contract (``tests/test_contract.py`` runs
them) and every kind of rule of ``benchmarks/cost.py`` under the policies
that differ for it.
"""

import pytest

import dataclasses

from smartvjp._plan import (
    RECOMPUTE, SAVE, Answer, Answers, Asked, Facts, Forward, Kind,
    answer_for_chain, fwd_or_f, linear_part_only, plan, primal_outputs_by,
    without_residuals)

FWD_BWD = Facts(has_fwd=True, has_fwd_bwd=False)          # defvjp(fwd, bwd)
ALL_THREE = Facts(has_fwd=True, has_fwd_bwd=True)         # + fwd_bwd=
ONLY_FUSED = Facts(has_fwd=False, has_fwd_bwd=True)       # defvjp(fwd_bwd=)
INPUTS_ONLY = Facts(has_fwd=True, has_fwd_bwd=False, num_computed=0)
OPAQUE = Facts(has_fwd=True, has_fwd_bwd=False, num_computed=2,
               splittable=False)                          # a kernel fwd
HOST = Asked(Answer.OFFLOAD, "pinned_host")


def _split(value):
  calls = []

  def split():
    calls.append(1)
    return value
  split.calls = calls
  return split


ROWS = [
    # (name, facts, answers, expected kind, expected schedule)
    ("grad without remat", FWD_BWD, None, Kind.FWD, "fwd forward, bwd backward"),
    ("grad without remat, fwd_bwd also given", ALL_THREE, None,
     Kind.FWD, "fwd forward, bwd backward"),
    ("grad without remat, fwd computes nothing", INPUTS_ONLY, None,
     Kind.FWD, "fwd forward, bwd backward"),
    ("eager grad: fwd not traced yet",
     Facts(has_fwd=True, has_fwd_bwd=False, num_computed=None), None,
     Kind.FWD, "fwd forward, bwd backward"),
    ("only fwd_bwd, no remat", ONLY_FUSED, None,
     Kind.RECOMPUTE, "f forward, fwd_bwd backward"),
    ("only fwd_bwd, checkpoint", ONLY_FUSED,
     Answers(RECOMPUTE, ()), Kind.RECOMPUTE, "f forward, fwd_bwd backward"),
    ("checkpoint (nothing saveable)", FWD_BWD,
     Answers(RECOMPUTE, (RECOMPUTE,)), Kind.RECOMPUTE, "f forward, fwd+bwd backward"),
    ("checkpoint, fwd_bwd also given", ALL_THREE,
     Answers(RECOMPUTE, (RECOMPUTE,)), Kind.RECOMPUTE, "f forward, fwd_bwd backward"),
    ("checkpoint, the seed's fwd (residual is the input)", INPUTS_ONLY,
     Answers(RECOMPUTE, ()), Kind.RECOMPUTE, "f forward, fwd+bwd backward"),
    ("everything_saveable, the seed's fwd", INPUTS_ONLY,
     Answers(SAVE, ()), Kind.F_FOR_FWD, "f forward, bwd backward"),
    ("everything_saveable", FWD_BWD, Answers(SAVE, (SAVE,), _split(None)),
     Kind.FWD, "fwd forward, bwd backward"),
    ("everything_saveable, opaque fwd", OPAQUE, Answers(SAVE, (SAVE, SAVE)),
     Kind.FWD, "fwd forward, bwd backward"),
    ("named residual saved by save_only_these_names, opaque fwd",
     Facts(has_fwd=True, has_fwd_bwd=False, num_computed=1, splittable=False),
     Answers(RECOMPUTE, (SAVE,)), Kind.FWD, "fwd forward, bwd backward"),
    ("kernel fwd, dots_saveable (its outputs are not dots)", OPAQUE,
     Answers(RECOMPUTE, (RECOMPUTE, RECOMPUTE)),
     Kind.RECOMPUTE, "f forward, fwd+bwd backward"),
    ("kernel fwd, one residual named and saved, the other not", OPAQUE,
     Answers(RECOMPUTE, (SAVE, RECOMPUTE)), Kind.RECOMPUTE, "f forward, fwd+bwd backward"),
    ("saveable rules, dots_saveable (y = x @ w saved): nothing to rebuild",
     FWD_BWD, Answers(RECOMPUTE, (SAVE,), _split(None)),
     Kind.FWD, "fwd forward, bwd backward"),
    ("saveable rules, dots_saveable, gelu(y) recomputed from the saved y",
     FWD_BWD, Answers(RECOMPUTE, (SAVE,), _split("split")),
     Kind.SPLIT, "part of fwd forward, fwd+bwd backward"),
    ("mixed rules, dots_saveable: y saved, gelu'(y) rebuilt", FWD_BWD,
     Answers(RECOMPUTE, (SAVE, RECOMPUTE), _split("split")),
     Kind.SPLIT, "part of fwd forward, fwd+bwd backward"),
    ("mixed rules, dots_saveable, split not worth it", FWD_BWD,
     Answers(RECOMPUTE, (SAVE, RECOMPUTE), _split(None)),
     Kind.RECOMPUTE, "f forward, fwd+bwd backward"),
    ("named rules, save_only_these_names(res): the rest rebuilt", FWD_BWD,
     Answers(RECOMPUTE, (RECOMPUTE, SAVE), _split("split")),
     Kind.SPLIT, "part of fwd forward, fwd+bwd backward"),
    ("offloaded residual: never split", FWD_BWD,
     Answers(RECOMPUTE, (HOST,), _split("split")), Kind.FWD, "fwd forward, bwd backward"),
    ("references among the inputs: not split",
     Facts(has_fwd=True, has_fwd_bwd=False, splittable=False),
     Answers(RECOMPUTE, (SAVE,), _split("split")), Kind.FWD, "fwd forward, bwd backward"),
    ("defremat rules alone: kept whatever the policy",
     Facts(has_fwd=True, has_fwd_bwd=False, always_save=True),
     Answers(RECOMPUTE, (RECOMPUTE,)), Kind.FWD, "fwd forward, bwd backward"),
    ("defremat rules alone, fwd computes nothing",
     Facts(has_fwd=True, has_fwd_bwd=False, always_save=True, num_computed=0),
     Answers(RECOMPUTE, ()), Kind.F_FOR_FWD, "f forward, bwd backward"),
    ("defvjp + defremat, recomputed: the defremat rules",
     Facts(has_fwd=True, has_fwd_bwd=False, remat_rules=True),
     Answers(RECOMPUTE, (RECOMPUTE,), _split("split")),
     Kind.REMAT_RULES, "fwd forward, bwd backward"),
    ("defvjp + defremat, saved: the defvjp rules",
     Facts(has_fwd=True, has_fwd_bwd=False, remat_rules=True),
     Answers(SAVE, (SAVE,)), Kind.FWD, "fwd forward, bwd backward"),
    ("fwd computes nothing, but fwd has a debug print",
     Facts(has_fwd=True, has_fwd_bwd=False, num_computed=0,
           keeps_effects=True), Answers(SAVE, ()), Kind.FWD, "fwd forward, bwd backward"),
    ("a split's backward side met by a nested plain checkpoint",
     Facts(has_fwd=True, has_fwd_bwd=False, fwd_reads_saved=True),
     Answers(RECOMPUTE, (RECOMPUTE,), _split(None)),
     Kind.RECOMPUTE, "part of fwd forward, fwd+bwd backward"),
    ("the same, fwd_bwd also given (it would ignore the saved values)",
     Facts(has_fwd=True, has_fwd_bwd=True, fwd_reads_saved=True),
     Answers(RECOMPUTE, (RECOMPUTE,), _split(None)),
     Kind.RECOMPUTE, "part of fwd forward, fwd+bwd backward"),
    ("a split's backward side, everything saveable inside",
     Facts(has_fwd=True, has_fwd_bwd=False, fwd_reads_saved=True),
     Answers(SAVE, (SAVE,), _split(None)), Kind.FWD, "fwd forward, bwd backward"),
    ("fwd computes nothing, but its output type differs from f's",
     Facts(has_fwd=True, has_fwd_bwd=False, num_computed=0,
           f_matches_fwd=False), Answers(SAVE, ()), Kind.FWD, "fwd forward, bwd backward"),
]


@pytest.mark.parametrize("name,facts,answers,kind,schedule", ROWS,
                         ids=[r[0] for r in ROWS])
def test_plan_table(name, facts, answers, kind, schedule):
  decided = plan(facts, answers)
  assert decided.kind is kind
  assert str(decided.schedule) == schedule


def test_offload_spaces_come_from_the_answers():
  p = plan(Facts(has_fwd=True, has_fwd_bwd=False, num_computed=2),
           Answers(RECOMPUTE, (HOST, SAVE)))
  assert p.kind is Kind.FWD and p.spaces == ("pinned_host", None)
  assert p.offloads


def test_split_is_asked_only_when_it_could_apply():
  for facts, answers in [
      (OPAQUE, Answers(RECOMPUTE, (SAVE, RECOMPUTE), _split("split"))),
      (FWD_BWD, Answers(RECOMPUTE, (HOST,), _split("split"))),
      (INPUTS_ONLY, Answers(RECOMPUTE, (), _split("split"))),
      (FWD_BWD, None)]:
    split = answers.split if answers is not None else None
    plan(facts, answers)
    assert split is None or not split.calls, facts


@pytest.mark.parametrize("facts,spaces,schedule", [
    (FWD_BWD, (None,), "fwd forward, bwd backward"), (FWD_BWD, ("pinned_host",), "fwd forward, bwd backward"),
    (INPUTS_ONLY, (), "f forward, bwd backward"),
    (Facts(has_fwd=True, has_fwd_bwd=False, num_computed=0,
           keeps_effects=True), (), "fwd forward, bwd backward")])
def test_fwd_or_f_keeps_the_residuals(facts, spaces, schedule):
  """Where the adapters place a ``fwd`` whose residuals are kept (the
  ``defremat`` rules chosen): nothing is rebuilt backward."""
  decided = fwd_or_f(facts, spaces)
  assert str(decided.schedule) == schedule
  assert not decided.schedule.recomputes and not decided.schedule.runs_fwd_bwd


def test_schedule_is_a_hashable_value_that_says_what_recomputes():
  """The schedule travels in equation params (hashed by JAX's caches)."""
  rows = {plan(facts, answers).schedule for _, facts, answers, _, _ in ROWS}
  assert len(rows) == 5   # (f, fwd, part of fwd) x (bwd, fwd+bwd, fwd_bwd)
  assert {str(s) for s in rows if s.recomputes} == {"f forward, fwd+bwd backward",
                                                    "f forward, fwd_bwd backward"}
  assert {str(s) for s in rows if s.runs_fwd_bwd} == {"f forward, fwd_bwd backward"}


def test_answer_for_a_residual_follows_its_producers_lazily():
  asked = []

  def chain(*answers):
    for a in answers:
      asked.append(a)
      yield a
  assert answer_for_chain(SAVE, chain(RECOMPUTE)) is SAVE and not asked
  assert answer_for_chain(RECOMPUTE, chain(SAVE, RECOMPUTE)) is SAVE
  assert asked == [SAVE]
  assert answer_for_chain(RECOMPUTE, chain(RECOMPUTE, HOST)) is HOST
  assert answer_for_chain(RECOMPUTE, chain()) is RECOMPUTE


def test_defremat_rules_that_cannot_be_used_recompute_instead():
  facts = Facts(has_fwd=True, has_fwd_bwd=False, remat_rules=True,
                remat_rules_usable=lambda: False)
  assert plan(facts, Answers(RECOMPUTE, (RECOMPUTE,))).kind is Kind.RECOMPUTE


def _facts(base=FWD_BWD, **kw):
  return dataclasses.replace(base, **kw)


# Dead-code elimination asks these two (tests/test_contract.py has the
# programs): what runs where no residual is read, and whether a call whose
# primal outputs nobody reads needs only its linear map.
UNREAD = [
    ("f traced and carried: f stands in", _facts(), Forward.F),
    ("linearized where made: f not traced", _facts(f_carried=False),
     Forward.FWD),
    ("fwd prints: jax.custom_vjp would", _facts(fwd_keeps_effects=True),
     Forward.FWD),
    ("references involved", _facts(references=True), Forward.FWD),
    ("f's output types differ from fwd's", _facts(f_matches_fwd=False),
     Forward.FWD),
    ("fwd reads saved values: its primal part, cheaper than f",
     _facts(fwd_reads_saved=True, f_carried=False), Forward.PART_OF_FWD),
    ("fwd reads saved values and prints", _facts(fwd_reads_saved=True,
                                                 fwd_keeps_effects=True),
     Forward.FWD),
]


@pytest.mark.parametrize("reads_saved, forward", [
    (False, Forward.F), (True, Forward.PART_OF_FWD)])
def test_primal_outputs_alone_come_from_f_or_the_part_of_fwd(reads_saved,
                                                             forward):
  assert primal_outputs_by(_facts(fwd_reads_saved=reads_saved)) is forward


@pytest.mark.parametrize("name, facts, forward", UNREAD,
                         ids=[r[0] for r in UNREAD])
def test_without_residuals_table(name, facts, forward):
  assert without_residuals(facts) is forward, name


RECOMPUTED = plan(FWD_BWD, Answers(RECOMPUTE, (RECOMPUTE,))).schedule
FUSED = plan(ALL_THREE, Answers(RECOMPUTE, (RECOMPUTE,))).schedule
LINEAR_ONLY = [
    ("fwd computes residuals: they must be rebuilt", _facts(), RECOMPUTED,
     False),
    ("the seed's fwd: residuals are inputs", _facts(rebuilds=False),
     RECOMPUTED, True),
    ("fwd_bwd runs on the inputs", _facts(ALL_THREE), FUSED, True),
    ("an effect would be skipped", _facts(rebuilds=False, keeps_effects=True),
     RECOMPUTED, False),
    ("references", _facts(ALL_THREE, references=True), FUSED, False),
]


@pytest.mark.parametrize("name, facts, schedule, linear", LINEAR_ONLY,
                         ids=[r[0] for r in LINEAR_ONLY])
def test_linear_part_only_table(name, facts, schedule, linear):
  assert linear_part_only(facts, schedule) is linear, name
