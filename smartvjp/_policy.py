"""What the plan is told about a call: its facts, a remat policy's answers,
and the split of a JAX-coded ``fwd`` by the policy.

The policy is asked about the call's own ``smartvjp_jvp`` equation and, for
each residual ``fwd`` computes, about the equation producing it (through
``checkpoint_name``), as if ``fwd`` were inlined. A split (JAX's partial
evaluator on ``fwd``'s jaxpr) is refused where it saves nothing computed,
an opaque kernel would run twice, or it costs more than ``f``."""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp

from smartvjp import _facade as jx
from smartvjp import _jaxprs
from smartvjp import _plan


@dataclasses.dataclass(frozen=True)
class Split:
  """``known``: ``[*fwd_consts, *primals] -> [*primal_outs, *saved]``;
  ``staged``: ``fwd`` from ``[*saved, *fwd_consts, *primals]``."""
  known: object
  staged: object
  # per saved value, the primal output it is (saved as itself), or None
  saved_outputs: tuple = ()


def split_fwd(policy, call, fwd) -> Split | None:
  if fwd is None or fwd.jaxpr is None or not fwd.num_new_res:
    return None
  jaxpr = fwd.jaxpr.jaxpr
  n_out = call.num_outs
  # as jax.checkpoint splits its body: known maps the inputs to
  # [*known_outs, *residuals], staged the residuals to the outputs
  none = [False] * len(jaxpr.invars)
  known, staged, _, _, num_res = jx.pe.partial_eval_jaxpr_custom(
      jaxpr, none, none, [False] * n_out + [True] * fwd.num_new_res, True,
      named_policy(policy))
  inputs = set(jaxpr.invars)
  staged = _reading_forwarded_inputs(staged, num_res, known, jaxpr)
  computed = [r for r in staged.invars[:num_res] if r not in inputs]
  staged, fillers = _without_saved_outputs(
      staged.replace(invars=[*computed, *jaxpr.invars]), n_out, set(computed))
  _, used = jx.pe.dce_jaxpr(staged, [True] * len(staged.outvars))
  saved = [r for r, u in zip(computed, used) if u]
  if all(_an_input(v, jaxpr) for v in saved):
    return None   # nothing fwd computes is kept: f forward is never dearer
  staged, _ = jx.pe.dce_jaxpr(
      staged.replace(invars=[*saved, *jaxpr.invars]),
      [True] * len(staged.outvars), True)
  if len(staged.eqns) == fillers:
    return None   # nothing to recompute: the residuals are simply kept
  outs = list(known.outvars[:n_out])
  saved_outputs = tuple(outs.index(v) if v in outs else None for v in saved)
  extra = [v for v, o in zip(saved, saved_outputs) if o is None]
  known, _ = jx.pe.dce_jaxpr(known.replace(outvars=[*outs, *extra]),
                             [True] * (n_out + len(extra)), True)
  if not _worth_it(known, staged, call):
    return None
  names = {v: jx.checkpoint_name_of(e.primitive, e.params)
           for e in jaxpr.eqns for v in e.outvars[:1]}   # effects: none
  known_spec = dataclasses.replace(
      fwd, jaxpr=jx.ClosedJaxpr(known, ()),
      new_res_names=tuple(names.get(v) for v in extra), new_res_eqns=(),
      split_part="saved")
  staged_spec = dataclasses.replace(
      fwd.reading_saved(jx.ClosedJaxpr(staged, ()), len(saved)),
      split_part="rest")
  return Split(known_spec, staged_spec, saved_outputs)


def _reading_forwarded_inputs(staged, num_res, known, jaxpr):
  """A residual that is an input returned through a nested ``jit`` (a
  jitted ``fwd`` or helper returning its arguments) is read as that input,
  as JAX forwards it, instead of being saved."""
  subst = {}
  for r in staged.invars[:num_res]:
    v = jx.forwarded_input(r, known)
    if v is not None and v is not r:
      subst[r] = jaxpr.invars[known.invars.index(v)]
  if not subst:
    return staged

  def read(vs):
    return [subst.get(v, v) if type(v) is jx.core.Var else v for v in vs]
  return staged.replace(
      invars=read(staged.invars),
      eqns=[e.replace(invars=read(e.invars)) for e in staged.eqns],
      outvars=read(staged.outvars))


