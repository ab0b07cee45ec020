"""The one module that touches JAX internals (``jax._src``, JAX's rule tables).

Every other smartvjp module gets JAX-internal names and rule registration
from here, so that a JAX upgrade that moves or renames internals is a change
to this file only. Supported: jax/jaxlib 0.10.x, 0.11.x and 0.12.x.

Where JAX's internals differ between releases, the difference is detected by
feature (never by version number), and the comment beside each detection
names the release that changed it. At import, :func:`check_internals` makes
sure every internal smartvjp uses exists, and raises one ``ImportError``
naming the installed JAX version and every missing name otherwise.
"""

from __future__ import annotations

import contextvars
import importlib
import inspect
from typing import Any, Callable, Sequence

import jax

# (module, names) for every JAX internal that smartvjp uses.
_REQUIRED: tuple[tuple[str, tuple[str, ...]], ...] = (
    ("jax._src.core", (
        "Primitive", "JaxprEqn", "Var", "Literal", "Tracer", "typeof",
        "typecompat", "mem_kind_to_space", "trace_ctx", "EvalTrace",
        "eval_jaxpr", "unmapped_aval", "mapped_aval", "pp_eqn_rules", "pp_eqn",
        "set_current_trace", "DropVar", "get_referent", "NamedAxisEffect")),
    ("jax._src.interpreters.partial_eval", (
        "Recompute", "Offloadable", "new_jaxpr_eqn", "trace_to_jaxpr_dynamic",
        "convert_constvars_jaxpr", "partial_eval_jaxpr_custom_rules",
        "custom_partial_eval_rules", "dce_rules", "ensure_enum",
        "_default_dce_rule", "dce_jaxpr", "dceable_effects",
        "partial_eval_jaxpr_custom")),
    ("jax._src.interpreters.ad", (
        "is_undefined_primal", "instantiate_zeros", "primitive_jvps",
        "primitive_transposes", "primitive_linearizations",
        "fallback_linearize_rule", "LinearizeTrace", "LinearizeTracer",
        "JVPTracer")),
    ("jax._src.interpreters.batching", (
        "fancy_primitive_batchers", "batch_jaxpr", "batch_jaxpr_axes",
        "bdim_at_front", "zero_if_mapped", "BatchTrace", "_batch_inner",
        "BatchTracer")),
    ("jax._src.interpreters.mlir", ("register_lowering", "lower_fun")),
    ("jax._src.api_util", ("debug_info", "resolve_kwargs")),
    ("jax._src.linear_util", ("wrap_init",)),
    ("jax._src.config", ("trace_context", "optional_string_state",
                         "mutable_array_checks")),
    ("jax._src.custom_derivatives", ("CustomVJPPrimal",)),
    ("jax._src.debugging", ("DebugEffect",)),
    ("jax._src.ad_checkpoint", ("name_p",)),
    ("jax._src.checkify", ("error_checks", "checkify_jaxpr_flat", "Error")),
    ("jax._src.state.types", ("AbstractRef", "ReadEffect")),
    ("jax._src.state.discharge", ("discharge_state", "register_discharge_rule")),
    ("jax._src.ad_util", ("Zero", "SymbolicZero")),
    ("jax._src.dtypes", ("float0",)),
    ("jax._src.util", ("weakref_cache_key_types",)),
    ("jax.extend.core", ("ClosedJaxpr",)),
    ("jax._src.core", ("ShapedArray",)),
    ("jax._src.traceback_util", ("register_exclusion",)),
    ("jax._src.source_info_util", ("register_exclusion",)),
    ("jax._src.interpreters.remat", ("rules", "RematTrace")),
    ("jax._src.ad_checkpoint", ("RematTraced", "CheckpointName")),
)


def check_internals(required=_REQUIRED) -> None:
  """Raises ``ImportError`` naming every JAX internal in ``required`` that the
  installed JAX lacks (rather than an ``AttributeError`` deep inside a rule)."""
  missing = []
  for module_name, names in required:
    try:
      module = importlib.import_module(module_name)
    except ImportError:
      missing.append(module_name)
      continue
    missing.extend(f"{module_name}.{n}" for n in names
                   if not hasattr(module, n))
  if missing:
    raise ImportError(
        f"smartvjp does not support the installed jax {jax.__version__}: "
        f"it lacks the JAX internals {', '.join(missing)}. smartvjp supports "
        "jax 0.10.x to 0.12.x; install one of those, or a smartvjp release "
        "made for this JAX.")


check_internals()

