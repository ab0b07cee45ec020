"""What ``jax.custom_vjp`` refuses about mutable array references, refused here.

JAX's mutable array checks (``jax_mutable_array_checks``, on by default)
refuse three things at a ``jax.custom_vjp`` call, each with a ``ValueError``:

* one mutable array passed through two differentiable arguments (``bwd``
  would return two cotangents for it);
* ``f`` returning a reference (its outputs are values);
* ``fwd`` returning a reference among its primal outputs, or one among its
  residuals that is not one of its own arguments (a residual reference is
  forwarded from the arguments to ``bwd``, never created).

The messages name the user's function and rule, each argument by its
parameter name with the pytree path inside it, and the reference's type.
"""

from __future__ import annotations

import inspect

from jax import tree_util

from smartvjp import _facade as jx
from smartvjp._errors import rule_error


def _checks_on() -> bool:
  return jx.mutable_array_checks_enabled()


def argument_leaf_names(rules, num_args: int, in_tree) -> list[str]:
  """The name of each differentiable argument leaf, as the user wrote the
  call: the parameter name, then the path inside it (``x_ref``,
  ``params['w']``, ``args[2]`` for a ``*args`` position)."""
  params = _parameter_names(rules.fun, num_args)
  dyn = [i for i in range(num_args) if i not in rules.nondiff_argnums]
  skeleton = tree_util.tree_unflatten(in_tree, [0] * in_tree.num_leaves)
  names = []
  for path, _ in tree_util.tree_flatten_with_path(skeleton)[0]:
    names.append(params[dyn[path[0].idx]] + tree_util.keystr(path[1:]))
  return names


def _parameter_names(fun, num_args: int) -> list[str]:
  try:
    sig = inspect.signature(fun)
  except (TypeError, ValueError):
    return [f"args[{i}]" for i in range(num_args)]
  named, rest = [], None
  for p in sig.parameters.values():
    if p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD):
      named.append(p.name)
    elif p.kind is p.VAR_POSITIONAL:
      rest = p.name
  rest = rest or "args"
  return [named[i] if i < len(named) else f"{rest}[{i - len(named)}]"
          for i in range(num_args)]


def aliased_refs(leaves) -> list:
  """Pairs ``(i, j)``, ``i < j``, of positions in ``leaves`` holding
  references to one mutable array, when JAX's mutable array checks are on;
  empty otherwise."""
  if not _checks_on():
    return []
  first, pairs = {}, []
  for j, x in enumerate(leaves):
    x = x.value if isinstance(x, jx.CustomVJPPrimal) else x
    if jx.is_ref(x):
      i = first.setdefault(jx.referent_id(x), j)
      if i != j:
        pairs.append((i, j))
  return pairs


def check_aliased_arguments(rules, role: str, num_args: int, in_tree,
                            primals) -> None:
  """Raises ``ValueError`` naming ``role`` and both arguments when two of
  ``primals`` (the differentiable argument leaves) are references to one
  mutable array (only with JAX's mutable array checks on)."""
  pairs = aliased_refs(primals)
  if not pairs:
    return
  i, j = pairs[0]
  names = argument_leaf_names(rules, num_args, in_tree)
  leaf = primals[j]
  leaf = leaf.value if isinstance(leaf, jx.CustomVJPPrimal) else leaf
  raise rule_error(
      ValueError, rules, role,
      f"received one mutable array through two differentiable arguments, "
      f"{names[i]} and {names[j]} (a reference of type "
      f"{jx.get_aval(leaf).str_short()}); pass each mutable array at "
      "most once among the differentiable arguments, since bwd returns one "
      "cotangent per argument.")


def check_aliased_refs(call, primals) -> None:
  """:func:`check_aliased_arguments` for ``fwd`` of a traced or eager call."""
  check_aliased_arguments(call.rules, "fwd", call.num_args, call.in_tree,
                          primals)


def _first_ref(tree):
  for path, leaf in tree_util.tree_flatten_with_path(tree)[0]:
    if jx.is_ref(leaf):
      return tree_util.keystr(path), leaf
  return None


def _at(what: str, path: str) -> str:
  return f" at {what}{path}" if path else ""


def check_f_output(rules, out) -> None:
  """Raises ``ValueError`` when ``f``'s output holds a reference."""
  if not _checks_on():
    return
  hit = _first_ref(out)
  if hit is not None:
    path, leaf = hit
    raise rule_error(
        ValueError, rules, "fun",
        f"returned a mutable array reference of type "
        f"{jx.get_aval(leaf).str_short()}{_at('output', path)}; f must "
        "return values: read the reference (ref[...]) to return its value.")


def check_fwd_output(rules, primal_out, res, primals) -> None:
  """Raises ``ValueError`` when ``fwd``'s primal output holds a reference,
  or its residuals one that is not among ``primals`` (its differentiable
  arguments, possibly wrapped as ``CustomVJPPrimal``)."""
  if _checks_on():
    hit = _first_ref(primal_out)
    if hit is not None:
      path, leaf = hit
      raise rule_error(
          ValueError, rules, "fwd",
          f"returned a mutable array reference of type "
          f"{jx.get_aval(leaf).str_short()} in its primal output"
          f"{_at('output', path)}; like f, fwd must return values there "
          "(residuals may hold the references fwd received as arguments).")
  passed = {id(p.value if isinstance(p, jx.CustomVJPPrimal) else p)
            for p in primals}
  for path, leaf in tree_util.tree_flatten_with_path(res)[0]:
    leaf = leaf.value if isinstance(leaf, jx.CustomVJPPrimal) else leaf
    if jx.is_ref(leaf) and id(leaf) not in passed:
      raise rule_error(
          ValueError, rules, "fwd",
          f"returned a mutable array reference of type "
          f"{jx.get_aval(leaf).str_short()} among its residuals"
          f"{_at('residuals', tree_util.keystr(path))} that is not one of its "
          "differentiable arguments; only references passed to fwd can be "
          "residuals (bwd receives them to write into).")


def argument_position(leaf, primals):
  """For a residual leaf that is a reference, its position among
  ``primals`` (:func:`check_fwd_output` has made sure it is there);
  ``None`` for any other residual."""
  leaf = leaf.value if isinstance(leaf, jx.CustomVJPPrimal) else leaf
  if not jx.is_ref(leaf):
    return None
  for i, p in enumerate(primals):
    if (p.value if isinstance(p, jx.CustomVJPPrimal) else p) is leaf:
      return i
  raise RuntimeError(
      "smartvjp internal error: a residual reference that fwd did not "
      "receive passed the check; please report this with the program.")
