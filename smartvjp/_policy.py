"""What the decision (``_plan.py``) is told about a call: its facts, a remat
policy's answers, and the split of a JAX-coded ``fwd`` by the policy.

Facts (:func:`facts`) come from the traced rules: effects, references, types.
Answers (:func:`answers`): the policy is asked about the call's own
``smartvjp_jvp`` equation (so ``everything_saveable`` saves it and
``nothing_saveable`` recomputes it) and, for each residual ``fwd`` computes,
about the equation of ``fwd``'s jaxpr producing it, through
``checkpoint_name`` (so ``save_only_these_names`` works; under
``jax_remat3`` the high-level name primitive is asked about as JAX's
``name_p``), as it would be asked inside ``fwd`` inlined: a ``dot_general``
output is saveable under ``dots_saveable``, a kernel's output is not.

Splitting (:func:`split_fwd`). When ``fwd`` is JAX code, a remat policy can save some of the values it
computes and not others, exactly as ``jax.checkpoint`` would if ``fwd`` were
inlined into its body. :func:`plan_split` asks JAX's own partial evaluator
to split ``fwd``'s jaxpr that way and decides whether the split is worth it:

* the forward pass runs the part of ``fwd`` that produces the primal outputs
  and the saved values (``known``);
* the backward region rebuilds ``fwd``'s residuals (and the primal outputs,
  which then follow the policy like any other value) from the saved values
  and the call's inputs (``staged``), and runs ``bwd`` on them.

The split is refused (and the whole call recomputed: ``f`` forward, ``fwd``
or ``fwd_bwd`` backward) when it saves nothing that ``fwd`` computes, when an
opaque kernel would run in both passes (saving only some outputs of a kernel
still needs the kernel again), or when what runs in both passes is estimated
to cost more than ``f``, which the whole recomputation runs instead.
"""

from __future__ import annotations

import dataclasses
import math

import jax
import jax.numpy as jnp

from smartvjp import _facade as jx
from smartvjp import _plan


@dataclasses.dataclass(frozen=True)
class Split:
  """``known``: a spec for ``smartvjp_fwd``, ``[*fwd_consts, *primals] ->
  [*primal_outs, *saved]``; ``staged``: a spec for ``smartvjp_jvp`` whose
  ``fwd`` is ``[*saved, *fwd_consts, *primals] -> [*primal_outs, *new_res]``
  (the saved values are its leading constants)."""
  known: object
  staged: object
  # per saved value, the primal output it is (saved as itself), or None
  saved_outputs: tuple = ()


def split_fwd(saveable, call, fwd) -> Split | None:
  """The split of ``fwd`` by ``saveable``, or ``None`` to recompute whole."""
  if fwd is None or fwd.jaxpr is None or not fwd.num_new_res:
    return None
  jaxpr = fwd.jaxpr.jaxpr
  n_out = call.num_outs
  # as jax.checkpoint splits its body: known maps the inputs to
  # [*known_outs, *residuals], staged the residuals to the outputs
  none = [False] * len(jaxpr.invars)
  known, staged, _, _, num_res = jx.pe.partial_eval_jaxpr_custom(
      jaxpr, none, none, [False] * n_out + [True] * fwd.num_new_res, True,
      saveable)
  inputs = set(jaxpr.invars)
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
  names = {e.outvars[0]: jx.checkpoint_name_of(e.primitive, e.params)
           for e in jaxpr.eqns}
  known_spec = dataclasses.replace(
      fwd, jaxpr=jx.ClosedJaxpr(known, ()),
      new_res_names=tuple(names.get(v) for v in extra), new_res_eqns=(),
      split_part="saved")
  staged_spec = dataclasses.replace(
      fwd.reading_saved(jx.ClosedJaxpr(staged, ()), len(saved)),
      split_part="rest")
  return Split(known_spec, staged_spec, saved_outputs)


