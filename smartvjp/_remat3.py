"""Rules for JAX's remat3 path (``jax_remat3`` + ``jax_custom_vjp3``).

Under those flags ``jax.checkpoint`` does not partially evaluate its body: it
runs the body once on the forward pass's trace and once more on the trace of
the rematerialized region (the "rem" side), which the backward pass then
differentiates. A primitive may take over both halves with a rule (see
``_compat.register_remat3``). Without one, a ``smartvjp_call`` runs ``f``
forward and, differentiated in the backward region, ``fwd`` and ``bwd``
whatever the policy says.

The rule for ``smartvjp_call`` makes the same decision as the default path's
partial evaluation (``_partial_eval.residual_policy``, ``_policy.plan_split``):

* nothing of the call saved (``jax.checkpoint`` without a policy,
  ``nothing_saveable``, a policy that saves none of ``fwd``'s residuals): the
  forward pass runs ``f`` (``smartvjp_primal``), and the rem side is a
  ``smartvjp_rem`` equation which, differentiated, runs ``fwd`` then ``bwd``,
  or ``fwd_bwd`` when given;
* the policy saves every residual ``fwd`` computes: the forward pass runs
  ``fwd`` and keeps its primal outputs and residuals; the rem side hands them
  to ``bwd`` without running anything;
* it saves some of a JAX-coded ``fwd``'s values: the forward pass runs the
  part of ``fwd`` producing them, the rem side rebuilds the rest from them.

``smartvjp_rem`` (``[*f_consts, *fwd_consts, *primals] -> primal_outs``)
differentiates as ``smartvjp_jvp`` does once ``fwd`` is fixed: its JVP binds
``smartvjp_jvp`` with the rem side's ``fwd`` (JAX's linearization of it then
goes through ``smartvjp_jvp``'s partial evaluation: ``fwd`` now, ``bwd`` in
the transpose), so every other rule of smartvjp applies unchanged.
"""

from __future__ import annotations

import dataclasses

import jax

from smartvjp import _compat
from smartvjp._ad import _call_jvp, closure_error, expand_tangents
from smartvjp._batching import (
    _to_front_or_none, _unbatched, batched_call, batched_fwd)
from smartvjp._jax_api import remat_call
from smartvjp._policy import plan_split
from smartvjp._primitives import (
    bind_primal, bwd_eval, bwd_p, call_p, discharged_on, eval_scoped, fwd_p,
    jvp_p, uses_references)
from smartvjp._spec import check_fwd_output_types, select_outputs

rem_p = _compat.new_primitive("smartvjp_rem")


# -- the policy ------------------------------------------------------------------

def _named_policy(policy):
  """``policy`` asked about a remat3 ``checkpoint_name`` (a high-level
  primitive) as about JAX's ``name_p`` equation, as the default path asks."""
  def asked(prim, *avals, **params):
    name = _compat.name_of(prim, params)
    if name is not None and prim is not _compat.name_p:
      return policy(_compat.name_p, *avals, name=name)
    return policy(prim, *avals, **params)
  return asked


def _residual_answers(policy, call, fwd, fwd_consts, in_vals, in_nz):
  """Per residual that ``fwd`` computes, the policy's answer (Saveable,
  Recompute or Offloadable), asked as ``_partial_eval.residual_policy`` asks:
  for the call itself, then for the equations producing the residual in
  ``fwd``'s jaxpr (through ``checkpoint_name``, the named value's)."""
  params = dict(call=call, fwd=fwd, in_nz=in_nz, remat=False)
  n = call.num_consts
  avals = [*(_compat.get_aval(x) for x in in_vals[:n]),
           *(_compat.get_aval(x) for x in fwd_consts),
           *(_compat.get_aval(x) for x in in_vals[n:]),
           *(a.to_tangent_aval() for a, nz in zip(call.in_avals, in_nz) if nz)]
  call_answer = _compat.policy_answer(policy, jvp_p, avals, params)
  recompute = type(_compat.Recompute)
  jaxpr = fwd.jaxpr.jaxpr
  producers = {v: e for e in jaxpr.eqns for v in e.outvars}
  answers = []
  for v in jaxpr.outvars[call.num_outs:]:
    answer = call_answer
    while isinstance(answer, recompute) and isinstance(v, _compat.Var) \
        and v in producers:
      eqn = producers[v]
      answer = _compat.policy_answer(policy, eqn.primitive,
                               [u.aval for u in eqn.invars], eqn.params)
      if _compat.checkpoint_name_of(eqn) is None:
        break
      v = eqn.invars[0]
    answers.append(answer)
  return call_answer, answers


