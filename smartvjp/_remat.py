"""Remat: partial evaluation (``jax.checkpoint``'s policy-driven one and the
trace-time one of its backward region), JAX's remat3 rules, and dead-code
elimination.

Partial evaluation, not dead-code elimination, decides where the user's
rules run (jax-ml/jax#21303's "avoid making the mess in the first place").
Both remat paths share one step (:func:`_place`): ask the policy and the
plan, emit what the forward pass runs, and say what the backward side
starts from: the whole call again (recompute), the rest of a split ``fwd``
from the saved values, or the kept residuals. The policy-driven partial
evaluation stages that backward side as an equation, remat3 as a
``smartvjp_rem``.

Dead-code elimination prunes what nobody reads, never putting back a rule
the plan removed (what is left is ``_plan.prune``'s answer). Effects
``jax.custom_vjp`` would run (a ``jax.debug.print`` in a rule) run here too,
as JAX keeps any equation with effects.
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp

from smartvjp import _execute as ex
from smartvjp import _facade as jx
from smartvjp import _plan
from smartvjp import _policy
from smartvjp._checks import check_fwd_output_types
from smartvjp._primitive import (
    call_p, dce_whole, jvp_p, lin_p, register, rem_p, replace_rule, rule_p)
from smartvjp._spec import pruned


class Eqn:
  """Emits the one equation replacing ``like`` (read it as ``.eqn``);
  ``first``: variables for the leading outputs."""

  def __init__(self, like):
    self.like = like
    self.eqn = None

  def __call__(self, prim, ins, params, first=None):
    if self.eqn is not None:
      raise RuntimeError("smartvjp internal error: a second equation "
                         "emitted in place of one")
    avals, effects = prim.abstract_eval(*[v.aval for v in ins], **params)
    first = list(first or [])
    outvars = [*first, *map(jx.core.Var, avals[len(first):])]
    effects = jx.resolve_effects(effects, ins)
    self.eqn = jx.pe.new_jaxpr_eqn(
        list(ins), outvars, prim, params, effects, self.like.source_info,
        self.like.ctx)
    return outvars


@dataclasses.dataclass
class _Placed:
  call: object
  fwd: object
  plan: _plan.Plan
  fwd_consts: list
  outs: list
  saved: list        # what the backward side reads from the forward pass
  back: object       # the backward side's fwd (where the jvp is staged again)
  kept: bool         # the residuals kept: the linear map is what is staged


def _place(emit, policy, call, fwd, in_nz, f_consts, fwd_consts, primals,
           avals, params, first=None) -> _Placed:
  answers = _policy.answers(policy, call, fwd, jvp_p, avals, params)
  call, fwd, plan, swapped = _policy.decide(call, fwd, in_nz, policy,
                                             answers)
  if swapped:   # the defremat rules: their fwd closes over nothing
    fwd_consts = []
  outs, kept = ex.forward(emit, call, fwd, plan, f_consts, fwd_consts,
                          primals, first)
  if plan.kind is _plan.Kind.RECOMPUTE:
    return _Placed(call, fwd, plan, fwd_consts, outs, [], fwd, False)
  if plan.kind is _plan.Kind.SPLIT:
    it = iter(kept)
    saved = [next(it) if o is None else outs[o]
             for o in plan.split.saved_outputs]
    return _Placed(call, fwd, plan, fwd_consts, outs, saved,
                   plan.split.staged, False)
  return _Placed(call, fwd, plan, fwd_consts, outs, kept, None, True)


# -- the backward region's pair: f + fwd_bwd or fwd + bwd ----------------------------

def backward_pair(call, fwd, in_nz, schedule, output_read):
  """``schedule`` with its backward pair chosen (:func:`_policy.decide_pair`),
  weighing the rules as traced for ``in_nz``."""
  if not schedule.asks_pair:   # nothing to weigh
    return schedule
  return _policy.decide_pair(
      call, fwd, schedule, output_read,
      functools.partial(ex.traced_backward_rules, call, fwd, in_nz))


# -- smartvjp_jvp: policy-driven partial evaluation (jax.checkpoint) ------------------

def _residuals(eqn, inst_in, staged, new_vars=()):
  out, seen = list(new_vars), set(new_vars)
  reads = {v for v in staged.invars if type(v) is jx.core.Var}
  for v, inst in zip(eqn.invars, inst_in):
    if type(v) is jx.core.Var and not inst and v in reads and v not in seen:
      out.append(v)
      seen.add(v)
  return out


def _jvp_partial_eval_custom(saveable, unks_in, inst_in, eqn):
  call, fwd, in_nz = (eqn.params[k] for k in ("call", "fwd", "in_nz"))
  n_known = len(eqn.invars) - sum(in_nz)
  n_all, n_out = len(eqn.outvars), call.num_outs
  if not any(unks_in):   # tangents known too (a custom_jvp's zero tangent)
    return eqn, None, [False] * n_all, [False] * n_all, []
  if any(unks_in[:n_known]):   # primals unknown: all of it is staged
    return (None, eqn, [True] * n_all, [True] * n_all,
            _residuals(eqn, inst_in, eqn))
  f_consts, fwd_consts, primals, tangents = call.split_jvp_args(eqn.invars,
                                                                fwd)
  emit = Eqn(eqn)
  p = _place(emit, saveable, call, fwd, in_nz, f_consts, fwd_consts, primals,
             [v.aval for v in eqn.invars], eqn.params,
             first=eqn.outvars[:n_out])
  known = emit.eqn
  unks_out = [False] * n_out + [True] * (n_all - n_out)
  if p.kept:   # the linear map staged
    ins, params = ex.linear(p.call, p.fwd, p.plan, in_nz,
                            [*p.fwd_consts, *primals], primals, p.saved)
    staged = jx.pe.new_jaxpr_eqn([*ins, *tangents], eqn.outvars[n_out:],
                                 lin_p, params, set(), eqn.source_info,
                                 eqn.ctx)
    inst_out = [False] * n_out + [True] * (n_all - n_out)
  else:   # the jvp again, its fwd the whole one or the rest of a split
    ins = [*f_consts, *p.saved, *p.fwd_consts, *primals, *tangents]
    params = dict(eqn.params, call=p.call, fwd=p.back,
                  schedule=p.plan.schedule)
    if p.plan.split is None:   # recomputed: the same equation, decided
      staged = eqn.replace(invars=ins, params=params)
      read = ()
    else:   # a primal output the policy saves is read from the forward pass
      read = {o for o in p.plan.split.saved_outputs if o is not None}
      emit = Eqn(eqn)
      emit(jvp_p, ins, params, first=[jx.core.Var(v.aval) if i in read else v
                                      for i, v in enumerate(eqn.outvars)])
      staged = emit.eqn
    inst_out = [i not in read for i in range(n_all)]
  return (known, staged, unks_out, inst_out,
          _residuals(eqn, inst_in, staged, p.saved))


register(jvp_p, "partial_eval_custom", _jvp_partial_eval_custom)


# -- smartvjp_jvp: trace-time partial evaluation (the rematerialized region) --------

def _jvp_partial_eval(trace, *tracers, call, fwd, in_nz, schedule):
  params = dict(call=call, fwd=fwd, in_nz=in_nz, schedule=schedule)
  n_known = len(tracers) - sum(in_nz)
  known_tracers, tangent_tracers = tracers[:n_known], tracers[n_known:]
  if (not all(t.is_known() for t in known_tracers)
      or all(t.is_known() for t in tangent_tracers)):
    return trace.default_process_primitive(jvp_p, tracers, params)
  vals = [t.pval.get_known() for t in known_tracers]
  f_consts, fwd_consts, primals, _ = call.split_jvp_args(vals, fwd)
  # where no dead-code elimination weighed the pair first, as if f's
  # output were read
  schedule = backward_pair(call, fwd, in_nz, schedule, None)
  with jx.core.set_current_trace(getattr(trace, "parent_trace", None)):
    outs, lin_ins, lin_params = ex.backward_region(
        call, fwd, schedule, in_nz, f_consts, fwd_consts, primals)
  staged_in = [*(trace.new_instantiated_const(x) for x in lin_ins),
               *tangent_tracers]
  return [*outs,
          *trace.default_process_primitive(lin_p, staged_in, lin_params)]


register(jvp_p, "partial_eval", _jvp_partial_eval)


# -- smartvjp_call, smartvjp_rem: remat3 (jax_remat3 + jax_custom_vjp3) -------------

def _full_remat(prim, in_vals, params):
  outs = prim.bind(*in_vals, **params)
  return outs, (), lambda _res, *rem_in: prim.bind(*rem_in, **params)


def _handled(ctx, call) -> bool:
  return (ctx.custom_vjp_rules and call.eager is None
          and call.jaxpr is not None and call.rules.fwd is not None
          and not call.references)


def _fused_only(ctx, call) -> bool:
  """Only ``fwd_bwd`` given: JAX's remat3 runs ``fwd`` (here ``f`` saving
  its inputs) as code in the forward pass, so an outer derivative of the
  primal output is ``f``'s, not the custom rule's (issue 70)."""
  return (ctx.custom_vjp_rules and call.eager is None
          and call.jaxpr is not None and call.rules.fwd is None
          and not call.references)


def _call_remat3(ctx, *in_vals, call):
  in_nz = call.perturbed((True,) * call.num_primals)
  if _fused_only(ctx, call) and any(in_nz):
    f_consts, primals = call.split_call_args(in_vals)
    outs = ex.primal(ex.Bind(), call, None, f_consts, [], primals,
                     _plan.Forward.F)
    return (list(outs), (),
            lambda _res, *rem_in: call_p.bind(*rem_in, call=call))
  if not _handled(ctx, call) or not any(in_nz):
    return _full_remat(call_p, in_vals, dict(call=call))
  fwd, fwd_consts = call.fwd_for(in_nz)
  check_fwd_output_types(call, fwd)   # f and fwd may both run
  f_consts, primals = call.split_call_args(in_vals)
  avals = [jx.core.typeof(x) for x in (*f_consts, *fwd_consts, *primals)]
  avals += [a.to_tangent_aval() for a, nz in zip(call.in_avals, in_nz) if nz]
  p = _place(ex.Bind(), ctx.policy, call, fwd, in_nz, f_consts, fwd_consts,
             primals, avals, dict(
                 call=call, fwd=fwd, in_nz=in_nz,
                 schedule=_policy.schedule_without_policy(call, fwd)))
  # the rem side's region is differentiated later: whether it reads f's
  # output is not known here, so the pair is chosen as if it does
  back, spaces = p.back, ()
  schedule = backward_pair(p.call, p.fwd, in_nz, p.plan.schedule, None)
  outs, saved = list(p.outs), [_rounded(x) for x in p.saved]
  if p.plan.kind is _plan.Kind.SPLIT:
    back = _rebuilding(p.plan.split)
    for x, o in zip(saved, p.plan.split.saved_outputs):
      if o is not None:
        outs[o] = x
  elif p.kept:   # the rem side hands the kept outputs to bwd
    back = ex.passthrough(p.call, p.fwd, [jx.core.typeof(x) for x in p.outs])
    outs = [_rounded(x) for x in outs]
    saved, schedule = [*outs, *saved], p.plan.rem_schedule
    spaces = (None,) * p.call.num_outs + (p.plan.spaces or ())

  def rem(res, *rem_in):
    res = [r if s is None else jax.device_put(r, jx.core.mem_kind_to_space("device"))
           for r, s in zip(res, (*spaces, *[None] * len(res)))]
    f_consts, rest = call.split_call_args(rem_in)
    return rem_p.bind(*f_consts, *res, *rest, call=p.call, fwd=back,
                      schedule=schedule)
  return outs, [*saved, *p.fwd_consts], rem


def _rounded(x):
  """A saved value at its dtype's precision, read so by the forward pass
  too, as JAX's remat3 saves a value: XLA may keep a low-precision value
  in more bits where it is not stored, and the backward pass would then
  see another value than the forward output (issue 56)."""
  t = jx.core.typeof(x)
  # only a type narrower than f32 is computed in more bits than it has
  # (XLA's float normalization); rounding a wider one is no change, though
  # XLA's cost analysis would count it as work
  if (type(t) is not jx.core.ShapedArray
      or not jnp.issubdtype(t.dtype, jnp.floating) or t.dtype.itemsize >= 4):
    return x
  info = jnp.finfo(t.dtype)
  return jax.lax.reduce_precision(x, exponent_bits=info.nexp,
                                  mantissa_bits=info.nmant)


def _rebuilding(split):
  staged = split.staged
  jaxpr = staged.jaxpr.jaxpr
  outvars = list(jaxpr.outvars)
  for i, o in enumerate(split.saved_outputs):
    if o is not None:
      outvars[o] = jaxpr.invars[i]
  jaxpr, _ = jx.pe.dce_jaxpr(jaxpr.replace(outvars=outvars),
                             [True] * len(outvars), True)
  return dataclasses.replace(staged, jaxpr=jx.ClosedJaxpr(jaxpr, ()))


register(call_p, "remat3", _call_remat3)


def _rem_remat3(ctx, *in_vals, call, fwd, schedule):
  """Rematerialized again (a checkpoint inside a checkpointed scan): ``f``
  forward where ``fwd`` was to run backward; else the saved values
  replayed."""
  params = dict(call=call, fwd=fwd, schedule=schedule)
  if schedule.forward is not _plan.Forward.F or not ctx.custom_vjp_rules:
    return _full_remat(rem_p, in_vals, params)
  f_consts, fwd_consts, primals, _ = call.split_jvp_args(in_vals, fwd)
  outs = ex.primal(ex.Bind(), call, fwd, f_consts, fwd_consts, primals,
                   schedule.forward)
  return list(outs), (), lambda _res, *rem_in: rem_p.bind(*rem_in, **params)


register(rem_p, "remat3", _rem_remat3)


# -- dead-code elimination ------------------------------------------------------------

def _jvp_dce(used_outputs, eqn):
  call, fwd, in_nz, schedule = (eqn.params[k]
                                for k in ("call", "fwd", "in_nz", "schedule"))
  n = call.num_outs
  if any(used_outputs[n:]):   # the backward region: is f's output read?
    chosen = backward_pair(call, fwd, in_nz, schedule, any(used_outputs[:n]))
    if chosen != schedule:
      schedule = chosen
      eqn = eqn.replace(params=dict(eqn.params, schedule=schedule))
  left = _plan.prune(_policy.facts_of(call, fwd), schedule,
                     any(used_outputs[:n]), any(used_outputs[n:]))
  if left.linear and left.primal is not None:
    return [True] * len(eqn.invars), eqn
  f_consts, fwd_consts, primals, tangents = call.split_jvp_args(eqn.invars,
                                                                fwd)
  emit = Eqn(eqn)
  if left.linear:   # the linear map alone, on inputs of the call
    if schedule.runs_fwd_bwd:
      ins, params = primals, ex.lin_params(call, None, in_nz)
    else:
      fwd_inputs = [*fwd_consts, *primals]
      ins = fwd.assemble_residuals(fwd_inputs,
                                   ex.passed_inputs(fwd, fwd_inputs))
      params = ex.lin_params(call, fwd, in_nz)
    emit(lin_p, [*ins, *tangents], params, first=eqn.outvars[n:])
  elif left.primal is None:
    return [False] * len(eqn.invars), None
  elif left.primal is _plan.Forward.FWD:   # fwd without its residuals
    emit(rule_p, [*fwd_consts, *primals], ex.fwd_params(call, fwd),
         first=[*eqn.outvars[:n], *(jx.core.DropVar(a)
                                    for a in fwd.jaxpr.out_avals[n:])])
  else:
    ex.primal(emit, call, fwd, f_consts, fwd_consts, primals, left.primal,
              first=eqn.outvars[:n])
  return _reads(eqn, emit.eqn), emit.eqn


def _reads(eqn, new_eqn):
  read = {id(v) for v in new_eqn.invars}
  return [id(v) in read for v in eqn.invars]


replace_rule(jvp_p, "dce", _jvp_dce)


def _call_dce(used_outputs, eqn):
  """Per output, as JAX prunes ``jax.custom_vjp``'s ``f``."""
  if all(used_outputs) or not any(used_outputs):
    return dce_whole(used_outputs, eqn)
  kept = tuple(i for i, u in enumerate(used_outputs) if u)
  new_eqn = eqn.replace(
      outvars=[eqn.outvars[i] for i in kept],
      params=dict(eqn.params, call=pruned(eqn.params["call"], kept)))
  return [True] * len(eqn.invars), new_eqn


