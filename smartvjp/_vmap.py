"""The user's rules under ``jax.vmap``, as ``jax.custom_vjp`` batches
them: ``f`` and ``fwd`` map every output to axis 0 (a residual ``fwd``
leaves unmapped stays so); ``bwd`` and ``fwd_bwd`` run under ``vmap`` and
an unbatched argument's cotangent is summed. They run as part of the vmap
being batched (its trace tag), so values closed over from it are batched."""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
from jax import tree_util

from smartvjp import _facade as jx
from smartvjp import _jax_api
from smartvjp._cache import batching_tag
from smartvjp._checks import flatten_cotangents
from smartvjp._forward import BatchedJvpRule, tangents_only
from smartvjp._spec import (
    CallSpec, Rules, is_static_residual, trace_call)

def _is_mapped_here(x) -> bool:
  """Whether ``x`` is a value of the vmap now tracing, with a mapped axis
  (a value of the same vmap's trace that a rule closes over, joined by its
  trace tag, counts)."""
  trace = jx.core.trace_ctx.trace
  if not isinstance(x, jx.batching.BatchTracer) or x.batch_dim is None:
    return False
  return x._trace is trace or (  # pylint: disable=protected-access
      isinstance(trace, jx.batching.BatchTrace)
      and x._trace.tag is trace.tag)  # pylint: disable=protected-access


def _vmap_rule(fn, in_axes, axis_data, tag=None, report=None, may_stay=None):
  """``report`` receives which output leaves ``fn`` mapped; ``may_stay(i)``:
  an unmapped output leaf ``i`` stays unmapped."""
  if report is not None:
    fn = _reporting(fn, report)
  if tag is None and may_stay is None:
    return jax.vmap(fn, in_axes=in_axes, out_axes=0, axis_size=axis_data.size,
                    axis_name=axis_data.name,
                    spmd_axis_name=axis_data.spmd_name)
  if tag is None:
    tag = jx.core.TraceTag()

  def batched(*args):
    axes = in_axes if isinstance(in_axes, (tuple, list)) else \
        (in_axes,) * len(args)
    leaves, in_tree = tree_util.tree_flatten(args)
    store = {}

    def flat(*xs):
      out = fn(*tree_util.tree_unflatten(in_tree, list(xs)))
      out_leaves, store["tree"] = tree_util.tree_flatten(out)
      store["dims"] = [
          None if may_stay is not None and may_stay(i)
          and not _is_mapped_here(x) else 0
          for i, x in enumerate(out_leaves)]
      return out_leaves
    outs = jx.batch_inner(flat, tag, axis_data, _flat_axes(tuple(axes), args),
                          lambda: store["dims"])(*leaves)
    return tree_util.tree_unflatten(store["tree"], outs)
  return batched


def _reporting(fn, report):
  def run(*args):
    out = fn(*args)
    report([_is_mapped_here(x) for x in tree_util.tree_leaves(out)])
    return out
  return run


def _flat_axes(in_axes, args):
  out = []
  tree_util.tree_map(
      lambda ax, sub: out.extend([ax] * len(tree_util.tree_leaves(sub))),
      in_axes, args, is_leaf=lambda x: x is None)
  return out


def _named(fn, like):
  fn.__name__ = getattr(like, "__name__", "rule")
  return fn


def _none_for_zeros(cts):
  return [None if type(c) is jx.ad_util.Zero else c for c in cts]


def _sum_unbatched(cts, in_dims):
  return tuple(None if c is None else (c if d is not None else jnp.sum(c, 0))
               for c, d in zip(cts, in_dims))


def _split_symbolic(g_leaves):
  zeros = [type(g) is jx.ad_util.SymbolicZero for g in g_leaves]
  arrays = [g for g, z in zip(g_leaves, zeros) if not z]
  unbatched = [jx.ad_util.SymbolicZero(jx.core.mapped_aval(g.aval.shape[0], 0, g.aval))
               if z else None for g, z in zip(g_leaves, zeros)]

  def rebuild(arrays_in):
    it = iter(arrays_in)
    return [u if z else next(it) for u, z in zip(unbatched, zeros)]
  return arrays, rebuild


def _fwd_values(rules, leaves, n):
  if rules.symbolic_zeros:
    return [l.value for l in leaves], [l.perturbed for l in leaves]
  return list(leaves), [True] * n


