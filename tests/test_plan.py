"""The one decision (``smartvjp._plan``) as a table: facts and policy answers
in, plan out, nothing traced.

Rows: every row of the README's contract (``tests/test_contract.py`` runs
them) and every kind of rule of ``benchmarks/cost.py`` under the policies
that differ for it.
"""

import pytest

import dataclasses

from smartvjp._plan import (
    ASK, RECOMPUTE, REPLAYED, SAVE, Answer, Answers, Asked, Facts, Forward,
    FwdLeft, Kind, Pruned, answer_for_chain, fwd_or_f, plan, prune)

FWD_BWD = Facts(has_fwd=True, has_fwd_bwd=False)          # defvjp(fwd, bwd)
ALL_THREE = Facts(has_fwd=True, has_fwd_bwd=True)         # + fwd_bwd=
ONLY_FUSED = Facts(has_fwd=False, has_fwd_bwd=True)       # defvjp(fwd_bwd=)
INPUTS_ONLY = Facts(has_fwd=True, has_fwd_bwd=False, num_computed=0,
                    inputs_only=True)
# the seed's twin: fwd's residual is its input through checkpoint_name
TWIN = Facts(has_fwd=True, has_fwd_bwd=False, num_computed=1, inputs_only=True)
OPAQUE = Facts(has_fwd=True, has_fwd_bwd=False, num_computed=2,
               splittable=False)                          # a kernel fwd
HOST = Asked(Answer.OFFLOAD, "pinned_host")


def _split(value):
  """The policy's split as the adapter hands it over once the plan asked
  for it (``_policy.decide``): the plan is asked first with ``ASK``."""
  return value


