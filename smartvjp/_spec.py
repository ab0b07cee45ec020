"""Traced forms of the user's rules: :class:`CallSpec` (``f`` for one
abstract signature, with the rules; the primitives' ``call`` param) and
:class:`FwdSpec` (``fwd`` traced lazily per perturbation pattern). Both
compare by identity, so equations sharing a spec share compiled code."""

from __future__ import annotations

import dataclasses
import functools
from typing import Any, Callable

import jax
from jax import tree_util
from jax.errors import UnexpectedTracerError

from smartvjp import _facade as jx
from smartvjp._cache import TraceLocalCache
from smartvjp._checks import (
    argument_position, check_aliased_refs, check_f_output,
    check_fwd_output, check_jax_leaves, check_primal_out, describe_tree,
    function_name, rule_error, ROLE_NAMES, zero_tangent)


def expect_used_up(it, what: str) -> None:
  """An internal invariant: ``it`` is exhausted."""
  end = object()
  if next(it, end) is not end:
    raise RuntimeError(
        f"smartvjp internal error: more {what} than expected; please report "
        "this with the program that raised it.")


@dataclasses.dataclass(frozen=True, eq=False)
class Rules:
  fun: Callable
  fwd: Callable | None
  bwd: Callable | None
  fwd_bwd: Callable | None
  symbolic_zeros: bool
  nondiff_argnums: tuple[int, ...]
  # defremat (smartvjp/_jax_api.py): keep fwd's residuals whatever the policy
  # says; ``remat``: the defremat rules to use where the policy recomputes
  always_save: bool = False
  remat: "Rules | None" = None
  # defvjp(..., generic_batching=True): under vmap an output f maps nowhere
  # stays unmapped even when fwd maps it (see _batching._output_batching)
  generic_batching: bool = False
  # defvjp(..., jvp=...): the forward rule (a _forward.JvpRule), run by
  # forward mode instead of transposing bwd
  jvp: Any = None
  # defvjp(..., fused=...): True or False forces f + fwd_bwd or fwd + bwd in
  # the rematerialized backward region (None: _plan.backward_pair chooses)
  fused: bool | None = None
  name: str = dataclasses.field(init=False)

  def __post_init__(self):
    object.__setattr__(self, "name", function_name(self.fun))

  def rule_name(self, which: str) -> str:
    return function_name(getattr(self, which))


@dataclasses.dataclass(frozen=True)
class StaticResidual:
  """A Python scalar residual: it reaches ``bwd`` as ``fwd`` returned it, as
  with ``jax.custom_vjp``."""
  value: Any


def is_static_residual(leaf) -> bool:
  return isinstance(leaf, (bool, int, float, complex)) and \
      not isinstance(leaf, jx.core.Tracer)