# -- the rule for smartvjp_call ----------------------------------------------------

def _full_remat(prim, in_vals, params):
  """No rule: the primitive runs in both passes (JAX's default)."""
  outs = prim.bind(*in_vals, **params)
  return outs, (), lambda _res, *rem_in: prim.bind(*rem_in, **params)


def _handled(ctx, call) -> bool:
  return (ctx.custom_vjp_rules and call.eager is None
          and call.jaxpr is not None and call.rules.fwd is not None
          and not uses_references(call))


def _call_remat3(ctx, *in_vals, call):
  if call.full is not None and _handled(ctx, call.full):
    outs, res, rem = _call_remat3(ctx, *in_vals, call=call.full)
    return (select_outputs(call, outs), res,
            lambda res, *rem_in: select_outputs(call, rem(res, *rem_in)))
  if call.full is not None or not _handled(ctx, call):
    return _full_remat(call_p, in_vals, dict(call=call))
  in_nz = call.in_nz_possible
  if not any(in_nz):
    return _full_remat(call_p, in_vals, dict(call=call))
  policy = None if ctx.policy is None else _named_policy(ctx.policy)
  fwd, fwd_consts = call.fwd_for(in_nz)
  check_fwd_output_types(call, fwd)  # f and fwd may both run
  n = call.num_consts
  f_consts, primals = list(in_vals[:n]), list(in_vals[n:])
  plan = _plan(policy, call, fwd, fwd_consts, in_vals, in_nz)
  if plan[0] == "remat" and call.rules.remat is not None:
    alt = remat_call(call)   # defremat's rules where the policy recomputes
    alt_fwd, alt_consts = alt.fwd_for(in_nz)
    if not alt_consts:
      call, fwd, fwd_consts = alt, alt_fwd, []
      plan = ("save", (None,) * fwd.num_new_res)
  if plan[0] == "remat":
    return _recompute(call, fwd, f_consts, fwd_consts, primals)
  if plan[0] == "split":
    return _split(call, plan[1], f_consts, fwd_consts, primals)
  return _save(call, fwd, plan[1], f_consts, fwd_consts, primals)


def _plan(policy, call, fwd, fwd_consts, in_vals, in_nz):
  """``("remat",)``, ``("save", spaces)`` (one memory space or ``None`` per
  residual ``fwd`` computes) or ``("split", Split)``."""
  if call.rules.always_save:   # defremat: the user decides
    return ("save", (None,) * fwd.num_new_res)
  if policy is None:
    return ("remat",)
  call_answer, answers = _residual_answers(policy, call, fwd, fwd_consts,
                                           in_vals, in_nz)
  recompute = type(_compat.Recompute)
  if fwd.num_new_res == 0:
    return ("remat",) if isinstance(call_answer, recompute) else ("save", ())
  if not any(isinstance(a, recompute) for a in answers):
    return ("save", tuple(_compat.memory_space(a.dst)
                          if isinstance(a, _compat.Offloadable) else None
                          for a in answers))
  if call.rules.remat is None:
    split = plan_split(policy, call, fwd)
    if split is not None:
      return ("split", split)
  return ("remat",)


def _recompute(call, fwd, f_consts, fwd_consts, primals):
  """``f`` forward; the rem side runs ``fwd`` (or ``fwd_bwd``) when
  differentiated."""
  outs = bind_primal(call, fwd, f_consts, fwd_consts, primals)
  params = dict(call=call, fwd=fwd, remat=True)

  def rem(fwd_consts, *rem_in):
    k = len(f_consts)
    return rem_p.bind(*rem_in[:k], *fwd_consts, *rem_in[k:], **params)
  return list(outs), list(fwd_consts), rem


def _passthrough(call, fwd, out_avals):
  """A ``fwd`` for the rem side whose leading inputs are the forward pass's
  primal outputs (of types ``out_avals``) and computed residuals, returned as
  they are (residuals that are inputs keep coming from the inputs)."""
  avals = [*out_avals, *fwd.jaxpr.out_avals[call.num_outs:]]
  num_saved = len(avals)
  rest = fwd.jaxpr.in_avals

  def same(*args):
    return list(args[:num_saved])
  closed, _ = _compat.trace_to_closed_jaxpr(   # closes over nothing: no consts
      same, [*avals[:num_saved], *rest], "smartvjp remat3 saved", same,
      [jax.ShapeDtypeStruct(a.shape, a.dtype) for a in [*avals, *rest]])
  spec = fwd.shifted(closed, num_saved)
  return dataclasses.replace(spec, new_res_names=(None,) * fwd.num_new_res,
                             new_res_eqns=(), out_avals=tuple(out_avals))


