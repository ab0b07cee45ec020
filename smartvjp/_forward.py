"""The optional forward rule ``defvjp(..., jvp=...)``: called, checked, and
batched.

``jvp(*nondiff_args, primals, tangents) -> (primal_out, tangent_out)``, the
signature of a ``jax.custom_jvp`` rule. Where a call has one, forward mode
(``jax.jvp``, ``jax.jacfwd``, ``jax.linearize``) runs it instead of
transposing ``bwd``; reverse mode never runs it. ``jax.custom_jvp`` and
``jax.custom_vjp`` cannot both be put on one function, so an opaque kernel
(a ``pure_callback``, an FFI call, a Tesseract's endpoints) gets forward mode
only through this rule.

To give the linear map (``smartvjp_lin``) what the rule needs, ``fwd``'s
residuals carry the call's primal inputs after its own ones
(``FwdSpec.jvp_primals``): forwarded inputs, so nothing is computed for them.
"""

from __future__ import annotations

import dataclasses
from typing import Callable

import jax
import jax.numpy as jnp
from jax import tree_util

from smartvjp import _facade as jx
from smartvjp._checks import describe_tree, function_name, rule_error


@dataclasses.dataclass(frozen=True, eq=False)
class JvpRule:
  """The user's forward rule ``fn`` for one ``smart_custom_vjp``."""
  fn: Callable

  @property
  def __name__(self) -> str:   # what errors call the rule
    return function_name(self.fn)

  def run(self, call, primals, in_nz, nz_tangents) -> tuple[list, list]:
    """The rule on flat leaves: ``primals`` (one per leaf of ``call``'s
    differentiable arguments) and the tangents of the leaves where ``in_nz``
    is true; the others get zero tangents (``SymbolicZero`` with
    ``symbolic_zeros=True``, else zeros; ``float0`` for integer inputs).
    Returns ``(primal_out_leaves, nz_tangent_out_leaves)``: a tangent for
    each output of ``call.out_nz``. Raises ``TypeError`` naming the rule and
    the output path where what it returns does not fit ``f``'s output."""
    rules = call.rules
    it = iter(nz_tangents)
    tangents = [next(it) if nz else _zero(a, rules.symbolic_zeros)
                for a, nz in zip(call.in_avals, in_nz)]
    py_primals = tree_util.tree_unflatten(call.in_tree, list(primals))
    py_tangents = tree_util.tree_unflatten(call.in_tree, tangents)
    with jax.named_scope(f"smartvjp/{call.name}/jvp"):
      pair = self.fn(*call.nondiff, tuple(py_primals), tuple(py_tangents))
    return _checked(call, pair)


def _zero(aval, symbolic: bool):
  zero = jx.ad_util.Zero(aval.to_tangent_aval())
  return jx.ad_util.SymbolicZero(zero.aval) if symbolic else jx.ad.instantiate_zeros(zero)


