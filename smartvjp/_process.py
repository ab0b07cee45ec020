"""How the current trace processes a ``smart_custom_vjp`` call, as JAX's
traces process a ``jax.custom_vjp`` call: plain evaluation calls ``f``; a
linearization applied directly to the call (eagerly or over ``jit``/``vmap``,
and ``grad(vmap(F))``) traces only ``fwd``, never ``f``; anything else
traces ``f`` once per signature and outer trace into a ``smartvjp_call``."""

from __future__ import annotations

import contextlib
import dataclasses

import jax
from jax import tree_util
from jax.errors import UnexpectedTracerError

from smartvjp import _facade as jx
from smartvjp import _policy
from smartvjp import _spec
from smartvjp import _versions
from smartvjp import _vmap
from smartvjp._cache import batching, differentiated_where_made
from smartvjp._checks import (
    check_aliased_arguments, check_f_output, check_jax_leaves)
from smartvjp._forward import forward_mode_on_call, forward_mode_refusal
from smartvjp._primitive import call_p, register
from smartvjp._spec import (
    EagerClosureError, eager_fwd, linearized_call, trace_call, untraced)
from smartvjp._static import static_key


def eager_call(rules, nondiff: tuple, num_args: int, in_tree,
               in_avals: tuple, primals, nonzero):
  """Differentiated eagerly: ``fwd`` (or ``f`` with only ``fwd_bwd``) runs
  on the concrete values now, as with ``jax.custom_vjp``; ``f`` is never
  traced. Returns the ``CallSpec`` that carries what ran."""
  call = untraced(rules, nondiff, num_args, in_tree, in_avals)
  in_nz = call.perturbed(nonzero)
  if _policy.schedule_without_policy(call, None).runs_fwd_bwd:
    # fwd_bwd alone: f now
    with jax.named_scope(call.scopes["f"]):
      out = rules.fun(*call.full_args(primals))
    check_jax_leaves(out, rules, "fun", "output")
    check_f_output(rules, out)
    out_leaves, out_tree = tree_util.tree_flatten(out)
    result = (in_nz, out_leaves, list(primals), None)
  else:
    out_leaves, res, fwd = eager_fwd(call, in_nz, primals)
    out_tree = fwd.out_tree
    result = (in_nz, out_leaves, res, fwd)
  if any(isinstance(x, jx.core.Tracer) for x in (*result[1], *result[2])):
    raise EagerClosureError
  return dataclasses.replace(
      call, out_tree=out_tree,
      out_avals=tuple(jx.core.typeof(x) for x in out_leaves), eager=result,
      eager_primals=tuple(primals))


def _call_process(bind, leaves, call) -> list:
  """The outputs (flat) of the unprocessed ``call`` on ``leaves``; sets
  ``call.out_tree``. ``bind``: ``smartvjp_call``'s plain bind, which
  finishes a call processed here into a traced one."""
  rules, nondiff, num_args, in_tree, _ = call.signature
  if (isinstance(jx.core.trace_ctx.trace, jx.core.EvalTrace)
      and not any(isinstance(x, jx.core.Tracer) for x in leaves)):
    if not _versions.ALIASED_REFS_CHECKED_AT_CALL:   # (else checked already)
      check_aliased_arguments(rules, "fun", num_args, in_tree, leaves)
    out = rules.fun(*_spec.full_args(rules, nondiff, num_args, in_tree,
                                     leaves))
    check_f_output(rules, out)
    out_leaves, call.out_tree = tree_util.tree_flatten(out)
    return out_leaves
  linearizing = _linearizing(leaves)
  if linearizing is not None:   # grad/vjp innermost: f need not be traced
    hit = _linearized(call, *linearizing)
    if hit is not None:
      spec, consts = hit
      call.out_tree = spec.out_tree
      return bind(*consts, *leaves, call=spec)
  outs = _vmap_of_linearized(call, leaves)
  if outs is not None:   # vmap innermost, over grad/vjp: f need not be traced
    return outs
  try:
    spec, consts = _traced(call)
  except Exception as e:  # noqa: BLE001 - forward mode's refusal, or as is
    refusal = forward_mode_refusal(e, rules, "fun", forward_mode_on_call())
    if refusal is None:
      raise
    raise refusal from e
  call.out_tree = spec.out_tree
  # differentiated now, by the current trace (as opposed to staged and
  # differentiated later): the two refuse a closure with different errors
  with (differentiated_where_made(spec)
        if isinstance(_below_vmaps(jx.core.trace_ctx.trace),
                      (jx.ad.LinearizeTrace, jx.ad.JVPTrace))
        else contextlib.nullcontext()):
    return bind(*consts, *leaves, call=spec)


register(call_p, "process", _call_process)