# pylint: disable=g-import-not-at-top,wrong-import-position
from jax._src import config as _config  # noqa: E402
from jax._src import core as _core  # noqa: E402
from jax._src import linear_util as _lu  # noqa: E402
from jax._src import util as _util  # noqa: E402
from jax._src.ad_checkpoint import name_p  # noqa: E402,F401
from jax._src.ad_util import Zero, SymbolicZero  # noqa: E402,F401
from jax._src.api_util import debug_info as _debug_info  # noqa: E402
from jax._src.custom_derivatives import CustomVJPPrimal  # noqa: E402,F401
from jax._src.debugging import DebugEffect  # noqa: E402
from jax._src.dtypes import float0  # noqa: E402,F401
from jax._src.interpreters import ad as _ad  # noqa: E402
from jax._src.interpreters import batching as _batching  # noqa: E402
from jax._src.interpreters import mlir as _mlir  # noqa: E402
from jax._src.interpreters import partial_eval as _pe  # noqa: E402
from jax.extend.core import ClosedJaxpr  # noqa: E402,F401

# jax 0.11 merged ClosedJaxpr into Jaxpr (core.ClosedJaxpr became an alias)
# and jax 0.12 removed the alias; jax.extend.core.ClosedJaxpr names the class
# on every supported release, and ClosedJaxpr(jaxpr, consts) builds one.
Primitive = _core.Primitive
JaxprEqn = _core.JaxprEqn
Var = _core.Var
Literal = _core.Literal
Tracer = _core.Tracer
Recompute = _pe.Recompute
Offloadable = _pe.Offloadable
new_jaxpr_eqn = _pe.new_jaxpr_eqn
is_undefined_primal = _ad.is_undefined_primal
instantiate_zeros = _ad.instantiate_zeros
get_aval = _core.typeof
typecompat = _core.typecompat  # shape, dtype, sharding, varying axes; no weak_type


def varying_axes(aval) -> frozenset:
  """The manual mesh axes (``jax.shard_map`` with ``check_vma=True``) along
  which values of type ``aval`` vary; empty outside such a ``shard_map``."""
  manual = getattr(aval, "manual_axis_type", None)
  return frozenset(getattr(manual, "varying", ()))
eval_jaxpr = _core.eval_jaxpr
unmapped_aval = _core.unmapped_aval
mapped_aval = _core.mapped_aval
set_current_trace = _core.set_current_trace
convert_constvars_jaxpr = _pe.convert_constvars_jaxpr
batch_jaxpr = _batching.batch_jaxpr
batch_jaxpr_axes = _batching.batch_jaxpr_axes
bdim_at_front = _batching.bdim_at_front
zero_if_mapped = _batching.zero_if_mapped
ShapedArray = _core.ShapedArray


# -- feature detection --------------------------------------------------------

# jax 0.11.1 (after the jax-v0.11.0 tag): a linearization rule returns five
# values, (primal_out, tangent_nzs_out, residuals, structured_res, linearized),
# and `linearized` is called as linearized(residuals, structured_res_binders,
# *tangents); before, four values and linearized(residuals, *tangents).
LINEARIZE_HAS_STRUCTURED_RES = (
    "structured_res" in _ad.LinearizeTrace.process_primitive.__code__.co_varnames)

# jax 0.12.0: DCE rules are called as rule(used_outs, live_ins, eqn); before,
# rule(used_outs, eqn).
DCE_RULE_TAKES_LIVE_INS = (
    "live_ins" in inspect.signature(_pe._default_dce_rule).parameters)


# -- rule registration adapters -----------------------------------------------

# The vmap whose batching rule is running (its trace tag and axis data), so
# that the user's rules, re-run under vmap by a batching rule, see values
# they close over from that same vmap as batched, as jax.custom_vjp's do.
_BATCHING: contextvars.ContextVar = contextvars.ContextVar(
    "smartvjp_batching", default=None)


class _SmartPrimitive(_core.Primitive):
  """A primitive that notes which vmap is batching it (see ``_BATCHING``)."""

  def bind_with_trace(self, trace, args, avals, params, /):
    if not isinstance(trace, _batching.BatchTrace):
      return super().bind_with_trace(trace, args, avals, params)
    token = _BATCHING.set((trace.tag, trace.axis_data))
    try:
      return super().bind_with_trace(trace, args, avals, params)
    finally:
      _BATCHING.reset(token)


def new_primitive(name: str) -> Primitive:
  """A multiple-results primitive."""
  p = _SmartPrimitive(name)
  p.multiple_results = True
  return p


def current_batch_tag(axis_data):
  """The trace tag of the vmap (over ``axis_data``) whose batching rule for
  one of smartvjp's primitives is running, or ``None``."""
  now = _BATCHING.get()
  return now[0] if now is not None and now[1] is axis_data else None


def vmap_in_trace(fun: Callable, tag, axis_data, in_dims):
  """``fun(*flat_args) -> flat_outs`` batched as by ``jax.vmap`` (inputs at
  ``in_dims``, ``None`` for unmapped; every output at axis 0) but as part of
  the vmap with trace tag ``tag``: values ``fun`` closes over that are
  batched by that vmap are batched here too (jax.custom_vjp batches its
  rules the same way)."""
  def run(*args):
    dbg = _debug_info("smartvjp vmap", fun, args, {})
    store = {}

    def counted(*a):
      outs = fun(*a)
      store["n"] = len(outs)
      return outs
    wrapped = _batching._batch_inner(
        _lu.wrap_init(counted, debug_info=dbg), axis_data,
        lambda: [0] * store["n"], False)
    outs, _, trace = wrapped.call_wrapped(tag, list(in_dims), *args)
    del trace
    return list(outs)
  return run