@dataclasses.dataclass(frozen=True, eq=False)
class FwdSpec:
  """``jaxpr``: ``[*consts, *primals] -> [*primal_outs, *new_res]``
  (``None`` where ``fwd`` ran eagerly). ``res_src[i]``: the input position
  residual leaf ``i`` forwards, ``None`` for the next of ``new_res``, or a
  :class:`StaticResidual`."""
  jaxpr: jx.ClosedJaxpr | None
  num_consts: int
  res_tree: Any
  res_avals: tuple
  res_src: tuple
  new_res_names: tuple
  # per new residual, the equations of fwd's jaxpr a remat policy is asked
  # about: its producer and, through checkpoint_name, the named value's one
  new_res_eqns: tuple = ()
  # fwd's primal output types, which may differ from f's in varying manual
  # axes or sharding (shape and dtype are checked to agree), and their tree
  out_avals: tuple = ()
  out_tree: Any = None
  # with a forward rule (``Rules.jvp``): the last ``jvp_primals`` carried
  # residuals are the call's primal inputs, for the linear map's forward
  # mode; ``bwd`` never sees them
  jvp_primals: int = 0
  # the leading inputs are values the forward pass saved (the backward side
  # of a split, or of remat3): the part producing the primal outputs costs
  # no more than ``f``
  reads_saved: bool = False
  # one side of a fwd that a remat policy split (_policy.split_fwd), as
  # jaxprs print it: "saved", the forward side (fwd's primal outputs and
  # the values the policy saves), or "rest", the backward side
  split_part: str | None = None

  @functools.cached_property
  def num_new_res(self) -> int:
    return len(self.new_res_names)

  def assemble_residuals(self, fwd_inputs, new_res):
    it = iter(new_res)
    res = [fwd_inputs[s] if type(s) is int else next(it)
           for s in self.res_src if type(s) is not StaticResidual]
    expect_used_up(it, "computed residuals")
    return res

  def residual_tree(self, residuals):
    residuals = list(residuals)
    k = self.jvp_primals
    it = iter(residuals[:len(residuals) - k])
    src = self.res_src[:len(self.res_src) - k]
    leaves = [s.value if type(s) is StaticResidual else next(it)
              for s in src]
    expect_used_up(it, "residuals")
    return tree_util.tree_unflatten(self.res_tree, leaves)

  def computing_only(self, kept) -> "FwdSpec":
    """``fwd`` computing only the new residuals ``kept`` marks (as JAX prunes
    an inlined ``fwd``); those left out become ``StaticResidual(None)``."""
    kept = list(kept)
    n_out = len(self.jaxpr.out_avals) - self.num_new_res
    jaxpr = jx.dce_jaxpr_keep_inputs(self.jaxpr, [True] * n_out + kept)
    it = iter(kept)
    src, avals, carried = [], [], iter(self.res_avals)
    for s in self.res_src:
      if type(s) is not StaticResidual:
        aval = next(carried)
        if s is None and not next(it):
          s = StaticResidual(None)
        else:
          avals.append(aval)
      src.append(s)
    pick = lambda xs: tuple(x for x, k in zip(xs, kept) if k)
    return dataclasses.replace(
        self, jaxpr=jaxpr, res_src=tuple(src), res_avals=tuple(avals),
        new_res_names=pick(self.new_res_names),
        new_res_eqns=pick(self.new_res_eqns) if self.new_res_eqns else ())

  def shifted(self, jaxpr, shift: int) -> "FwdSpec":
    return dataclasses.replace(
        self, jaxpr=jaxpr, num_consts=self.num_consts + shift,
        res_src=tuple(s + shift if type(s) is int else s
                      for s in self.res_src))

  def reading_saved(self, jaxpr, num_saved: int) -> "FwdSpec":
    return dataclasses.replace(self.shifted(jaxpr, num_saved),
                               reads_saved=True)


