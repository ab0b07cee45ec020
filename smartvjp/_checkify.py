"""``jax.experimental.checkify`` rules: checks inside the user's rules become
error values, as with ``jax.custom_vjp``.

``checkify`` interprets a jaxpr equation by equation and turns each
``checkify.check`` (and, when enabled, each NaN, division and index check)
into an error value that flows alongside the program's values. Our
primitives hide the user's code in their params, so each needs a rule that
interprets that code the same way:

* ``smartvjp_call`` (``f``) becomes a new smart call over
  ``[*error_leaves, *primals]`` whose ``f`` is the checked ``f`` (its output
  carries the updated error) and whose ``fwd``/``bwd``/``fwd_bwd`` are the
  user's rules around it, so the result stays differentiable with the same
  rules. As ``jax.custom_vjp`` does, ``fwd`` is not checked there: where
  the call is differentiated after ``checkify`` (``jax.vjp`` of a checkified
  function, eager or under ``jit``), the error that comes out is the one
  that went in, with none of ``f``'s checks added (``err._metadata`` as
  ``jax.custom_vjp`` leaves it), and a check in ``fwd`` or ``bwd`` raises
  when it runs, as with ``jax.custom_vjp``.
* ``smartvjp_fwd`` and ``smartvjp_bwd`` (``fwd``, ``bwd``, ``fwd_bwd``, as
  they appear in ``checkify(jax.grad(...))``, where ``jax.custom_vjp`` has
  inlined them) run their traced rule checked, as a ``smartvjp_bwd``
  equation over the checked jaxpr.
* ``smartvjp_jvp``/``smartvjp_lin``/``smartvjp_fused_lin`` (forward mode, and
  the jvp left in a checkpointed body by ``jax.jvp``/``jax.linearize``) run
  their forward-mode evaluation checked, the same way.
"""

from __future__ import annotations

from functools import partial

import jax
from jax import tree_util

from smartvjp import _compat
from smartvjp._ad import _fused_lin_forward, _jvp_forward, _lin_forward
from smartvjp._bwd import flatten_cotangents
from smartvjp._primitives import (
    call_p, fused_lin_p, fwd_p, jvp_p, lin_p, primal_eval, primal_p, bwd_eval,
    bwd_p)
from smartvjp._spec import Rules, _check_primal_out, trace_call


def _checked_rule(ctx, error, enabled, fn, args, call, which, what):
  """Traces ``fn(*args)``, checks it, and binds it as ``smartvjp_bwd``
  (``which`` names the rule); returns ``(error, outs)``."""
  err_vals, err_tree = tree_util.tree_flatten(error)
  n_err = len(err_vals)
  avals = [_compat.get_aval(a) for a in args]
  name_fun = getattr(call.rules, which) or call.rules.fun
  inner, inner_consts = _compat.trace_to_closed_jaxpr(
      lambda *xs: list(fn(*xs)), avals, what, name_fun, avals)
  store = {}

  def checked(*xs):
    err, outs = _compat.checkify_jaxpr(ctx, inner.jaxpr, enabled, err_tree,
                                 *xs[:n_err], *inner_consts, *xs[n_err:])
    leaves, store["tree"] = tree_util.tree_flatten(err)
    return [*leaves, *outs]

  all_avals = [*(_compat.get_aval(e) for e in err_vals), *avals]
  jaxpr, consts = _compat.trace_to_closed_jaxpr(checked, all_avals, what, name_fun,
                                          all_avals)
  outs = bwd_p.bind(*consts, *err_vals, *args, call=call, which=which,
                     jaxpr=jaxpr)
  n_out_err = store["tree"].num_leaves
  return (tree_util.tree_unflatten(store["tree"], outs[:n_out_err]),
          list(outs[n_out_err:]))


def _fwd_checkify(ctx, error, enabled, *args, call, fwd, offload):
  error, outs = _checked_rule(
      ctx, error, enabled,
      lambda *xs: _compat.eval_jaxpr(fwd.jaxpr.jaxpr, (), *xs), args, call, "fwd",
      "smart_custom_vjp fwd")
  if offload is not None:  # residuals a policy offloads, as in fwd_eval
    n = call.num_outs
    outs[n:] = [r if space is None else jax.device_put(r, space)
                for r, space in zip(outs[n:], offload)]
  return error, outs


def _primal_checkify(ctx, error, enabled, *args, call, fwd):
  """The forward pass's ``f`` (``smartvjp_primal``) checked; it appears only
  after differentiation, so what runs it needs no derivative."""
  return _checked_rule(
      ctx, error, enabled, partial(primal_eval, call=call, fwd=fwd), args,
      call, "fun", "smart_custom_vjp f")


