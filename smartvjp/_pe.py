"""Partial evaluation and dead-code elimination rules.

Partial evaluation, not dead-code elimination, decides where the user's
rules run (jax-ml/jax#21303's "avoid making the mess in the first place"):

* policy-driven (``jax.checkpoint``'s ``partial_eval_jaxpr_custom``):
  ``smartvjp_jvp`` is split into the forward pass (known) and the
  rematerialized backward region (staged) as the plan says, carried out by
  ``_execute``: ``f`` forward and the whole jvp staged (its schedule
  recomputes), ``fwd`` forward and the linear map staged, or part of a
  JAX-coded ``fwd`` forward and the rest rebuilt in a staged jvp;
* trace-time (a ``JaxprTrace``: the backward pass of ``jax.checkpoint``, and
  linearize without direct linearize): what the equation's ``schedule``
  says the backward side starts with runs now, the linear map is staged.

Dead-code elimination prunes what nobody reads, never putting back a rule
the plan removed: a call some of whose outputs are unused computes only the
others; a ``fwd`` some of whose residuals ``bwd`` does not read computes only
the others; a traced backward rule loses its unread inputs. Effects
``jax.custom_vjp`` would run (a ``jax.debug.print`` in a rule) run here
too, as JAX keeps any equation with effects.
"""

from __future__ import annotations

from smartvjp import _execute as ex
from smartvjp import _facade as jx
from smartvjp import _plan
from smartvjp import _policy
from smartvjp._primitive import (
    call_p, dce_whole, jvp_p, lin_p, register, replace_rule, rule_p)
from smartvjp._spec import pruned


# -- smartvjp_jvp: policy-driven partial evaluation (jax.checkpoint) ------------------

def _residuals(eqn, inst_in, staged, new_vars=()):
  """What the staged side needs from the known side: ``new_vars`` (outputs
  of the known equation), then each input of ``eqn`` that the staged
  equation reads and that is not already instantiated there, once."""
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
  n_all = len(eqn.outvars)
  if not any(unks_in):   # tangents known too (a custom_jvp's zero tangent)
    return eqn, None, [False] * n_all, [False] * n_all, []
  if any(unks_in[:n_known]):   # primals unknown: all of it is staged
    return (None, eqn, [True] * n_all, [True] * n_all,
            _residuals(eqn, inst_in, eqn))
  answers = _policy.answers(saveable, call, fwd, jvp_p,
                            [v.aval for v in eqn.invars], eqn.params)
  new_call, new_fwd, plan, swapped = ex.decide(call, fwd, in_nz, saveable,
                                               answers)
  if swapped:   # the defremat rules: their fwd closes over nothing
    n1, n2 = call.num_consts, call.num_consts + fwd.num_consts
    eqn = eqn.replace(invars=[*eqn.invars[:n1], *eqn.invars[n2:]],
                      params=dict(eqn.params, call=new_call, fwd=new_fwd))
    inst_in = [*inst_in[:n1], *inst_in[n2:]]
  call, fwd = new_call, new_fwd
  f_consts, fwd_consts, primals, tangents = call.split_jvp_args(eqn.invars,
                                                                fwd)
  n_out = call.num_outs
  emit = ex.Eqns(eqn)
  _, kept = ex.forward(emit, call, fwd, plan, f_consts, fwd_consts, primals,
                       first=eqn.outvars[:n_out])
  known = emit.eqn
  unks_out = [False] * n_out + [True] * (n_all - n_out)
  if plan.kind is _plan.Kind.RECOMPUTE:
    # f in the forward pass, the whole jvp in the backward region
    staged = eqn.replace(params=dict(eqn.params, schedule=plan.schedule))
    return (known, staged, unks_out, [True] * n_all,
            _residuals(eqn, inst_in, staged))
  if plan.kind is _plan.Kind.SPLIT:
    return _split(eqn, inst_in, plan, known, kept, f_consts, fwd_consts,
                  primals, tangents)
  # fwd (or f in its place) forward, its residuals kept; the linear map staged
  ins, params = ex.linear(call, fwd, plan, in_nz, [*fwd_consts, *primals],
                          primals, kept)
  staged = jx.pe.new_jaxpr_eqn([*ins, *tangents], eqn.outvars[n_out:], lin_p,
                               params, set(), eqn.source_info, eqn.ctx)
  return (known, staged, unks_out, [False] * n_out + [True] * (n_all - n_out),
          _residuals(eqn, inst_in, staged, kept))


