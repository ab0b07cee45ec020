"""Calling the user's ``bwd`` and ``fwd_bwd`` and checking what they return.

The checks follow ``jax.custom_vjp``'s (``_flatten_bwd`` in
``jax/_src/custom_derivatives.py``): one entry per differentiable argument,
``None`` for "no cotangent", shapes and dtypes of the corresponding inputs,
and cotangents of integer inputs ignored (they are ``float0``).
"""

from __future__ import annotations

import jax.numpy as jnp
from jax import tree_util

from smartvjp import _compat as C
from smartvjp._errors import describe_tree, rule_error
from smartvjp._primitives import rule_p


def _prepare_cts(call, cts_out):
  if call.rules.symbolic_zeros:
    return [C.SymbolicZero(ct.aval) if type(ct) is C.Zero else ct
            for ct in cts_out]
  return [C.instantiate_zeros(ct) for ct in cts_out]


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
  zero_in = tuple(type(c) is C.SymbolicZero for c in cts)
  args = [*inputs, *(c for c, z in zip(cts, zero_in) if not z)]
  if C.is_eval_trace() and not any(isinstance(a, C.Tracer) for a in args):
    return user(inputs, cts)  # concrete values: run the rule itself, eagerly
  avals = tuple(C.get_aval(a) for a in args)
  cache_key = (which, key, avals, zero_in, C.config_key())
  hit = call.rule_cache.get(cache_key)
  if hit is None:
    store = {}

    def flat(*args):
      ins, nz_cts = args[:len(inputs)], iter(args[len(inputs):])
      full = [c if z else next(nz_cts) for c, z in zip(cts, zero_in)]
      outs = user(ins, full)
      store["zero_out"] = tuple(type(o) is C.Zero for o in outs)
      return [o for o in outs if type(o) is not C.Zero]

    jaxpr, consts = C.trace_to_closed_jaxpr(
        flat, avals, f"smart_custom_vjp {which}", getattr(call.rules, which),
        avals)
    hit = (jaxpr, consts, store["zero_out"])
    call.rule_cache.put(cache_key, hit, consts)
  jaxpr, consts, zero_out = hit
  outs = iter(rule_p.bind(*consts, *args, call=call, which=which, jaxpr=jaxpr))
  return [C.Zero(_ct_aval(a)) if z else next(outs)
          for a, z in zip(call.in_avals, zero_out)]


def _inexact(dtype) -> bool:
  return jnp.issubdtype(dtype, jnp.inexact)


def _ct_aval(aval):
  return aval.to_ct_aval() if hasattr(aval, "to_ct_aval") \
      else aval.to_tangent_aval()


def flatten_cotangents(call, out, which: str) -> list:
  """Checks a rule's cotangent output; returns arrays or ``Zero`` per leaf."""
  rules = call.rules
  arg_trees = tree_util.treedef_children(call.in_tree)
  if isinstance(out, list) and len(out) == len(arg_trees):
    out = tuple(out)
  if not isinstance(out, tuple) or len(out) != len(arg_trees):
    n = len(arg_trees)
    raise rule_error(
        TypeError, rules, which,
        f"must return a tuple with one cotangent (or None) per "
        f"differentiable argument of {rules.name}, i.e. of length {n} "
        f"matching the structure {call.in_tree}, but returned "
        f"{describe_tree(out)}.")
  sentinel_leaves = [object() for _ in range(call.in_tree.num_leaves)]
  dummy = tree_util.tree_unflatten(call.in_tree, sentinel_leaves)
  position = {id(s): i for i, s in enumerate(sentinel_leaves)}
  flat: list = [None] * call.in_tree.num_leaves

  def visit(path, ct, d):
    leaves = tree_util.tree_leaves(d)
    if ct is None:
      return
    if len(leaves) != 1 or leaves[0] is not d:
      raise rule_error(
          TypeError, rules, which,
          f"returned a single value at output{tree_util.keystr(path)} where "
          f"a pytree of structure {tree_util.tree_structure(d)} (the "
          "argument's structure) or None was expected.")
    flat[position[id(d)]] = (path, ct)

  try:
    tree_util.tree_map_with_path(visit, out, dummy,
                                 is_leaf=lambda x: x is None)
  except ValueError as e:
    got = tree_util.tree_structure(out, is_leaf=lambda x: x is None)
    raise rule_error(
        TypeError, rules, which,
        f"returned cotangents with pytree structure {got}, but the "
        f"differentiable arguments of {rules.name} have structure "
        f"{call.in_tree} (None is allowed for any subtree). Details: {e}"
    ) from None

  results = []
  for entry, aval in zip(flat, call.in_avals):
    ct_aval = _ct_aval(aval)
    if entry is None or ct_aval.dtype == C.float0:
      results.append(C.Zero(ct_aval))
      continue
    path, ct = entry
    if type(ct) is C.SymbolicZero:
      if (ct.aval.shape, ct.aval.dtype) != (ct_aval.shape, ct_aval.dtype):
        raise rule_error(
            ValueError, rules, which,
            f"returned a SymbolicZero at output{tree_util.keystr(path)} of "
            f"type {ct.aval.str_short()}, but the corresponding input has "
            f"cotangent type {ct_aval.str_short()}.")
      results.append(C.Zero(ct_aval))
      continue
    try:
      got = C.get_aval(ct)
    except TypeError:
      raise rule_error(
          TypeError, rules, which,
          f"returned a value of type {type(ct).__name__} at "
          f"output{tree_util.keystr(path)}, which is not a JAX array.") from None
    if (got.shape == ct_aval.shape and got.dtype != ct_aval.dtype
        and _inexact(ct_aval.dtype) and _inexact(got.dtype)):
      # jax.custom_vjp lets a float cotangent of another precision through
      # (mixed precision); we cast it to the input's cotangent dtype
      ct = ct.astype(ct_aval.dtype)
      got = C.get_aval(ct)
    if got.shape != ct_aval.shape or got.dtype != ct_aval.dtype:
      raise rule_error(
          ValueError, rules, which,
          f"returned a cotangent of type {got.str_short()} at "
          f"output{tree_util.keystr(path)}, but the corresponding input of "
          f"{rules.name} has type {aval.str_short()} (expected cotangent "
          f"{ct_aval.str_short()}).")
    if not C.typecompat(ct_aval, got):
      raise rule_error(
          ValueError, rules, which,
          f"returned a cotangent of type {got.str_short()} at "
          f"output{tree_util.keystr(path)}, whose sharding or varying manual "
          f"axes (shard_map) differ from those of the corresponding input of "
          f"{rules.name}, {aval.str_short()} (expected cotangent "
          f"{ct_aval.str_short()}); a psum over the missing axes is usually "
          "what is needed.")
    results.append(ct)
  return results