def _an_input(v, jaxpr) -> bool:
  """``v`` is one of ``jaxpr``'s inputs passed through ``jit``s that return
  it unchanged (``jnp.atleast_2d`` of a matrix): JAX's partial evaluator
  keeps such a value as a residual when a ``while_loop`` reads it (a loop's
  inputs are residuals whatever the policy), but saving it keeps nothing
  ``fwd`` computed."""
  producers = {o: e for e in jaxpr.eqns for o in e.outvars}
  inputs = set(jaxpr.invars)
  while v not in inputs:
    eqn = producers.get(v)
    if eqn is None or eqn.primitive.name not in ("jit", "pjit"):
      return False
    inner = eqn.params["jaxpr"].jaxpr
    out = inner.outvars[eqn.outvars.index(v)]
    if type(out) is not jx.core.Var or out not in inner.invars:
      return False
    v = eqn.invars[inner.invars.index(out)]
  return True


def _without_saved_outputs(staged, n_out, saved):
  """``(staged, fillers)``: a primal output that the policy saves is read
  from the forward pass,
  not from the backward region: its place among the staged outputs gets a
  zero array (unused, so XLA drops it) instead of the saved value, so that
  the backward region does not keep it alive for nothing."""
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
  """True when what runs in both passes has no opaque kernel and costs no
  more than ``f`` (the alternative runs ``f`` forward and all of ``fwd``
  backward, so the split costs ``fwd + twice``, recomputation ``fwd + f``)."""
  produced = {v for e in known.eqns for v in e.outvars}
  twice = [e for e in staged.eqns if any(v in produced for v in e.outvars)]
  if any(is_opaque(e) for e in twice):
    return False
  return cost(twice) <= cost(call.jaxpr.jaxpr.eqns)


def _sub_jaxprs(eqn):
  for v in eqn.params.values():
    for x in (v if isinstance(v, (tuple, list)) else (v,)):
      if isinstance(x, jx.ClosedJaxpr):
        yield x.jaxpr
      elif hasattr(x, "eqns") and hasattr(x, "outvars"):
        yield x


def is_opaque(eqn) -> bool:
  """One equation producing several values that JAX cannot look into (a
  ``pallas_call``, a custom call, a callback): part of its outputs costs the
  whole kernel."""
  return (eqn.primitive.multiple_results and len(eqn.outvars) > 1
          and not any(True for _ in _sub_jaxprs(eqn)))


def _size(aval) -> int:
  return math.prod(getattr(aval, "shape", ()))


def cost(eqns) -> float:
  """A rough operation count: matrix products by their multiply-adds, loops
  by their trip count, other operations by their output size, an opaque
  kernel as unbounded."""
  total = 0.0
  for e in eqns:
    subs = list(_sub_jaxprs(e))
    if subs:
      inner = max(cost(j.eqns) for j in subs)
      total += inner * e.params.get("length", 1)
    elif is_opaque(e):
      return math.inf
    elif jx.checkpoint_name_of(e.primitive, e.params) is not None:
      continue   # checkpoint_name: an identity
    elif e.primitive.name == "dot_general":
      (lhs_contract, _), _ = e.params["dimension_numbers"]
      k = math.prod(e.invars[0].aval.shape[d] for d in lhs_contract)
      total += 2.0 * _size(e.outvars[0].aval) * k
    else:
      total += sum(_size(v.aval) for v in e.outvars)
  return total


# -- facts and answers --------------------------------------------------------------

def uses_references(call) -> bool:
  """References are involved: an input, or an effect on one, whose position
  follows ``f``'s own inputs (so the call is kept whole wherever it goes)."""
  return ((call.jaxpr is not None and any(
      isinstance(e, jx.effects.JaxprInputEffect) for e in call.jaxpr.effects))
          or any(isinstance(a, jx.state_types.AbstractRef)
                 for a in call.in_avals))


def has_effects(call, fwd) -> bool:
  """``f`` or ``fwd`` (traced) has effects that JAX would not remove (a
  debug print, a reference written)."""
  return ((call.jaxpr is not None and jx.effects_keep_alive(call.jaxpr.effects))
          or (fwd is not None and fwd.jaxpr is not None
              and jx.effects_keep_alive(fwd.jaxpr.effects)))


def f_matches_fwd(call, fwd) -> bool:
  """``f``'s primal outputs have ``fwd``'s full types."""
  return fwd is None or not fwd.out_avals or all(
      jx.core.typecompat(a, b) for a, b in zip(call.out_avals, fwd.out_avals))


