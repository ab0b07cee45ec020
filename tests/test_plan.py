"""The one decision (``smartvjp._plan``) as a table: facts and policy answers
in, plan out, nothing traced.

Rows: every row of the README's contract (``tests/test_contract.py`` runs
them) and every kind of rule of ``benchmarks/cost.py`` under the policies
that differ for it.
"""

import pytest

from smartvjp._plan import (
    RECOMPUTE, SAVE, Answer, Answers, Asked, Facts, Kind, answer_for_chain,
    backward_rule, plan)

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
    # (name, facts, answers, expected kind)
    ("grad without remat", FWD_BWD, None, Kind.FWD),
    ("grad without remat, fwd_bwd also given", ALL_THREE, None, Kind.FWD),
    ("grad without remat, fwd computes nothing", INPUTS_ONLY, None, Kind.FWD),
    ("eager grad: fwd not traced yet",
     Facts(has_fwd=True, has_fwd_bwd=False, num_computed=None), None,
     Kind.FWD),
    ("only fwd_bwd, no remat", ONLY_FUSED, None, Kind.RECOMPUTE),
    ("only fwd_bwd, checkpoint", ONLY_FUSED,
     Answers(RECOMPUTE, ()), Kind.RECOMPUTE),
    ("checkpoint (nothing saveable)", FWD_BWD,
     Answers(RECOMPUTE, (RECOMPUTE,)), Kind.RECOMPUTE),
    ("checkpoint, fwd_bwd also given", ALL_THREE,
     Answers(RECOMPUTE, (RECOMPUTE,)), Kind.RECOMPUTE),
    ("checkpoint, the seed's fwd (residual is the input)", INPUTS_ONLY,
     Answers(RECOMPUTE, ()), Kind.RECOMPUTE),
    ("everything_saveable, the seed's fwd", INPUTS_ONLY,
     Answers(SAVE, ()), Kind.F_FOR_FWD),
    ("everything_saveable", FWD_BWD, Answers(SAVE, (SAVE,), _split(None)),
     Kind.FWD),
    ("everything_saveable, opaque fwd", OPAQUE, Answers(SAVE, (SAVE, SAVE)),
     Kind.FWD),
    ("named residual saved by save_only_these_names, opaque fwd",
     Facts(has_fwd=True, has_fwd_bwd=False, num_computed=1, splittable=False),
     Answers(RECOMPUTE, (SAVE,)), Kind.FWD),
    ("kernel fwd, dots_saveable (its outputs are not dots)", OPAQUE,
     Answers(RECOMPUTE, (RECOMPUTE, RECOMPUTE)), Kind.RECOMPUTE),
    ("kernel fwd, one residual named and saved, the other not", OPAQUE,
     Answers(RECOMPUTE, (SAVE, RECOMPUTE)), Kind.RECOMPUTE),
    ("saveable rules, dots_saveable (y = x @ w saved): nothing to rebuild",
     FWD_BWD, Answers(RECOMPUTE, (SAVE,), _split(None)), Kind.FWD),
    ("saveable rules, dots_saveable, gelu(y) recomputed from the saved y",
     FWD_BWD, Answers(RECOMPUTE, (SAVE,), _split("split")), Kind.SPLIT),
    ("mixed rules, dots_saveable: y saved, gelu'(y) rebuilt", FWD_BWD,
     Answers(RECOMPUTE, (SAVE, RECOMPUTE), _split("split")), Kind.SPLIT),
    ("mixed rules, dots_saveable, split not worth it", FWD_BWD,
     Answers(RECOMPUTE, (SAVE, RECOMPUTE), _split(None)), Kind.RECOMPUTE),
    ("named rules, save_only_these_names(res): the rest rebuilt", FWD_BWD,
     Answers(RECOMPUTE, (RECOMPUTE, SAVE), _split("split")), Kind.SPLIT),
    ("offloaded residual: never split", FWD_BWD,
     Answers(RECOMPUTE, (HOST,), _split("split")), Kind.FWD),
    ("references among the inputs: not split",
     Facts(has_fwd=True, has_fwd_bwd=False, splittable=False),
     Answers(RECOMPUTE, (SAVE,), _split("split")), Kind.FWD),
    ("defremat rules alone: kept whatever the policy",
     Facts(has_fwd=True, has_fwd_bwd=False, always_save=True),
     Answers(RECOMPUTE, (RECOMPUTE,)), Kind.FWD),
    ("defremat rules alone, fwd computes nothing",
     Facts(has_fwd=True, has_fwd_bwd=False, always_save=True, num_computed=0),
     Answers(RECOMPUTE, ()), Kind.F_FOR_FWD),
    ("defvjp + defremat, recomputed: the defremat rules",
     Facts(has_fwd=True, has_fwd_bwd=False, remat_rules=True),
     Answers(RECOMPUTE, (RECOMPUTE,), _split("split")), Kind.REMAT_RULES),
    ("defvjp + defremat, saved: the defvjp rules",
     Facts(has_fwd=True, has_fwd_bwd=False, remat_rules=True),
     Answers(SAVE, (SAVE,)), Kind.FWD),
    ("fwd computes nothing, but fwd has a debug print",
     Facts(has_fwd=True, has_fwd_bwd=False, num_computed=0,
           keeps_effects=True), Answers(SAVE, ()), Kind.FWD),
    ("fwd computes nothing, but its output type differs from f's",
     Facts(has_fwd=True, has_fwd_bwd=False, num_computed=0,
           f_matches_fwd=False), Answers(SAVE, ()), Kind.FWD),
]


@pytest.mark.parametrize("name,facts,answers,kind", ROWS,
                         ids=[r[0] for r in ROWS])
def test_plan_table(name, facts, answers, kind):
  assert plan(facts, answers).kind is kind


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


@pytest.mark.parametrize("facts,recomputed,rule", [
    (ONLY_FUSED, False, "fwd_bwd"), (ONLY_FUSED, True, "fwd_bwd"),
    (ALL_THREE, True, "fwd_bwd"), (ALL_THREE, False, "bwd"),
    (FWD_BWD, True, "bwd"), (FWD_BWD, False, "bwd")])
def test_backward_rule(facts, recomputed, rule):
  assert backward_rule(facts, recomputed) == rule


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