# -- one registration entry point per primitive --------------------------------

# What :func:`register_rules` registered: primitive name -> rule kind -> the
# function as given (before any adapter wrapped it). ``design/architecture.md``
# lists the same table, and ``tests/test_architecture.py`` keeps them equal.
RULES: dict[str, dict[str, Callable]] = {}


def register_rules(prim: Primitive, **rules: Callable) -> None:
  """Registers every rule of ``prim`` in one call, through the adapters below.

  Keywords (each optional): ``impl``, ``abstract_eval`` (effectful form:
  returns ``(out_avals, effects)``), ``lowering`` (an impl that evaluates
  the primitive's jaxprs, traced to lower it), ``jvp``, ``linearization``,
  ``transpose``, ``partial_eval``, ``partial_eval_custom``, ``dce``,
  ``batching``, ``pp``, ``checkify``, ``discharge``, ``remat3``,
  ``to_lojax``, ``transpose_with_logs`` (a triple, see
  :func:`register_transpose_with_logs`); see each adapter for the rule's
  signature. Raises ``TypeError`` for an unknown keyword and
  ``ValueError`` if ``prim`` already has rules registered here.
  """
  adapters = {
      "impl": prim.def_impl,
      "abstract_eval": prim.def_effectful_abstract_eval,
      "lowering": lambda impl: register_lowering_from_impl(prim, impl),
      "jvp": lambda r: register_jvp(prim, r),
      "linearization": lambda r: register_linearization(prim, r),
      "transpose": lambda r: register_transpose(prim, r),
      "partial_eval": lambda r: register_partial_eval(prim, r),
      "partial_eval_custom": lambda r: register_partial_eval_custom(prim, r),
      "dce": lambda r: register_dce(prim, r),
      "batching": lambda r: register_batching(prim, r),
      "pp": lambda r: register_pp(prim, r),
      "checkify": lambda r: register_checkify(prim, r),
      "discharge": lambda r: register_discharge(prim, r),
      "transpose_with_logs": lambda r: register_transpose_with_logs(prim, *r),
      "remat3": lambda r: register_remat3(prim, r),
      "to_lojax": lambda r: register_to_lojax(prim, r),
  }
  unknown = sorted(set(rules) - set(adapters))
  if unknown:
    raise TypeError(f"register_rules({prim.name}): unknown rule kinds "
                    f"{unknown}; known: {sorted(adapters)}")
  if prim.name in RULES:
    raise ValueError(f"register_rules({prim.name}): already registered")
  # (a transpose_with_logs entry is (rule, collecting, merge): the rule is
  # what is listed)
  RULES[prim.name] = {k: (r[0] if k == "transpose_with_logs" else r)
                      for k, r in rules.items()}
  for kind, rule in rules.items():
    adapters[kind](rule)


def register_jvp(prim: Primitive, rule: Callable) -> None:
  """``rule(primals, tangents, **params) -> (primals_out, tangents_out)``."""
  _ad.primitive_jvps[prim] = rule


def register_transpose(prim: Primitive, rule: Callable) -> None:
  """``rule(cts, *args, **params) -> cts_in`` (``None`` for defined args)."""
  _ad.primitive_transposes[prim] = rule


def register_linearization(prim: Primitive, rule: Callable) -> None:
  """``rule(is_vjp, nonzeros, *primals, **params)`` returns four values,
  ``(primal_outs, tangent_nzs_out, residuals, linearized)``, with
  ``linearized(residuals, *tangents) -> tangents_out`` (the pre-0.11.1 form);
  the adapter converts to the installed JAX's convention."""
  if LINEARIZE_HAS_STRUCTURED_RES:
    def adapted(is_vjp, nonzeros, *primals, **params):
      outs, nzs, res, linearized = rule(is_vjp, nonzeros, *primals, **params)
      return outs, nzs, res, None, (
          lambda res, _structured, *tangents: linearized(res, *tangents))
    _ad.primitive_linearizations[prim] = adapted
  else:
    _ad.primitive_linearizations[prim] = rule


def fallback_linearize(prim: Primitive, is_vjp, nonzeros, *primals, **params):
  """JAX's linearize-by-JVP-and-partial-eval for ``prim``, in the four-value
  form that :func:`register_linearization` rules return."""
  result = _ad.fallback_linearize_rule(prim, is_vjp, nonzeros, *primals,
                                       **params)
  if not LINEARIZE_HAS_STRUCTURED_RES:
    return result
  outs, nzs, res, structured, linearized = result
  return outs, nzs, res, (
      lambda res, *tangents: linearized(res, structured, *tangents))