def _save(call, fwd, spaces, f_consts, fwd_consts, primals):
  """``fwd`` forward, its outputs kept (residuals offloaded where the policy
  says); the rem side hands them to ``bwd``."""
  n_out = call.num_outs
  offload = spaces if any(s is not None for s in spaces) else None
  if fwd.num_new_res:
    outs = fwd_p.bind(*fwd_consts, *primals, call=call, fwd=fwd,
                      offload=offload)
  else:   # fwd computes nothing that f does not
    outs = bind_primal(call, fwd, f_consts, fwd_consts, primals)
  saved = list(outs)
  spec = _passthrough(call, fwd, [_compat.get_aval(x) for x in outs[:n_out]])
  params = dict(call=call, fwd=spec, remat=False)

  def rem(saved, *rem_in):
    back = [r if s is None else jax.device_put(r, _compat.device_memory_space())
            for r, s in zip(saved[n_out:], spaces)]
    k = len(f_consts)
    return rem_p.bind(*rem_in[:k], *saved[:n_out], *back, *fwd_consts,
                      *rem_in[k:], **params)
  return list(outs[:n_out]), saved, rem


def _split(call, split, f_consts, fwd_consts, primals):
  """The part of ``fwd`` producing the saved values forward; the rem side
  rebuilds the rest from them (a saved primal output is read, not rebuilt)."""
  n_out = call.num_outs
  outs = fwd_p.bind(*fwd_consts, *primals, call=call, fwd=split.known,
                    offload=None)
  extra = iter(outs[n_out:])
  saved = [next(extra) if o is None else outs[o] for o in split.saved_outputs]
  staged = split.staged
  jaxpr = staged.jaxpr.jaxpr
  outvars = list(jaxpr.outvars)
  for i, o in enumerate(split.saved_outputs):
    if o is not None:
      outvars[o] = jaxpr.invars[i]
  jaxpr, _ = _compat.dce_jaxpr(jaxpr.replace(outvars=outvars),
                         [True] * len(outvars), True)
  staged = dataclasses.replace(staged, jaxpr=_compat.ClosedJaxpr(jaxpr, ()))
  params = dict(call=call, fwd=staged, remat=False)

  def rem(saved, *rem_in):
    k = len(f_consts)
    return rem_p.bind(*rem_in[:k], *saved, *fwd_consts, *rem_in[k:],
                      **params)
  return list(outs[:n_out]), saved, rem


# -- smartvjp_rem -----------------------------------------------------------------

def _split_rem_args(args, call, fwd):
  n1, n2 = call.num_consts, call.num_consts + fwd.num_consts
  return list(args[:n1]), list(args[n1:n2]), list(args[n2:])


def _uses_f(call, fwd, remat) -> bool:
  """The rem side's primal outputs come from ``f`` (a fused ``fwd_bwd`` will
  run in the backward pass), else from ``fwd``."""
  return remat and call.rules.fwd_bwd is not None


def _rem_abstract_eval(*avals, call, fwd, remat):
  effects = set(fwd.jaxpr.effects)
  if _uses_f(call, fwd, remat):
    effects |= set(call.jaxpr.effects)
  return list(call.out_avals), effects


def _rem_eval(*args, call, fwd, remat):
  f_consts, fwd_consts, primals = _split_rem_args(args, call, fwd)
  if _uses_f(call, fwd, remat):
    return eval_scoped(call.jaxpr, f"smartvjp/{call.name}/f",
                       [*f_consts, *primals])
  outs = eval_scoped(fwd.jaxpr, f"smartvjp/{call.name}/fwd",
                     [*fwd_consts, *primals])
  return outs[:call.num_outs]


def _rem_jvp(primals, tangents, *, call, fwd, remat):
  """``smartvjp_jvp`` with the rem side's ``fwd``; tangents of what ``f``
  closes over follow the default path (``f`` itself differentiated when they
  alone move), except where remat3 perturbs every input (jax 0.10)."""
  f_consts, fwd_consts, args = _split_rem_args(primals, call, fwd)
  f_t, _, arg_t = _split_rem_args(tangents, call, fwd)
  in_nz = tuple(type(t) is not _compat.Zero and possible
                for t, possible in zip(arg_t, call.in_nz_possible))
  const_nz = any(type(t) is not _compat.Zero for t in f_t)
  if const_nz and not _compat.REMAT3_PERTURBS_EVERY_INPUT:
    if any(in_nz):
      raise closure_error(call)
    return _call_jvp([*f_consts, *args], [*f_t, *arg_t], call=call)
  if not any(in_nz):
    return (rem_p.bind(*primals, call=call, fwd=fwd, remat=remat),
            expand_tangents(call, []))
  nz_t = [t for t, nz in zip(arg_t, in_nz) if nz]
  outs = jvp_p.bind(*f_consts, *fwd_consts, *args, *nz_t, call=call, fwd=fwd,
                    in_nz=in_nz, remat=remat)
  return outs[:call.num_outs], expand_tangents(call, outs[call.num_outs:])


