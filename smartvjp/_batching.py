"""Batching rules (``jax.vmap``): a batched call is a new call whose
rules are the user's under ``vmap`` (``_vmap.py``); a traced rule is
batched by batching its jaxpr. A batched equation keeps its schedule."""

from __future__ import annotations

import contextlib
import dataclasses

from smartvjp import _execute as ex
from smartvjp import _facade as jx
from smartvjp import _versions
from smartvjp import _vmap
from smartvjp._cache import differentiated_where_made, made_where_differentiated
from smartvjp._primitive import (
    call_p, jvp_p, lin_p, register, rem_p, rule_p)


# -- smartvjp_call -------------------------------------------------------------------

def _call_batching(axis_data, args, dims, *, call, fwd=None, primal=False):
  """``primal``: a ``smartvjp_primal`` (``f`` differentiated as its code,
  or as ``fwd``'s primal outputs), batched as one again, so that a
  derivative taken after ``vmap`` is still the code's (issue 70)."""
  f_consts, fwd_consts, primals, _ = call.split_jvp_args(args, fwd)
  cdims, wdims, pdims, _ = call.split_jvp_args(dims, fwd)
  if _vmap.unbatched(axis_data, dims, call.jaxpr.effects):
    return ((rule_p.bind(*args, call=call, which="f", fwd=fwd) if primal
             else call_p.bind(*args, call=call)), [None] * call.num_outs)
  primals, pdims = _vmap.to_front_or_none(axis_data, primals, pdims)
  bcall, bconsts = _vmap.batched_call(call, f_consts, cdims, pdims,
                                      axis_data)
  with (differentiated_where_made(bcall)
        if made_where_differentiated.get() is call
        else contextlib.nullcontext()):
    if not primal:
      outs = call_p.bind(*bconsts, *primals, call=bcall)
    elif fwd is None:
      outs = rule_p.bind(*bconsts, *primals, call=bcall, which="f", fwd=None)
    else:   # fwd batched too, every output mapped as bcall's are
      bfwd, extra, _ = _vmap.batched_fwd(call, fwd, axis_data,
                                         [*wdims, *pdims], out_dim=0)
      outs = rule_p.bind(*bconsts, *extra, *fwd_consts, *primals, call=bcall,
                         which="f", fwd=bfwd)
  # an output f computes from unbatched inputs only is the same for every
  # example: one copy, unbatched, as JAX returns it; differentiated, fwd ran
  # and its outputs decide (_output_batching)
  _, out_batched = jx.batching.batch_jaxpr(
      call.jaxpr, axis_data, [d is not None for d in (*cdims, *pdims)], False)
  out_batched = _output_batching(bcall, outs, out_batched)
  outs = [o if b else o[0] for o, b in zip(outs, out_batched)]
  return outs, [0 if b else None for b in out_batched]


register(call_p, "batching", _call_batching)


def _carries_tangent(x) -> bool:
  """Whether ``x`` is a tracer of the current trace, a JVP or a
  linearization, with a tangent that is not a symbolic zero."""
  return (isinstance(x, (jx.ad.JVPTracer, jx.ad.LinearizeTracer))
          and x._trace is jx.core.trace_ctx.trace  # pylint: disable=protected-access
          and type(x.tangent) is not jx.ad_util.Zero)


def _output_batching(bcall, outs, f_batched):
  """``f``'s mapped outputs, except for a call just differentiated, where
  ``fwd`` ran and decides (as for ``jax.custom_vjp``), unless
  ``generic_batching``."""
  if (all(f_batched) or bcall.rules.generic_batching
      or not any(_carries_tangent(o) for o in outs)):
    return f_batched
  mapped = getattr(bcall.rules.fwd, "mapped_outputs", {}).get("fwd")
  if mapped is None or len(mapped) != len(f_batched):
    return f_batched
  return list(mapped)


# -- smartvjp_rule ---------------------------------------------------------------------