def register_partial_eval(prim: Primitive, rule: Callable) -> None:
  """Trace-time (``JaxprTrace``) partial eval:
  ``rule(trace, *tracers, **params) -> out_tracers``."""
  _pe.custom_partial_eval_rules[prim] = rule


def register_partial_eval_custom(prim: Primitive, rule: Callable) -> None:
  """Policy-driven partial eval (``jax.checkpoint``): ``rule(saveable,
  unks_in, inst_in, eqn) -> (eqn_known, eqn_staged, unks_out, inst_out,
  residuals)``."""
  _pe.partial_eval_jaxpr_custom_rules[prim] = rule


def register_dce(prim: Primitive, rule: Callable) -> None:
  """``rule(used_outputs, eqn) -> (used_inputs, new_eqn | None)``."""
  if DCE_RULE_TAKES_LIVE_INS:
    _pe.dce_rules[prim] = lambda used_outs, _live_ins, eqn: rule(used_outs, eqn)
  else:
    _pe.dce_rules[prim] = rule


def register_batching(prim: Primitive, rule: Callable) -> None:
  """``rule(axis_data, args, dims, **params) -> (outs, out_dims)``."""
  _batching.fancy_primitive_batchers[prim] = rule


def register_lowering_from_impl(prim: Primitive, impl: Callable) -> None:
  """Lowers ``prim`` by tracing ``impl`` (which evaluates its jaxprs)."""
  _mlir.register_lowering(prim, _mlir.lower_fun(impl, multiple_results=True))


def register_pp(prim: Primitive, rule: Callable) -> None:
  """``rule(eqn, context, settings) -> doc``; see :func:`pp_eqn`."""
  _core.pp_eqn_rules[prim] = rule


_PRINT_STAND_INS: dict[str, Primitive] = {}


def pp_eqn(eqn, context, settings):
  """JAX's default printing of an equation (what a ``register_pp`` rule
  delegates to after choosing which params to show).

  ``core.pp_eqn`` would call the rule again, so the equation is printed under
  a stand-in primitive of the same name that has no printing rule.
  """
  name = eqn.primitive.name
  stand_in = _PRINT_STAND_INS.get(name)
  if stand_in is None:
    stand_in = _PRINT_STAND_INS.setdefault(name, Primitive(name))
  return _core.pp_eqn(eqn.replace(primitive=stand_in), context, settings)


# -- tracing ------------------------------------------------------------------

def trace_to_closed_jaxpr(
    fun: Callable, in_avals: Sequence[Any], what: str, name_fun: Callable,
    example_args: Sequence[Any],
) -> tuple[ClosedJaxpr, list[Any]]:
  """Traces ``fun(*flat_args) -> flat_outs`` to a jaxpr.

  Returns ``(closed, consts)`` where ``closed`` has no constants of its own:
  the values it closes over (arrays or tracers of an enclosing trace) are its
  leading inputs, and ``consts`` are the values to pass there.
  """
  dbg = _debug_info(what, name_fun, example_args, {})
  wrapped = _lu.wrap_init(fun, debug_info=dbg.with_unknown_names())
  jaxpr, _, consts = _pe.trace_to_jaxpr_dynamic(wrapped, list(in_avals))
  jaxpr = _pe.convert_constvars_jaxpr(jaxpr)
  return ClosedJaxpr(jaxpr, ()), list(consts)


def register_weak_param_type(cls: type) -> type:
  """Lets JAX's caches keyed on primitive params hold ``cls`` weakly.

  Without it, JAX's abstract-eval cache (up to 2048 entries) keeps every
  spec, and with it the user's per-step functions, alive.
  """
  _util.weakref_cache_key_types.add(cls)
  return cls


def memory_space(kind: str):
  """The memory space of a memory kind (``"device"``, ``"pinned_host"``)."""
  return _core.mem_kind_to_space(kind)


def device_memory_space():
  return _core.mem_kind_to_space("device")


def resolve_kwargs(fun: Callable, args, kwargs) -> tuple:
  """Arguments to positions with defaults applied, exactly as jax.custom_vjp."""
  from jax._src.api_util import resolve_kwargs as _resolve
  return _resolve(fun, args, kwargs)


def is_eval_trace() -> bool:
  """True when no transformation is tracing (plain eager evaluation)."""
  return isinstance(_core.trace_ctx.trace, _core.EvalTrace)


def config_key() -> Any:
  """Everything in JAX's configuration that can change a trace (x64, ...)."""
  return _config.trace_context()


def policy_answer(policy: Callable, prim: Primitive, avals, params):
  """Asks a remat policy about one equation; returns Saveable/Recompute/Offloadable."""
  return _pe.ensure_enum(policy(prim, *avals, **params))