def batched_rules(call: CallSpec, consts, const_dims, in_dims, axis_data,
                  res_mapped=None):
  """``res_mapped``: which residual leaves ``bwd`` gets mapped, where no
  ``fwd`` of these rules ran."""
  rules = call.rules
  n = call.num_primals
  tag = batching_tag(axis_data)

  def vmapped(fn, in_axes, report=None, may_stay=None):
    return _vmap_rule(fn, in_axes, axis_data, tag, report, may_stay)

  # which primal outputs and array residuals fwd maps, noted when it runs
  seen = {} if res_mapped is None else {"res": tuple(res_mapped)}

  def note(mapped):
    k = out_tree().num_leaves
    seen["fwd"] = tuple(mapped[:k])
    seen["res"] = tuple(mapped[k:])

  def out_tree():
    return call.out_tree if call.out_tree is not None else seen["out_tree"]

  def fun(*leaves):
    if call.jaxpr is None:   # f not traced: the user's f itself under vmap
      def one(leaves):
        return tuple(tree_util.tree_leaves(rules.fun(*call.full_args(leaves))))
      return vmapped(one, (list(in_dims),))(list(leaves))

    def one(consts, leaves):
      return tuple(jx.core.eval_jaxpr(call.jaxpr.jaxpr, (), *consts, *leaves))
    return vmapped(one, (list(const_dims), list(in_dims)))(
        list(consts), list(leaves))

  def fwd(*leaves):
    vals, perturbed = _fwd_values(rules, leaves, n)
    statics = {}

    def one(*vals):
      out, res = rules.fwd(*call.full_args(call.fwd_inputs(vals, perturbed)))
      out_leaves, seen["out_tree"] = tree_util.tree_flatten(out)
      # Python scalars among the residuals stay Python values, unbatched, as
      # jax.custom_vjp hands them to bwd; only array residuals are batched
      res_leaves, statics["tree"] = tree_util.tree_flatten(res)
      statics["leaves"] = [r if is_static_residual(r) else None
                           for r in res_leaves]
      seen["static"] = tuple(s is not None for s in statics["leaves"])
      return tuple(out_leaves), [r for r in res_leaves
                                 if not is_static_residual(r)]
    out, dynamic = vmapped(one, list(in_dims), note,
                           lambda i: i >= seen["out_tree"].num_leaves)(*vals)
    it = iter(dynamic)
    res = [next(it) if s is None else s for s in statics["leaves"]]
    return out, tree_util.tree_unflatten(statics["tree"], res)
  fwd.mapped_outputs = seen

  def bwd(res, g):
    arrays, rebuild = _split_symbolic(list(g))
    mapped = iter(seen.get("res", ()))
    # which leaves are Python values: as fwd returned them (a float input
    # that fwd saw traced may come back a float subclass), else by type
    leaves, res_tree = tree_util.tree_flatten(res)
    static = seen.get("static")
    if static is None or len(static) != len(leaves):
      static = [is_static_residual(r) for r in leaves]
    # axes over the flat leaves: an axes pytree would be matched against
    # res by JAX, which reads a None node of res as an axis
    res_axes = [None if s else (0 if next(mapped, True) else None)
                for s in static]

    def one(leaves, arrays):
      res = tree_util.tree_unflatten(res_tree, leaves)
      with _jax_api.collecting_logs() as sink:   # per example, batched out
        py_g = tree_util.tree_unflatten(out_tree(), rebuild(arrays))
        cts = flatten_cotangents(
            call, rules.bwd(*call.nondiff, res, py_g), "bwd")
      return _none_for_zeros(cts), _jax_api.merged_logs(sink)
    out, logs = vmapped(one, (res_axes, 0))(leaves, arrays)
    _jax_api.deposit_logs(logs)
    return _sum_unbatched(out, in_dims)

  def fwd_bwd(*args):
    vals, perturbed = _fwd_values(rules, args[:n], n)
    arrays, rebuild = _split_symbolic(list(args[n]))

    def one(vals, arrays):
      full = call.full_args(call.fwd_inputs(vals, perturbed))
      py_g = tree_util.tree_unflatten(out_tree(), rebuild(arrays))
      cts = flatten_cotangents(call, rules.fwd_bwd(*full, py_g), "fwd_bwd")
      return _none_for_zeros(cts)
    return _sum_unbatched(vmapped(one, (list(in_dims), 0))(vals, arrays),
                          in_dims)

  return Rules(
      fun=_named(fun, rules.fun),
      fwd=_named(fwd, rules.fwd) if rules.fwd is not None else None,
      bwd=_named(bwd, rules.bwd) if rules.bwd is not None else None,
      fwd_bwd=(_named(fwd_bwd, rules.fwd_bwd)
               if rules.fwd_bwd is not None else None),
      symbolic_zeros=rules.symbolic_zeros, nondiff_argnums=(),
      always_save=rules.always_save, generic_batching=rules.generic_batching,
      fused=rules.fused,
      jvp=(BatchedJvpRule(rules.jvp, call, tuple(in_dims), vmapped)
           if rules.jvp is not None else None),
      remat=(batched_rules(call.remat_call(), consts, const_dims, in_dims,
                           axis_data) if rules.remat is not None else None))