def _an_input(v, jaxpr) -> bool:
  """``v`` is an input passed through ``jit``s unchanged: saving it keeps
  nothing ``fwd`` computed (a ``while_loop`` makes its inputs residuals)."""
  return jx.forwarded_input(v, jaxpr) is not None


def _without_saved_outputs(staged, n_out, saved):
  """A primal output the policy saves is read from the forward pass: its
  staged place gets a zero array (unused, dropped by XLA); returns
  ``(staged, fillers)``."""
  outvars, eqns = list(staged.outvars), list(staged.eqns)
  fillers = 0
  for i in range(n_out):
    if type(outvars[i]) is jx.core.Var and outvars[i] in saved:
      aval = outvars[i].aval
      zeros = jax.make_jaxpr(lambda: jnp.zeros(aval.shape, aval.dtype))()
      eqns.extend(zeros.jaxpr.eqns)
      fillers += len(zeros.jaxpr.eqns)
      outvars[i] = zeros.jaxpr.outvars[0]
  return staged.replace(eqns=eqns, outvars=outvars), fillers


def _worth_it(known, staged, call) -> bool:
  """What runs in both passes has no opaque kernel and costs no more than
  ``f`` (the recompute's alternative)."""
  produced = {v for e in known.eqns for v in e.outvars}
  twice = [e for e in staged.eqns if any(v in produced for v in e.outvars)]
  if any(_jaxprs.is_multi_output_kernel(e) for e in twice):
    return False
  return (_jaxprs.operation_count(twice)
          <= _jaxprs.operation_count(call.jaxpr.jaxpr.eqns))


# -- facts and answers --------------------------------------------------------------

def f_matches_fwd(call, fwd) -> bool:
  return fwd is None or not fwd.out_avals or all(
      jx.core.typecompat(a, b) for a, b in zip(call.out_avals, fwd.out_avals))


def passed_through(fwd):
  """The input position of each computed residual of a ``fwd`` that only
  passes inputs through (``checkpoint_name`` at most), else ``None``."""
  jaxpr = fwd.jaxpr.jaxpr
  named = {e.outvars[0]: e.invars[0] for e in jaxpr.eqns
           if jx.checkpoint_name_of(e.primitive, e.params) is not None}
  pos = {v: i for i, v in enumerate(jaxpr.invars)}
  passed = []
  for v in jaxpr.outvars[len(jaxpr.outvars) - fwd.num_new_res:]:
    while type(v) is jx.core.Var and v in named:
      v = named[v]
    if type(v) is not jx.core.Var or v not in pos:
      return None
    passed.append(pos[v])
  return passed


def facts_of(call, fwd) -> _plan.Facts:
  """Computed once and kept on ``fwd`` (on the call without one)."""
  holder = call if fwd is None else fwd
  kept = holder.__dict__.get("_facts")
  if kept is None or kept[0] is not call:
    kept = (call, facts(call, fwd))
    object.__setattr__(holder, "_facts", kept)
  return kept[1]


def facts(call, fwd) -> _plan.Facts:
  traced = fwd is not None and fwd.jaxpr is not None
  fwd_effects = traced and jx.effects_keep_alive(fwd.jaxpr.effects)
  return _plan.Facts(
      has_fwd=call.rules.fwd is not None,
      has_fwd_bwd=call.rules.fwd_bwd is not None,
      num_computed=(fwd.num_new_res if traced else
                    None if call.rules.fwd is not None else 0),
      always_save=call.rules.always_save,
      remat_rules=call.rules.remat is not None,
      splittable=(traced and call.jaxpr is not None
                  and not call.references),
      keeps_effects=fwd_effects or (call.jaxpr is not None and
                                    jx.effects_keep_alive(call.jaxpr.effects)),
      f_matches_fwd=call.jaxpr is not None and f_matches_fwd(call, fwd),
      fwd_keeps_effects=fwd_effects,
      f_traced=call.jaxpr is not None,
      f_closes_over=bool(call.num_consts),
      references=call.references,
      inputs_only=traced and passed_through(fwd) is not None,
      fwd_reads_saved=traced and fwd.reads_saved,
      fused=call.rules.fused)


def schedule_without_policy(call, fwd) -> _plan.Schedule:
  return _plan.plan(facts_of(call, fwd), None).schedule