def uses_axis_name(effects, name) -> bool:
  """True if a jaxpr with these effects refers to the named axis ``name``
  (a collective such as ``psum(x, name)`` inside it)."""
  return name is not None and any(
      isinstance(e, _core.NamedAxisEffect) and e.name == name for e in effects)


def split_by_policy(jaxpr, ensure_out_unknowns, ensure_out_inst, policy):
  """Splits a jaxpr whose inputs are all known by a remat policy, as
  ``jax.checkpoint`` splits its body: ``(known, staged, num_res)``. ``known``
  maps the inputs to ``[*known_outs, *residuals]``; ``staged`` maps the
  residuals (inputs among them) to the instantiated outputs, recomputing what
  the policy does not save."""
  n = len(jaxpr.invars)
  known, staged, _, _, num_res = _pe.partial_eval_jaxpr_custom(
      jaxpr, [False] * n, [False] * n, ensure_out_unknowns, ensure_out_inst,
      policy)
  return known, staged, num_res


def dce_jaxpr(jaxpr, used_outputs, instantiate=False):
  """JAX's dead-code elimination: ``(jaxpr, used_inputs)``."""
  return _pe.dce_jaxpr(jaxpr, used_outputs, instantiate)




def hide_frames_under(path: str) -> None:
  """Treats files under ``path`` as JAX treats its own: left out of filtered
  tracebacks and skipped when an equation records its user source line."""
  from jax._src import source_info_util, traceback_util
  traceback_util.register_exclusion(path)
  source_info_util.register_exclusion(path)


def define_string_option(name: str, help: str):
  """An optional-string JAX config option that is part of the trace context
  (so jitted functions retrace when it changes)."""
  return _config.optional_string_state(name, default=None, help=help,
                                       include_in_trace_context=True)


def outermost_trace():
  """The outermost transformation trace now active, or ``None`` under plain
  evaluation. Each ``jax.jit``/``make_jaxpr``/eager ``grad``/``vmap`` call
  starts a new one; nested traces (scan bodies, linearize inside jit) lead
  back to it through their ``parent_trace``."""
  trace, outer = _core.trace_ctx.trace, None
  while trace is not None and not isinstance(trace, _core.EvalTrace):
    outer = trace
    trace = getattr(trace, "parent_trace", None)
  return outer


def eager_linearize_inputs(leaves):
  """``(parent_trace, primals, nonzero)`` when ``leaves`` are being
  differentiated eagerly: the current trace is a linearization (``jax.grad``,
  ``jax.vjp``) directly over plain evaluation and every leaf is concrete or
  that trace's tracer over a concrete value, at least one of them. ``None``
  otherwise."""
  trace = _core.trace_ctx.trace
  if (not isinstance(trace, _ad.LinearizeTrace)
      or not isinstance(trace.parent_trace, _core.EvalTrace)):
    return None
  primals, nonzero = [], []
  for x in leaves:
    if isinstance(x, _ad.LinearizeTracer) and x._trace is trace:
      if isinstance(x.primal, Tracer):
        return None
      primals.append(x.primal)
      nonzero.append(True)
    elif isinstance(x, Tracer):
      return None
    else:
      primals.append(x)
      nonzero.append(False)
  if not any(nonzero):
    return None
  return trace.parent_trace, primals, nonzero


def dce_jaxpr_keep_inputs(closed: ClosedJaxpr, used_outputs) -> ClosedJaxpr:
  """``closed`` computing only the used outputs; every input is kept."""
  jaxpr, _ = _pe.dce_jaxpr(closed.jaxpr, list(used_outputs), instantiate=True)
  return ClosedJaxpr(jaxpr, closed.consts)


# -- jax.custom_vjp's own definition methods (smartvjp/_jax_api.py) ----------

def custom_vjp_has(method: str) -> bool:
  """Whether the installed ``jax.custom_vjp`` has the definition method
  ``method`` (JAX's own class, even when a test has swapped the public name)."""
  from jax._src import custom_derivatives as _cd
  return callable(getattr(_cd.custom_vjp, method, None))


def custom_vjp_defvjp_takes(param: str) -> bool:
  """Whether ``jax.custom_vjp.defvjp`` accepts the parameter ``param``."""
  from jax._src import custom_derivatives as _cd
  return param in inspect.signature(_cd.custom_vjp.defvjp).parameters


def gradient_accumulator(aval):
  """The accumulator ``jax.custom_vjp.defvjp_with_accums``' ``bwd`` receives
  for a primal input of type ``aval`` when nothing wraps the rule: a value
  accumulator, or a null one where the cotangent is ``float0`` (jax 0.12.0
  added both)."""
  ct_aval = aval.to_ct_aval() if hasattr(aval, "to_ct_aval") \
      else aval.to_tangent_aval()
  if getattr(ct_aval, "dtype", None) == float0:
    return _ad.NullAccum(ct_aval)
  return _ad.ValAccum(ct_aval)