register(jvp_p, "partial_eval_custom", _jvp_partial_eval_custom)


def _split(eqn, inst_in, plan, known, extra, f_consts, fwd_consts, primals,
           tangents):
  """Some of ``fwd``'s values saved: the forward pass ran the part of
  ``fwd`` producing the primal outputs and the saved values (``known``,
  ``extra`` the saved values that are not primal outputs); the backward
  region rebuilds the rest (a jvp whose ``fwd`` takes the saved values as
  leading inputs) and runs ``bwd``. A primal output the policy saves is read
  from the forward pass, not recomputed."""
  split = plan.split
  n_out = len(known.outvars) - len(extra)
  it = iter(extra)
  saved = [next(it) if o is None else eqn.outvars[o]
           for o in split.saved_outputs]
  kept_outs = {o for o in split.saved_outputs if o is not None}
  emit = ex.Eqns(eqn)
  emit(jvp_p, [*f_consts, *saved, *fwd_consts, *primals, *tangents],
       dict(eqn.params, fwd=split.staged, schedule=plan.schedule),
       first=[jx.core.Var(v.aval) if i in kept_outs else v
              for i, v in enumerate(eqn.outvars)])
  staged = emit.eqn
  unks_out = [False] * n_out + [True] * (len(eqn.outvars) - n_out)
  inst_out = [i not in kept_outs for i in range(len(eqn.outvars))]
  return known, staged, unks_out, inst_out, _residuals(eqn, inst_in, staged,
                                                       saved)


# -- smartvjp_jvp: trace-time partial evaluation (the rematerialized region) --------

def _jvp_partial_eval(trace, *tracers, call, fwd, in_nz, schedule):
  """Primal inputs known, tangents not: the primal side runs now (what the
  ``schedule`` says the backward side starts with) and the linear map is
  staged."""
  params = dict(call=call, fwd=fwd, in_nz=in_nz, schedule=schedule)
  n_known = len(tracers) - sum(in_nz)
  known_tracers, tangent_tracers = tracers[:n_known], tracers[n_known:]
  if (not all(t.is_known() for t in known_tracers)
      or all(t.is_known() for t in tangent_tracers)):
    return trace.default_process_primitive(jvp_p, tracers, params)
  vals = [t.pval.get_known() for t in known_tracers]
  f_consts, fwd_consts, primals, _ = call.split_jvp_args(vals, fwd)
  with jx.core.set_current_trace(getattr(trace, "parent_trace", None)):
    outs, lin_ins, lin_params = ex.backward_region(
        call, fwd, schedule, in_nz, f_consts, fwd_consts, primals)
  staged_in = [*(trace.new_instantiated_const(x) for x in lin_ins),
               *tangent_tracers]
  return [*outs,
          *trace.default_process_primitive(lin_p, staged_in, lin_params)]


register(jvp_p, "partial_eval", _jvp_partial_eval)


# -- smartvjp_jvp: dead-code elimination ------------------------------------------
#
# What is left is _plan.prune's answer. A jvp whose tangents are dead stands
# for the rule jax.custom_vjp runs for a differentiated call: fwd, when it
# has effects.

def _jvp_dce(used_outputs, eqn):
  call, fwd, in_nz, schedule = (eqn.params[k]
                                for k in ("call", "fwd", "in_nz", "schedule"))
  n = call.num_outs
  facts = _policy.facts_of(call, fwd)
  left = _plan.prune(facts, schedule, any(used_outputs[:n]),
                     any(used_outputs[n:]))
  if left.linear and left.primal is not None:
    return [True] * len(eqn.invars), eqn
  f_consts, fwd_consts, primals, tangents = call.split_jvp_args(eqn.invars,
                                                                fwd)
  emit = ex.Eqns(eqn)
  if left.linear:   # the linear map alone, on inputs of the call
    if schedule.runs_fwd_bwd:
      ins, params = primals, ex.lin_params(call, None, in_nz)
    else:
      fwd_inputs = [*fwd_consts, *primals]
      passed = _policy.passed_through(fwd)
      ins = fwd.assemble_residuals(fwd_inputs, [fwd_inputs[i] for i in passed])
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
  """Per input of ``eqn``: whether ``new_eqn``, which replaces it, reads
  it."""
  read = {id(v) for v in new_eqn.invars}
  return [id(v) in read for v in eqn.invars]


