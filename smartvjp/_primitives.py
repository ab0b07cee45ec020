"""smartvjp's primitives and their evaluation rules.

Seven primitives, all with multiple results:

``smartvjp_call``       ``[*f_consts, *primals] -> primal_outs``: evaluates ``f``.
``smartvjp_primal``     ``[*f_consts, *fwd_consts, *primals] -> primal_outs``:
                        evaluates ``f`` where a differentiated call needs only
                        its primal outputs (the forward pass under remat, or
                        a ``fwd`` whose residuals are all inputs); an outer
                        derivative differentiates ``fwd``'s code, as it does
                        with ``jax.custom_vjp`` (whose forward pass runs
                        ``fwd``).
``smartvjp_fwd``        ``[*fwd_consts, *primals] -> [*primal_outs, *new_res]``:
                        evaluates ``fwd``.
``smartvjp_jvp``        ``[*f_consts, *fwd_consts, *primals, *nz_tangents]
                        -> [*primal_outs, *nz_tangent_outs]``: "primal and
                        tangent outputs together"; only partial evaluation
                        decides which rules it becomes. ``remat=True`` marks a
                        call whose forward pass ran ``f`` and whose backward
                        region must run ``fwd`` (or ``fwd_bwd``).
``smartvjp_lin``        ``[*residuals, *nz_tangents] -> nz_tangent_outs``:
                        linear in the tangents; its transpose runs ``bwd``.
``smartvjp_fused_lin``  ``[*primals, *nz_tangents] -> nz_tangent_outs``:
                        linear in the tangents; its transpose runs ``fwd_bwd``.
``smartvjp_bwd``        ``[*consts, *inputs, *nz_cotangents] -> nz_cotangents_in``:
                        evaluates ``bwd`` or ``fwd_bwd`` (param ``which``),
                        traced when the transpose runs.

This module holds what every primitive needs to be evaluated: abstract
evaluation, eager implementation (the traced jaxpr evaluated op by op, as
``jax.custom_vjp`` does, so no compiled executable keeps a per-step function
alive), lowering (under a ``smartvjp/<f>/<rule>``
named scope), dead-code elimination and printing. Differentiation rules live
in ``_ad.py``, partial evaluation in ``_partial_eval.py``.
"""

from __future__ import annotations

import jax

from smartvjp import _compat as C
from smartvjp._spec import pruned

call_p = C.new_primitive("smartvjp_call")
primal_p = C.new_primitive("smartvjp_primal")
fwd_p = C.new_primitive("smartvjp_fwd")
jvp_p = C.new_primitive("smartvjp_jvp")
lin_p = C.new_primitive("smartvjp_lin")
fused_lin_p = C.new_primitive("smartvjp_fused_lin")
rule_p = C.new_primitive("smartvjp_bwd")


def eval_scoped(jaxpr: C.ClosedJaxpr, scope: str, args):
  """Evaluates a traced rule under the named scope ``scope``."""
  with jax.named_scope(scope):
    return C.eval_jaxpr(jaxpr.jaxpr, jaxpr.consts, *args)


def tangent_avals(avals, nz):
  return [a.to_tangent_aval() for a, n in zip(avals, nz) if n]


def split_jvp_args(args, call, fwd):
  """``[*f_consts, *fwd_consts, *primals, *nz_tangents]`` -> four lists."""
  n1 = call.num_consts
  n2 = n1 + (fwd.num_consts if fwd is not None else 0)
  n3 = n2 + call.num_primals
  return list(args[:n1]), list(args[n1:n2]), list(args[n2:n3]), list(args[n3:])


def bind_primal_and_residuals(call, fwd, f_consts, fwd_consts, primals):
  """Runs ``fwd``; returns ``(primal_outs, residuals)`` (all residual leaves).

  When every residual of ``fwd`` is an input forwarded unchanged (as in the
  seed's ``fwd`` that returns ``(sin(x), (x,))``), ``fwd`` computes nothing
  that ``f`` does not, so ``f`` runs in its place.
  """
  fwd_inputs = [*fwd_consts, *primals]
  if fwd.num_new_res == 0:
    outs = bind_primal(call, fwd, f_consts, fwd_consts, primals)
    return list(outs), fwd.assemble_residuals(fwd_inputs, [])
  outs = fwd_p.bind(*fwd_inputs, call=call, fwd=fwd, offload=None)
  primal_outs, new_res = outs[:call.num_outs], outs[call.num_outs:]
  return list(primal_outs), fwd.assemble_residuals(fwd_inputs, new_res)