def tangents_over_mapped(call, primals, in_nz, tangents, tdims, axis_data):
  """The forward rule's tangent part with only its tangents mapped
  (``jax.jacfwd``), so a kernel in its primal part serves the whole batch."""
  tangents = [front(axis_data, t, d) for t, d in zip(tangents, tdims)]
  tag = batching_tag(axis_data)
  rule = BatchedJvpRule(
      call.rules.jvp, call, (None,) * call.num_primals,
      lambda fn, in_axes: _vmap_rule(fn, in_axes, axis_data, tag),
      t_dims=(0,) * len(tangents))
  return tangents_only(call, primals, in_nz, tangents, rule)


def batched_avals(avals, in_dims, axis_data):
  return tuple(jx.core.unmapped_aval(axis_data.size, 0, a,
                                     axis_data.explicit_mesh_axis)
               if d is not None else a
               for a, d in zip(avals, in_dims))


def tuple_tree(n):
  return tree_util.tree_structure(tuple(range(n)))


def batched_call(call, consts, const_dims, in_dims, axis_data):
  key = (tuple(const_dims), tuple(in_dims), axis_data)
  hit = call.batch_cache.get(key)
  if hit is not None:
    return hit
  rules = batched_rules(call, consts, const_dims, in_dims, axis_data)
  in_avals = batched_avals(call.in_avals, in_dims, axis_data)
  out = trace_call(rules, (), len(in_avals), tuple_tree(len(in_avals)),
                   in_avals)
  call.batch_cache.put(key, out, [*consts, *out[1]])
  return out


def linear_only_call(call, in_dims, axis_data, res_mapped=None):
  key = ("linear", tuple(in_dims), axis_data,
         None if res_mapped is None else tuple(res_mapped))
  hit = call.batch_cache.get(key)
  if hit is not None:
    return hit
  rules = batched_rules(call, (), (), in_dims, axis_data, res_mapped)
  in_avals = batched_avals(call.in_avals, in_dims, axis_data)
  out_avals = batched_avals(call.out_avals, [0] * call.num_outs, axis_data)
  spec = CallSpec(
      rules=rules, nondiff=(), num_args=len(in_avals),
      in_tree=tuple_tree(len(in_avals)), in_avals=in_avals,
      out_tree=tuple_tree(len(out_avals)), out_avals=out_avals, jaxpr=None,
      num_consts=0, origin=call)
  call.batch_cache.put(key, spec)
  return spec


def batched_fwd(call, fwd, axis_data, dims,
                out_dim=jx.batching.zero_if_mapped):
  new, extra, out_batched = batched_jaxpr(fwd.jaxpr, axis_data, dims, out_dim)
  bfwd = dataclasses.replace(
      fwd.shifted(new, len(extra)),
      out_avals=tuple(new.out_avals[:call.num_outs]) if fwd.out_avals else ())
  return bfwd, extra, out_batched


def batched_jaxpr(jaxpr, axis_data, dims, out_dim=jx.batching.zero_if_mapped):
  batched, out_batched = jx.batching.batch_jaxpr_axes(
      jaxpr, axis_data, dims, [out_dim] * len(jaxpr.out_avals))
  new = jx.ClosedJaxpr(jx.pe.convert_constvars_jaxpr(batched.jaxpr), ())
  return new, list(batched.consts), out_batched


def front(axis_data, x, d):
  return jx.batching.bdim_at_front(x, d, axis_data.size,
                                   axis_data.explicit_mesh_axis)


def to_front_or_none(axis_data, xs, dims):
  return ([x if d is None else
           front(axis_data, x, None if d == "broadcast" else d)
           for x, d in zip(xs, dims)],
          [None if d is None else 0 for d in dims])


def unbatched(axis_data, dims, effects) -> bool:
  """No input is mapped and no collective names the axis (a ``psum`` must
  see the axis even on an unmapped operand)."""
  name = axis_data.name
  return all(d is None for d in dims) and (name is None or not any(
      isinstance(e, jx.core.NamedAxisEffect) and e.name == name
      for e in effects))
