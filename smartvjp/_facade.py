"""The one module that imports JAX internals (``jax._src``).

JAX's private modules are exported as namespaces (``jx.core``, ``jx.ad``,
``jx.pe``, ...) holding exactly the names declared below, used as JAX
spells them (``jx.ad.LinearizeTrace``). At import, a missing name raises one
``ImportError`` naming the installed JAX and every missing name; using a
name that is not declared is an ``AttributeError``; ``tests/test_facade.py``
fails when a declared name is never used. The functions below exist only
where JAX releases differ (each difference one flag in ``_versions.py``) or
where JAX's internals need more than a name (a private attribute, an
adapter to one calling convention, an object JAX does not export read by
its attributes or class name). What a jaxpr's equations amount to is read
one floor up, in ``_jaxprs.py``.
"""

from __future__ import annotations

import importlib
import logging
import types
from typing import Any, Callable, Sequence

import jax

from smartvjp import _versions as V

# (module, names) of every declaration below, for the import-time check and
# tests/test_facade.py
REQUIRED: list[tuple[str, str, tuple[str, ...]]] = []
_MISSING: list[str] = []


def _internals(alias: str, module_name: str, *names: str,
               since: tuple[bool, tuple[str, ...]] = (False, ())):
  """A namespace with the declared ``names`` of ``module_name`` (noted in
  ``REQUIRED`` under ``alias``, the name this file gives the namespace).
  ``since``: ``(flag, more_names)``, names that exist only from the release
  a ``_versions`` flag names on, required (and present) where it is true."""
  flag, later = since
  REQUIRED.append((alias, module_name, names + later))
  try:
    module = importlib.import_module(module_name)
  except ImportError:
    _MISSING.append(module_name)
    return types.SimpleNamespace()
  present = {}
  for n in names + (later if flag else ()):
    if hasattr(module, n):
      present[n] = getattr(module, n)
    else:
      _MISSING.append(f"{module_name}.{n}")
  return types.SimpleNamespace(**present)


core = _internals(
    "core", "jax._src.core", "Primitive", "Var", "Tracer",
    "ShapedArray", "typeof", "typecompat", "mem_kind_to_space", "trace_ctx",
    "EvalTrace", "eval_jaxpr", "unmapped_aval", "mapped_aval", "pp_eqn_rules",
    "pp_eqn", "set_current_trace", "DropVar", "get_referent", "Jaxpr",
    "NamedAxisEffect", "TraceTag",
    since=(V.EFFECTS_NAME_VARS,
           ("positional_effects", "resolve_input_effects")))
pe = _internals(
    "pe", "jax._src.interpreters.partial_eval", "Recompute", "Offloadable",
    "new_jaxpr_eqn", "trace_to_jaxpr_dynamic", "convert_constvars_jaxpr",
    "partial_eval_jaxpr_custom_rules", "custom_partial_eval_rules",
    "dce_rules", "ensure_enum", "dce_jaxpr", "dceable_effects",
    "partial_eval_jaxpr_custom")
ad = _internals(
    "ad", "jax._src.interpreters.ad", "is_undefined_primal",
    "instantiate_zeros", "primitive_jvps", "primitive_transposes",
    "primitive_linearizations", "fallback_linearize_rule", "LinearizeTrace",
    "LinearizeTracer", "JVPTrace", "JVPTracer", "ValAccum", "NullAccum",
    "CustomVJPException",
    since=(V.TRANSPOSE_RETURNS_LOGS,
           ("fancy_transposes", "GradAccum", "UndefinedPrimal")))
batching = _internals(
    "batching", "jax._src.interpreters.batching", "fancy_primitive_batchers",
    "batch_jaxpr", "batch_jaxpr_axes", "bdim_at_front", "zero_if_mapped",
    "BatchTrace", "_batch_inner", "BatchTracer")
# what Pallas' cost estimate (pl.estimate_cost) counts per primitive: JAX's
# shipped kernels fill their cost_estimate from it, and XLA's TPU compiler
# reads that (design/upstream/tpu_gap.md)
pallas_cost = _internals(
    "pallas_cost", "jax._src.pallas.cost_estimate", "register_cost_rule",
    "cost_estimate_jaxpr", "CostEstimate")
mlir = _internals("mlir", "jax._src.interpreters.mlir", "register_lowering",
                   "lower_fun", "jaxpr_subcomp")
api_util = _internals("api_util", "jax._src.api_util", "debug_info",
                       "resolve_kwargs")