def named_policy(policy):
  """A remat3 ``checkpoint_name`` asked about as JAX's ``name_p``."""
  def asked(prim, *avals, **params):
    name = jx.checkpoint_name_of(prim, params)
    if name is not None and prim is not jx.ad_checkpoint.name_p:
      return policy(jx.ad_checkpoint.name_p, *avals, name=name)
    return policy(prim, *avals, **params)
  return asked


def _asked(policy, prim, avals, params) -> _plan.Asked:
  answer = jx.pe.ensure_enum(policy(prim, *avals, **params))
  if jx.is_recompute(answer):
    return _plan.RECOMPUTE
  space = jx.offload_space(answer)
  if space is not None:
    return _plan.Asked(_plan.Answer.OFFLOAD, space)
  return _plan.SAVE


def answers(policy, call, fwd, jvp_prim, jvp_avals, jvp_params) -> _plan.Answers:
  """``policy`` ``None`` (remat3's plain checkpoint) or no ``fwd``:
  recompute everything; the split is asked for later (:func:`split_fwd`)."""
  if fwd is None:
    return _plan.Answers(_plan.RECOMPUTE)
  if policy is None:
    return _plan.Answers(_plan.RECOMPUTE,
                         (_plan.RECOMPUTE,) * fwd.num_new_res)
  policy = named_policy(policy)
  call_answer = _asked(policy, jvp_prim, jvp_avals, jvp_params)
  chains = fwd.new_res_eqns or ((),) * fwd.num_new_res

  def along(chain):
    for e in chain:
      yield _asked(policy, e.primitive, [v.aval for v in e.invars], e.params)
  return _plan.Answers(
      call_answer,
      tuple(_plan.answer_for_chain(call_answer, along(c)) for c in chains),
      split=_plan.ASK)


# -- deciding ---------------------------------------------------------------

def decide(call, fwd, in_nz, policy, answers):
  """The plan, asked again with the policy's split or the ``defremat``
  rules' usability where it needs them; returns ``(call, fwd, plan,
  swapped)``, ``swapped`` where the ``defremat`` rules are swapped in."""
  facts = facts_of(call, fwd)
  plan = _plan.plan(facts, answers)
  if plan.asks_split:
    answers = dataclasses.replace(answers, split=split_fwd(policy, call, fwd))
    plan = _plan.plan(facts, answers)
  if plan.kind is not _plan.Kind.REMAT_RULES:
    return call, fwd, plan, False
  other = call.remat_call()
  other_fwd, other_consts = other.fwd_for(in_nz)
  if other_consts:   # their fwd closes over traced values: not usable
    plan = _plan.plan(dataclasses.replace(facts, remat_rules_usable=False),
                      answers)
    return call, fwd, plan, False
  return other, other_fwd, _plan.plan(facts_of(other, other_fwd),
                                      answers), True


def decide_pair(call, fwd, schedule, output_read, traced_rules):
  """``schedule`` with its backward pair chosen (``_plan.backward_pair``)
  where the plan left ``f`` + ``fwd_bwd`` to be weighed; else as it is.
  ``output_read``: whether the backward region reads ``f``'s output
  (``None``: not known there). ``traced_rules()``: ``(bwd, fwd_bwd)``
  traced for the call, called only where the costs are weighed."""
  if (not schedule.asks_pair or fwd is None or fwd.jaxpr is None
      or call.jaxpr is None):
    return schedule
  facts = facts_of(call, fwd)
  costs = (None, None)
  if facts.fused is None and output_read is not False:
    costs = _pair_costs(call, fwd, facts, traced_rules)
  return _plan.backward_pair(facts, output_read, *costs)


def _pair_costs(call, fwd, facts, traced_rules):
  """``(f + fwd_bwd, fwd + bwd)`` (``f`` + ``bwd`` where ``fwd`` computes
  nothing ``f`` does not), from the traced rules; ``(None, None)`` where
  one cannot be traced (its error is raised where the rule is bound)."""
  try:
    bwd, fwd_bwd = traced_rules()
  except Exception:  # noqa: BLE001 - raised again where the rule is bound
    return None, None
  cost = _jaxprs.plan_cost
  f = cost(call.jaxpr)
  apart = _plan.unfused_schedule(facts)
  first = f if apart.backward is _plan.Backward.BWD else cost(fwd.jaxpr)
  return f + cost(fwd_bwd), first + cost(bwd)
