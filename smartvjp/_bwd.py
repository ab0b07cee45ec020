"""``smartvjp_bwd``: the user's ``bwd`` or ``fwd_bwd``, called, checked and
traced when a transpose runs, with all the primitive's rules.

What a rule may return, and the check of it, is
``_typecheck.flatten_cotangents``.
"""

from __future__ import annotations

import jax
from jax import tree_util

from smartvjp import _facade as jx
from smartvjp import _jax_api
from smartvjp import _vmap
from smartvjp._checkify import checked_rule
from smartvjp._primitive import (
    bwd_p, define, discharged, eval_scoped, rule_jvp, scope)
from smartvjp._typecheck import bwd_checks_disabled, flatten_cotangents


def _prepare_cts(call, cts_out):
  if call.rules.symbolic_zeros:
    return [jx.SymbolicZero(ct.aval) if type(ct) is jx.Zero else ct
            for ct in cts_out]
  return [jx.instantiate_zeros(ct) for ct in cts_out]


def run_bwd(call, fwd, residuals, cts_out) -> list:
  """``bwd(*nondiff, res, g)``, one cotangent (array or ``Zero``) per primal leaf."""
  rules = call.rules

  def user(res, cts):
    py_res = fwd.residual_tree(res)
    py_ct = tree_util.tree_unflatten(call.out_tree, list(cts))
    return flatten_cotangents(call, rules.bwd(*call.nondiff, py_res, py_ct),
                              "bwd")
  return _bind_rule(call, "bwd", fwd, user, list(residuals),
                    _prepare_cts(call, cts_out))


def run_fwd_bwd(call, primals, in_nz, cts_out) -> list:
  """``fwd_bwd(*args, g)``, one cotangent (array or ``Zero``) per primal leaf."""
  rules = call.rules

  def user(primals, cts):
    args = call.full_args(call.fwd_inputs(primals, in_nz))
    py_ct = tree_util.tree_unflatten(call.out_tree, list(cts))
    return flatten_cotangents(call, rules.fwd_bwd(*args, py_ct), "fwd_bwd")
  return _bind_rule(call, "fwd_bwd", tuple(in_nz), user, list(primals),
                    _prepare_cts(call, cts_out))


def _bind_rule(call, which, key, user, inputs, cts):
  """Traces ``user`` (a rule) once per signature and binds ``smartvjp_bwd``.

  Only nonzero cotangents are inputs of the traced rule; ``SymbolicZero``
  ones (``symbolic_zeros=True``) are part of the signature.
  """
  zero_in = tuple(type(c) is jx.SymbolicZero for c in cts)
  args = [*inputs, *(c for c, z in zip(cts, zero_in) if not z)]
  if jx.stages_nothing():
    # eager (perhaps under vmap or jvp, as in an eager vmap(grad(F))): the
    # rule runs on the values themselves, as jax.custom_vjp runs bwd, so an
    # unbatched residual reaches it as a concrete array
    return user(inputs, cts)
  avals = tuple(jx.get_aval(a) for a in args)
  cache_key = (which, key, avals, zero_in, jx.config_key(),
               bwd_checks_disabled())
  hit = call.rule_cache.get(cache_key)
  if hit is None:
    store = {}

    def flat(*args):
      ins, nz_cts = args[:len(inputs)], iter(args[len(inputs):])
      full = [c if z else next(nz_cts) for c, z in zip(cts, zero_in)]
      with _jax_api.collecting_logs() as sink:
        outs = user(ins, full)
      log_leaves, store["logs"] = tree_util.tree_flatten(
          _jax_api.merged_logs(sink))
      store["zero_out"] = tuple(type(o) is jx.Zero for o in outs)
      return [o for o in outs if type(o) is not jx.Zero] + log_leaves

    jaxpr, consts = jx.trace_to_closed_jaxpr(
        flat, avals, f"smart_custom_vjp {which}", getattr(call.rules, which),
        avals)
    hit = (jaxpr, consts, store["zero_out"], store["logs"])
    call.rule_cache.put(cache_key, hit, consts)
  jaxpr, consts, zero_out, logs_tree = hit
  outs = bwd_p.bind(*consts, *args, call=call, which=which, jaxpr=jaxpr)
  n_logs = logs_tree.num_leaves
  if n_logs:   # the logs bwd returned, as outputs of the equation
    outs, log_leaves = outs[:-n_logs], outs[-n_logs:]
    _jax_api.deposit_logs(tree_util.tree_unflatten(logs_tree, log_leaves))
  outs = iter(outs)
  return [jx.Zero(jx.ct_aval(a)) if z else next(outs)
          for a, z in zip(call.in_avals, zero_out)]