lu = _internals("lu", "jax._src.linear_util", "wrap_init")
config = _internals("config", "jax._src.config", "trace_context",
                     "string_or_object_state", "mutable_array_checks")
cd = _internals("cd", "jax._src.custom_derivatives", "CustomVJPPrimal")
ad_checkpoint = _internals(
    "ad_checkpoint", "jax._src.ad_checkpoint", "name_p", "CheckpointName",
    since=(V.HAS_CHECKPOINT_NAME_FWD, ("CheckpointNameFwd",)))
checkify = _internals("checkify", "jax._src.checkify", "error_checks",
                       "checkify_jaxpr_flat")
state_types = _internals("state_types", "jax._src.state.types",
                          "AbstractRef", "ReadEffect")
discharge = _internals("discharge", "jax._src.state.discharge",
                        "discharge_state", "register_discharge_rule")
effects = _internals("effects", "jax._src.effects", "JaxprInputEffect")
ad_util = _internals("ad_util", "jax._src.ad_util", "Zero", "SymbolicZero")
dtypes = _internals("dtypes", "jax._src.dtypes", "float0")
util = _internals("util", "jax._src.util", "weakref_cache_key_types")
remat = _internals("remat", "jax._src.interpreters.remat", "rules")
shard_map = _internals("shard_map", "jax._src.shard_map", "ShardMapTrace")
traceback_util = _internals("traceback_util", "jax._src.traceback_util",
                             "register_exclusion")
source_info_util = _internals(
    "source_info_util", "jax._src.source_info_util", "register_exclusion")

if _MISSING:
  raise ImportError(
      f"smartvjp does not support the installed jax {jax.__version__}: it "
      f"lacks the JAX internals {', '.join(_MISSING)}. smartvjp supports jax "
      "0.10.x to 0.12.x; install one of those, or a smartvjp release made for "
      "this JAX.")

# ClosedJaxpr from jax.extend.core names the closed-jaxpr class on every supported
# release (jax 0.11 merged it into Jaxpr and 0.12 removed core's alias), and
# ClosedJaxpr(jaxpr, consts) builds one; jaxpr_as_fun makes one a function
# (the audit lowers a rule's traced jaxpr alone for its cost).
from jax.extend.core import ClosedJaxpr, jaxpr_as_fun  # noqa: E402


# -- jaxprs and equations ----------------------------------------------------------

def trace_to_closed_jaxpr(
    fun: Callable, in_avals: Sequence[Any], what: str, name_fun: Callable,
    example_args: Sequence[Any],
) -> tuple[ClosedJaxpr, list[Any]]:
  """Traces ``fun(*flat_args) -> flat_outs``: ``(closed, consts)``, where
  ``closed`` has no constants of its own (what it closes over are its
  leading inputs) and ``consts`` are the values to pass there."""
  dbg = api_util.debug_info(what, name_fun, example_args, {})
  wrapped = lu.wrap_init(fun, debug_info=dbg.with_unknown_names())
  jaxpr, _, consts = pe.trace_to_jaxpr_dynamic(wrapped, list(in_avals))
  return ClosedJaxpr(pe.convert_constvars_jaxpr(jaxpr), ()), list(consts)


def dce_jaxpr_keep_inputs(closed: ClosedJaxpr, used_outputs) -> ClosedJaxpr:
  """``closed`` computing only the used outputs; every input is kept."""
  jaxpr, _ = pe.dce_jaxpr(closed.jaxpr, list(used_outputs), instantiate=True)
  return ClosedJaxpr(jaxpr, closed.consts)


def checkpoint_name_of(prim, params):
  """The name of a ``checkpoint_name`` equation (``name_p``, or under
  ``jax_remat3`` the high-level primitive JAX binds instead), else ``None``."""
  if prim is ad_checkpoint.name_p:
    return params["name"]
  hi = params.get("_prim")
  kinds = (ad_checkpoint.CheckpointName,) + (
      (ad_checkpoint.CheckpointNameFwd,) if V.HAS_CHECKPOINT_NAME_FWD else ())
  if hi is not None and isinstance(hi, kinds):
    return hi.params["name"]
  return None


# An equation's ``_prim`` (a high-level primitive under the remat3 and
# custom_vjp3 flags, of classes JAX does not export) is read here only.