ROWS = [
    # (name, facts, answers, expected kind, expected schedule)
    ("grad without remat", FWD_BWD, None, Kind.FWD, "fwd forward, bwd backward"),
    ("grad without remat, fwd_bwd also given", ALL_THREE, None,
     Kind.FWD, "fwd forward, bwd backward"),
    ("jax.jvp's equation, fwd computes nothing: f stands in where it is "
     "partially evaluated", INPUTS_ONLY, None,
     Kind.FWD, "f forward, bwd backward"),
    ("jax.jvp's equation, fwd computes nothing but prints", dataclasses.replace(
        INPUTS_ONLY, keeps_effects=True), None,
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
    ("checkpoint, the seed's fwd (residual is the input): bwd alone backward",
     INPUTS_ONLY, Answers(RECOMPUTE, ()), Kind.RECOMPUTE,
     "f forward, bwd backward"),
    ("checkpoint, fwd computes nothing but prints: fwd backward",
     dataclasses.replace(INPUTS_ONLY, keeps_effects=True),
     Answers(RECOMPUTE, ()), Kind.RECOMPUTE, "f forward, fwd+bwd backward"),
    ("checkpoint, the seed's twin (its input through checkpoint_name): bwd "
     "alone backward, as for the seed", TWIN, Answers(RECOMPUTE, (RECOMPUTE,)),
     Kind.RECOMPUTE, "f forward, bwd backward"),
    ("the seed's twin, its named input saved: f stands in forward", TWIN,
     Answers(RECOMPUTE, (SAVE,)), Kind.FWD, "f forward, bwd backward"),
    ("the seed's twin, its named input offloaded: fwd forward", TWIN,
     Answers(RECOMPUTE, (HOST,)), Kind.FWD, "fwd forward, bwd backward"),
    ("everything_saveable, the seed's fwd", INPUTS_ONLY,
     Answers(SAVE, ()), Kind.FWD, "f forward, bwd backward"),
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
     Facts(has_fwd=True, has_fwd_bwd=False, always_save=True, num_computed=0,
           inputs_only=True),
     Answers(RECOMPUTE, ()), Kind.FWD, "f forward, bwd backward"),
    ("defvjp + defremat, recomputed: the defremat rules",
     Facts(has_fwd=True, has_fwd_bwd=False, remat_rules=True),
     Answers(RECOMPUTE, (RECOMPUTE,), _split("split")),
     Kind.REMAT_RULES, "fwd forward, bwd backward"),
    ("defvjp + defremat, saved: the defvjp rules",
     Facts(has_fwd=True, has_fwd_bwd=False, remat_rules=True),
     Answers(SAVE, (SAVE,)), Kind.FWD, "fwd forward, bwd backward"),
    ("fwd computes nothing, but fwd has a debug print",
     Facts(has_fwd=True, has_fwd_bwd=False, num_computed=0,
           inputs_only=True, keeps_effects=True), Answers(SAVE, ()), Kind.FWD, "fwd forward, bwd backward"),
    ("a split's backward side met by a nested plain checkpoint",
     Facts(has_fwd=True, has_fwd_bwd=False, fwd_reads_saved=True),
     Answers(RECOMPUTE, (RECOMPUTE,), _split(None)),
     Kind.RECOMPUTE, "part of fwd forward, fwd+bwd backward"),
    ("the same, fwd_bwd also given (it would ignore the saved values)",
     Facts(has_fwd=True, has_fwd_bwd=True, fwd_reads_saved=True),
     Answers(RECOMPUTE, (RECOMPUTE,), _split(None)),
     Kind.RECOMPUTE, "part of fwd forward, fwd+bwd backward"),
    ("the same, every residual of it a saved value: bwd alone backward",
     Facts(has_fwd=True, has_fwd_bwd=False, fwd_reads_saved=True,
           inputs_only=True),
     Answers(RECOMPUTE, (RECOMPUTE,), _split(None)),
     Kind.RECOMPUTE, "part of fwd forward, bwd backward"),
    ("a split's backward side, everything saveable inside",
     Facts(has_fwd=True, has_fwd_bwd=False, fwd_reads_saved=True),
     Answers(SAVE, (SAVE,), _split(None)), Kind.FWD, "fwd forward, bwd backward"),
    ("fwd computes nothing, but its output type differs from f's",
     Facts(has_fwd=True, has_fwd_bwd=False, num_computed=0,
           inputs_only=True, f_matches_fwd=False), Answers(SAVE, ()), Kind.FWD, "fwd forward, bwd backward"),
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
      (OPAQUE, Answers(RECOMPUTE, (SAVE, RECOMPUTE), ASK)),
      (FWD_BWD, Answers(RECOMPUTE, (HOST,), ASK)),
      (INPUTS_ONLY, Answers(RECOMPUTE, (), ASK)),
      (_facts_of(remat_rules=True), Answers(RECOMPUTE, (RECOMPUTE,), ASK)),
      (FWD_BWD, None)]:
    assert not plan(facts, answers).asks_split, facts


@pytest.mark.parametrize("name,facts,answers,kind,schedule", [
    r for r in ROWS if r[2] is not None],
    ids=[r[0] for r in ROWS if r[2] is not None])
def test_the_split_is_asked_for_then_used(name, facts, answers, kind,
                                          schedule):
  """As ``_policy.decide`` asks: with ``ASK`` first; where the plan says
  it needs the split, again with it (the row's split): the row's plan."""
  decided = plan(facts, dataclasses.replace(answers, split=ASK))
  if decided.asks_split:
    assert decided.kind is Kind.SPLIT
    decided = plan(facts, answers)
  assert not decided.asks_split
  assert decided.kind is kind and str(decided.schedule) == schedule


def test_schedule_is_a_hashable_value_that_says_what_recomputes():
  """The schedule travels in equation params (hashed by JAX's caches)."""
  rows = {plan(facts, answers).schedule for _, facts, answers, _, _ in ROWS}
  assert len(rows) == 6   # (f, fwd, part of fwd) x (bwd, fwd+bwd, fwd_bwd)
  assert {str(s) for s in rows if s.recomputes} == {"f forward, fwd+bwd backward",
                                                    "f forward, fwd_bwd backward"}
  assert {str(s) for s in rows if s.runs_fwd_bwd} == {"f forward, fwd_bwd backward"}
  assert {s.primal_by for s in rows} == {Forward.F, Forward.PART_OF_FWD}