def _checked(call, pair) -> tuple[list, list]:
  rules = call.rules
  if not isinstance(pair, (tuple, list)) or len(pair) != 2:
    raise rule_error(TypeError, rules, "jvp",
                     "must return a pair (primal_output, tangent_output), "
                     f"but returned {describe_tree(pair)}.")
  primal_out, tangent_out = pair
  out_leaves, out_tree = tree_util.tree_flatten(primal_out)
  if call.out_tree is not None and out_tree != call.out_tree:
    raise rule_error(
        TypeError, rules, "jvp",
        "returned a primal output whose pytree structure differs from "
        f"{rules.name}'s output: expected {call.out_tree}, got {out_tree}.")
  is_zero = lambda x: isinstance(x, jx.ad_util.SymbolicZero)
  t_leaves, t_tree = tree_util.tree_flatten(tangent_out, is_leaf=is_zero)
  if t_tree != out_tree:
    raise rule_error(
        TypeError, rules, "jvp",
        "returned a tangent output whose pytree structure differs from its "
        f"primal output's: expected {out_tree}, got {t_tree}.")
  paths = [tree_util.keystr(p) for p, _ in
           tree_util.tree_flatten_with_path(primal_out)[0]]
  want_avals = call.out_avals or [jx.core.typeof(x) for x in out_leaves]
  nz_out = []
  for path, leaf, t, want in zip(paths, out_leaves, t_leaves, want_avals):
    where = f"output{path}" if path else "its output"
    got = jx.core.typeof(leaf)
    if (got.shape, got.dtype) != (want.shape, want.dtype):
      raise rule_error(
          TypeError, rules, "jvp",
          f"returned a primal output that differs from {rules.name}'s at "
          f"{where}: expected {want.str_short()}, got {got.str_short()}.")
    want_t = want.to_tangent_aval()
    if want_t.dtype == jx.dtypes.float0:
      continue   # integer output: no tangent
    if is_zero(t):
      nz_out.append(jnp.zeros(want_t.shape, want_t.dtype))
      continue
    got_t = jx.core.typeof(t)
    if (got_t.shape, got_t.dtype) != (want_t.shape, want_t.dtype):
      raise rule_error(
          TypeError, rules, "jvp",
          f"returned a tangent at {where} of type {got_t.str_short()}, but "
          f"the primal output's tangent type is {want_t.str_short()}.")
    nz_out.append(t)
  return out_leaves, nz_out


def tangents_only(call, primals, in_nz, nz_tangents, rule=None) -> list:
  """The rule's tangent outputs alone (the linear map's forward mode,
  ``jax.linearize`` and ``jax.jacfwd``): the rule traced on the types of
  its inputs and its primal part removed, so an opaque primal kernel inside
  it (a Tesseract's ``apply``) does not run again. Traced once per signature
  (``call.rule_cache``); ``rule``, another form of the call's rule (one
  batched by a batching rule), is traced at each use."""
  args = [*primals, *nz_tangents]
  avals = tuple(jx.core.typeof(a) for a in args)
  n = len(primals)
  key = ("jvp", avals, tuple(in_nz), jx.config.trace_context())
  hit = call.rule_cache.get(key) if rule is None else None
  if hit is None:
    run = (rule or call.rules.jvp).run

    def flat(*xs):
      return run(call, xs[:n], in_nz, xs[n:])[1]
    closed, consts = jx.trace_to_closed_jaxpr(
        flat, avals, "smart_custom_vjp jvp", call.rules.jvp.fn, avals)
    hit = (jx.dce_jaxpr_keep_inputs(closed, [True] * len(closed.out_avals)),
           consts)
    if rule is None:
      call.rule_cache.put(key, hit, consts)
  jaxpr, consts = hit
  with jax.named_scope(f"smartvjp/{call.name}/jvp"):
    return jx.core.eval_jaxpr(jaxpr.jaxpr, jaxpr.consts, *consts, *args)


@dataclasses.dataclass(frozen=True, eq=False)
class BatchedJvpRule:
  """``inner`` (the rule of ``call``, the unbatched call) under ``vmap``:
  primal leaves mapped at ``in_dims`` (0 or None), a nonzero tangent as its
  primal (every batching rule maps them alike), every output at 0 (``vmapped`` is the batching rule's ``vmap``)."""
  inner: "JvpRule | BatchedJvpRule"
  call: object
  in_dims: tuple
  vmapped: Callable
  t_dims: tuple | None = None   # the nonzero tangents' dims, if not as primals

  @property
  def __name__(self) -> str:
    return self.inner.__name__

  @property
  def fn(self) -> Callable:
    return self.inner.fn

  def run(self, bcall, primals, in_nz, nz_tangents) -> tuple[list, list]:
    del bcall

    def one(ps, ts):
      outs, touts = self.inner.run(self.call, ps, in_nz, ts)
      return tuple(outs), tuple(touts)
    t_dims = (list(self.t_dims) if self.t_dims is not None else
              [d for d, nz in zip(self.in_dims, in_nz) if nz])
    outs, touts = self.vmapped(one, (list(self.in_dims), t_dims))(
        list(primals), list(nz_tangents))
    return list(outs), list(touts)