def _bwd_checkify(ctx, error, enabled, *args, call, which, jaxpr):
  return _checked_rule(
      ctx, error, enabled,
      partial(bwd_eval, call=call, which=which, jaxpr=jaxpr), args, call,
      which, f"smart_custom_vjp {which}")


def _forward_mode_checkify(impl, which_of):
  def rule(ctx, error, enabled, *args, **params):
    which = which_of(params)
    return _checked_rule(ctx, error, enabled, partial(impl, **params), args,
                         params["call"], which, f"smart_custom_vjp {which}")
  return rule


def _lin_which(params):
  return "bwd"


def _fused_lin_which(params):
  return "fwd_bwd"


def _jvp_which(params):
  return "bwd" if params["fwd"] is not None else "fwd_bwd"


# -- smartvjp_call: a new smart call whose f is checked ------------------------

def _call_checkify(ctx, error, enabled, *args, call):
  err_vals, err_tree = tree_util.tree_flatten(error)
  f_consts, primals = args[:call.num_consts], args[call.num_consts:]
  leaves = [*err_vals, *primals]
  store = {}
  rules = _checked_rules(ctx, call, enabled, err_tree, len(err_vals),
                         list(f_consts), store)
  avals = tuple(_compat.get_aval(x) for x in leaves)
  in_tree = tree_util.tree_structure(tuple(leaves))
  new_call, consts = trace_call(rules, (), len(leaves), in_tree, avals)
  outs = call_p.bind(*consts, *leaves, call=new_call)
  n_out_err = store["tree"].num_leaves
  if store.get("fwd_ran"):
    # differentiated after checkify (jax.vjp of a checkified function): the
    # call's rule is fwd, which adds no checks, so the error that comes out
    # is the one that went in, as jax.custom_vjp's checkify rule returns it
    # (f's checks are not added, not even as checks that never fire)
    return error, list(outs[n_out_err:])
  return (tree_util.tree_unflatten(store["tree"], outs[:n_out_err]),
          list(outs[n_out_err:]))


def _value(x):
  return x.value if isinstance(x, _compat.CustomVJPPrimal) else x


def _checked_rules(ctx, call, enabled, err_tree, n_err, f_consts, store):
  """The user's rules over ``[*error_leaves, *primal_leaves]``: ``f`` checked,
  ``fwd`` passing the incoming error through, cotangents of errors ``None``."""
  user = call.rules

  def fun(*leaves):
    err, outs = _compat.checkify_jaxpr(ctx, call.jaxpr.jaxpr, enabled, err_tree,
                                 *leaves[:n_err], *f_consts, *leaves[n_err:])
    err_leaves, store["tree"] = tree_util.tree_flatten(err)
    store["effects"] = _compat.error_effects(err)
    return [*err_leaves, *outs]

  def fwd(*leaves):
    store["fwd_ran"] = True   # traced or run for this call: it is its rule
    in_err = tree_util.tree_unflatten(err_tree,
                                      [_value(e) for e in leaves[:n_err]])
    out, res = user.fwd(*call.full_args(leaves[n_err:]))
    _check_primal_out(call, out)
    widened = _compat.widen_error(in_err, store["effects"])
    return [*tree_util.tree_leaves(widened), *tree_util.tree_leaves(out)], res

  def user_cts(out, which):
    cts = flatten_cotangents(call, out, which)
    return tuple([None] * n_err + [None if type(c) is _compat.Zero else c
                                   for c in cts])

  def bwd(res, g):
    ct = tree_util.tree_unflatten(call.out_tree, list(g[n_err_out():]))
    return user_cts(user.bwd(*call.nondiff, res, ct), "bwd")

  def fwd_bwd(*args):
    leaves, g = args[:-1], args[-1]
    ct = tree_util.tree_unflatten(call.out_tree, list(g[n_err_out():]))
    return user_cts(user.fwd_bwd(*call.full_args(leaves[n_err:]), ct),
                    "fwd_bwd")

  def n_err_out():
    return store["tree"].num_leaves

  for fn, like in ((fun, user.fun), (fwd, user.fwd), (bwd, user.bwd),
                   (fwd_bwd, user.fwd_bwd)):
    fn.__name__ = getattr(like, "__name__", fn.__name__)
  return Rules(fun=fun, fwd=fwd if user.fwd is not None else None,
               bwd=bwd if user.bwd is not None else None,
               fwd_bwd=fwd_bwd if user.fwd_bwd is not None else None,
               symbolic_zeros=user.symbolic_zeros, nondiff_argnums=(),
               generic_batching=user.generic_batching)