@dataclasses.dataclass(frozen=True, eq=False)
class CallSpec:
  """``jaxpr``: ``[*consts, *primals] -> outs``; the primals are the leaves
  of the differentiable arguments (their tuple's tree: ``in_tree``)."""
  rules: Rules
  nondiff: tuple
  num_args: int
  in_tree: Any
  in_avals: tuple
  out_tree: Any
  out_avals: tuple
  jaxpr: jx.ClosedJaxpr | None  # None for linear-only and eager specs
  num_consts: int
  # eager differentiation (see ``_process.eager_call``): what fwd (or f) returned,
  # and the concrete primal leaves it ran on
  eager: Any = None
  eager_primals: tuple = ()
  # a batched spec for the linear primitives (no f of its own): the call it
  # batches, whose f's output types its derivative follows
  origin: Any = None
  # a call linearized where it was made, f never traced (see
  # ``linearized_call``): its fwd, whose constants are the leading inputs
  fwd_only: Any = None
  # traced rules, each valid within one outer trace (see _cache.py)
  fwd_cache: TraceLocalCache = dataclasses.field(default_factory=TraceLocalCache)
  batch_cache: TraceLocalCache = dataclasses.field(
      default_factory=TraceLocalCache)
  rule_cache: TraceLocalCache = dataclasses.field(
      default_factory=TraceLocalCache)

  @functools.cached_property
  def name(self) -> str:
    return self.rules.name

  @functools.cached_property
  def scopes(self) -> dict:
    """Per role, the named scope of a user's rule in jaxprs and HLO."""
    return {r: f"smartvjp/{self.name}/{ROLE_NAMES.get(r, r)}"
            for r in (*ROLE_NAMES, "f")}

  @functools.cached_property
  def references(self) -> bool:
    """``f`` reads or writes mutable array references."""
    return ((self.jaxpr is not None and any(
        isinstance(e, jx.effects.JaxprInputEffect) for e in self.jaxpr.effects))
            or any(isinstance(a, jx.state_types.AbstractRef)
                   for a in self.in_avals))

  def num_nonlinear(self, fwd) -> int:
    """Inputs of the linear map before its tangents."""
    return len(fwd.res_avals) if fwd is not None else self.num_primals

  @functools.cached_property
  def num_primals(self) -> int:
    return len(self.in_avals)

  @functools.cached_property
  def num_outs(self) -> int:
    return len(self.out_avals)

  @functools.cached_property
  def out_nz(self) -> tuple[bool, ...]:
    return tuple(_has_tangent(a) for a in self.out_avals)

  def perturbed(self, nonzero) -> tuple[bool, ...]:
    return perturbed(nonzero, self.in_avals)

  def full_args(self, dyn_leaves) -> list:
    return full_args(self.rules, self.nondiff, self.num_args, self.in_tree,
                     dyn_leaves)

  def fwd_inputs(self, primals, in_nz):
    if self.rules.symbolic_zeros:
      return [jx.cd.CustomVJPPrimal(x, nz) for x, nz in zip(primals, in_nz)]
    return list(primals)

  def with_rules(self, rules: Rules) -> "CallSpec":
    return dataclasses.replace(self, rules=rules, fwd_cache=TraceLocalCache(),
                               batch_cache=TraceLocalCache(),
                               rule_cache=TraceLocalCache())

  def remat_call(self) -> "CallSpec | None":
    """The call with its ``defremat`` rules (``None`` without)."""
    if self.rules.remat is None:
      return None
    hit = self.batch_cache.get(("defremat",))
    if hit is None:
      hit = self.with_rules(self.rules.remat)
      self.batch_cache.put(("defremat",), hit)
    return hit

  def split_call_args(self, args) -> tuple[list, list]:
    """``(f's constants, the primals)`` from a ``smartvjp_call``'s inputs
    ``[*f_consts, *primals]``, or from anything laid out as they are (their
    tangents, nonzero flags or batch dimensions)."""
    return list(args[:self.num_consts]), list(args[self.num_consts:])

  def split_jvp_args(self, args, fwd) -> tuple[list, list, list, list]:
    n1 = self.num_consts
    n2 = n1 + (fwd.num_consts if fwd is not None else 0)
    n3 = n2 + self.num_primals
    return list(args[:n1]), list(args[n1:n2]), list(args[n2:n3]), \
        list(args[n3:])

  def expand_tangents(self, nz_outs) -> list:
    it = iter(nz_outs)
    outs = [next(it) if nz else jx.ad_util.Zero(a.to_tangent_aval())
            for a, nz in zip(self.out_avals, self.out_nz)]
    expect_used_up(it, "tangents")
    return outs

  def fwd_for(self, in_nz) -> tuple[FwdSpec | None, list]:
    if self.rules.fwd is None:
      return None, []
    key = tuple(in_nz) if self.rules.symbolic_zeros else None
    hit = self.fwd_cache.get(key)
    if hit is not None:
      return hit
    spec, consts = _trace_fwd(self, tuple(in_nz))
    self.fwd_cache.put(key, (spec, consts), consts)
    return spec, consts


def pruned(call: CallSpec, kept: tuple) -> CallSpec:
  """``call`` keeping only outputs ``kept``, with its rules pruned to match,
  as JAX's dead-code elimination prunes a ``jax.custom_vjp`` call."""
  out_avals = tuple(call.out_avals[i] for i in kept)
  return dataclasses.replace(
      call.with_rules(_pruned_rules(call, call.rules, kept)),
      jaxpr=jx.dce_jaxpr_keep_inputs(
          call.jaxpr, [i in kept for i in range(call.num_outs)]),
      out_avals=out_avals,
      out_tree=tree_util.tree_structure(tuple(range(len(out_avals)))))