def _rem_discharge(should, *args, call, fwd, remat):
  """:func:`_rem_eval` with the rule's references discharged (``f`` or
  ``fwd`` creating references of their own)."""
  n1, n2 = call.num_consts, call.num_consts + fwd.num_consts
  if _uses_f(call, fwd, remat):
    with jax.named_scope(f"smartvjp/{call.name}/f"):
      return discharged_on(call.jaxpr, should, args,
                           [*range(n1), *range(n2, len(args))])
  with jax.named_scope(f"smartvjp/{call.name}/fwd"):
    new_args, outs = discharged_on(fwd.jaxpr, should, args,
                                   list(range(n1, len(args))))
  return new_args, outs[:call.num_outs]


def _rem_dce(used_outputs, eqn):
  if not any(used_outputs) and not _compat.effects_keep_alive(eqn.effects):
    return [False] * len(eqn.invars), None
  return [True] * len(eqn.invars), eqn


def _rem_pp(eqn, context, settings):
  call = eqn.params["call"]
  shown = {"f": call.name, "fwd": call.rules.rule_name("fwd"),
           "remat": eqn.params["remat"]}
  return _compat.pp_eqn(eqn.replace(params=shown), context, settings)


def _rem_remat3(ctx, *in_vals, call, fwd, remat):
  """The rem side rematerialized again (a checkpoint inside a checkpointed
  scan or function): where ``fwd`` was to run in the backward pass, the new
  forward pass runs ``f`` for the primal outputs and ``fwd`` stays in the
  new backward region; otherwise the saved values are simply replayed."""
  params = dict(call=call, fwd=fwd, remat=remat)
  if not remat or not ctx.custom_vjp_rules:
    return _full_remat(rem_p, in_vals, params)
  f_consts, fwd_consts, primals = _split_rem_args(in_vals, call, fwd)
  outs = bind_primal(call, fwd, f_consts, fwd_consts, primals)
  return list(outs), (), lambda _res, *rem_in: rem_p.bind(*rem_in, **params)


# -- high-level primitives in a traced rule (checkpoint_name under remat3) ----

def _bwd_to_lojax(*args, call, which, jaxpr):
  """Evaluates the traced ``bwd``/``fwd_bwd`` inline, where its
  ``checkpoint_name`` equations become low-level ones."""
  return bwd_eval(*args, call=call, which=which, jaxpr=jaxpr)


# -- smartvjp_rem under vmap ------------------------------------------------------

def _rem_batch(axis_data, args, dims, *, call, fwd, remat):
  """A rem side that is still undifferentiated when a vmap batches it (a
  ``jax.grad`` inside ``jax.vmap`` that does not differentiate the call's
  inputs): the batched call with its batched rules, and the rem side's
  ``fwd`` batched with every input and output mapped at axis 0, so that its
  residuals are laid out as the batched ``bwd`` expects them."""
  params = dict(call=call, fwd=fwd, remat=remat)
  if _unbatched(axis_data, dims, _rem_abstract_eval(**params)[1]):
    return rem_p.bind(*args, **params), [None] * call.num_outs
  args, _ = _to_front_or_none(
      axis_data, args, ["broadcast" if d is None else d for d in dims])
  f_consts, fwd_in, primals = _split_rem_args(args, call, fwd)
  bcall, bconsts = batched_call(call, f_consts, [0] * len(f_consts),
                                [0] * len(primals), axis_data)
  n_in, n_out = len(fwd.jaxpr.in_avals), len(fwd.jaxpr.out_avals)
  bfwd, extra, _ = batched_fwd(call, fwd, axis_data, [0] * n_in, [0] * n_out)
  jaxpr = bfwd.jaxpr.jaxpr
  in_avals = [v.aval for v in jaxpr.invars]
  new_res = iter(v.aval for v in jaxpr.outvars[call.num_outs:])
  bfwd = dataclasses.replace(bfwd, res_avals=tuple(
      in_avals[s] if type(s) is int else next(new_res)
      for s in bfwd.res_src if s is None or type(s) is int))
  outs = rem_p.bind(*bconsts, *extra, *fwd_in, *primals, call=bcall,
                    fwd=bfwd, remat=remat)
  return outs, [0] * len(outs)