def test_remat3_rem_side_replays_what_was_kept():
  """Where everything is kept, remat3's rem side replays the saved values
  (the part of a fwd reading them), whatever ran forward."""
  for _, facts, answers, kind, _ in ROWS:
    p = plan(facts, answers)
    if kind in (Kind.RECOMPUTE, Kind.SPLIT):
      assert p.rem_schedule is p.schedule
    else:
      assert p.rem_schedule == REPLAYED


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
                remat_rules_usable=False)
  assert plan(facts, Answers(RECOMPUTE, (RECOMPUTE,))).kind is Kind.RECOMPUTE


def _facts_of(**kw):
  return dataclasses.replace(FWD_BWD, **kw)


def _facts(base=FWD_BWD, **kw):
  return dataclasses.replace(base, **kw)


# Dead-code elimination asks prune (tests/test_contract.py and
# tests/test_dead_code.py have the programs): what is left of a call's
# equation once the outputs nobody reads are gone. A row: the facts, the
# schedule, which outputs are read (primal, tangent), whether the equation
# carries f (a jvp) or fwd's inputs only (fwd's own equation), and what is
# left (what computes the primal outputs, whether the linear map stays).
RECOMPUTED = plan(FWD_BWD, Answers(RECOMPUTE, (RECOMPUTE,))).schedule
FUSED = plan(ALL_THREE, Answers(RECOMPUTE, (RECOMPUTE,))).schedule
SEED = plan(INPUTS_ONLY, Answers(RECOMPUTE, ())).schedule
F, FWD, PART = Forward.F, Forward.FWD, Forward.PART_OF_FWD
PRUNE = [
    # both read: the equation as it is
    ("all read", _facts(), RECOMPUTED, True, True, True, Pruned(F, True)),
    # tangents read, primal outputs not
    ("fwd computes residuals: they must be rebuilt", _facts(), RECOMPUTED,
     False, True, True, Pruned(F, True)),
    ("the seed's fwd: residuals are inputs, the linear map alone",
     _facts(INPUTS_ONLY), SEED, False, True, True,
     Pruned(None, True)),
    ("fwd_bwd runs on the inputs: the linear map alone", _facts(ALL_THREE),
     FUSED, False, True, True, Pruned(None, True)),
    ("the seed's twin (its input named): the linear map alone",
     _facts(TWIN), plan(TWIN, Answers(RECOMPUTE, (RECOMPUTE,))).schedule,
     False, True, True, Pruned(None, True)),
    ("an effect would be skipped", _facts(inputs_only=True, keeps_effects=True),
     RECOMPUTED, False, True, True, Pruned(F, True)),
    ("references", _facts(ALL_THREE, references=True), FUSED, False, True,
     True, Pruned(F, True)),
    # no tangent read, in a jvp equation
    ("tangents unused: f", _facts(), RECOMPUTED, True, False, True,
     Pruned(F, False)),
    ("tangents unused, fwd reads saved values: its primal part",
     _facts(fwd_reads_saved=True), RECOMPUTED, True, False, True,
     Pruned(PART, False)),
    ("tangents unused, fwd prints: fwd, as jax.custom_vjp would run it",
     _facts(fwd_keeps_effects=True, keeps_effects=True), RECOMPUTED, True,
     False, True, Pruned(FWD, False)),
    ("nothing read, fwd prints: fwd still", _facts(fwd_keeps_effects=True,
                                                  keeps_effects=True),
     RECOMPUTED, False, False, True, Pruned(FWD, False)),
    ("nothing read: nothing", _facts(), RECOMPUTED, False, False, True,
     Pruned(None, False)),
    ("nothing read, only fwd_bwd given and f prints: f",
     _facts(ONLY_FUSED, keeps_effects=True), FUSED, False, False, True,
     Pruned(F, False)),
    ("nothing read, only fwd_bwd given: nothing", _facts(ONLY_FUSED), FUSED,
     False, False, True, Pruned(None, False)),
    # fwd's own equation, no residual read
    ("fwd alone: f traced and carried stands in", _facts(), None, True, False,
     False, Pruned(F, False)),
    ("fwd alone, linearized where made: f not traced",
     _facts(f_traced=False), None, True, False, False, Pruned(FWD, False)),
    ("fwd alone, f closes over traced values fwd's equation lacks",
     _facts(f_closes_over=True), None, True, False, False, Pruned(FWD, False)),
    ("fwd alone, fwd prints: jax.custom_vjp would",
     _facts(fwd_keeps_effects=True), None, True, False, False,
     Pruned(FWD, False)),
    ("fwd alone, references involved", _facts(references=True), None, True,
     False, False, Pruned(FWD, False)),
    ("fwd alone, f's output types differ from fwd's",
     _facts(f_matches_fwd=False), None, True, False, False,
     Pruned(FWD, False)),
    ("fwd alone, reading saved values: its primal part, cheaper than f",
     _facts(fwd_reads_saved=True, f_traced=False), None, True, False, False,
     Pruned(PART, False)),
    ("fwd alone, reading saved values and printing",
     _facts(fwd_reads_saved=True, fwd_keeps_effects=True), None, True, False,
     False, Pruned(FWD, False)),
    ("fwd alone, not traced (eager): whole", _facts(num_computed=None), None,
     True, False, False, Pruned(FWD, False)),
    # fwd's own equation, residuals read (as remat3's and linearize's
    # forward passes leave it): its last element, what else is unread
    ("fwd's residuals and outputs all read: whole", _facts(), None, True,
     True, False, Pruned(FWD, True, FwdLeft.WHOLE)),
    ("fwd's residuals read, a primal output not: its code pruned", _facts(),
     None, True, True, False, Pruned(FWD, True, FwdLeft.CODE),
     dict(all_outputs_used=False)),
    ("the same with a residual offloaded: the residuals read only",
     _facts(), None, True, True, False, Pruned(FWD, True, FwdLeft.RESIDUALS),
     dict(all_outputs_used=False, all_tangents_used=False, offloaded=True)),
    ("some residuals unread: fwd computing only those read", _facts(), None,
     True, True, False, Pruned(FWD, True, FwdLeft.RESIDUALS),
     dict(all_tangents_used=False)),
    ("some residuals unread, fwd not traced: whole",
     _facts(num_computed=None), None, True, True, False,
     Pruned(FWD, True, FwdLeft.WHOLE), dict(all_tangents_used=False)),
]