replace_rule(jvp_p, "dce", _jvp_dce)


# -- smartvjp_call: dead-code elimination --------------------------------------------

def _call_dce(used_outputs, eqn):
  """Per output, as JAX prunes ``jax.custom_vjp``'s ``f``: only the work for
  the used outputs stays (every input is kept)."""
  if all(used_outputs) or not any(used_outputs):
    return dce_whole(used_outputs, eqn)
  kept = tuple(i for i, u in enumerate(used_outputs) if u)
  new_eqn = eqn.replace(outvars=[eqn.outvars[i] for i in kept],
      params=dict(eqn.params, call=pruned(eqn.params["call"], kept)))
  return [True] * len(eqn.invars), new_eqn


replace_rule(call_p, "dce", _call_dce)


# -- smartvjp_rule: dead-code elimination --------------------------------------------

def _fwd_dce(used_outputs, eqn):
  """``fwd`` some of whose residuals are unused computes only the others
  (``bwd`` does not read them); ``fwd`` none of whose residuals is used (no
  cotangent reaches the call) is just ``f`` where the plan says so
  (``_plan.prune``)."""
  call, fwd = eqn.params["call"], eqn.params["fwd"]
  n = call.num_outs
  kept = used_outputs[n:]
  if (any(kept) and not all(used_outputs[:n]) and fwd.jaxpr is not None
      and eqn.params["offload"] is None):
    # residuals read and some primal outputs not: fwd's traced code pruned
    # as JAX prunes the inlined fwd of a jax.custom_vjp (a solver's unused
    # state is not computed)
    return _traced_dce(used_outputs, eqn.replace(params=dict(
        call=call, which="fwd", jaxpr=fwd.jaxpr)))
  if any(kept) and not all(kept) and fwd.jaxpr is not None:
    # some residuals read, some not: fwd computes only those read
    offload = eqn.params["offload"]
    if offload is not None:
      offload = tuple(o for o, k in zip(offload, kept) if k)
    emit = ex.Eqns(eqn)
    emit(rule_p, eqn.invars, ex.fwd_params(call, fwd.computing_only(kept),
                                           offload),
         first=[*eqn.outvars[:n], *(v for v, k in zip(eqn.outvars[n:], kept)
                                    if k)])
    return [True] * len(eqn.invars), emit.eqn
  if any(used_outputs[n:]) or not any(used_outputs[:n]) or fwd.jaxpr is None:
    return dce_whole(used_outputs, eqn)
  by = _plan.prune(_policy.facts_of(call, fwd), None, True, False,
                   carries_f=False).primal
  if by is _plan.Forward.FWD:
    return dce_whole(used_outputs, eqn)
  fwd_consts, primals = eqn.invars[:fwd.num_consts], eqn.invars[fwd.num_consts:]
  emit = ex.Eqns(eqn)
  ex.primal(emit, call, fwd, [], fwd_consts, primals, by,
            first=eqn.outvars[:n])
  return _reads(eqn, emit.eqn), emit.eqn


def _traced_dce(used_outputs, eqn):
  """The traced rule's dead code removed: the inputs it does not read (a
  residual that ``bwd`` ignores) and the outputs nobody uses leave the
  equation, as they leave the inlined ``bwd`` of a ``jax.custom_vjp``; the
  ``fwd`` producing such a residual then computes less (:func:`_fwd_dce`).
  The same for any traced rule (a pruned or checked ``fwd``)."""
  jaxpr = eqn.params["jaxpr"]
  if not any(used_outputs) and not jx.effects_keep_alive(eqn.effects):
    return [False] * len(eqn.invars), None
  pruned_jaxpr, used_inputs = jx.pe.dce_jaxpr(jaxpr.jaxpr, list(used_outputs))
  if all(used_inputs) and all(used_outputs):
    return used_inputs, eqn
  emit = ex.Eqns(eqn)
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
