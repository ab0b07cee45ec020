"""The one module that touches JAX internals (``jax._src``, JAX's rule tables).

Every other smartvjp module reaches JAX's internals through the names and
small functions here, in shapes that do not change between releases: a JAX
upgrade is a change to this file and to ``_versions.py`` (where each
difference between releases is one named flag).

The internals used are declared per module with :func:`_internals`, which
builds a namespace holding exactly the declared names. At import, a missing
name raises one ``ImportError`` naming the installed JAX and every missing
name; using a name that is not declared is an ``AttributeError``; and
``tests/test_facade.py`` fails when a declared name is never used.
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


_core = _internals(
    "_core", "jax._src.core", "Primitive", "Var", "Literal", "Tracer",
    "ShapedArray", "typeof", "typecompat", "mem_kind_to_space", "trace_ctx",
    "EvalTrace", "eval_jaxpr", "unmapped_aval", "mapped_aval", "pp_eqn_rules",
    "pp_eqn", "set_current_trace", "DropVar", "get_referent", "Jaxpr",
    "NamedAxisEffect", "TraceTag",
    since=(V.EFFECTS_NAME_VARS,
           ("positional_effects", "resolve_input_effects")))
_pe = _internals(
    "_pe", "jax._src.interpreters.partial_eval", "Recompute", "Offloadable",
    "new_jaxpr_eqn", "trace_to_jaxpr_dynamic", "convert_constvars_jaxpr",
    "partial_eval_jaxpr_custom_rules", "custom_partial_eval_rules",
    "dce_rules", "ensure_enum", "dce_jaxpr", "dceable_effects",
    "partial_eval_jaxpr_custom")
_ad = _internals(
    "_ad", "jax._src.interpreters.ad", "is_undefined_primal",
    "instantiate_zeros", "primitive_jvps", "primitive_transposes",
    "primitive_linearizations", "fallback_linearize_rule", "LinearizeTrace",
    "LinearizeTracer", "JVPTrace", "JVPTracer", "ValAccum", "NullAccum",
    "CustomVJPException",
    since=(V.TRANSPOSE_RETURNS_LOGS,
           ("fancy_transposes", "GradAccum", "UndefinedPrimal")))
_batching = _internals(
    "_batching", "jax._src.interpreters.batching", "fancy_primitive_batchers",
    "batch_jaxpr", "batch_jaxpr_axes", "bdim_at_front", "zero_if_mapped",
    "BatchTrace", "_batch_inner", "BatchTracer")
_mlir = _internals("_mlir", "jax._src.interpreters.mlir", "register_lowering",
                   "lower_fun", "jaxpr_subcomp")
_api_util = _internals("_api_util", "jax._src.api_util", "debug_info",
                       "resolve_kwargs")
_lu = _internals("_lu", "jax._src.linear_util", "wrap_init")
_config = _internals("_config", "jax._src.config", "trace_context",
                     "string_or_object_state", "mutable_array_checks")
_cd = _internals("_cd", "jax._src.custom_derivatives", "CustomVJPPrimal")
_ad_checkpoint = _internals(
    "_ad_checkpoint", "jax._src.ad_checkpoint", "name_p", "CheckpointName",
    since=(V.HAS_CHECKPOINT_NAME_FWD, ("CheckpointNameFwd",)))
_checkify = _internals("_checkify", "jax._src.checkify", "error_checks",
                       "checkify_jaxpr_flat")
_state_types = _internals("_state_types", "jax._src.state.types",
                          "AbstractRef", "ReadEffect")
_discharge = _internals("_discharge", "jax._src.state.discharge",
                        "discharge_state", "register_discharge_rule")
_effects = _internals("_effects", "jax._src.effects", "JaxprInputEffect")
_ad_util = _internals("_ad_util", "jax._src.ad_util", "Zero", "SymbolicZero")
_dtypes = _internals("_dtypes", "jax._src.dtypes", "float0")
_util = _internals("_util", "jax._src.util", "weakref_cache_key_types")
_remat = _internals("_remat", "jax._src.interpreters.remat", "rules")
_traceback_util = _internals("_traceback_util", "jax._src.traceback_util",
                             "register_exclusion")
_source_info_util = _internals(
    "_source_info_util", "jax._src.source_info_util", "register_exclusion")

if _MISSING:
  raise ImportError(
      f"smartvjp does not support the installed jax {jax.__version__}: it "
      f"lacks the JAX internals {', '.join(_MISSING)}. smartvjp supports jax "
      "0.10.x to 0.12.x; install one of those, or a smartvjp release made for "
      "this JAX.")

# jax.extend.core.ClosedJaxpr names the closed-jaxpr class on every supported
# release (jax 0.11 merged it into Jaxpr and 0.12 removed core's alias), and
# ClosedJaxpr(jaxpr, consts) builds one.
from jax.extend.core import ClosedJaxpr  # noqa: E402

# -- types and values ------------------------------------------------------------

Primitive = _core.Primitive
Var = _core.Var
Literal = _core.Literal
Tracer = _core.Tracer
ShapedArray = _core.ShapedArray
Zero = _ad_util.Zero
SymbolicZero = _ad_util.SymbolicZero
CustomVJPPrimal = _cd.CustomVJPPrimal
float0 = _dtypes.float0
name_p = _ad_checkpoint.name_p
Recompute = _pe.Recompute
Offloadable = _pe.Offloadable
get_aval = _core.typeof
typecompat = _core.typecompat  # shape, dtype, sharding, varying axes; no weak type
eval_jaxpr = _core.eval_jaxpr
unmapped_aval = _core.unmapped_aval
mapped_aval = _core.mapped_aval
set_current_trace = _core.set_current_trace
convert_constvars_jaxpr = _pe.convert_constvars_jaxpr
is_undefined_primal = _ad.is_undefined_primal


def custom_vjp_exception(message: str) -> Exception:
  """The exception type ``jax.custom_vjp`` raises when a closed-over value
  is differentiated (JAX's ``CustomVJPException``), with our own message
  (JAX's constructor takes none)."""
  error = _ad.CustomVJPException.__new__(_ad.CustomVJPException)
  Exception.__init__(error, message)
  return error
instantiate_zeros = _ad.instantiate_zeros
batch_jaxpr = _batching.batch_jaxpr
batch_jaxpr_axes = _batching.batch_jaxpr_axes
bdim_at_front = _batching.bdim_at_front
zero_if_mapped = _batching.zero_if_mapped
BatchTrace = _batching.BatchTrace


def varying_axes(aval) -> frozenset:
  """The manual mesh axes (``jax.shard_map`` with ``check_vma=True``) along
  which values of type ``aval`` vary; empty outside such a ``shard_map``."""
  manual = getattr(aval, "manual_axis_type", None)
  return frozenset(getattr(manual, "varying", ()))


def ct_aval(aval):
  """The cotangent type of a primal input of type ``aval``."""
  return aval.to_ct_aval()


def memory_space(kind: str):
  """The memory space of a memory kind (``"device"``, ``"pinned_host"``)."""
  return _core.mem_kind_to_space(kind)


def drop_var(aval):
  """An output variable of an equation that nothing reads."""
  return _core.DropVar(aval)


# -- jaxprs and equations ----------------------------------------------------------

def new_eqn(invars, outvars, prim, params, effects, like):
  """A new equation with the source information and context of ``like``."""
  return _pe.new_jaxpr_eqn(list(invars), list(outvars), prim, params,
                           effects, like.source_info, like.ctx)


def eqn_with(eqn, **changes):
  """``eqn`` with some of its fields (``invars``, ``outvars``, ``params``)
  replaced."""
  return eqn.replace(**changes)


def jaxpr_with(jaxpr, **changes):
  """``jaxpr`` (open) with some of its fields (``invars``, ``outvars``,
  ``eqns``) replaced."""
  return jaxpr.replace(**changes)


def trace_to_closed_jaxpr(
    fun: Callable, in_avals: Sequence[Any], what: str, name_fun: Callable,
    example_args: Sequence[Any],
) -> tuple[ClosedJaxpr, list[Any]]:
  """Traces ``fun(*flat_args) -> flat_outs`` to a jaxpr.

  Returns ``(closed, consts)``: ``closed`` has no constants of its own; the
  values it closes over (arrays, or tracers of an enclosing trace) are its
  leading inputs, and ``consts`` are the values to pass there.
  """
  dbg = _api_util.debug_info(what, name_fun, example_args, {})
  wrapped = _lu.wrap_init(fun, debug_info=dbg.with_unknown_names())
  jaxpr, _, consts = _pe.trace_to_jaxpr_dynamic(wrapped, list(in_avals))
  return ClosedJaxpr(_pe.convert_constvars_jaxpr(jaxpr), ()), list(consts)


def dce_jaxpr(jaxpr, used_outputs, instantiate=False):
  """JAX's dead-code elimination of an open jaxpr: ``(jaxpr, used_inputs)``."""
  return _pe.dce_jaxpr(jaxpr, list(used_outputs), instantiate)


def dce_jaxpr_keep_inputs(closed: ClosedJaxpr, used_outputs) -> ClosedJaxpr:
  """``closed`` computing only the used outputs; every input is kept."""
  jaxpr, _ = _pe.dce_jaxpr(closed.jaxpr, list(used_outputs), instantiate=True)
  return ClosedJaxpr(jaxpr, closed.consts)


def split_by_policy(jaxpr, ensure_out_unknowns, ensure_out_inst, policy):
  """Splits a jaxpr whose inputs are all known by a remat policy, as
  ``jax.checkpoint`` splits its body: ``(known, staged, num_res)``; ``known``
  maps the inputs to ``[*known_outs, *residuals]``, ``staged`` maps the
  residuals (inputs among them) to the instantiated outputs."""
  n = len(jaxpr.invars)
  known, staged, _, _, num_res = _pe.partial_eval_jaxpr_custom(
      jaxpr, [False] * n, [False] * n, ensure_out_unknowns, ensure_out_inst,
      policy)
  return known, staged, num_res


def policy_answer(policy: Callable, prim, avals, params):
  """A remat policy asked about one equation: Saveable, Recompute or an
  ``Offloadable`` (with ``.dst``)."""
  return _pe.ensure_enum(policy(prim, *avals, **params))


def is_recompute(answer) -> bool:
  return isinstance(answer, type(_pe.Recompute))


def is_offload(answer) -> bool:
  return isinstance(answer, _pe.Offloadable)


def checkpoint_name_of(prim, params):
  """The name of a ``checkpoint_name`` equation (``name_p``, or under
  ``jax_remat3`` the high-level primitive JAX binds instead), else ``None``."""
  if prim is _ad_checkpoint.name_p:
    return params["name"]
  hi = params.get("_prim")
  kinds = (_ad_checkpoint.CheckpointName,) + (
      (_ad_checkpoint.CheckpointNameFwd,) if V.HAS_CHECKPOINT_NAME_FWD else ())
  if hi is not None and isinstance(hi, kinds):
    return hi.params["name"]
  return None


def quiet_callback_failures(exc_type: type) -> None:
  """JAX logs the traceback of an exception a ``jax.debug.callback`` raises
  before re-raising it; drop that log for ``exc_type``, an error the caller
  raises on purpose (and the user sees raised)."""
  def keep(record):
    exc = record.exc_info[1] if record.exc_info else None
    return not isinstance(exc, exc_type)
  logging.getLogger("jax._src.debugging").addFilter(keep)


# -- reading a traced program (swap_report) -------------------------------------

def is_jax_private_module(name: str) -> bool:
  """``name`` is one of JAX's private modules (where JAX's own APIs, such as
  ``jax.custom_gradient``, define their functions)."""
  return name == "jax._src" or name.startswith("jax._src.")


def jaxprs_in_eqn(eqn):
  """The jaxprs an equation holds: call, loop and branch bodies, and a
  high-level primitive's own."""
  values = list(eqn.params.values())
  hi = eqn.params.get("_prim")
  if hi is not None:
    values += [getattr(hi, "jaxpr", None),
               getattr(getattr(hi, "traced", None), "jaxpr", None)]
  for value in values:
    for v in value if isinstance(value, (tuple, list)) else (value,):
      if isinstance(v, ClosedJaxpr):
        yield v.jaxpr
      elif isinstance(v, _core.Jaxpr):
        yield v


def _user_function(fn, depth=3):
  """The function a user wrote behind JAX's wrappers of it (a
  ``WrappedFun``, a partial, a closure made in JAX's private modules)."""
  while True:
    if hasattr(fn, "f") and callable(fn.f):   # lu.WrappedFun
      fn = fn.f
    elif hasattr(fn, "func") and callable(fn.func):   # functools.partial
      fn = fn.func
    else:
      break
  if depth and is_jax_private_module(getattr(fn, "__module__", "") or ""):
    for cell in getattr(fn, "__closure__", None) or ():
      try:
        inner = _user_function(cell.cell_contents, depth - 1)
      except ValueError:   # an empty cell
        continue
      if callable(inner) and not is_jax_private_module(
          getattr(inner, "__module__", "") or ""):
        return inner
  return fn


def custom_vjp_call_parts(eqn):
  """For an equation of a ``jax.custom_vjp`` call (``custom_vjp_call``, or
  ``CustomVJPTraced`` under ``jax_custom_vjp3``): ``(f's name as JAX
  recorded it or None, the user's bwd or JAX's wrapper of it)``; else
  ``None``."""
  hi = eqn.params.get("_prim")
  if hi is not None:
    if type(hi).__name__ != "CustomVJPTraced":
      return None
    traced = getattr(hi, "traced", None)
    return getattr(traced, "fun_name", None), _user_function(hi.bwd)
  if eqn.primitive.name not in ("custom_vjp_call", "custom_vjp_call_jaxpr"):
    return None
  body = eqn.params.get("call_jaxpr", eqn.params.get("fun_jaxpr"))
  body = getattr(body, "jaxpr", body)
  info = getattr(body, "debug_info", None)
  return (getattr(info, "func_name", None),
          _user_function(eqn.params.get("bwd")))


# -- traces ------------------------------------------------------------------------

def current_trace():
  return _core.trace_ctx.trace


def is_eval_trace(trace=None) -> bool:
  """True for plain eager evaluation (no transformation)."""
  return isinstance(current_trace() if trace is None else trace,
                    _core.EvalTrace)


def stages_nothing(trace=None) -> bool:
  """True where every trace from ``trace`` (default: the current one) down
  to plain evaluation is ``vmap``, ``jvp`` or a linearization's primal side:
  values are computed now, nothing is staged into a jaxpr, so a rule called
  here sees concrete values wherever they are not being transformed."""
  t = current_trace() if trace is None else trace
  while isinstance(t, (_batching.BatchTrace, _ad.JVPTrace,
                       _ad.LinearizeTrace)):
    t = getattr(t, "parent_trace", None)
  return isinstance(t, _core.EvalTrace)


def parent_trace(trace):
  """The trace a transformation's trace stages into, or ``None``."""
  return getattr(trace, "parent_trace", None)


def is_linearize_trace(trace) -> bool:
  """A ``jax.grad``/``jax.vjp``/``jax.linearize`` (direct linearize) trace."""
  return isinstance(trace, _ad.LinearizeTrace)


def below_vmaps(trace):
  """The first trace from ``trace`` down that is not a ``vmap``'s."""
  while isinstance(trace, _batching.BatchTrace):
    trace = parent_trace(trace)
  return trace


def is_differentiating_trace(trace) -> bool:
  """A trace that differentiates what is bound under it where it is made
  (a linearization or a ``jax.jvp``), past any ``vmap`` over it."""
  return isinstance(below_vmaps(trace), (_ad.LinearizeTrace, _ad.JVPTrace))


def linearize_parts(x, trace):
  """``(primal, tangent_is_nonzero)`` for a tracer of the linearization
  ``trace``, else ``None``."""
  if isinstance(x, _ad.LinearizeTracer) and x._trace is trace:  # pylint: disable=protected-access
    return x.primal, type(x.tangent) is not _ad_util.Zero
  return None


def carries_tangent(x) -> bool:
  """Whether ``x`` is a tracer of the current trace, a JVP or a
  linearization, with a tangent that is not a symbolic zero."""
  trace = current_trace()
  if not isinstance(x, (_ad.JVPTracer, _ad.LinearizeTracer)):
    return False
  return x._trace is trace and type(x.tangent) is not _ad_util.Zero  # pylint: disable=protected-access


def is_mapped_here(x) -> bool:
  """Whether ``x`` is a value of the vmap now tracing, with a mapped axis
  (a value of the same vmap's trace that a rule closes over, joined by its
  trace tag, counts)."""
  trace = current_trace()
  if not isinstance(x, _batching.BatchTracer) or x.batch_dim is None:
    return False
  return x._trace is trace or (  # pylint: disable=protected-access
      isinstance(trace, _batching.BatchTrace)
      and x._trace.tag is trace.tag)  # pylint: disable=protected-access


def batch_parts(x, trace):
  """``(value, batch_dim)`` for a tracer of the vmap ``trace``, else
  ``None`` (``batch_dim`` ``None`` for an unmapped one)."""
  if isinstance(x, _batching.BatchTracer) and x._trace is trace:  # pylint: disable=protected-access
    return x.val, x.batch_dim
  return None


def batch_tracer(trace, value, dim):
  """A value of the vmap ``trace``, mapped at ``dim``."""
  return _batching.BatchTracer(trace, value, dim)


def is_batch_trace(trace) -> bool:
  return isinstance(trace, _batching.BatchTrace)


def batch_trace_key(trace):
  """``(tag, axis_data)`` of a vmap's trace."""
  return trace.tag, trace.axis_data


def vmap_axis(axis_data) -> tuple:
  """``(size, name, spmd_name, explicit_mesh_axis)`` of a vmap's axis."""
  return (axis_data.size, axis_data.name, axis_data.spmd_name,
          axis_data.explicit_mesh_axis)


def new_trace_tag():
  """A tag for a new vmap (what ``jax.vmap`` makes for each of its calls)."""
  return _core.TraceTag()


def batch_inner(fun: Callable, tag, axis_data, in_dims, out_dims: Callable):
  """Runs ``fun(*flat_args)`` batched as part of the vmap with trace ``tag``
  (inputs at ``in_dims``, outputs at ``out_dims()``, 0 or ``None`` each,
  asked once ``fun`` has run); returns a function of the flat arguments."""
  def run(*args):
    dbg = _api_util.debug_info("smartvjp vmap", fun, args, {})
    wrapped = _batching._batch_inner(  # pylint: disable=protected-access
        _lu.wrap_init(fun, debug_info=dbg), axis_data, out_dims, False)
    outs, _, _ = wrapped.call_wrapped(tag, list(in_dims), *args)
    return list(outs)
  return run


# JaxprTrace (trace-time partial evaluation) internals

def pe_default(trace, prim, tracers, params):
  """JAX's partial evaluation of an equation as a whole."""
  return trace.default_process_primitive(prim, tracers, params)


def pe_known_values(tracers):
  """The known values of partial-evaluation tracers, or ``None`` unless all
  of them are known."""
  if not all(t.is_known() for t in tracers):
    return None
  return [t.pval.get_known() for t in tracers]


def pe_all_known(tracers) -> bool:
  return all(t.is_known() for t in tracers)


def pe_instantiate(trace, x):
  """A known value as a staged constant of the partial-evaluation trace."""
  return trace.new_instantiated_const(x)


# -- configuration ------------------------------------------------------------------

def config_key() -> Any:
  """Everything in JAX's configuration that can change a trace (x64, ...)."""
  return _config.trace_context()


def define_string_option(name: str, help: str):
  """An optional-string JAX config option that is part of the trace context
  and of ``jax.jit``'s cache key, so that a jitted function already traced
  is traced again when the option changes (``jax.jit`` reuses a compiled
  function without looking at the trace context)."""
  def validator(value):
    if value is not None and not isinstance(value, str):
      raise ValueError(f"{name} must be None or a string, got "
                       f"{type(value).__name__} {value!r}.")
  return _config.string_or_object_state(
      name, None, help, validator=validator, include_in_jit_key=True,
      include_in_trace_context=True)


def mutable_array_checks_enabled() -> bool:
  """Whether JAX's mutable array checks (``jax_mutable_array_checks``) are
  on: then ``jax.custom_vjp`` refuses references it cannot differentiate."""
  return bool(_config.mutable_array_checks.value)


def resolve_kwargs(fun: Callable, args, kwargs) -> tuple:
  """Arguments to positions with defaults applied, exactly as jax.custom_vjp."""
  return _api_util.resolve_kwargs(fun, args, kwargs)


def hide_frames_under(path: str) -> None:
  """Treats files under ``path`` as JAX treats its own: left out of filtered
  tracebacks and skipped when an equation records its user source line."""
  _traceback_util.register_exclusion(path)
  _source_info_util.register_exclusion(path)


def register_weak_param_type(cls: type) -> type:
  """Lets JAX's caches keyed on primitive params hold ``cls`` weakly (JAX's
  abstract-eval cache keeps up to 2048 entries, and with them the user's
  per-step functions, otherwise)."""
  _util.weakref_cache_key_types.add(cls)
  return cls


# -- effects and references ------------------------------------------------------------

def is_ref_aval(aval) -> bool:
  return isinstance(aval, _state_types.AbstractRef)


def is_ref(x) -> bool:
  """True for a mutable array reference (``jax.new_ref``) or its tracer."""
  try:
    return is_ref_aval(_core.typeof(x))
  except TypeError:
    return False


def ref_aval(value_aval):
  """The type of a mutable array reference holding values of ``value_aval``."""
  return _state_types.AbstractRef(value_aval)


def referent_id(x) -> int:
  """Identifies the mutable array a reference points to."""
  return id(_core.get_referent(x))


def _input_position(effect):
  return effect.input if V.EFFECTS_NAME_VARS else effect.input_index


def positional_effects(jaxpr) -> set:
  """The effects of a traced rule (no constants of its own) as its
  primitive's abstract evaluation returns them. A reference the rule
  receives but neither reads nor writes counts as read: an equation taking a
  reference must have an effect on it, or ``jit``, meeting it as a constant,
  would lower it as a constant instead of discharging it."""
  jaxpr = jaxpr.jaxpr if isinstance(jaxpr, ClosedJaxpr) else jaxpr
  effs = (set(_core.positional_effects(jaxpr)) if V.EFFECTS_NAME_VARS
          else set(jaxpr.effects))
  touched = {_input_position(e) for e in effs
             if isinstance(e, _effects.JaxprInputEffect)}
  return effs | {_state_types.ReadEffect(i)
                 for i, v in enumerate(jaxpr.invars)
                 if is_ref_aval(v.aval) and i not in touched}


def resolve_effects(effs, invars) -> set:
  """Positional effects (what an abstract evaluation returns) as the
  effects of an equation over ``invars``."""
  if V.EFFECTS_NAME_VARS:
    return _core.resolve_input_effects(effs, invars)
  return set(effs)


def move_input_effects(effs, where: Callable[[int], int]) -> set:
  """Positional effects with each input position ``i`` moved to ``where(i)``
  (an equation whose inputs are a rule's inputs plus others)."""
  out = set()
  for e in effs:
    if isinstance(e, _effects.JaxprInputEffect):
      i = where(_input_position(e))
      e = e.replace(i) if V.EFFECTS_NAME_VARS else e.replace(input_index=i)
    out.add(e)
  return out


def has_input_effects(jaxpr) -> bool:
  """True when ``jaxpr`` has effects on its inputs (references)."""
  return any(isinstance(e, _effects.JaxprInputEffect) for e in jaxpr.effects)


def effects_keep_alive(effects) -> bool:
  """True when an equation with these effects must not be removed even if
  its outputs are unused (as JAX decides: a debug print or a write to a
  reference keeps it; reading a reference does not)."""
  return any(not _pe.dceable_effects.contains(e) for e in effects)


def uses_axis_name(effects, name) -> bool:
  """True if a jaxpr with these effects refers to the named axis ``name``
  (a collective such as ``psum(x, name)`` inside it)."""
  return name is not None and any(
      isinstance(e, _core.NamedAxisEffect) and e.name == name for e in effects)


def eval_discharged(jaxpr: ClosedJaxpr, should_discharge, *args) -> list:
  """Evaluates ``jaxpr`` (no constants of its own) with its references at the
  ``should_discharge`` positions given as values: its outputs, then the
  final value of each of those references."""
  should = tuple(bool(d) for d in should_discharge)
  if V.DISCHARGE_STATE_TAKES_CLOSED_JAXPR:
    pure = _discharge.discharge_state(jaxpr, should_discharge=should)
    consts = pure.consts
    pure = pure.jaxpr if isinstance(pure, ClosedJaxpr) else pure
  else:
    pure, consts = _discharge.discharge_state(jaxpr.jaxpr, jaxpr.consts,
                                              should_discharge=should)
  return _core.eval_jaxpr(pure, consts, *args)


# -- checkify -------------------------------------------------------------------------

def checkify_jaxpr(ctx, jaxpr, enabled_errors, err_tree, *args):
  """Evaluates ``jaxpr`` (no constants of its own) with its checks turned
  into error values: ``args`` are the leaves of the incoming error (of tree
  ``err_tree``) then the jaxpr's inputs; returns ``(error, outs)``."""
  if V.CHECKIFY_TAKES_CTX:
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


# -- gradient accumulators (jax.custom_vjp.defvjp_with_accums) ----------------------------

def gradient_accumulator(aval):
  """The accumulator ``defvjp_with_accums``' ``bwd`` receives for a primal
  input of type ``aval`` when nothing wraps the rule: a value accumulator,
  or a null one where the cotangent is ``float0``."""
  ct = ct_aval(aval)
  if getattr(ct, "dtype", None) == _dtypes.float0:
    return _ad.NullAccum(ct)
  return _ad.ValAccum(ct)


def accumulated(accumulator):
  """What a :func:`gradient_accumulator` holds: an array, or ``None`` when
  nothing (or only zeros) was pushed into it."""
  if not isinstance(accumulator, _ad.ValAccum):
    return None
  value = accumulator.freeze()
  return None if isinstance(value, _ad_util.Zero) else value


def is_accumulator(x) -> bool:
  return isinstance(x, (_ad.ValAccum, _ad.NullAccum))


# -- rule registration, one function per kind of rule ------------------------------------
#
# Each takes the rule in smartvjp's form (the same on every release) and
# registers it in JAX's table in the installed release's form.

def new_primitive_class(on_batch_trace: Callable):
  """A multiple-results primitive class whose binds on a vmap's trace run
  inside ``on_batch_trace((tag, axis_data))``, a context manager (see
  ``_vmap.py``: the user's rules, run again by a batching rule, see values
  they close over from that vmap as batched)."""
  class SmartPrimitive(_core.Primitive):
    multiple_results = True

    def bind_with_trace(self, trace, args, avals, params, /):
      if not isinstance(trace, _batching.BatchTrace):
        return super().bind_with_trace(trace, args, avals, params)
      with on_batch_trace(batch_trace_key(trace)):
        return super().bind_with_trace(trace, args, avals, params)
  return SmartPrimitive


def register_impl(prim, impl):
  prim.def_impl(impl)


def register_abstract_eval(prim, rule):
  """``rule(*avals, **params) -> (out_avals, effects)``."""
  prim.def_effectful_abstract_eval(rule)


def register_lowering(prim, impl, inline=None):
  """Lowers ``prim`` by tracing ``impl`` (which evaluates its jaxprs); with
  ``inline(**params) -> (jaxpr, scope, positions, num_outs)`` or ``None``,
  by lowering that traced jaxpr (no constants of its own, low-level
  primitives only) inlined where the equation stands, on the inputs at
  ``positions`` (``None``: all), its first ``num_outs`` outputs kept
  (``None``: all), under the named scope ``scope``: what tracing ``impl``
  again would give, without the trace. As JAX lowers its own
  ``custom_vjp_call``: where the equation stands, under its traceback, and
  not cached as an out-of-line function per distinct equation (emitting
  that function cost a scanned model's trace + lower about 10-25%); the
  equations inside still share JAX's lowering cache."""
  traced = _mlir.lower_fun(impl, multiple_results=True)
  if inline is None:
    _mlir.register_lowering(prim, traced)
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
    outs, tokens = _mlir.jaxpr_subcomp(
        sub, closed.jaxpr, ctx.name_stack.extend(scope), ctx.tokens_in, [],
        *ins, dim_var_values=ctx.dim_var_values,
        const_lowering=ctx.const_lowering, outer_traceback=ctx.traceback)
    ctx.set_tokens_out(tokens)
    outs = list(outs)
    return outs if num_outs is None else outs[:num_outs]
  _mlir.register_lowering(prim, lowering, cacheable=False)


def register_jvp(prim, rule):
  """``rule(primals, tangents, **params) -> (primals_out, tangents_out)``."""
  _ad.primitive_jvps[prim] = rule


def register_transpose(prim, rule):
  """``rule(cts, *args, **params) -> cts_in`` (``None`` for defined args)."""
  _ad.primitive_transposes[prim] = rule


def register_linearization(prim, rule):
  """``rule(is_vjp, nonzeros, *primals, **params) -> (primal_outs,
  tangent_nzs_out, residuals, linearized)`` with ``linearized(residuals,
  *tangents) -> tangents_out``."""
  if V.LINEARIZE_HAS_STRUCTURED_RES:
    def adapted(is_vjp, nonzeros, *primals, **params):
      outs, nzs, res, linearized = rule(is_vjp, nonzeros, *primals, **params)
      return outs, nzs, res, None, (
          lambda res, _structured, *tangents: linearized(res, *tangents))
    _ad.primitive_linearizations[prim] = adapted
  else:
    _ad.primitive_linearizations[prim] = rule


def fallback_linearize(prim, is_vjp, nonzeros, *primals, **params):
  """JAX's linearize-by-JVP-and-partial-eval for ``prim``, in the four-value
  form of :func:`register_linearization` rules."""
  result = _ad.fallback_linearize_rule(prim, is_vjp, nonzeros, *primals,
                                       **params)
  if not V.LINEARIZE_HAS_STRUCTURED_RES:
    return result
  outs, nzs, res, structured, linearized = result
  return outs, nzs, res, (
      lambda res, *tangents: linearized(res, structured, *tangents))


def register_partial_eval(prim, rule):
  """Trace-time (``JaxprTrace``) partial evaluation:
  ``rule(trace, *tracers, **params) -> out_tracers``."""
  _pe.custom_partial_eval_rules[prim] = rule


def register_partial_eval_custom(prim, rule):
  """Policy-driven partial evaluation (``jax.checkpoint``): ``rule(saveable,
  unks_in, inst_in, eqn) -> (eqn_known, eqn_staged, unks_out, inst_out,
  residuals)``."""
  _pe.partial_eval_jaxpr_custom_rules[prim] = rule


def register_dce(prim, rule):
  """``rule(used_outputs, eqn) -> (used_inputs, new_eqn | None)``."""
  if V.DCE_RULE_TAKES_LIVE_INS:
    _pe.dce_rules[prim] = lambda used, _live_ins, eqn: rule(used, eqn)
  else:
    _pe.dce_rules[prim] = rule


def register_batching(prim, rule):
  """``rule(axis_data, args, dims, **params) -> (outs, out_dims)``."""
  _batching.fancy_primitive_batchers[prim] = rule


def register_pp(prim, rule):
  """``rule(eqn, context, settings) -> doc``; see :func:`pp_eqn`."""
  _core.pp_eqn_rules[prim] = rule


_PRINT_STAND_INS: dict = {}


def pp_eqn(eqn, context, settings, name=None):
  """JAX's default printing of an equation (what a printing rule delegates
  to after choosing which params to show), under a stand-in primitive of the
  same name (or of ``name``) that has no printing rule of its own."""
  name = name or eqn.primitive.name
  stand_in = _PRINT_STAND_INS.setdefault(name, _core.Primitive(name))
  return _core.pp_eqn(eqn.replace(primitive=stand_in), context, settings)


def register_checkify(prim, rule):
  """``rule(ctx, error, enabled_errors, *args, **params) -> (error, outs)``;
  ``ctx`` is ``None`` on releases without a checkify context."""
  if V.CHECKIFY_TAKES_CTX:
    _checkify.error_checks[prim] = rule
  else:
    _checkify.error_checks[prim] = (
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
      return rule([is_ref_aval(a) for a in in_avals], *args, **params)
  _discharge.register_discharge_rule(prim)(adapted)


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
  _remat.rules[prim] = adapted


def register_to_lojax(prim, rule):
  """``rule(*args, **params) -> outs``: how ``prim`` is evaluated where JAX
  needs low-level primitives only (lowering under jit) and ``prim`` carries a
  jaxpr with high-level ones (``checkpoint_name`` under ``jax_remat3``)."""
  prim.to_lojax = rule


def register_transpose_with_logs(prim, rule, collecting, merge):
  """Where JAX collects backward-pass logs, also registers ``rule`` (a
  transpose rule as for :func:`register_transpose`) in the form that returns
  them: ``rule`` runs inside ``collecting()``, a context manager giving a
  list of log dicts, and ``merge`` of that list (a dict or ``None``) is
  returned."""
  if not V.TRANSPOSE_RETURNS_LOGS:
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