# -- smartvjp_bwd's rules ------------------------------------------------------------
# ``[*consts, *inputs, *nz_cts] -> nz_cts_in``; ``which`` is "bwd" or
# "fwd_bwd", ``jaxpr`` the rule traced (constants as leading inputs).

def _abstract_eval(*avals, call, which, jaxpr):
  return list(jaxpr.out_avals), jx.positional_effects(jaxpr)


def bwd_eval(*args, call, which, jaxpr):
  return eval_scoped(jaxpr, scope(call, which), args)


def _jvp(primals, tangents, **params):
  """Higher order: the rule's code differentiated (JAX's error, with a note
  naming the rule, for an opaque one)."""
  return rule_jvp(bwd_eval, params["which"], primals, tangents, **params)


def _transpose(cts, *args, call, which, jaxpr):
  """``bwd``/``fwd_bwd`` are linear in the cotangent; forward mode
  transposes them (which fails, and forward mode says so, when they are
  opaque)."""
  undefined = [jx.is_undefined_primal(a) for a in args]
  lin_avals = [a.aval for a, u in zip(args, undefined) if u]

  def linear_part(*lin):
    it = iter(lin)
    full = [next(it) if u else a for a, u in zip(args, undefined)]
    return bwd_eval(*full, call=call, which=which, jaxpr=jaxpr)

  transposed = jax.linear_transpose(linear_part, *lin_avals)  # full types
  out_cts = transposed([jx.instantiate_zeros(c) for c in cts])
  it = iter(out_cts)
  return [next(it) if u else None for u in undefined]


def _batch(axis_data, args, dims, *, call, which, jaxpr):
  if _vmap.unbatched(axis_data, dims, jaxpr.effects):
    return (bwd_p.bind(*args, call=call, which=which, jaxpr=jaxpr),
            [None] * len(jaxpr.out_avals))
  new, consts, out_batched = _vmap.batched_jaxpr(jaxpr, axis_data, dims)
  outs = bwd_p.bind(*consts, *args, call=call, which=which, jaxpr=new)
  return outs, [0 if b else None for b in out_batched]


def _dce(used_outputs, eqn):
  """The traced rule's dead code removed: the inputs it does not read (a
  residual that ``bwd`` ignores) and the outputs nobody uses leave the
  equation, as they leave the inlined ``bwd`` of a ``jax.custom_vjp``; the
  ``fwd`` producing such a residual then computes less (``_fwd._dce``)."""
  jaxpr = eqn.params["jaxpr"]
  if not any(used_outputs) and not jx.effects_keep_alive(eqn.effects):
    return [False] * len(eqn.invars), None
  pruned, used_inputs = jx.dce_jaxpr(jaxpr.jaxpr, used_outputs)
  if all(used_inputs) and all(used_outputs):
    return used_inputs, eqn
  invars = [v for v, u in zip(eqn.invars, used_inputs) if u]
  outvars = [v for v, u in zip(eqn.outvars, used_outputs) if u]
  closed = jx.ClosedJaxpr(pruned, ())
  new_eqn = jx.new_eqn(invars, outvars, bwd_p,
                       dict(eqn.params, jaxpr=closed),
                       jx.eqn_effects(closed, invars), eqn)
  return used_inputs, new_eqn


def _discharge(should, *args, call, which, jaxpr):
  with jax.named_scope(scope(call, which)):
    return discharged(jaxpr, should, args)


def _checkify(ctx, error, enabled, *args, call, which, jaxpr):
  return checked_rule(
      ctx, error, enabled,
      lambda *xs: bwd_eval(*xs, call=call, which=which, jaxpr=jaxpr), args,
      call, which)


define(bwd_p, impl=bwd_eval, abstract_eval=_abstract_eval, jvp=_jvp,
       transpose=_transpose, batching=_batch, dce=_dce, discharge=_discharge,
       checkify=_checkify,
       # evaluated inline where the traced rule holds high-level primitives
       # (checkpoint_name under jax_remat3) and JAX needs low-level ones
       to_lojax=bwd_eval)
