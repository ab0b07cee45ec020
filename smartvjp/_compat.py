"""The one module that touches JAX internals (``jax._src``).

Every other smartvjp module imports JAX-internal names from here, so that a JAX
upgrade that moves or renames internals is a change to this file only.
Supported: jax/jaxlib 0.10.x and 0.11.x.
"""

from __future__ import annotations

from typing import Any, Callable, Sequence

from jax._src import config as _config
from jax._src import core
from jax._src import linear_util as lu
from jax._src import source_info_util
from jax._src.ad_checkpoint import name_p
from jax._src.ad_util import Zero, SymbolicZero
from jax._src.api_util import debug_info as _debug_info
from jax._src.custom_derivatives import CustomVJPPrimal
from jax._src.debugging import DebugEffect
from jax._src.dtypes import float0
from jax._src.interpreters import ad, batching, mlir
from jax._src.interpreters import partial_eval as pe

__all__ = [
    "core", "lu", "ad", "pe", "mlir", "batching", "source_info_util",
    "Zero", "SymbolicZero", "CustomVJPPrimal", "float0", "name_p",
    "Primitive", "ClosedJaxpr", "Jaxpr", "JaxprEqn", "Var", "Literal", "Tracer",
    "Recompute", "Offloadable", "new_jaxpr_eqn", "is_undefined_primal",
    "instantiate_zeros", "get_aval", "typecompat",
    "new_primitive", "trace_to_closed_jaxpr", "register_weak_param_type",
    "memory_space", "device_memory_space", "resolve_kwargs", "is_eval_trace",
    "config_key", "register_lowering_from_impl", "policy_answer",
    "only_unordered_debug_effects", "pp_eqn", "define_string_option",
]

Primitive = core.Primitive
ClosedJaxpr = core.ClosedJaxpr
Jaxpr = core.Jaxpr
JaxprEqn = core.JaxprEqn
Var = core.Var
Literal = core.Literal
Tracer = core.Tracer
Recompute = pe.Recompute
Offloadable = pe.Offloadable
new_jaxpr_eqn = pe.new_jaxpr_eqn
is_undefined_primal = ad.is_undefined_primal
instantiate_zeros = ad.instantiate_zeros
get_aval = core.typeof
typecompat = core.typecompat  # shape, dtype, sharding, varying axes; no weak_type


def new_primitive(name: str) -> Primitive:
  """A multiple-results primitive."""
  p = core.Primitive(name)
  p.multiple_results = True
  return p


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
  wrapped = lu.wrap_init(fun, debug_info=dbg.with_unknown_names())
  jaxpr, _, consts = pe.trace_to_jaxpr_dynamic(wrapped, list(in_avals))
  jaxpr = pe.convert_constvars_jaxpr(jaxpr)
  return core.ClosedJaxpr(jaxpr, ()), list(consts)


def register_weak_param_type(cls: type) -> type:
  """Lets JAX's caches keyed on primitive params hold ``cls`` weakly.

  Without it, JAX's abstract-eval cache (up to 2048 entries) keeps every
  spec, and with it the user's per-step functions, alive.
  """
  from jax._src.util import weakref_cache_key_types
  weakref_cache_key_types.add(cls)
  return cls


def memory_space(kind: str):
  """The memory space of a memory kind (``"device"``, ``"pinned_host"``)."""
  return core.mem_kind_to_space(kind)


def device_memory_space():
  return core.mem_kind_to_space("device")


def resolve_kwargs(fun: Callable, args, kwargs) -> tuple:
  """Arguments to positions with defaults applied, exactly as jax.custom_vjp."""
  from jax._src.api_util import resolve_kwargs as _resolve
  return _resolve(fun, args, kwargs)


def is_eval_trace() -> bool:
  """True when no transformation is tracing (plain eager evaluation)."""
  return isinstance(core.trace_ctx.trace, core.EvalTrace)


def config_key() -> Any:
  """Everything in JAX's configuration that can change a trace (x64, ...)."""
  return _config.trace_context()


def register_lowering_from_impl(prim: Primitive, impl: Callable) -> None:
  """Lowers ``prim`` by tracing ``impl`` (which evaluates its jaxprs)."""
  mlir.register_lowering(prim, mlir.lower_fun(impl, multiple_results=True))


def policy_answer(policy: Callable, prim: Primitive, avals, params):
  """Asks a remat policy about one equation; returns Saveable/Recompute/Offloadable."""
  return pe.ensure_enum(policy(prim, *avals, **params))


def only_unordered_debug_effects(effects) -> bool:
  """True if dropping an equation with these effects changes no program output.

  Unordered debug effects (``jax.debug.print``/``debug.callback``) only
  observe; where a rule runs is smartvjp's decision, not the user's program.
  """
  return all(isinstance(e, DebugEffect) for e in effects)




def pp_eqn(eqn, context, settings):
  return core._pp_eqn(eqn, context, settings)


def define_string_option(name: str, help: str):
  """An optional-string JAX config option that is part of the trace context
  (so jitted functions retrace when it changes)."""
  from jax._src import config as _cfg
  return _cfg.optional_string_state(name, default=None, help=help,
                                    include_in_trace_context=True)
