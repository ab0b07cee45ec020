"""Remat3 rules (``jax_remat3`` + ``jax_custom_vjp3``).

Under those flags ``jax.checkpoint`` runs its body once on the forward
pass's trace and once more on the rematerialized region's (the "rem" side),
which the backward pass then differentiates. ``smartvjp_call``'s rule asks
the plan (the same ``_execute.decide`` as the policy-driven partial
evaluation) and carries it out: the forward pass runs what
``_execute.forward`` emits, and the rem side is a ``smartvjp_rem`` carrying
the schedule and what the forward pass kept: the user's ``fwd`` to run there
(recompute), a pass-through of the saved outputs (everything kept), or the
rest of a split ``fwd``.
"""

from __future__ import annotations

import dataclasses

import jax

from smartvjp import _execute as ex
from smartvjp import _facade as jx
from smartvjp import _plan
from smartvjp import _policy
from smartvjp._checks import check_fwd_output_types
from smartvjp._primitive import call_p, jvp_p, register, rem_p
from smartvjp._spec import select_outputs


def _full_remat(prim, in_vals, params):
  """JAX's default: the primitive runs in both passes."""
  outs = prim.bind(*in_vals, **params)
  return outs, (), lambda _res, *rem_in: prim.bind(*rem_in, **params)


def _handled(ctx, call) -> bool:
  return (ctx.custom_vjp_rules and call.eager is None
          and call.jaxpr is not None and call.rules.fwd is not None
          and not _policy.uses_references(call))


def _call_remat3(ctx, *in_vals, call):
  if call.full is not None and _handled(ctx, call.full):
    outs, res, rem = _call_remat3(ctx, *in_vals, call=call.full)
    return (select_outputs(call, outs), res,
            lambda res, *rem_in: select_outputs(call, rem(res, *rem_in)))
  in_nz = call.in_nz_possible
  if call.full is not None or not _handled(ctx, call) or not any(in_nz):
    return _full_remat(call_p, in_vals, dict(call=call))
  fwd, fwd_consts = call.fwd_for(in_nz)
  check_fwd_output_types(call, fwd)   # f and fwd may both run
  n = call.num_consts
  f_consts, primals = list(in_vals[:n]), list(in_vals[n:])
  avals = [jx.core.typeof(x) for x in (*f_consts, *fwd_consts, *primals)]
  avals += [a.to_tangent_aval() for a, nz in zip(call.in_avals, in_nz) if nz]
  answers = _policy.answers(
      ctx.policy, call, fwd, jvp_p, avals,
      dict(call=call, fwd=fwd, in_nz=in_nz,
           schedule=_policy.schedule_without_policy(call, fwd)))
  call, fwd, plan, swapped = ex.decide(call, fwd, in_nz, ctx.policy, answers)
  if swapped:
    fwd_consts = []
  outs, kept = ex.forward(ex.Bind(), call, fwd, plan, f_consts, fwd_consts,
                          primals)
  k = len(f_consts)
  if plan.kind is _plan.Kind.RECOMPUTE:
    # f forward; the rem side runs fwd (or fwd_bwd) when differentiated
    def rem(fwd_consts, *rem_in):
      return rem_p.bind(*rem_in[:k], *fwd_consts, *rem_in[k:], call=call,
                        fwd=fwd, schedule=plan.schedule)
    return list(outs), list(fwd_consts), rem
  if plan.kind is _plan.Kind.SPLIT:
    saved = _saved_of_split(plan.split, outs, kept)
    staged = _rebuilding(plan)

    def rem(saved, *rem_in):
      return rem_p.bind(*rem_in[:k], *saved, *fwd_consts, *rem_in[k:],
                        call=call, fwd=staged, schedule=plan.schedule)
    return list(outs), saved, rem
  # fwd (or f in its place) forward, its outputs kept (residuals offloaded
  # where the policy says); the rem side hands them to bwd
  spec = ex.passthrough(call, fwd, [jx.core.typeof(x) for x in outs])
  spaces = plan.spaces or (None,) * len(kept)
  n_out = call.num_outs

  def rem(saved, *rem_in):
    back = [r if s is None else jax.device_put(r, jx.core.mem_kind_to_space("device"))
            for r, s in zip(saved[n_out:], spaces)]
    return rem_p.bind(*rem_in[:k], *saved[:n_out], *back, *fwd_consts,
                      *rem_in[k:], call=call, fwd=spec,
                      schedule=plan.rem_schedule)
  return list(outs), [*outs, *kept], rem


def _saved_of_split(split, outs, extra) -> list:
  """The values a split saves, in its order: a saved primal output is the
  forward pass's output itself."""
  it = iter(extra)
  return [next(it) if o is None else outs[o] for o in split.saved_outputs]


def _rebuilding(plan):
  """The rem side's ``fwd`` for a split: the rest of ``fwd``, from the saved
  values (its leading inputs); a primal output that is saved is read, not
  rebuilt."""
  split = plan.split
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
  """The rem side rematerialized again (a checkpoint inside a checkpointed
  scan or function): where ``fwd`` was to run in the backward pass, the new
  forward pass runs ``f`` for the primal outputs and ``fwd`` stays in the
  new backward region; otherwise the saved values are replayed."""
  params = dict(call=call, fwd=fwd, schedule=schedule)
  if schedule.forward is not _plan.Forward.F or not ctx.custom_vjp_rules:
    outs = rem_p.bind(*in_vals, **params)
    return outs, (), lambda _res, *rem_in: rem_p.bind(*rem_in, **params)
  n1, n2 = call.num_consts, call.num_consts + fwd.num_consts
  outs = ex.primal(ex.Bind(), call, fwd, in_vals[:n1], in_vals[n1:n2],
                   in_vals[n2:], schedule.forward)
  return list(outs), (), lambda _res, *rem_in: rem_p.bind(*rem_in, **params)


register(rem_p, "remat3", _rem_remat3)