def bind_primal(call, fwd, f_consts, fwd_consts, primals):
  """``f``'s outputs for a differentiated call (see ``smartvjp_primal``);
  without ``fwd`` (only ``fwd_bwd`` given) a plain ``smartvjp_call``."""
  if fwd is None:
    return call_p.bind(*f_consts, *primals, call=call)
  return primal_p.bind(*f_consts, *fwd_consts, *primals, call=call, fwd=fwd)


def primal_eqn(call, fwd, f_consts, fwd_consts, primals, outvars, eqn):
  """The equation of :func:`bind_primal`, with ``eqn``'s source info."""
  if fwd is None:
    return C.new_jaxpr_eqn([*f_consts, *primals], outvars, call_p,
                           dict(call=call), call.jaxpr.effects,
                           eqn.source_info, eqn.ctx)
  return C.new_jaxpr_eqn([*f_consts, *fwd_consts, *primals], outvars, primal_p,
                         dict(call=call, fwd=fwd), call.jaxpr.effects,
                         eqn.source_info, eqn.ctx)


# -- smartvjp_call ------------------------------------------------------------

def _call_abstract_eval(*avals, call):
  return list(call.out_avals), call.jaxpr.effects


def _call_lower(*args, call):
  return eval_scoped(call.jaxpr, f"smartvjp/{call.name}/f", args)


call_p.def_effectful_abstract_eval(_call_abstract_eval)
call_p.def_impl(_call_lower)
C.register_lowering_from_impl(call_p, _call_lower)


# -- smartvjp_primal ------------------------------------------------------------

def split_primal_args(args, call, fwd):
  """``[*f_consts, *fwd_consts, *primals]`` -> three lists."""
  n1, n2 = call.num_consts, call.num_consts + fwd.num_consts
  return list(args[:n1]), list(args[n1:n2]), list(args[n2:])


def _primal_abstract_eval(*avals, call, fwd):
  return list(call.out_avals), call.jaxpr.effects


def primal_eval(*args, call, fwd):
  f_consts, _, primals = split_primal_args(args, call, fwd)
  return _call_lower(*f_consts, *primals, call=call)


primal_p.def_effectful_abstract_eval(_primal_abstract_eval)
primal_p.def_impl(primal_eval)
C.register_lowering_from_impl(primal_p, primal_eval)


# -- smartvjp_fwd -------------------------------------------------------------

def _fwd_abstract_eval(*avals, call, fwd, offload):
  outs = list(fwd.jaxpr.out_avals)
  if offload is not None:  # residuals a policy offloads (Offloadable.dst)
    n = call.num_outs
    outs[n:] = [a if space is None else a.update(memory_space=space)
                for a, space in zip(outs[n:], offload)]
  return outs, fwd.jaxpr.effects


def fwd_eval(*args, call, fwd, offload):
  outs = eval_scoped(fwd.jaxpr, f"smartvjp/{call.name}/fwd", args)
  if offload is not None:
    n = call.num_outs
    outs[n:] = [r if space is None else jax.device_put(r, space)
                for r, space in zip(outs[n:], offload)]
  return outs


fwd_p.def_effectful_abstract_eval(_fwd_abstract_eval)
fwd_p.def_impl(fwd_eval)
C.register_lowering_from_impl(fwd_p, fwd_eval)


def _bind_fwd(*args, call, fwd, offload):
  """Binds ``smartvjp_fwd``; a residual that ``fwd`` named with
  ``checkpoint_name`` leaves it through a ``checkpoint_name`` equation, as it
  leaves ``jax.custom_vjp``'s inlined ``fwd``, so that outer remat policies
  and ``jax.ad_checkpoint.print_saved_residuals`` see the name."""
  outs = C.Primitive.bind(fwd_p, *args, call=call, fwd=fwd, offload=offload)
  n = call.num_outs
  named = [r if name is None else C.name_p.bind(r, name=name)
           for r, name in zip(outs[n:], fwd.new_res_names)]
  return [*outs[:n], *named]


fwd_p.bind = _bind_fwd


# -- smartvjp_jvp -------------------------------------------------------------

def _jvp_abstract_eval(*avals, call, fwd, in_nz, remat):
  effects = call.jaxpr.effects
  if fwd is not None:
    effects = effects | fwd.jaxpr.effects
  outs = [*call.out_avals, *tangent_avals(call.out_avals, call.out_nz)]
  return outs, effects