class _Selecting:
  """A user's rule seen through ``how``; errors still name and locate the
  rule (``__wrapped__``)."""

  def __init__(self, rule, how):
    self.__wrapped__, self.__name__, self._how = rule, function_name(rule), how

  def __call__(self, *args):
    return self._how(self.__wrapped__, *args)


@dataclasses.dataclass(frozen=True, eq=False)
class _PrunedJvp:
  inner: Any
  full: Any
  kept: tuple

  @property
  def __name__(self) -> str:
    return self.inner.__name__

  @property
  def fn(self):
    return self.inner.fn

  def run(self, call, primals, in_nz, nz_tangents):
    del call
    outs, touts = self.inner.run(self.full, primals, in_nz, nz_tangents)
    touts = self.full.expand_tangents(touts)
    return ([outs[i] for i in self.kept],
            [touts[i] for i in self.kept if self.full.out_nz[i]])


def _pruned_rules(full: CallSpec, rules: Rules, kept: tuple) -> Rules:
  pick = lambda out: tuple(tree_util.tree_leaves(out)[i] for i in kept)

  def pair(fwd, *args):
    out = fwd(*args)
    if isinstance(out, (tuple, list)) and len(out) == 2:
      return pick(out[0]), out[1]
    return out   # not a pair: _call_fwd says so

  def cotangents(bwd, *args):   # zeros for the outputs no longer there
    cts = [zero_tangent(a, rules.symbolic_zeros) for a in full.out_avals]
    for i, c in zip(kept, args[-1]):
      cts[i] = c
    return bwd(*args[:-1], tree_util.tree_unflatten(full.out_tree, cts))

  wrap = lambda rule, how: None if rule is None else _Selecting(rule, how)
  return dataclasses.replace(
      rules, fun=wrap(rules.fun, lambda f, *args: pick(f(*args))),
      fwd=wrap(rules.fwd, pair), bwd=wrap(rules.bwd, cotangents),
      fwd_bwd=wrap(rules.fwd_bwd, cotangents),
      remat=rules.remat and _pruned_rules(full, rules.remat, kept),
      jvp=rules.jvp and _PrunedJvp(rules.jvp, full, kept))


# JAX's caches keyed on primitive params (its abstract-eval cache keeps up to
# 2048 entries) hold the specs, and with them the user's functions, weakly
jx.util.weakref_cache_key_types.update((FwdSpec, CallSpec))


@dataclasses.dataclass(eq=False)
class Unprocessed:
  """A call as ``smart_custom_vjp.__call__`` binds it, before the current
  trace processes it (``_process.py``)."""
  rules: Rules
  nondiff: tuple
  num_args: int
  in_tree: Any
  avals: tuple
  cache: TraceLocalCache
  out_tree: Any = None
  unprocessed = True   # what smartvjp_call's bind looks for

  @functools.cached_property
  def signature(self) -> tuple:
    return self.rules, self.nondiff, self.num_args, self.in_tree, self.avals


def perturbed(nonzero, avals) -> tuple[bool, ...]:
  """Which inputs carry a tangent: nonzero and not ``float0``."""
  return tuple(bool(nz) and _has_tangent(a) for nz, a in zip(nonzero, avals))


def _has_tangent(aval) -> bool:
  try:
    return aval.to_tangent_aval().dtype != jx.dtypes.float0
  except AttributeError:
    return False


def full_args(rules: Rules, nondiff: tuple, num_args: int, in_tree,
              dyn_leaves) -> list:
  """The user's arguments: the nondiff ones in their places."""
  dyn = iter(tree_util.tree_unflatten(in_tree, list(dyn_leaves)))
  fixed = dict(zip(rules.nondiff_argnums, nondiff))
  return [fixed[i] if i in fixed else next(dyn) for i in range(num_args)]


