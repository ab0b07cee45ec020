"""``checkify`` of a call: a new smart call whose ``f`` is checked and
whose other rules are the user's, so it stays differentiable."""

from __future__ import annotations

from jax import tree_util

from smartvjp import _facade as jx
from smartvjp._checks import (
    check_primal_out, flatten_cotangents, primal_value)
from smartvjp._primitive import call_p, replace_rule
from smartvjp._spec import Rules, trace_call


def _call_checkify(ctx, error, enabled, *args, call):
  """As with ``jax.custom_vjp``, ``fwd`` is not checked: differentiated
  after ``checkify``, the error that comes out is the one that went in."""
  err_vals, err_tree = tree_util.tree_flatten(error)
  f_consts, primals = call.split_call_args(args)
  leaves = [*err_vals, *primals]
  store = {}
  rules = _checked_rules(ctx, call, enabled, err_tree, len(err_vals),
                         list(f_consts), store)
  avals = tuple(jx.core.typeof(x) for x in leaves)
  new_call, consts = trace_call(rules, (), len(leaves),
                                tree_util.tree_structure(tuple(leaves)), avals)
  outs = call_p.bind(*consts, *leaves, call=new_call)
  n_out_err = store["tree"].num_leaves
  if not store.get("fwd_ran"):
    error = tree_util.tree_unflatten(store["tree"], outs[:n_out_err])
  return error, list(outs[n_out_err:])


def _checked_rules(ctx, call, enabled, err_tree, n_err, f_consts, store):
  user = call.rules

  def fun(*leaves):
    err, outs = jx.checkify_jaxpr(ctx, call.jaxpr.jaxpr, enabled, err_tree,
                                  *leaves[:n_err], *f_consts, *leaves[n_err:])
    err_leaves, store["tree"] = tree_util.tree_flatten(err)
    store["effects"] = jx.error_effects(err)
    return [*err_leaves, *outs]

  def fwd(*leaves):
    store["fwd_ran"] = True   # traced or run for this call: it is its rule
    in_err = tree_util.tree_unflatten(
        err_tree, [primal_value(e) for e in leaves[:n_err]])
    out, res = user.fwd(*call.full_args(leaves[n_err:]))
    check_primal_out(call, out)
    widened = jx.widen_error(in_err, store["effects"])
    return [*tree_util.tree_leaves(widened), *tree_util.tree_leaves(out)], res

  def user_cts(out, which):
    cts = flatten_cotangents(call, out, which)
    return tuple([None] * n_err + [None if type(c) is jx.ad_util.Zero else c
                                   for c in cts])

  def bwd(res, g):
    ct = tree_util.tree_unflatten(call.out_tree,
                                  list(g[store["tree"].num_leaves:]))
    return user_cts(user.bwd(*call.nondiff, res, ct), "bwd")

  def fwd_bwd(*args):
    leaves, g = args[:-1], args[-1]
    ct = tree_util.tree_unflatten(call.out_tree,
                                  list(g[store["tree"].num_leaves:]))
    return user_cts(user.fwd_bwd(*call.full_args(leaves[n_err:]), ct),
                    "fwd_bwd")

  for fn, like in ((fun, user.fun), (fwd, user.fwd), (bwd, user.bwd),
                   (fwd_bwd, user.fwd_bwd)):
    fn.__name__ = getattr(like, "__name__", fn.__name__)
  return Rules(fun=fun, fwd=fwd if user.fwd is not None else None,
               bwd=bwd if user.bwd is not None else None,
               fwd_bwd=fwd_bwd if user.fwd_bwd is not None else None,
               symbolic_zeros=user.symbolic_zeros, nondiff_argnums=(),
               generic_batching=user.generic_batching, fused=user.fused)


replace_rule(call_p, "checkify", _call_checkify)