jvp_p.def_effectful_abstract_eval(_jvp_abstract_eval)


# -- smartvjp_lin / smartvjp_fused_lin ------------------------------------------

def _lin_abstract_eval(*avals, call, **_):
  return tangent_avals(call.out_avals, call.out_nz)


lin_p.def_abstract_eval(_lin_abstract_eval)
fused_lin_p.def_abstract_eval(_lin_abstract_eval)


# -- smartvjp_bwd (bwd or fwd_bwd, traced at transpose time) -------------------

def _rule_abstract_eval(*avals, call, which, jaxpr):
  return list(jaxpr.out_avals), jaxpr.effects


def rule_eval(*args, call, which, jaxpr):
  return eval_scoped(jaxpr, f"smartvjp/{call.name}/{which}", args)


rule_p.def_effectful_abstract_eval(_rule_abstract_eval)
rule_p.def_impl(rule_eval)
C.register_lowering_from_impl(rule_p, rule_eval)


# -- dead-code elimination ----------------------------------------------------

def _dce_whole(used_outputs, eqn):
  """Drop an equation none of whose outputs is used, else keep it whole.

  Unordered debug effects inside a rule do not keep it alive: which rule runs
  where is smartvjp's decision, and a ``jax.debug.print`` in ``fwd`` must not
  change it.
  """
  if not any(used_outputs) and C.only_unordered_debug_effects(eqn.effects):
    return [False] * len(eqn.invars), None
  return [True] * len(eqn.invars), eqn


def _dce_jvp(used_outputs, eqn):
  """A jvp equation whose tangents are unused is just ``f``."""
  call, fwd = eqn.params["call"], eqn.params["fwd"]
  n = call.num_outs
  if any(used_outputs[n:]):
    return [True] * len(eqn.invars), eqn
  if not any(used_outputs[:n]):
    return _dce_whole(used_outputs, eqn)
  f_consts, fwd_consts, primals, tangents = split_jvp_args(eqn.invars, call, fwd)
  new_eqn = primal_eqn(call, fwd, f_consts, fwd_consts, primals,
                       eqn.outvars[:n], eqn)
  used = ([True] * len(f_consts) + [fwd is not None] * len(fwd_consts)
          + [True] * len(primals) + [False] * len(tangents))
  return used, new_eqn


def _dce_call(used_outputs, eqn):
  """Per output, as JAX prunes ``jax.custom_vjp``'s ``f``: only the work for
  the used outputs stays (every input is kept)."""
  if all(used_outputs) or not any(used_outputs):
    return _dce_whole(used_outputs, eqn)
  kept = tuple(i for i, u in enumerate(used_outputs) if u)
  new_eqn = eqn.replace(
      outvars=[eqn.outvars[i] for i in kept],
      params=dict(eqn.params, call=pruned(eqn.params["call"], kept)))
  return [True] * len(eqn.invars), new_eqn


C.register_dce(call_p, _dce_call)
for _p in (primal_p, fwd_p, lin_p, fused_lin_p, rule_p):
  C.register_dce(_p, _dce_whole)
C.register_dce(jvp_p, _dce_jvp)


# -- printing -----------------------------------------------------------------

def _pp_rule(eqn, context, settings):
  params = dict(eqn.params)
  call = params.pop("call")
  shown = {"f": call.name}
  fwd = params.pop("fwd", None)
  if (eqn.primitive in (fwd_p, lin_p, jvp_p, primal_p)
      and call.rules.fwd is not None):
    shown["fwd"] = call.rules.rule_name("fwd")
  if eqn.primitive in (lin_p, jvp_p) and call.rules.bwd is not None:
    shown["bwd"] = call.rules.rule_name("bwd")
  if eqn.primitive in (fused_lin_p, jvp_p) and call.rules.fwd_bwd is not None:
    shown["fwd_bwd"] = call.rules.rule_name("fwd_bwd")
  which = params.pop("which", None)
  if which is not None:
    params.pop("jaxpr")
    shown[which] = call.rules.rule_name(which)
  if fwd is not None and fwd.num_new_res:
    shown["num_res"] = fwd.num_new_res
  shown.update((k, v) for k, v in params.items() if v is not None)
  return C.pp_eqn(eqn.replace(params=shown), context, settings)


for _p in (call_p, primal_p, fwd_p, jvp_p, lin_p, fused_lin_p, rule_p):
  C.register_pp(_p, _pp_rule)
