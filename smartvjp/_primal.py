"""``smartvjp_primal``: ``f``'s value where a differentiated call needs only its
primal outputs, with all the primitive's rules.

``[*f_consts, *fwd_consts, *primals] -> primal_outs``. It evaluates ``f``
where a differentiated call needs only its primal outputs: remat's forward
pass, or in the rematerialized region where ``fwd`` computes nothing more.
There ``jax.custom_vjp`` runs ``fwd``, so an outer derivative differentiates
``fwd``'s code (a straight-through estimator's ``floor`` differentiates to
zero): that JVP is why this is not ``smartvjp_call``, whose JVP is the
custom rule. Under ``vmap`` nothing differentiates it any more, and it is
batched as the ``smartvjp_call`` it evaluates.
"""

from __future__ import annotations

import jax

from smartvjp import _facade as jx
from smartvjp._checkify import checked_rule
from smartvjp._policy import uses_references
from smartvjp._primitive import (
    call_p, define, discharged, eval_scoped, primal_p, rule_jvp, scope)


def _plain_call(call) -> bool:
  """A plain ``smartvjp_call`` stands in where references are involved (its
  rules handle them; here nothing is differentiated any more)."""
  return uses_references(call)


def _num_fwd_consts(fwd) -> int:
  return 0 if fwd is None else fwd.num_consts


def bind_primal(call, fwd, f_consts, fwd_consts, primals) -> list:
  """``f``'s outputs for a differentiated call (``fwd`` its rule; ``None``
  where only ``fwd_bwd`` is given)."""
  if _plain_call(call):
    return call_p.bind(*f_consts, *primals, call=call)
  return primal_p.bind(*f_consts, *fwd_consts, *primals, call=call, fwd=fwd)


def primal_eqn(call, fwd, f_consts, fwd_consts, primals, outvars, like):
  """The equation :func:`bind_primal` would bind, with ``like``'s source
  information; also returns whether it reads ``fwd_consts``."""
  if _plain_call(call):
    ins = [*f_consts, *primals]
    return jx.new_eqn(ins, outvars, call_p, dict(call=call),
                      jx.eqn_effects(call.jaxpr, ins), like), False
  return jx.new_eqn([*f_consts, *fwd_consts, *primals], outvars, primal_p,
                    dict(call=call, fwd=fwd), call.jaxpr.effects, like), True


def split_args(args, call, fwd) -> tuple[list, list, list]:
  """``[*f_consts, *fwd_consts, *primals]`` as three lists."""
  n1 = call.num_consts
  n2 = n1 + _num_fwd_consts(fwd)
  return list(args[:n1]), list(args[n1:n2]), list(args[n2:])


def _abstract_eval(*avals, call, fwd):
  return list(call.out_avals), call.jaxpr.effects


def primal_eval(*args, call, fwd):
  f_consts, _, primals = split_args(args, call, fwd)
  return eval_scoped(call.jaxpr, scope(call, "f"), [*f_consts, *primals])


def _jvp(primals, tangents, *, call, fwd):
  """The JVP of ``fwd``'s code for the primal outputs (where JAX runs
  ``fwd``); of ``f``'s where only ``fwd_bwd`` is given, as of a ``fwd`` that
  returns ``f``'s outputs with the inputs as residuals."""
  if fwd is None:
    return rule_jvp(primal_eval, "fun", list(primals), list(tangents),
                    call=call, fwd=None)
  _, fwd_consts, xs = split_args(primals, call, fwd)
  _, fwd_consts_t, xs_t = split_args(tangents, call, fwd)

  def fwd_primal_outs(*args, call):
    outs = eval_scoped(fwd.jaxpr, scope(call, "fwd"), args)
    return outs[:call.num_outs]
  return rule_jvp(fwd_primal_outs, "fwd", [*fwd_consts, *xs],
                  [*fwd_consts_t, *xs_t], call=call)


def _batch(axis_data, args, dims, *, call, fwd):
  """Batched as the ``smartvjp_call`` it evaluates, by that primitive's
  registered batching rule (looked up, not imported: ``_call`` builds on
  this module)."""
  f_consts, _, primals = split_args(args, call, fwd)
  cdims, _, pdims = split_args(dims, call, fwd)
  return jx.batching_rule(call_p)(axis_data, [*f_consts, *primals],
                                  [*cdims, *pdims], call=call)


def _discharge(should, *args, call, fwd):
  """``f`` on its own inputs (``fwd``'s constants are not read): ``f`` may
  create and free references of its own (``jax.new_ref`` inside ``f``)."""
  n1 = call.num_consts
  n2 = n1 + _num_fwd_consts(fwd)
  with jax.named_scope(scope(call, "f")):
    return discharged(call.jaxpr, should, args,
                      [*range(n1), *range(n2, len(args))])


def _checkify(ctx, error, enabled, *args, call, fwd):
  """The forward pass's ``f`` checked; it appears only after
  differentiation, so what runs it needs no derivative."""
  return checked_rule(
      ctx, error, enabled, lambda *xs: primal_eval(*xs, call=call, fwd=fwd),
      args, call, "fun")


define(primal_p, impl=primal_eval, abstract_eval=_abstract_eval, jvp=_jvp,
       batching=_batch, discharge=_discharge, checkify=_checkify)
