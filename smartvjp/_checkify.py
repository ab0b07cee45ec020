"""``jax.experimental.checkify`` of a rule's code: what the checkify rules of
smartvjp's primitives share.

``checkify`` interprets a jaxpr equation by equation and turns each
``checkify.check`` (and, when enabled, each NaN, division and index check)
into an error value that flows alongside the program's values. smartvjp's
primitives hide the user's code in their params, so each has a checkify
rule (in its own module) that interprets that code the same way, here:
the code is traced, checked, and bound as a ``smartvjp_bwd`` equation over
the checked jaxpr, named after the rule. ``smartvjp_call``'s rule instead
makes a new smart call whose ``f`` is checked (see ``_call.py``), so that the
result stays differentiable with the user's rules, as with
``jax.custom_vjp``.
"""

from __future__ import annotations

from jax import tree_util

from smartvjp import _facade as jx
from smartvjp._primitive import bwd_p


def checked_rule(ctx, error, enabled, fn, args, call, which):
  """Traces ``fn(*args)`` (a rule's code: ``which`` is ``"fun"``, ``"fwd"``,
  ``"bwd"`` or ``"fwd_bwd"``), checks it, and binds it as ``smartvjp_bwd``;
  returns ``(error, outs)``."""
  what = f"smart_custom_vjp {'f' if which == 'fun' else which}"
  err_vals, err_tree = tree_util.tree_flatten(error)
  n_err = len(err_vals)
  avals = [jx.get_aval(a) for a in args]
  name_fun = getattr(call.rules, which) or call.rules.fun
  inner, inner_consts = jx.trace_to_closed_jaxpr(
      lambda *xs: list(fn(*xs)), avals, what, name_fun, avals)
  store = {}

  def checked(*xs):
    err, outs = jx.checkify_jaxpr(ctx, inner.jaxpr, enabled, err_tree,
                                  *xs[:n_err], *inner_consts, *xs[n_err:])
    leaves, store["tree"] = tree_util.tree_flatten(err)
    return [*leaves, *outs]

  all_avals = [*(jx.get_aval(e) for e in err_vals), *avals]
  jaxpr, consts = jx.trace_to_closed_jaxpr(checked, all_avals, what, name_fun,
                                           all_avals)
  outs = bwd_p.bind(*consts, *err_vals, *args, call=call, which=which,
                    jaxpr=jaxpr)
  n_out_err = store["tree"].num_leaves
  return (tree_util.tree_unflatten(store["tree"], outs[:n_out_err]),
          list(outs[n_out_err:]))