def _linearized(call, trace, primals, nonzero):
  """``f`` untraced: eagerly ``fwd`` runs on the values, else it is traced;
  ``None`` where ``f`` must be traced after all."""
  rules, nondiff, num_args, in_tree, avals = call.signature
  parent = getattr(trace, "parent_trace", None)
  if isinstance(parent, jx.core.EvalTrace) and not any(
      isinstance(p, jx.core.Tracer) for p in primals):
    try:
      with jx.core.set_current_trace(parent):
        return eager_call(*call.signature, primals, nonzero), ()
    except (EagerClosureError, UnexpectedTracerError):
      return None    # a rule closes over a tracer: trace f to find it
  if rules.fwd is None or _has_refs(avals):
    return None
  in_nz = _spec.perturbed(nonzero, avals)
  if not any(in_nz):
    return None
  static = tuple(static_key(v) for v in nondiff)
  key = ("linearized", in_tree, avals, static, num_args, in_nz,
         jx.config.trace_context())
  hit = None if None in static else call.cache.get(key)
  if hit is None:
    hit = linearized_call(*call.signature, in_nz,
                          lambda c: _linearize_parts(c, trace) is not None)
    if hit is not None and None not in static:
      call.cache.put(key, hit, hit[1])
  return hit


def _vmap_of_linearized(call, leaves):
  """``grad(vmap(F))``, vmaps nested too: the user's rules batched as Python
  functions and the batched call linearized where made, outputs mapped as
  the batched ``fwd`` maps them; ``None`` where that does not apply."""
  rules, nondiff, num_args, in_tree, avals = call.signature
  batch = jx.core.trace_ctx.trace
  if (not isinstance(batch, jx.batching.BatchTrace) or rules.generic_batching
      or rules.fwd is None or _has_refs(avals)):
    return None
  parent = getattr(batch, "parent_trace", None)
  # vmaps over vmaps over the linearization
  if not isinstance(_below_vmaps(parent), jx.ad.LinearizeTrace):
    return None
  axis_data = batch.axis_data
  parts = [(x.val, x.batch_dim) if isinstance(x, jx.batching.BatchTracer)
           and x._trace is batch else None  # pylint: disable=protected-access
           for x in leaves]
  vals = [x if p is None else _vmap.front(axis_data, p[0], p[1])
          if p[1] is not None else p[0] for x, p in zip(leaves, parts)]
  in_dims = [None if p is None or p[1] is None else 0 for p in parts]
  base = _spec.untraced(rules, nondiff, num_args, in_tree, avals)
  with batching((batch.tag, axis_data)):
    brules = _vmap.batched_rules(base, (), (), in_dims, axis_data)
  bavals = _vmap.batched_avals(avals, in_dims, axis_data)
  with jx.core.set_current_trace(parent):
    if isinstance(parent, jx.ad.LinearizeTrace):
      outs = _linearized_batched(brules, vals, bavals, parent)
    else:   # the next vmap out batches the batched rules again
      outs = _vmap_of_linearized(
          _spec.Unprocessed(brules, (), len(vals),
                            _vmap.tuple_tree(len(vals)), bavals, call.cache),
          vals)
  if outs is None:
    return None
  seen = brules.fwd.mapped_outputs   # what the batched fwd noted
  call.out_tree = seen["out_tree"]
  return [jx.batching.BatchTracer(batch, o, 0) if m else o[0]
          for o, m in zip(outs, seen["fwd"])]


def _linearized_batched(brules, vals, bavals, lin):
  linearizing = _linearizing(vals)
  if linearizing is None:
    return None
  _, primals, nonzero = linearizing
  in_nz = _spec.perturbed(nonzero, bavals)
  if not any(in_nz):
    return None
  hit = linearized_call(brules, (), len(vals), _vmap.tuple_tree(len(vals)),
                        bavals, in_nz,
                        lambda c: _linearize_parts(c, lin) is not None)
  if hit is None:
    return None
  spec, consts = hit
  return call_p.bind(*consts, *vals, call=spec)


def _traced(call):
  """Nondiff arguments are part of the key; unhashable ones are traced afresh."""
  rules, nondiff, num_args, in_tree, avals = call.signature
  static = tuple(static_key(v) for v in nondiff)
  if any(k is None for k in static):   # unhashable: it may be mutated
    return trace_call(rules, nondiff, num_args, in_tree, avals)
  key = (in_tree, avals, static, num_args, jx.config.trace_context())
  hit = call.cache.get(key)
  if hit is not None:
    return hit
  spec, consts = trace_call(rules, nondiff, num_args, in_tree, avals)
  call.cache.put(key, (spec, consts), consts)
  return spec, consts


def _linearizing(leaves):
  """``(trace, primals, nonzero)`` where the current trace linearizes some
  leaf with a nonzero tangent, else ``None``."""
  trace = jx.core.trace_ctx.trace
  if not isinstance(trace, jx.ad.LinearizeTrace):
    return None
  primals, nonzero = [], []
  for x in leaves:
    parts = _linearize_parts(x, trace)
    primals.append(x if parts is None else parts[0])
    nonzero.append(parts is not None and parts[1])
  return (trace, primals, nonzero) if any(nonzero) else None


def _linearize_parts(x, trace):
  """``(primal, tangent_is_nonzero)`` for a tracer of ``trace``, else
  ``None``."""
  if isinstance(x, jx.ad.LinearizeTracer) and x._trace is trace:  # pylint: disable=protected-access
    return x.primal, type(x.tangent) is not jx.ad_util.Zero
  return None


def _below_vmaps(trace):
  while isinstance(trace, jx.batching.BatchTrace):
    trace = trace.parent_trace
  return trace


def _has_refs(avals) -> bool:
  return any(isinstance(a, jx.state_types.AbstractRef) for a in avals)