def trace_call(rules: Rules, nondiff: tuple, num_args: int, in_tree,
               in_avals: tuple) -> tuple[CallSpec, list]:
  store = {}

  def f_flat(*primals):
    out = rules.fun(*full_args(rules, nondiff, num_args, in_tree, primals))
    leaves, tree = tree_util.tree_flatten(out)
    check_jax_leaves(out, rules, "fun", "output")
    check_f_output(rules, out)
    store["out_tree"] = tree
    return leaves

  example = [jax.ShapeDtypeStruct(a.shape, a.dtype) if hasattr(a, "shape")
             else a for a in in_avals]
  closed, consts = jx.trace_to_closed_jaxpr(
      f_flat, in_avals, "smart_custom_vjp f", rules.fun, example)
  spec = CallSpec(rules=rules, nondiff=nondiff, num_args=num_args,
                  in_tree=in_tree, in_avals=in_avals,
                  out_tree=store["out_tree"], out_avals=tuple(closed.out_avals),
                  jaxpr=closed, num_consts=len(consts))
  return spec, consts


def _call_fwd(call: CallSpec, in_nz, primals):
  rules = call.rules
  check_aliased_refs(call, primals)
  pair = rules.fwd(*call.full_args(call.fwd_inputs(primals, in_nz)))
  if not isinstance(pair, (tuple, list)) or len(pair) != 2:
    raise rule_error(
        TypeError, rules, "fwd",
        "must return a pair (primal_output, residuals), "
        f"but returned {describe_tree(pair)}.")
  primal_out, res = pair
  check_fwd_output(rules, primal_out, res, primals)
  if call.out_tree is None and getattr(jax.config, "jax_custom_vjp3", False):
    # f not traced yet (differentiated where made): jax_custom_vjp3 traces
    # f and checks fwd's primal output against it, so this does too, where
    # f can be traced (an eager NumPy f is not, and works here as before)
    try:
      call = trace_call(rules, call.nondiff, call.num_args, call.in_tree,
                        call.in_avals)[0]
    except Exception:  # noqa: BLE001 - f untraceable: nothing to compare
      pass
  check_primal_out(call, primal_out)
  check_jax_leaves(primal_out, rules, "fwd", "primal output")
  check_jax_leaves(res, rules, "fwd", "residuals")
  res_leaves, res_tree = tree_util.tree_flatten(res)
  out_leaves, out_tree = tree_util.tree_flatten(primal_out)
  return out_leaves, out_tree, res_leaves, res_tree


class EagerClosureError(Exception):
  ...


def untraced(rules: Rules, nondiff: tuple, num_args: int, in_tree,
             in_avals: tuple) -> CallSpec:
  return CallSpec(rules=rules, nondiff=nondiff, num_args=num_args,
                  in_tree=in_tree, in_avals=in_avals, out_tree=None,
                  out_avals=(), jaxpr=None, num_consts=0)


def linearized_call(rules: Rules, nondiff: tuple, num_args: int, in_tree,
                    in_avals: tuple, in_nz: tuple, own_tracer) -> tuple:
  """Linearized where made (``jax.grad`` innermost): only ``fwd`` traced;
  ``None`` where ``fwd`` closes over a value this linearization
  differentiates, or fails to trace."""
  base = untraced(rules, nondiff, num_args, in_tree, in_avals)
  try:
    fwd, consts = _trace_fwd(base, in_nz)
  except UnexpectedTracerError:
    return None
  if any(own_tracer(c) for c in consts):
    return None
  return dataclasses.replace(
      base, out_tree=fwd.out_tree, out_avals=fwd.out_avals,
      num_consts=len(consts), fwd_only=fwd), consts


def eager_f(call: CallSpec, primals) -> list:
  with jax.named_scope(call.scopes["f"]):
    out = call.rules.fun(*call.full_args(primals))
  check_f_output(call.rules, out)
  return tree_util.tree_leaves(out)