replace_rule(call_p, "dce", _call_dce)


def _fwd_dce(used_outputs, eqn):
  call, fwd, offload = (eqn.params[k] for k in ("call", "fwd", "offload"))
  n = call.num_outs
  kept = used_outputs[n:]
  left = _plan.prune(_policy.facts_of(call, fwd), None,
                     any(used_outputs[:n]), any(kept), carries_f=False,
                     all_outputs_used=all(used_outputs[:n]),
                     all_tangents_used=all(kept),
                     offloaded=offload is not None)
  if left.fwd is _plan.FwdLeft.CODE:
    # a solver's unused state is not computed
    return _traced_dce(used_outputs, eqn.replace(params=dict(
        call=call, which="fwd", jaxpr=fwd.jaxpr, part=eqn.params["part"])))
  if left.fwd is _plan.FwdLeft.RESIDUALS:
    if offload is not None:
      offload = tuple(o for o, k in zip(offload, kept) if k)
    emit = Eqn(eqn)
    emit(rule_p, eqn.invars, ex.fwd_params(call, fwd.computing_only(kept),
                                           offload),
         first=[*eqn.outvars[:n], *(v for v, k in zip(eqn.outvars[n:], kept)
                                    if k)])
    return [True] * len(eqn.invars), emit.eqn
  if left.primal in (None, _plan.Forward.FWD):
    return dce_whole(used_outputs, eqn)
  fwd_consts, primals = eqn.invars[:fwd.num_consts], eqn.invars[fwd.num_consts:]
  emit = Eqn(eqn)
  ex.primal(emit, call, fwd, [], fwd_consts, primals, left.primal,
            first=eqn.outvars[:n])
  return _reads(eqn, emit.eqn), emit.eqn