def accumulated(accumulator):
  """What a :func:`gradient_accumulator` holds: an array, or ``None`` when
  nothing (or only zeros) was pushed into it."""
  if not isinstance(accumulator, _ad.ValAccum):
    return None
  value = accumulator.freeze()
  return None if isinstance(value, Zero) else value


def drop_var(aval) -> Var:
  """An output variable of an equation that nothing reads."""
  return _core.DropVar(aval)


# -- checkify -----------------------------------------------------------------

from jax._src import checkify as _checkify  # noqa: E402

# jax 0.11: checkify rules and checkify_jaxpr_flat take a leading
# CheckifyContext (which numbers the checks); before, they had none.
CHECKIFY_TAKES_CTX = hasattr(_checkify, "CheckifyContext")


def register_checkify(prim: Primitive, rule: Callable) -> None:
  """``rule(ctx, error, enabled_errors, *args, **params) -> (error, outs)``;
  ``ctx`` is ``None`` on JAX releases without a checkify context."""
  if CHECKIFY_TAKES_CTX:
    _checkify.error_checks[prim] = rule
  else:
    _checkify.error_checks[prim] = (
        lambda error, enabled, *args, **params:
        rule(None, error, enabled, *args, **params))


def checkify_jaxpr(ctx, jaxpr, enabled_errors, err_tree, *args):
  """Evaluates ``jaxpr`` (no constants of its own) with its checks turned
  into error values: ``args`` are the leaves of the incoming error (of tree
  ``err_tree``) then the jaxpr's inputs; returns ``(error, outs)``."""
  if CHECKIFY_TAKES_CTX:
    return _checkify.checkify_jaxpr_flat(ctx, jaxpr, (), enabled_errors,
                                         err_tree, *args)
  return _checkify.checkify_jaxpr_flat(jaxpr, (), enabled_errors, err_tree,
                                       *args)


def error_effects(error) -> set:
  """The kinds of error a checkify ``Error`` value carries."""
  return set(error._pred)  # pylint: disable=protected-access


def widen_error(error, effects):
  """``error`` with entries that never fire for the kinds in ``effects`` it
  lacks, so that its leaves match an error that may carry them."""
  return error._add_placeholder_effects(effects)  # pylint: disable=protected-access


# -- mutable array references -------------------------------------------------

from jax._src.state.types import AbstractRef as _AbstractRef  # noqa: E402
from jax._src.state.types import ReadEffect as _ReadEffect  # noqa: E402


def is_ref(x) -> bool:
  """True for a mutable array reference (``jax.new_ref``) or its tracer."""
  try:
    return isinstance(_core.typeof(x), _AbstractRef)
  except TypeError:
    return False


def is_ref_aval(aval) -> bool:
  return isinstance(aval, _AbstractRef)


from jax._src import effects as _effects  # noqa: E402

# jax 0.10.1: an effect on a jaxpr input (a reference read or written) names
# the input's Var inside a jaxpr and equation, and its position in what an
# abstract evaluation rule returns; before, it held a position everywhere.
_EFFECTS_NAME_VARS = hasattr(_core, "positional_effects")


def positional_effects(jaxpr) -> set:
  """The effects of a traced rule (no constants of its own) as its
  primitive's abstract evaluation returns them.

  A reference the rule receives but neither reads nor writes counts as read:
  an equation that takes a reference must have an effect on it, or jit,
  meeting it as a constant (a reference the jitted function closes over),
  would lower it as a constant instead of discharging it."""
  jaxpr = jaxpr.jaxpr if isinstance(jaxpr, ClosedJaxpr) else jaxpr
  if _EFFECTS_NAME_VARS:
    effs = set(_core.positional_effects(jaxpr))
  else:
    effs = set(jaxpr.effects)
  touched = {_input_position(e) for e in effs
             if isinstance(e, _effects.JaxprInputEffect)}
  return effs | {_ReadEffect(i) for i, v in enumerate(jaxpr.invars)
                 if is_ref_aval(v.aval) and i not in touched}


def eqn_effects(jaxpr, invars) -> set:
  """The effects of an equation over ``invars`` that evaluates ``jaxpr``."""
  effs = positional_effects(jaxpr)
  if _EFFECTS_NAME_VARS:
    return _core.resolve_input_effects(effs, invars)
  return effs


def _input_position(e):
  return e.input if _EFFECTS_NAME_VARS else e.input_index


def move_input_effects(effs, where: Callable[[int], int]) -> set:
  """Positional effects with each input position ``i`` moved to ``where(i)``
  (for an equation whose inputs are a rule's inputs plus others)."""
  out = set()
  for e in effs:
    if isinstance(e, _effects.JaxprInputEffect):
      i = where(_input_position(e))
      e = e.replace(i) if _EFFECTS_NAME_VARS else e.replace(input_index=i)
    out.add(e)
  return out