def high_level_jaxprs(eqn) -> list:
  """The jaxprs ``_prim`` holds (its own, its traced function's), or []."""
  hi = eqn.params.get("_prim")
  return [] if hi is None else [
      getattr(hi, "jaxpr", None),
      getattr(getattr(hi, "traced", None), "jaxpr", None)]


def primitive_label(eqn) -> str:
  """The primitive's name, or ``_prim``'s class's (``RematTraced``)."""
  hi = eqn.params.get("_prim")
  return type(hi).__name__ if hi is not None else eqn.primitive.name


def remat_policy_of(eqn) -> tuple | None:
  """``(policy,)`` of a remat3 checkpoint (``None``: plain), else ``None``."""
  hi = eqn.params.get("_prim")
  return ((hi.policy,) if hasattr(hi, "policy") and hasattr(hi, "prevent_cse")
          else None)


def custom_vjp3_parts(eqn) -> tuple | None:
  """``(f's name or None, bwd)`` of a ``jax.custom_vjp`` call under
  ``jax_custom_vjp3`` (``_prim`` a ``CustomVJPTraced``), else ``None``."""
  hi = eqn.params.get("_prim")
  if type(hi).__name__ != "CustomVJPTraced":
    return None
  return getattr(getattr(hi, "traced", None), "fun_name", None), hi.bwd


def offload_space(answer):
  """Where a remat policy's ``Offloadable`` answer moves a value, else None."""
  return (core.mem_kind_to_space(answer.dst)
          if isinstance(answer, pe.Offloadable) else None)


def unwrapped(fn):
  """``fn`` out of JAX's ``WrappedFun``s and ``functools.partial``s."""
  while True:
    if hasattr(fn, "f") and callable(fn.f):   # a WrappedFun
      fn = fn.f
    elif hasattr(fn, "func") and callable(fn.func):   # functools.partial
      fn = fn.func
    else:
      return fn


def is_recompute(answer) -> bool:
  """A remat policy's answer is JAX's ``Recompute``."""
  return isinstance(answer, type(pe.Recompute))


# call primitives whose outputs are their jaxpr's: the param holding it
_FORWARDING_CALLS = {"jit": "jaxpr", "pjit": "jaxpr", "closed_call": "call_jaxpr",
                     "core_call": "call_jaxpr", "custom_jvp_call": "call_jaxpr"}


def forwarded_input(v, jaxpr):
  """The input of ``jaxpr`` that ``v`` is, through nested calls (``jit``,
  ``custom_jvp``) that return it unchanged (a jitted ``fwd`` returning its
  inputs as residuals), else ``None``."""
  producers = {o: e for e in jaxpr.eqns for o in e.outvars}
  inputs = set(jaxpr.invars)
  while type(v) is core.Var and v not in inputs:
    eqn = producers.get(v)
    if eqn is None or eqn.primitive.name not in _FORWARDING_CALLS:
      return None
    inner = eqn.params[_FORWARDING_CALLS[eqn.primitive.name]]
    inner = getattr(inner, "jaxpr", inner)
    out = inner.outvars[eqn.outvars.index(v)]
    if type(out) is not core.Var or out not in inner.invars:
      return None
    v = eqn.invars[inner.invars.index(out)]
  return v if type(v) is core.Var else None


def quiet_callback_failures(exc_type: type) -> None:
  """Drops the log JAX writes when a ``jax.debug.callback`` raises
  ``exc_type`` (an error raised on purpose, which the user sees raised)."""
  def keep(record):
    exc = record.exc_info[1] if record.exc_info else None
    return not isinstance(exc, exc_type)
  logging.getLogger("jax._src.debugging").addFilter(keep)


def custom_vjp3_class() -> type | None:
  """The class of ``jax.custom_vjp`` objects made while ``jax_custom_vjp3``
  is on, where it is another class (jax 0.10, 0.11: ``hijax.custom_vjp3``),
  else ``None``; read by the audit, which intercepts their calls too."""
  try:
    module = importlib.import_module("jax._src.hijax")
  except ImportError:
    return None
  cls = getattr(module, "custom_vjp3", None)
  return cls if isinstance(cls, type) else None


def jit_static_arguments(fn) -> tuple[tuple[int, ...], tuple[str, ...]]:
  """``(static_argnums, static_argnames)`` of a ``jax.jit`` function (a
  compiled step takes only the others); ``((), ())`` for anything else."""
  info = getattr(fn, "_jit_info", None)
  return (tuple(getattr(info, "static_argnums", ()) or ()),
          tuple(getattr(info, "static_argnames", ()) or ()))