def _traced_dce(used_outputs, eqn):
  """A traced rule loses its unread inputs (a residual ``bwd`` ignores) and
  unused outputs, as the inlined rules of a ``jax.custom_vjp`` do."""
  jaxpr = eqn.params["jaxpr"]
  if not any(used_outputs) and not jx.effects_keep_alive(eqn.effects):
    return [False] * len(eqn.invars), None
  pruned_jaxpr, used_inputs = jx.pe.dce_jaxpr(jaxpr.jaxpr, list(used_outputs))
  if all(used_inputs) and all(used_outputs):
    return used_inputs, eqn
  emit = Eqn(eqn)
  emit(rule_p, [v for v, u in zip(eqn.invars, used_inputs) if u],
       dict(eqn.params, jaxpr=jx.ClosedJaxpr(pruned_jaxpr, ())),
       first=[v for v, u in zip(eqn.outvars, used_outputs) if u])
  return used_inputs, emit.eqn


def _rule_dce(used_outputs, eqn):
  which, params = eqn.params["which"], eqn.params
  if which == "fwd" and params.get("jaxpr") is None:
    return _fwd_dce(used_outputs, eqn)
  if which in ("bwd", "fwd_bwd", "fwd"):   # a traced rule
    return _traced_dce(used_outputs, eqn)
  return dce_whole(used_outputs, eqn)


replace_rule(rule_p, "dce", _rule_dce)