@pytest.mark.parametrize("row", PRUNE, ids=[r[0] for r in PRUNE])
def test_prune_table(row):
  name, facts, schedule, outputs, tangents, carries_f, left = row[:7]
  more = row[7] if len(row) > 7 else {}
  assert prune(facts, schedule, outputs, tangents, carries_f,
               **more) == left, name


def test_the_plan_calls_nothing_back():
  """No thunk from the plan back into the adapters: facts and answers are
  values (the split and the defremat rules' usability are asked for in a
  second, explicit step)."""
  for cls in (Facts, Answers):
    for field in dataclasses.fields(cls):
      assert "Callable" not in str(field.type), (cls, field.name)
      assert not callable(field.default), (cls, field.name)


def test_forward_mode_runs_the_equation_whole():
  """Whatever its schedule says (here ``f`` forward, ``fwd_bwd`` backward
  under ``jax.checkpoint``), forward mode runs ``fwd`` and the linear map
  (``_plan``'s docstring)."""
  import jax
  import jax.numpy as jnp
  import numpy as np

  import kernels
  from smartvjp import smart_custom_vjp
  F, counts = kernels.counting_sin(smart_custom_vjp, with_fwd_bwd=True)
  x = jnp.linspace(0.0, 1.0, 4)
  out, tangent = jax.jvp(jax.checkpoint(F), (x,), (jnp.ones(4),))
  np.testing.assert_allclose(tangent, jnp.cos(x), rtol=1e-6)
  assert counts["fwd"] >= 1 and counts["fwd_bwd"] == 0, counts