def is_jit_function(fn) -> bool:
  """``fn`` is a ``jax.jit`` function (what it returns can be traced and
  lowered without another ``jax.jit`` around it)."""
  return hasattr(fn, "trace") and hasattr(fn, "lower")


def is_jax_private_module(name: str) -> bool:
  """``name`` is one of JAX's private modules."""
  return name == "jax._src" or name.startswith("jax._src.")


def batch_inner(fun: Callable, tag, axis_data, in_dims, out_dims: Callable):
  """Runs ``fun(*flat_args)`` batched as part of the vmap with trace ``tag``
  (inputs at ``in_dims``, outputs at ``out_dims()``, 0 or ``None`` each,
  asked once ``fun`` has run); returns a function of the flat arguments."""
  def run(*args):
    dbg = api_util.debug_info("smartvjp vmap", fun, args, {})
    wrapped = batching._batch_inner(  # pylint: disable=protected-access
        lu.wrap_init(fun, debug_info=dbg), axis_data, out_dims, False)
    outs, _, _ = wrapped.call_wrapped(tag, list(in_dims), *args)
    return list(outs)
  return run


# -- configuration ------------------------------------------------------------------

def define_string_option(name: str, help: str):
  """An optional-string JAX config option in the trace context and in
  ``jax.jit``'s cache key (a jitted function is traced again when it
  changes)."""
  def validator(value):
    if value is not None and not isinstance(value, str):
      raise ValueError(f"{name} must be None or a string, got "
                       f"{type(value).__name__} {value!r}.")
  return config.string_or_object_state(
      name, None, help, validator=validator, include_in_jit_key=True,
      include_in_trace_context=True)


def hide_frames_under(path: str) -> None:
  """Treats files under ``path`` as JAX treats its own: left out of filtered
  tracebacks and of an equation's user source line."""
  traceback_util.register_exclusion(path)
  source_info_util.register_exclusion(path)


# -- effects and references ------------------------------------------------------------

def _input_position(effect):
  return effect.input if V.EFFECTS_NAME_VARS else effect.input_index


def positional_effects(jaxpr) -> set:
  """The effects of a traced rule (no constants of its own) as its
  primitive's abstract evaluation returns them. A reference the rule
  receives but neither reads nor writes counts as read (an equation taking
  a reference must have an effect on it, or ``jit`` would lower it as a
  constant instead of discharging it)."""
  jaxpr = jaxpr.jaxpr if isinstance(jaxpr, ClosedJaxpr) else jaxpr
  effs = (set(core.positional_effects(jaxpr)) if V.EFFECTS_NAME_VARS
          else set(jaxpr.effects))
  touched = {_input_position(e) for e in effs
             if isinstance(e, effects.JaxprInputEffect)}
  return effs | {state_types.ReadEffect(i)
                 for i, v in enumerate(jaxpr.invars)
                 if isinstance(v.aval, state_types.AbstractRef)
                 and i not in touched}


def resolve_effects(effs, invars) -> set:
  """Positional effects as the effects of an equation over ``invars``."""
  if V.EFFECTS_NAME_VARS:
    return core.resolve_input_effects(effs, invars)
  return set(effs)


def move_input_effects(effs, where: Callable[[int], int]) -> set:
  """Positional effects with each input position ``i`` moved to
  ``where(i)``."""
  out = set()
  for e in effs:
    if isinstance(e, effects.JaxprInputEffect):
      i = where(_input_position(e))
      e = e.replace(i) if V.EFFECTS_NAME_VARS else e.replace(input_index=i)
    out.add(e)
  return out


def effects_keep_alive(effs) -> bool:
  """True when an equation with these effects must not be removed even if
  its outputs are unused (as JAX decides: a debug print or a write to a
  reference keeps it; reading a reference does not)."""
  return any(not pe.dceable_effects.contains(e) for e in effs)


def eval_discharged(jaxpr: ClosedJaxpr, should_discharge, *args) -> list:
  """Evaluates ``jaxpr`` (no constants of its own) with its references at
  the ``should_discharge`` positions given as values: its outputs, then the
  final value of each of those references."""
  should = tuple(bool(d) for d in should_discharge)
  if V.DISCHARGE_STATE_TAKES_CLOSED_JAXPR:
    pure = discharge.discharge_state(jaxpr, should_discharge=should)
    consts = pure.consts
    pure = pure.jaxpr if isinstance(pure, ClosedJaxpr) else pure
  else:
    pure, consts = discharge.discharge_state(jaxpr.jaxpr, jaxpr.consts,
                                             should_discharge=should)
  return core.eval_jaxpr(pure, consts, *args)


