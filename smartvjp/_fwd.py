"""``smartvjp_fwd``: the user's ``fwd``, with all the primitive's rules.

``[*fwd_consts, *primals] -> [*primal_outs, *new_res]``, where ``new_res``
are the residuals ``fwd`` computes (those that are inputs are forwarded,
never copied). Partial evaluation places it (the forward pass when the
policy keeps its residuals, the backward region otherwise), and nothing may
turn it into ``f`` behind the user's back except where no residual of it is
used (a ``stop_gradient`` of the call's output), as ``optimize_remat=True``
does. ``offload``: per computed residual, the memory space a policy offloads
it to, or ``None``.
"""

from __future__ import annotations

import jax

from smartvjp import _facade as jx
from smartvjp import _plan
from smartvjp import _policy
from smartvjp import _vmap
from smartvjp._checkify import checked_rule
from smartvjp._primal import bind_primal, primal_eqn
from smartvjp._spec import with_f_traced
from smartvjp._primitive import (
    dce_whole, define, discharged, eval_scoped, fwd_p, rule_jvp, scope)


def bind_fwd(*args, call, fwd, offload=None) -> list:
  """Binds ``smartvjp_fwd`` (every bind of it, JAX's evaluation of a jaxpr
  holding it included: this is its ``bind``). A residual ``fwd`` named with
  ``checkpoint_name`` leaves it through a ``checkpoint_name`` equation, as
  it leaves ``jax.custom_vjp``'s inlined ``fwd``, so that outer remat
  policies and ``jax.ad_checkpoint.print_saved_residuals`` see the name."""
  outs = type(fwd_p).bind(fwd_p, *args, call=call, fwd=fwd, offload=offload)
  n = call.num_outs
  named = [r if name is None else jx.name_p.bind(r, name=name)
           for r, name in zip(outs[n:], fwd.new_res_names)]
  return [*outs[:n], *named]


def bind_fwd_side(call, fwd, f_consts, fwd_consts, primals):
  """Runs what ``fwd`` stands for where its residuals are kept: ``fwd``, or
  ``f`` in its place when ``fwd`` computes nothing more (``_plan.fwd_or_f``).
  Returns ``(primal_outs, residuals)`` (every residual leaf)."""
  fwd_inputs = [*fwd_consts, *primals]
  kind = _plan.fwd_or_f(_policy.facts(call, fwd)).kind
  if kind is _plan.Kind.F_FOR_FWD:
    outs = bind_primal(call, fwd, f_consts, fwd_consts, primals)
    return list(outs), fwd.assemble_residuals(fwd_inputs, [])
  outs = bind_fwd(*fwd_inputs, call=call, fwd=fwd)
  n = call.num_outs
  return list(outs[:n]), fwd.assemble_residuals(fwd_inputs, outs[n:])


def _offloaded(call, outs, offload):
  if offload is None:
    return outs
  n = call.num_outs
  return [*outs[:n], *(r if space is None else jax.device_put(r, space)
                       for r, space in zip(outs[n:], offload))]


def _abstract_eval(*avals, call, fwd, offload):
  outs = list(fwd.jaxpr.out_avals)
  if offload is not None:
    n = call.num_outs
    outs[n:] = [a if space is None else a.update(memory_space=space)
                for a, space in zip(outs[n:], offload)]
  return outs, jx.positional_effects(fwd.jaxpr)


def fwd_eval(*args, call, fwd, offload):
  return _offloaded(call, eval_scoped(fwd.jaxpr, scope(call, "fwd"), args),
                    offload)


def _jvp(primals, tangents, **params):
  """Higher order: ``fwd``'s code differentiated."""
  return rule_jvp(fwd_eval, "fwd", primals, tangents, **params)


def _batch(axis_data, args, dims, *, call, fwd, offload):
  if _vmap.unbatched(axis_data, dims, fwd.jaxpr.effects):
    return (bind_fwd(*args, call=call, fwd=fwd, offload=offload),
            [None] * len(fwd.jaxpr.out_avals))
  n_out = len(fwd.jaxpr.out_avals)
  bfwd, extra, out_batched = _vmap.batched_fwd(
      call, fwd, axis_data, dims, [jx.zero_if_mapped] * n_out)
  outs = bind_fwd(*extra, *args, call=call, fwd=bfwd, offload=offload)
  return outs, [0 if b else None for b in out_batched]


def _dce(used_outputs, eqn):
  """``fwd`` some of whose residuals are unused computes only the others
  (``bwd`` does not read them); ``fwd`` none of whose residuals is used (no
  cotangent reaches the call) is just ``f``; kept when ``f`` closes over
  values ``fwd``'s equation does not carry, or when either rule has effects
  or touches references."""
  call, fwd = eqn.params["call"], eqn.params["fwd"]
  n = call.num_outs
  kept = used_outputs[n:]
  if any(kept) and not all(kept) and fwd.jaxpr is not None:
    # some residuals read, some not: fwd computes only those read
    offload = eqn.params["offload"]
    if offload is not None:
      offload = tuple(o for o, k in zip(offload, kept) if k)
    pruned = fwd.computing_only(kept)
    outvars = [*eqn.outvars[:n], *(v for v, k in zip(eqn.outvars[n:], kept)
                                   if k)]
    new_eqn = jx.new_eqn(eqn.invars, outvars, fwd_p,
                         dict(call=call, fwd=pruned, offload=offload),
                         jx.eqn_effects(pruned.jaxpr, eqn.invars), eqn)
    return [True] * len(eqn.invars), new_eqn
  if (call.fwd_only is not None and not any(used_outputs[n:])
      and any(used_outputs[:n])):
    # linearized where it was made: f was not traced; it is now, to run
    call = with_f_traced(call) or call
  if (any(used_outputs[n:]) or not any(used_outputs[:n]) or call.num_consts
      or call.jaxpr is None or fwd.jaxpr is None
      or _policy.has_effects(call, fwd) or _policy.uses_references(call)
      or not _policy.f_matches_fwd(call, fwd)):
    return dce_whole(used_outputs, eqn)
  fwd_consts, primals = eqn.invars[:fwd.num_consts], eqn.invars[fwd.num_consts:]
  new_eqn, reads_consts = primal_eqn(call, fwd, [], fwd_consts, primals,
                                     eqn.outvars[:n], eqn)
  return [reads_consts] * len(fwd_consts) + [True] * len(primals), new_eqn


def _discharge(should, *args, call, fwd, offload):
  with jax.named_scope(scope(call, "fwd")):
    new_args, outs = discharged(fwd.jaxpr, should, args)
  return new_args, _offloaded(call, outs, offload)


def _checkify(ctx, error, enabled, *args, call, fwd, offload):
  error, outs = checked_rule(
      ctx, error, enabled, lambda *xs: jx.eval_jaxpr(fwd.jaxpr.jaxpr, (), *xs),
      args, call, "fwd")
  return error, _offloaded(call, outs, offload)


define(fwd_p, impl=fwd_eval, bind=bind_fwd, abstract_eval=_abstract_eval,
       jvp=_jvp, batching=_batch, dce=_dce, discharge=_discharge,
       checkify=_checkify)