from jax._src.state import discharge as _discharge  # noqa: E402

# jax 0.11: discharge rules take a DischargeContext first (with
# should_discharge); before, (in_avals, out_avals) first.
_DISCHARGE_TAKES_CTX = hasattr(_discharge, "DischargeContext")


def register_discharge(prim: Primitive, rule: Callable) -> None:
  """``rule(should_discharge, *args, **params) -> (new_args, outs)``: the
  state discharge of ``prim``; ``args`` are values where ``should_discharge``
  says so, and ``new_args`` has the final value of each of those references
  (``None`` elsewhere)."""
  if _DISCHARGE_TAKES_CTX:
    def adapted(ctx, *args, **params):
      return rule(list(ctx.should_discharge), *args, **params)
  else:
    def adapted(in_avals, out_avals, *args, **params):
      return rule([is_ref_aval(a) for a in in_avals], *args, **params)
  _discharge.register_discharge_rule(prim)(adapted)


def eval_discharged(jaxpr: ClosedJaxpr, should_discharge, *args) -> list:
  """Evaluates ``jaxpr`` (no constants of its own) with its references at the
  ``should_discharge`` positions given as values: returns its outputs, then
  the final value of each of those references."""
  should = tuple(bool(d) for d in should_discharge)
  if "closed_jaxpr" in inspect.signature(_discharge.discharge_state).parameters:
    pure = _discharge.discharge_state(jaxpr, should_discharge=should)
    consts = pure.consts  # jax 0.10.1: a ClosedJaxpr in and out; 0.11 Jaxpr
    pure = pure.jaxpr if isinstance(pure, ClosedJaxpr) else pure
  else:  # jax 0.10.0: (jaxpr, consts) in and out
    pure, consts = _discharge.discharge_state(jaxpr.jaxpr, jaxpr.consts,
                                              should_discharge=should)
  return _core.eval_jaxpr(pure, consts, *args)


def has_input_effects(jaxpr) -> bool:
  """True when ``jaxpr`` has effects on its inputs (references)."""
  return any(isinstance(e, _effects.JaxprInputEffect) for e in jaxpr.effects)


def effects_keep_alive(effects) -> bool:
  """True when an equation with these effects must not be removed even if
  its outputs are unused (as JAX decides: a debug print or a write to a
  reference keeps it; reading a reference does not)."""
  return any(not _pe.dceable_effects.contains(e) for e in effects)


def mutable_array_checks_enabled() -> bool:
  """Whether JAX's mutable array checks (``jax_mutable_array_checks``) are
  on: then ``jax.custom_vjp`` refuses references it cannot differentiate."""
  return _config.mutable_array_checks.value


def aliased_refs(leaves):
  """Pairs ``(i, j)``, ``i < j``, of positions in ``leaves`` holding
  references to the same mutable array, when JAX's mutable array checks are
  on (``jax_mutable_array_checks``); empty otherwise."""
  if not mutable_array_checks_enabled():
    return []
  first, pairs = {}, []
  for j, x in enumerate(leaves):
    x = x.value if isinstance(x, CustomVJPPrimal) else x
    if is_ref(x):
      i = first.setdefault(id(_core.get_referent(x)), j)
      if i != j:
        pairs.append((i, j))
  return pairs


from jax._src import custom_derivatives as _custom_derivatives  # noqa: E402

# jax 0.12: jax.custom_vjp refuses two differentiable arguments that are the
# same mutable array at every call; before, only when fwd runs.
ALIASED_REFS_CHECKED_AT_CALL = (
    "_check_for_aliased_refs"
    in inspect.unwrap(_custom_derivatives.custom_vjp.__call__).__code__.co_names)


# -- remat3 (jax_remat3 + jax_custom_vjp3; smartvjp/_remat3.py) ---------------

from jax._src import ad_checkpoint as _ad_checkpoint  # noqa: E402
from jax._src.interpreters import remat as _remat  # noqa: E402

# jax 0.11.0: remat3 rules receive the RematTrace (policy in trace.policy,
# trace.custom_vjp_rules) where 0.10.x passed the policy itself.
_REMAT3_RULE_GETS_TRACE = (
    "custom_vjp_rules" in inspect.signature(_remat.RematTrace.__init__).parameters)

# jax 0.12.0: remat3 rules return (primal_out, residuals, rem) and rem is
# called as rem(residuals, *rem_inputs); before, (primal_out, rem) and
# rem(*rem_inputs).
_REMAT3_RULE_RETURNS_RES = (
    "res" in _remat.RematTrace.process_primitive.__code__.co_varnames)

# jax 0.11.0: remat3 differentiates the rematerialized code only with respect
# to the checkpoint's perturbed inputs; jax 0.10.x perturbs every input
# (values the body closes over included), so a nonzero tangent there says
# nothing.
REMAT3_PERTURBS_EVERY_INPUT = (
    "in_nzs" not in _ad_checkpoint.RematTraced.vjp_fwd.__code__.co_varnames)


