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

import importlib
import inspect
from typing import Any, Callable, Sequence

import jax

# (module, names) for every JAX internal that smartvjp uses.
_REQUIRED: tuple[tuple[str, tuple[str, ...]], ...] = (
    ("jax._src.core", (
        "Primitive", "JaxprEqn", "Var", "Literal", "Tracer", "typeof",
        "typecompat", "mem_kind_to_space", "trace_ctx", "EvalTrace",
        "eval_jaxpr", "unmapped_aval", "pp_eqn_rules", "set_current_trace")),
    ("jax._src.interpreters.partial_eval", (
        "Recompute", "Offloadable", "new_jaxpr_eqn", "trace_to_jaxpr_dynamic",
        "convert_constvars_jaxpr", "partial_eval_jaxpr_custom_rules",
        "custom_partial_eval_rules", "dce_rules", "ensure_enum",
        "_default_dce_rule", "partial_eval_jaxpr_custom", "dce_jaxpr")),
    ("jax._src.interpreters.ad", (
        "is_undefined_primal", "instantiate_zeros", "primitive_jvps",
        "primitive_transposes", "primitive_linearizations",
        "fallback_linearize_rule", "LinearizeTrace")),
    ("jax._src.interpreters.batching", (
        "fancy_primitive_batchers", "batch_jaxpr", "batch_jaxpr_axes",
        "bdim_at_front", "zero_if_mapped")),
    ("jax._src.interpreters.mlir", ("register_lowering", "lower_fun")),
    ("jax._src.api_util", ("debug_info", "resolve_kwargs")),
    ("jax._src.linear_util", ("wrap_init",)),
    ("jax._src.config", ("trace_context", "optional_string_state")),
    ("jax._src.custom_derivatives", ("CustomVJPPrimal",)),
    ("jax._src.debugging", ("DebugEffect",)),
    ("jax._src.ad_checkpoint", ("name_p",)),
    ("jax._src.ad_util", ("Zero", "SymbolicZero")),
    ("jax._src.dtypes", ("float0",)),
    ("jax._src.util", ("weakref_cache_key_types",)),
    ("jax.extend.core", ("ClosedJaxpr",)),
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
eval_jaxpr = _core.eval_jaxpr
unmapped_aval = _core.unmapped_aval
set_current_trace = _core.set_current_trace
convert_constvars_jaxpr = _pe.convert_constvars_jaxpr
batch_jaxpr = _batching.batch_jaxpr
batch_jaxpr_axes = _batching.batch_jaxpr_axes
bdim_at_front = _batching.bdim_at_front
zero_if_mapped = _batching.zero_if_mapped


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

def new_primitive(name: str) -> Primitive:
  """A multiple-results primitive."""
  p = _core.Primitive(name)
  p.multiple_results = True
  return p


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


def pp_eqn(eqn, context, settings):
  """JAX's default printing of an equation (what a ``register_pp`` rule
  delegates to after choosing which params to show)."""
  return _core._pp_eqn(eqn, context, settings)


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


def only_unordered_debug_effects(effects) -> bool:
  """True if dropping an equation with these effects changes no program output.

  Unordered debug effects (``jax.debug.print``/``debug.callback``) only
  observe; where a rule runs is smartvjp's decision, not the user's program.
  """
  return all(isinstance(e, DebugEffect) for e in effects)


def define_string_option(name: str, help: str):
  """An optional-string JAX config option that is part of the trace context
  (so jitted functions retrace when it changes)."""
  return _config.optional_string_state(name, default=None, help=help,
                                       include_in_trace_context=True)