def _rule_batching(axis_data, args, dims, **params):
  call, which, jaxpr = params["call"], params["which"], params.get("jaxpr")
  if jaxpr is not None:   # a traced backward rule (or a checked one)
    if _vmap.unbatched(axis_data, dims, jaxpr.effects):
      return rule_p.bind(*args, **params), [None] * len(jaxpr.out_avals)
    new, consts, out_batched = _vmap.batched_jaxpr(jaxpr, axis_data, dims)
    outs = rule_p.bind(*consts, *args, **dict(params, jaxpr=new))
    return outs, [0 if b else None for b in out_batched]
  fwd = params["fwd"]
  if which == "f":   # batched as the smartvjp_call it evaluates
    # jax 0.10's remat3 perturbs every input of the checkpoint, so there the
    # forward pass's primal is one even for an input no transformation
    # perturbs, whose derivative is then the rule's: a smartvjp_call
    return _call_batching(axis_data, args, dims, call=call, fwd=fwd,
                          primal=not _versions.REMAT3_PERTURBS_EVERY_INPUT)
  if _vmap.unbatched(axis_data, dims, fwd.jaxpr.effects):
    return rule_p.bind(*args, **params), [None] * len(fwd.jaxpr.out_avals)
  bfwd, extra, out_batched = _vmap.batched_fwd(call, fwd, axis_data, dims)
  outs = rule_p.bind(*extra, *args, **dict(params, fwd=bfwd))
  return outs, [0 if b else None for b in out_batched]


register(rule_p, "batching", _rule_batching)


# -- smartvjp_lin ----------------------------------------------------------------------

def _lin_batching(axis_data, args, dims, *, call, fwd, in_nz, reload):
  if all(d is None for d in dims):
    return (lin_p.bind(*args, **ex.lin_params(call, fwd, in_nz, reload)),
            [None] * sum(call.out_nz))
  n = call.num_nonlinear(fwd)
  if call.rules.jvp is not None and all(d is None for d in dims[:n]):
    # only tangents mapped (jax.jacfwd): the forward rule with its primals
    # unmapped, evaluated here
    outs = _vmap.tangents_over_mapped(call, args[n - call.num_primals:n],
                                      in_nz, args[n:], dims[n:], axis_data)
    return outs, [0] * len(outs)
  # residuals vmap does not map stay unmapped (bwd reads them so, as
  # jax.custom_vjp's batched bwd does); tangents, and the primals of the
  # fused form or of a forward rule, are mapped at 0
  keep = fwd is not None and call.rules.jvp is None
  res_mapped = [d is not None for d in dims[:n]] if keep else None
  args = [x if keep and i < n and d is None else _vmap.front(axis_data, x, d)
          for i, (x, d) in enumerate(zip(args, dims))]
  bcall = _vmap.linear_only_call(call, [0] * call.num_primals, axis_data,
                                 res_mapped)
  bfwd = fwd
  if fwd is not None:
    bfwd = dataclasses.replace(
        fwd, res_avals=tuple(jx.core.typeof(r) for r in args[:n]),
        out_avals=_vmap.batched_avals(
            fwd.out_avals, [0] * len(fwd.out_avals), axis_data))
  outs = lin_p.bind(*args, **ex.lin_params(bcall, bfwd, in_nz, reload))
  return outs, [0] * len(outs)


register(lin_p, "batching", _lin_batching)


# -- smartvjp_jvp ----------------------------------------------------------------------