class Remat3Context:
  """What a remat3 rule may consult: ``policy`` (``None`` saves nothing) and
  ``custom_vjp_rules`` (``False`` inside a ``jax.custom_vjp`` ``fwd`` that
  JAX's own remat rule is replaying: rematerialize whole)."""

  def __init__(self, policy, custom_vjp_rules=True):
    self.policy = policy
    self.custom_vjp_rules = custom_vjp_rules


def register_remat3(prim: Primitive, rule: Callable) -> None:
  """``rule(ctx, *in_vals, **params) -> (outs, res, rem)`` with
  ``rem(res, *rem_inputs) -> rem_outs`` (``ctx`` a :class:`Remat3Context`):
  under ``jax_remat3``, ``jax.checkpoint`` calls it with the current trace
  being the forward pass's; it then calls ``rem`` on the rematerialized
  region's trace. The adapter converts to the installed JAX's convention."""
  def context(first):
    if _REMAT3_RULE_GETS_TRACE:
      return Remat3Context(first.policy, first.custom_vjp_rules)
    return Remat3Context(first)

  if _REMAT3_RULE_RETURNS_RES:
    def adapted(first, *in_vals, **params):
      return rule(context(first), *in_vals, **params)
  else:
    def adapted(first, *in_vals, **params):
      outs, res, rem = rule(context(first), *in_vals, **params)
      return outs, (lambda *rem_in: rem(res, *rem_in))
  _remat.rules[prim] = adapted


def register_to_lojax(prim: Primitive, rule: Callable) -> None:
  """``rule(*args, **params) -> outs``: how ``prim`` is evaluated where JAX
  needs low-level primitives only (lowering under jit) and ``prim`` carries a
  jaxpr with high-level ones (``checkpoint_name`` under ``jax_remat3``)."""
  prim.to_lojax = rule


def checkpoint_name_of(eqn):
  """The name of a ``checkpoint_name`` equation (``name_p``, or under
  ``jax_remat3`` the high-level primitive JAX binds instead), else ``None``."""
  return name_of(eqn.primitive, eqn.params)


def name_of(prim, params):
  """As :func:`checkpoint_name_of`, from a primitive and its params."""
  if prim is name_p:
    return params["name"]
  hi = params.get("_prim")
  kinds = tuple(getattr(_ad_checkpoint, k) for k in
                ("CheckpointName", "CheckpointNameFwd")
                if hasattr(_ad_checkpoint, k))
  if hi is not None and isinstance(hi, kinds):
    return hi.params["name"]
  return None


# -- drop-in conformance (issue 11: smartvjp/_batching.py, _jax_api.py) -------

def carries_tangent(x) -> bool:
  """Whether ``x`` is a tracer of the current trace, a JVP or a
  linearization, with a tangent that is not a symbolic zero: the primitive
  that produced it was differentiated."""
  trace = _core.trace_ctx.trace
  if not isinstance(x, (_ad.JVPTracer, _ad.LinearizeTracer)):
    return False
  return x._trace is trace and type(x.tangent) is not Zero


def is_mapped_here(x) -> bool:
  """Whether ``x`` is a value of the vmap now tracing with a mapped axis."""
  trace = _core.trace_ctx.trace
  return (isinstance(x, _batching.BatchTracer) and x._trace is trace
          and x.batch_dim is not None)


# jax 0.11.2: JAX's backward pass collects backward-pass logs (VJP.with_logs)
# from transpose rules in ad.fancy_transposes, which receive gradient
# accumulators and return None or a dict; before, there are no logs.
TRANSPOSE_RETURNS_LOGS = all(
    hasattr(_ad, n) for n in ("_merge_rule_logs", "fancy_transposes",
                              "GradAccum", "UndefinedPrimal"))


def register_transpose_with_logs(prim: Primitive, rule: Callable,
                                 collecting: Callable, merge: Callable) -> None:
  """Where JAX collects logs, also registers ``rule`` (a transpose rule as
  for :func:`register_transpose`) in the form that returns them: ``rule``
  runs inside ``collecting()``, a context manager giving a list of log
  dicts, and ``merge`` of that list (a dict or ``None``) is returned."""
  if not TRANSPOSE_RETURNS_LOGS:
    return

  def with_logs(cts, *args, **params):
    undefined = [_ad.UndefinedPrimal(x.aval)
                 if isinstance(x, _ad.GradAccum) else x for x in args]
    with collecting() as sink:
      cts_in = rule(cts, *undefined, **params)
    for x, ct in zip(args, cts_in):
      if isinstance(x, _ad.GradAccum):
        x.accum(ct)
    return merge(sink)
  _ad.fancy_transposes[prim] = with_logs


def ref_aval(value_aval):
  """The type of a mutable array reference holding values of ``value_aval``."""
  return _AbstractRef(value_aval)