def eager_fwd(call: CallSpec, in_nz, primals):
  """``(primal_outs, residuals, spec)``; ``spec`` has no jaxpr."""
  with jax.named_scope(call.scopes["fwd"]):
    outs, out_tree, res, res_tree = _call_fwd(call, tuple(in_nz), primals)
  res_src = tuple(StaticResidual(r) if is_static_residual(r) else None
                  for r in res)
  dynamic = [r for r in res if not is_static_residual(r)]
  k = 0
  if call.rules.jvp is not None:   # the primals too, for the forward rule
    k = len(primals)
    res_src += (None,) * k
    dynamic += list(primals)
  spec = FwdSpec(jaxpr=None, num_consts=0, res_tree=res_tree,
                 res_avals=tuple(jx.core.typeof(r) for r in dynamic),
                 res_src=res_src, new_res_names=(None,) * len(dynamic),
                 out_tree=out_tree, jvp_primals=k)
  return outs, dynamic, spec


def _trace_fwd(call: CallSpec, in_nz: tuple) -> tuple[FwdSpec, list]:
  rules = call.rules
  store = {}

  def fwd_flat(*primals):
    out_leaves, store["out_tree"], res_leaves, store["res_tree"] = _call_fwd(
        call, in_nz, primals)
    store["static"] = [StaticResidual(r) if is_static_residual(r) else None
                       for r in res_leaves]
    # a residual that is a mutable array reference must be one of the
    # arguments (as with jax.custom_vjp): it is forwarded, never returned
    store["ref_src"] = [None if is_static_residual(r) else
                        argument_position(r, primals) for r in res_leaves]
    return [*out_leaves,
            *(r for r, s in zip(res_leaves, store["ref_src"])
              if not is_static_residual(r) and s is None)]

  closed, consts = jx.trace_to_closed_jaxpr(
      fwd_flat, call.in_avals, "smart_custom_vjp fwd", rules.fwd,
      [jax.ShapeDtypeStruct(a.shape, a.dtype) for a in call.in_avals])
  jaxpr = closed.jaxpr
  n_out = store["out_tree"].num_leaves
  res_vars = jaxpr.outvars[n_out:]
  in_pos = {v: i for i, v in enumerate(jaxpr.invars)}
  names = {e.outvars[0]: e.params["name"] for e in jaxpr.eqns
           if e.primitive is jx.ad_checkpoint.name_p}
  producers = {v: e for e in jaxpr.eqns for v in e.outvars}
  # a residual that is an input returned through a nested jit is that input
  dyn_src = [in_pos.get(jx.forwarded_input(v, jaxpr)) for v in res_vars]
  it = iter(dyn_src)
  res_src = tuple(
      static if static is not None else
      (len(consts) + ref if ref is not None else next(it))
      for static, ref in zip(store["static"], store["ref_src"]))
  new_res = [v for v, s in zip(res_vars, dyn_src) if s is None]
  pruned = jaxpr.replace(outvars=[*jaxpr.outvars[:n_out], *new_res])
  res_avals = [jaxpr.invars[s].aval if type(s) is int else None
               for s in res_src if type(s) is not StaticResidual]
  it = iter(res_vars)
  res_avals = tuple(a if a is not None and isinstance(a, jx.state_types.AbstractRef) else next(it).aval
                    for a in res_avals)
  k = 0
  if rules.jvp is not None:   # the primals, forwarded, for the forward rule
    k = len(call.in_avals)
    res_src += tuple(len(consts) + i for i in range(k))
    res_avals += tuple(v.aval for v in jaxpr.invars[len(consts):])
  spec = FwdSpec(
      jaxpr=jx.ClosedJaxpr(pruned, ()),
      num_consts=len(consts),
      res_tree=store["res_tree"],
      out_tree=store["out_tree"],
      res_avals=res_avals,
      res_src=res_src,
      new_res_names=tuple(names.get(v) if isinstance(v, jx.core.Var) else None
                          for v in new_res),
      new_res_eqns=tuple(residual_producers(v, producers) for v in new_res),
      out_avals=tuple(v.aval for v in jaxpr.outvars[:n_out]),
      jvp_primals=k)
  return spec, consts


def residual_producers(v, producers_of) -> tuple:
  """A value's producer and, through ``checkpoint_name``, the named value's."""
  chain = []
  while type(v) is jx.core.Var and v in producers_of:
    eqn = producers_of[v]
    chain.append(eqn)
    if jx.checkpoint_name_of(eqn.primitive, eqn.params) is None:
      break
    v = eqn.invars[0]
  return tuple(chain)