def _jvp_batching(axis_data, args, dims, *, call, fwd, in_nz, schedule):
  params = dict(call=call, fwd=fwd, in_nz=in_nz, schedule=schedule)
  effects = call.jaxpr.effects | (fwd.jaxpr.effects if fwd is not None
                                  and fwd.jaxpr is not None else set())
  if _vmap.unbatched(axis_data, dims, effects):
    return jvp_p.bind(*args, **params), [None] * (call.num_outs
                                                  + sum(call.out_nz))
  f_consts, fwd_consts, primals, tangents = call.split_jvp_args(args, fwd)
  cdims, wdims, pdims, tdims = call.split_jvp_args(dims, fwd)
  if all(d is None for d in (*cdims, *wdims, *pdims)):
    return _tangents_only(axis_data, call, fwd, in_nz, schedule, f_consts,
                          fwd_consts, primals, tangents, tdims)
  # tangents are mapped at 0 (broadcast if need be), so a primal with a
  # tangent is mapped too: the batched rules see one batch, and bwd's
  # cotangent for it is per example, like its tangent
  pdims = [d if d is not None or not nz else "broadcast"
           for d, nz in zip(pdims, in_nz)]
  primals, pdims = _vmap.to_front_or_none(axis_data, primals, pdims)
  tangents = [_vmap.front(axis_data, t, d) for t, d in zip(tangents, tdims)]
  bcall, bconsts = _vmap.batched_call(call, f_consts, cdims, pdims, axis_data)
  bfwd, bfwd_consts = bcall.fwd_for(in_nz)
  outs = jvp_p.bind(*bconsts, *bfwd_consts, *primals, *tangents, call=bcall,
                    fwd=bfwd, in_nz=in_nz, schedule=schedule)
  return outs, [0] * len(outs)


register(jvp_p, "batching", _jvp_batching)


def _tangents_only(axis_data, call, fwd, in_nz, schedule, f_consts,
                   fwd_consts, primals, tangents, tdims):
  if call.rules.jvp is not None or fwd is None:
    outs = ex.primal(ex.Bind(), call, fwd, f_consts, fwd_consts, primals,
                     schedule.primal_by)
    lin_inputs = primals
  else:
    outs, lin_inputs = ex.fwd_side(call, fwd, schedule, f_consts, fwd_consts,
                                   primals)
  if call.rules.jvp is not None:
    touts = _vmap.tangents_over_mapped(call, primals, in_nz, tangents, tdims,
                                       axis_data)
  else:
    touts, _ = _lin_batching(
        axis_data, [*lin_inputs, *tangents],
        [None] * len(lin_inputs) + list(tdims),
        **ex.lin_params(call, fwd, in_nz))
  return [*outs, *touts], [None] * len(outs) + [0] * len(touts)


# -- smartvjp_rem ----------------------------------------------------------------------

def _rem_batching(axis_data, args, dims, *, call, fwd, schedule):
  """Every input and output mapped at 0, so the residuals are laid out as
  the batched ``bwd`` expects."""
  params = dict(call=call, fwd=fwd, schedule=schedule)
  if _vmap.unbatched(axis_data, dims,
                     rem_p.abstract_eval(*map(jx.core.typeof, args),
                                         **params)[1]):
    return rem_p.bind(*args, **params), [None] * call.num_outs
  args, _ = _vmap.to_front_or_none(
      axis_data, args, ["broadcast" if d is None else d for d in dims])
  f_consts, fwd_in, primals, _ = call.split_jvp_args(args, fwd)
  bcall, bconsts = _vmap.batched_call(call, f_consts, [0] * len(f_consts),
                                      [0] * len(primals), axis_data)
  bfwd, extra, _ = _vmap.batched_fwd(
      call, fwd, axis_data, [0] * len(fwd.jaxpr.in_avals), 0)
  jaxpr = bfwd.jaxpr.jaxpr
  in_avals = [v.aval for v in jaxpr.invars]
  new_res = iter(v.aval for v in jaxpr.outvars[call.num_outs:])
  bfwd = dataclasses.replace(bfwd, res_avals=tuple(
      in_avals[s] if type(s) is int else next(new_res)
      for s in bfwd.res_src if s is None or type(s) is int))
  outs = rem_p.bind(*bconsts, *extra, *fwd_in, *primals, call=bcall,
                    fwd=bfwd, schedule=schedule)
  return outs, [0] * len(outs)


register(rem_p, "batching", _rem_batching)