def passed_through(fwd):
  """For a ``fwd`` each of whose computed residuals is one of its inputs
  (through ``checkpoint_name`` at most: the backward side of a split whose
  residuals were all saved), the input position of each; else ``None``."""
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
  """The facts of a call whose ``fwd`` is ``fwd`` (``None`` without one),
  computed once and kept on ``fwd`` (on the call without one)."""
  holder = call if fwd is None else fwd
  kept = holder.__dict__.get("_facts")
  if kept is None or kept[0] is not call:
    kept = (call, facts(call, fwd))
    object.__setattr__(holder, "_facts", kept)
  return kept[1]


def facts(call, fwd) -> _plan.Facts:
  """The facts of a call whose ``fwd`` is ``fwd`` (``None`` without one);
  :func:`facts_of` keeps them."""
  traced = fwd is not None and fwd.jaxpr is not None
  return _plan.Facts(
      has_fwd=call.rules.fwd is not None,
      has_fwd_bwd=call.rules.fwd_bwd is not None,
      num_computed=(fwd.num_new_res if traced else
                    None if call.rules.fwd is not None else 0),
      always_save=call.rules.always_save,
      remat_rules=call.rules.remat is not None,
      splittable=(traced and call.jaxpr is not None
                  and not uses_references(call)),
      keeps_effects=has_effects(call, fwd),
      f_matches_fwd=call.jaxpr is not None and f_matches_fwd(call, fwd),
      fwd_keeps_effects=traced and jx.effects_keep_alive(fwd.jaxpr.effects),
      f_traced=call.jaxpr is not None,
      f_closes_over=bool(call.num_consts),
      references=uses_references(call),
      rebuilds=not traced or passed_through(fwd) is None,
      fwd_reads_saved=traced and fwd.reads_saved)


def schedule_without_policy(call, fwd) -> _plan.Schedule:
  """The schedule of a call no remat policy has been asked about yet (a
  ``smartvjp_jvp`` as ``jax.jvp`` or ``jax.checkpoint``'s JVP binds it):
  ``fwd`` then ``bwd``, or ``f`` then ``fwd_bwd`` where it is the only
  rule."""
  return _plan.plan(facts_of(call, fwd), None).schedule


def named_policy(policy):
  """``policy`` asked about a remat3 ``checkpoint_name`` (a high-level
  primitive) as about JAX's ``name_p`` equation, as the default path asks."""
  def asked(prim, *avals, **params):
    name = jx.checkpoint_name_of(prim, params)
    if name is not None and prim is not jx.ad_checkpoint.name_p:
      return policy(jx.ad_checkpoint.name_p, *avals, name=name)
    return policy(prim, *avals, **params)
  return asked


def _asked(policy, prim, avals, params) -> _plan.Asked:
  answer = jx.pe.ensure_enum(policy(prim, *avals, **params))
  if isinstance(answer, type(jx.pe.Recompute)):
    return _plan.RECOMPUTE
  if isinstance(answer, jx.pe.Offloadable):
    return _plan.Asked(_plan.Answer.OFFLOAD,
                       jx.core.mem_kind_to_space(answer.dst))
  return _plan.SAVE


def answers(policy, call, fwd, jvp_prim, jvp_avals, jvp_params) -> _plan.Answers:
  """The policy's answers for a call: asked about its ``smartvjp_jvp``
  equation (``jvp_prim`` over ``jvp_avals`` with ``jvp_params``), then for
  each residual ``fwd`` computes about its producers (see the module); the
  split is left to :func:`split`, where the plan asks for it. ``policy``
  ``None`` (a plain ``jax.checkpoint`` under remat3) recomputes
  everything; so does a call without ``fwd`` (only ``fwd_bwd`` given)."""
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


def split(policy, call, fwd) -> Split | None:
  """The split of ``fwd`` by ``policy`` (asked as :func:`answers` asks it)
  when one is worth doing."""
  return split_fwd(named_policy(policy), call, fwd)


def producers(v, producers_of) -> tuple:
  """The equations a policy is asked about for the value ``v`` of a traced
  ``fwd``: its producer and, through ``checkpoint_name`` equations, the
  named value's producer (``producers_of`` maps a variable to the equation
  producing it)."""
  chain = []
  while type(v) is jx.core.Var and v in producers_of:
    eqn = producers_of[v]
    chain.append(eqn)
    if jx.checkpoint_name_of(eqn.primitive, eqn.params) is None:
      break
    v = eqn.invars[0]
  return tuple(chain)
