"""``smartvjp_rem``: the rematerialized side of a call under remat3, with all
its rules.

``[*f_consts, *fwd_consts, *primals] -> primal_outs``. Under JAX's
``jax_remat3`` + ``jax_custom_vjp3`` flags, ``jax.checkpoint`` runs its body
once more on the trace of the rematerialized region, which the backward pass
differentiates later; ``smartvjp_call``'s remat3 rule (``_call.py``) leaves
this equation there. It carries the decision until then: ``fwd`` is the
rem side's ``fwd`` (the user's, the part of it a split rebuilds, or a
pass-through of what the forward pass saved), and ``schedule`` is the plan's
(``_plan.Schedule``: whether the call is recomputed whole, and whether its
backward side runs ``fwd_bwd``). Differentiated, it is ``smartvjp_jvp`` with that ``fwd``
(so every other rule applies unchanged); undifferentiated, it evaluates the
primal outputs (``f``'s where ``fwd_bwd`` will run, else ``fwd``'s).
"""

from __future__ import annotations

import dataclasses

import jax

from smartvjp import _facade as jx
from smartvjp import _versions
from smartvjp import _vmap
from smartvjp._call import closure_error
from smartvjp._primal import bind_primal, split_args
from smartvjp._primitive import (
    define, discharged, eval_scoped, jvp_p, rem_p, scope)


def _abstract_eval(*avals, call, fwd, schedule):
  effects = set(fwd.jaxpr.effects)
  if schedule.runs_fwd_bwd:
    effects |= set(call.jaxpr.effects)
  return list(call.out_avals), effects


def _eval(*args, call, fwd, schedule):
  f_consts, fwd_consts, primals = split_args(args, call, fwd)
  if schedule.runs_fwd_bwd:
    return eval_scoped(call.jaxpr, scope(call, "f"), [*f_consts, *primals])
  outs = eval_scoped(fwd.jaxpr, scope(call, "fwd"), [*fwd_consts, *primals])
  return outs[:call.num_outs]


def _jvp(primals, tangents, *, call, fwd, schedule):
  """``smartvjp_jvp`` with the rem side's ``fwd``. A tangent of what ``f``
  closes over is refused, with the error ``jax.custom_vjp`` raises under
  remat3, except where remat3 perturbs every input of the checkpoint,
  closed-over values included (``_versions``): there such a tangent says
  nothing and is ignored."""
  f_consts, fwd_consts, args = split_args(primals, call, fwd)
  f_t, _, arg_t = split_args(tangents, call, fwd)
  in_nz = tuple(type(t) is not jx.Zero and possible
                for t, possible in zip(arg_t, call.in_nz_possible))
  const_nz = any(type(t) is not jx.Zero for t in f_t)
  if const_nz and not _versions.REMAT3_PERTURBS_EVERY_INPUT:
    raise closure_error(call, "inside jax.checkpoint under JAX's jax_remat3 "
                        "flag")
  if not any(in_nz):
    return (rem_p.bind(*primals, call=call, fwd=fwd, schedule=schedule),
            call.expand_tangents([]))
  nz_t = [t for t, nz in zip(arg_t, in_nz) if nz]
  outs = jvp_p.bind(*f_consts, *fwd_consts, *args, *nz_t, call=call, fwd=fwd,
                    in_nz=in_nz, schedule=schedule)
  return outs[:call.num_outs], call.expand_tangents(outs[call.num_outs:])


def _discharge(should, *args, call, fwd, schedule):
  """:func:`_eval` with the rule's references discharged (``f`` or ``fwd``
  creating references of their own)."""
  n1, n2 = call.num_consts, call.num_consts + fwd.num_consts
  if schedule.runs_fwd_bwd:
    with jax.named_scope(scope(call, "f")):
      return discharged(call.jaxpr, should, args,
                        [*range(n1), *range(n2, len(args))])
  with jax.named_scope(scope(call, "fwd")):
    new_args, outs = discharged(fwd.jaxpr, should, args,
                                range(n1, len(args)))
  return new_args, outs[:call.num_outs]


def _remat3(ctx, *in_vals, call, fwd, schedule):
  """The rem side rematerialized again (a checkpoint inside a checkpointed
  scan or function): where ``fwd`` was to run in the backward pass, the new
  forward pass runs ``f`` for the primal outputs and ``fwd`` stays in the new
  backward region; otherwise the saved values are replayed."""
  params = dict(call=call, fwd=fwd, schedule=schedule)
  if not schedule.recomputes or not ctx.custom_vjp_rules:
    outs = rem_p.bind(*in_vals, **params)
    return outs, (), lambda _res, *rem_in: rem_p.bind(*rem_in, **params)
  f_consts, fwd_consts, primals = split_args(in_vals, call, fwd)
  outs = bind_primal(call, fwd, f_consts, fwd_consts, primals)
  return list(outs), (), lambda _res, *rem_in: rem_p.bind(*rem_in, **params)


def _batch(axis_data, args, dims, *, call, fwd, schedule):
  """A rem side still undifferentiated when a vmap batches it (a
  ``jax.grad`` inside ``jax.vmap`` that does not differentiate the call's
  inputs): the batched call with its batched rules, and the rem side's
  ``fwd`` batched with every input and output mapped at axis 0, so that its
  residuals are laid out as the batched ``bwd`` expects them."""
  params = dict(call=call, fwd=fwd, schedule=schedule)
  if _vmap.unbatched(axis_data, dims, _abstract_eval(**params)[1]):
    return rem_p.bind(*args, **params), [None] * call.num_outs
  args, _ = _vmap.to_front_or_none(
      axis_data, args, ["broadcast" if d is None else d for d in dims])
  f_consts, fwd_in, primals = split_args(args, call, fwd)
  bcall, bconsts = _vmap.batched_call(call, f_consts, [0] * len(f_consts),
                                      [0] * len(primals), axis_data)
  n_in, n_out = len(fwd.jaxpr.in_avals), len(fwd.jaxpr.out_avals)
  bfwd, extra, _ = _vmap.batched_fwd(call, fwd, axis_data, [0] * n_in,
                                     [0] * n_out)
  jaxpr = bfwd.jaxpr.jaxpr
  in_avals = [v.aval for v in jaxpr.invars]
  new_res = iter(v.aval for v in jaxpr.outvars[call.num_outs:])
  bfwd = dataclasses.replace(bfwd, res_avals=tuple(
      in_avals[s] if type(s) is int else next(new_res)
      for s in bfwd.res_src if s is None or type(s) is int))
  outs = rem_p.bind(*bconsts, *extra, *fwd_in, *primals, call=bcall,
                    fwd=bfwd, schedule=schedule)
  return outs, [0] * len(outs)


define(rem_p, impl=_eval, abstract_eval=_abstract_eval, jvp=_jvp,
       batching=_batch, discharge=_discharge, remat3=_remat3)