# -- checkify -------------------------------------------------------------------------

def checkify_jaxpr(ctx, jaxpr, enabled_errors, err_tree, *args):
  """Evaluates ``jaxpr`` (no constants of its own) with its checks turned
  into error values: ``args`` are the leaves of the incoming error (of tree
  ``err_tree``) then the jaxpr's inputs; returns ``(error, outs)``."""
  if V.CHECKIFY_TAKES_CTX:
    return checkify.checkify_jaxpr_flat(ctx, jaxpr, (), enabled_errors,
                                        err_tree, *args)
  return checkify.checkify_jaxpr_flat(jaxpr, (), enabled_errors, err_tree,
                                      *args)


def error_effects(error) -> set:
  """The kinds of error a checkify ``Error`` value carries."""
  return set(error._pred)  # pylint: disable=protected-access


def widen_error(error, effs):
  """``error`` with entries that never fire for the kinds in ``effs`` it
  lacks, so that its leaves match an error that may carry them."""
  return error._add_placeholder_effects(effs)  # pylint: disable=protected-access


# -- rule registration where JAX's releases differ ------------------------------------
#
# Each takes the rule in smartvjp's form (the same on every release) and
# registers it in JAX's table in the installed release's form; the other
# kinds of rule are entries of JAX's tables (``_primitive._KINDS``).

def register_lowering(prim, impl, inline=None):
  """Lowers ``prim`` by tracing ``impl`` (which evaluates its jaxprs); with
  ``inline(**params) -> (jaxpr, scope, positions, num_outs)`` or ``None``,
  by lowering that traced jaxpr (no constants of its own, low-level
  primitives only) inlined where the equation stands, on the inputs at
  ``positions`` (``None``: all), its first ``num_outs`` outputs kept
  (``None``: all), under the named scope ``scope``. As JAX lowers its own
  ``custom_vjp_call``: where the equation stands, under its traceback, and
  not cached as an out-of-line function per distinct equation (emitting
  that function cost a scanned model's trace + lower about 10-25%)."""
  traced = mlir.lower_fun(impl, multiple_results=True)
  if inline is None:
    mlir.register_lowering(prim, traced)
    return

  def lowering(ctx, *args, **params):
    how = inline(**params)
    closed = how[0] if how is not None else None
    if (closed is None or closed.consts
        or getattr(closed.jaxpr, "is_high", True)):
      return traced(ctx, *args, **params)
    jaxpr, scope, positions, num_outs = how
    ins = list(args) if positions is None else [args[i] for i in positions]
    sub = (ctx.module_context if ctx.platforms is None
           else ctx.module_context.replace(platforms=ctx.platforms))
    outs, tokens = mlir.jaxpr_subcomp(
        sub, closed.jaxpr, ctx.name_stack.extend(scope), ctx.tokens_in, [],
        *ins, dim_var_values=ctx.dim_var_values,
        const_lowering=ctx.const_lowering, outer_traceback=ctx.traceback)
    ctx.set_tokens_out(tokens)
    outs = list(outs)
    return outs if num_outs is None else outs[:num_outs]
  mlir.register_lowering(prim, lowering, cacheable=False)


def register_linearization(prim, rule):
  """``rule(is_vjp, nonzeros, *primals, **params) -> (primal_outs,
  tangent_nzs_out, residuals, linearized)`` with ``linearized(residuals,
  *tangents) -> tangents_out``."""
  if V.LINEARIZE_HAS_STRUCTURED_RES:
    def adapted(is_vjp, nonzeros, *primals, **params):
      outs, nzs, res, linearized = rule(is_vjp, nonzeros, *primals, **params)
      return outs, nzs, res, None, (
          lambda res, _structured, *tangents: linearized(res, *tangents))
    ad.primitive_linearizations[prim] = adapted
  else:
    ad.primitive_linearizations[prim] = rule


def fallback_linearize(prim, is_vjp, nonzeros, *primals, **params):
  """JAX's linearize-by-JVP-and-partial-eval for ``prim``, in the four-value
  form of :func:`register_linearization` rules."""
  result = ad.fallback_linearize_rule(prim, is_vjp, nonzeros, *primals,
                                      **params)
  if not V.LINEARIZE_HAS_STRUCTURED_RES:
    return result
  outs, nzs, res, structured, linearized = result
  return outs, nzs, res, (
      lambda res, *tangents: linearized(res, structured, *tangents))


def register_dce(prim, rule):
  """``rule(used_outputs, eqn) -> (used_inputs, new_eqn | None)``."""
  if V.DCE_RULE_TAKES_LIVE_INS:
    pe.dce_rules[prim] = lambda used, _live_ins, eqn: rule(used, eqn)
  else:
    pe.dce_rules[prim] = rule


_PRINT_STAND_INS: dict = {}


def pp_eqn(eqn, context, settings, name=None):
  """JAX's default printing of an equation (what a printing rule delegates
  to after choosing which params to show), under a stand-in primitive of the
  same name (or of ``name``) that has no printing rule of its own."""
  name = name or eqn.primitive.name
  stand_in = _PRINT_STAND_INS.setdefault(name, core.Primitive(name))
  return core.pp_eqn(eqn.replace(primitive=stand_in), context, settings)


def register_checkify(prim, rule):
  """``rule(ctx, error, enabled_errors, *args, **params) -> (error, outs)``;
  ``ctx`` is ``None`` on releases without a checkify context."""
  if V.CHECKIFY_TAKES_CTX:
    checkify.error_checks[prim] = rule
  else:
    checkify.error_checks[prim] = (
        lambda error, enabled, *args, **params:
        rule(None, error, enabled, *args, **params))


def register_discharge(prim, rule):
  """``rule(should_discharge, *args, **params) -> (new_args, outs)``: the
  state discharge of ``prim``; ``args`` are values where ``should_discharge``
  says so, and ``new_args`` has each of those references' final value
  (``None`` elsewhere)."""
  if V.DISCHARGE_RULE_TAKES_CTX:
    def adapted(ctx, *args, **params):
      return rule(list(ctx.should_discharge), *args, **params)
  else:
    def adapted(in_avals, out_avals, *args, **params):
      return rule([isinstance(a, state_types.AbstractRef) for a in in_avals],
                  *args, **params)
  discharge.register_discharge_rule(prim)(adapted)


class Remat3Context:
  """What a remat3 rule may consult: ``policy`` (``None`` saves nothing) and
  ``custom_vjp_rules`` (``False`` inside a ``jax.custom_vjp`` ``fwd`` that
  JAX's own remat rule is replaying: rematerialize whole)."""

  def __init__(self, policy, custom_vjp_rules=True):
    self.policy = policy
    self.custom_vjp_rules = custom_vjp_rules


def register_remat3(prim, rule):
  """``rule(ctx, *in_vals, **params) -> (outs, res, rem)`` with
  ``rem(res, *rem_inputs) -> rem_outs`` (``ctx`` a :class:`Remat3Context`):
  under ``jax_remat3``, ``jax.checkpoint`` calls it on the forward pass's
  trace, then ``rem`` on the rematerialized region's."""
  def context(first):
    if V.REMAT3_RULE_GETS_TRACE:
      return Remat3Context(first.policy, first.custom_vjp_rules)
    return Remat3Context(first)

  if V.REMAT3_RULE_RETURNS_RES:
    def adapted(first, *in_vals, **params):
      return rule(context(first), *in_vals, **params)
  else:
    def adapted(first, *in_vals, **params):
      outs, res, rem = rule(context(first), *in_vals, **params)
      return outs, (lambda *rem_in: rem(res, *rem_in))
  remat.rules[prim] = adapted


def register_transpose_with_logs(prim, rule, collecting, merge):
  """Where JAX collects backward-pass logs, also registers ``rule`` (a
  transpose rule) in the form that returns them: ``rule`` runs inside
  ``collecting()``, a context manager giving a list of log dicts, and
  ``merge`` of that list (a dict or ``None``) is returned."""
  if not V.TRANSPOSE_RETURNS_LOGS:
    return

  def with_logs(cts, *args, **params):
    undefined = [ad.UndefinedPrimal(x.aval)
                 if isinstance(x, ad.GradAccum) else x for x in args]
    with collecting() as sink:
      cts_in = rule(cts, *undefined, **params)
    for x, ct in zip(args, cts_in):
      if isinstance(x, ad.GradAccum):
        x.accum(ct)
    return merge(sink)
  ad.fancy_transposes[prim] = with_logs
