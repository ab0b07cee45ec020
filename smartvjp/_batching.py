"""Batching (``jax.vmap``) rules for smartvjp's primitives.

A batched call is a new smartvjp call whose rules are the user's rules under
``jax.vmap``, as ``jax.custom_vjp`` batches its rules: ``f`` and ``fwd`` map
every output to axis 0; ``bwd`` and ``fwd_bwd`` are traced under ``vmap`` and
the cotangent of an argument that was not batched is summed over the batch.
A ``vmap_method="sequential"`` callback kernel therefore runs once per example
per rule. ``smartvjp_fwd`` is batched by batching its traced jaxpr, which
keeps its output layout.

The batched rules work on flat lists of leaves (their ``in_tree`` is a tuple
of leaves), call the user's functions on the unbatched pytrees inside
``vmap``, and so check the user's outputs against the user's own shapes.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
from jax import tree_util

from smartvjp import _compat
from smartvjp import _jax_api
from smartvjp._jax_api import remat_call
from smartvjp._bwd import flatten_cotangents
from smartvjp._primitives import (
    bind_primal_and_residuals, call_p, fused_lin_p, fwd_p, jvp_p, lin_p,
    primal_p, bwd_p, split_jvp_args, split_primal_args)
from smartvjp._spec import CallSpec, Rules, select_outputs, trace_call


def _vmap_rule(fn, in_axes, axis_data, tag=None, report=None):
  """``jax.vmap(fn, in_axes)`` over ``axis_data`` (every output at axis 0);
  with the trace ``tag`` of the vmap being batched, as part of that vmap, so
  that values the user's rules close over from it are batched too.
  ``report``, if given, receives which output leaves ``fn`` mapped."""
  if report is not None:
    fn = _reporting(fn, report)
  if tag is None:
    return jax.vmap(fn, in_axes=in_axes, out_axes=0,
                    axis_size=axis_data.size, axis_name=axis_data.name,
                    spmd_axis_name=axis_data.spmd_name)

  def batched(*args):
    axes = in_axes if isinstance(in_axes, (tuple, list)) else \
        (in_axes,) * len(args)
    flat_dims = _flat_axes(tuple(axes), args)
    leaves, in_tree = tree_util.tree_flatten(args)
    store = {}

    def flat(*xs):
      out = fn(*tree_util.tree_unflatten(in_tree, list(xs)))
      out_leaves, store["tree"] = tree_util.tree_flatten(out)
      return out_leaves
    outs = _compat.vmap_in_trace(flat, tag, axis_data, flat_dims)(*leaves)
    return tree_util.tree_unflatten(store["tree"], outs)
  return batched


def _reporting(fn, report):
  """``fn`` that passes ``report`` which of its output leaves are mapped."""
  def run(*args):
    out = fn(*args)
    report([_compat.is_mapped_here(x) for x in tree_util.tree_leaves(out)])
    return out
  return run


def _flat_axes(in_axes, args):
  """One axis per leaf of ``args`` from the prefix tree ``in_axes``."""
  out = []
  tree_util.tree_map(
      lambda ax, sub: out.extend([ax] * len(tree_util.tree_leaves(sub))),
      in_axes, args, is_leaf=lambda x: x is None)
  return out


def _named(fn, like):
  fn.__name__ = getattr(like, "__name__", "rule")
  return fn


def _none_for_zeros(cts):
  return [None if type(c) is _compat.Zero else c for c in cts]


def _sum_unbatched(cts, in_dims):
  return tuple(None if c is None else (c if d is not None else jnp.sum(c, 0))
               for c, d in zip(cts, in_dims))


def _split_symbolic(g_leaves):
  """Array leaves to map over, and a function rebuilding the full leaves."""
  zeros = [type(g) is _compat.SymbolicZero for g in g_leaves]
  arrays = [g for g, z in zip(g_leaves, zeros) if not z]
  unbatched = [_compat.SymbolicZero(_unbatched_aval(g.aval)) if z else None
               for g, z in zip(g_leaves, zeros)]

  def rebuild(arrays_in):
    it = iter(arrays_in)
    return [u if z else next(it) for u, z in zip(unbatched, zeros)]
  return arrays, rebuild


def _unbatched_aval(aval):
  """One example's type (the sharding spec loses the mapped axis too)."""
  return _compat.mapped_aval(aval.shape[0], 0, aval)


def batched_rules(call: CallSpec, consts, const_dims, in_dims, axis_data):
  """The user's rules under vmap, over flat leaves (batched ones at axis 0);
  every output is batched (per-example values and cotangents)."""
  rules = call.rules
  n = call.num_primals
  tag = _compat.current_batch_tag(axis_data)

  def _vmap(fn, in_axes, axis_data, report=None):
    return _vmap_rule(fn, in_axes, axis_data, tag, report)

  seen = {}   # which primal outputs fwd maps, noted when it is traced

  def note(mapped):
    seen["fwd"] = tuple(mapped[:call.num_outs])

  def fun(*leaves):
    def one(consts, leaves):
      return tuple(_compat.eval_jaxpr(call.jaxpr.jaxpr, (), *consts, *leaves))
    return _vmap(one, (list(const_dims), list(in_dims)), axis_data)(
        list(consts), list(leaves))

  def fwd(*leaves):
    if rules.symbolic_zeros:
      vals = [l.value for l in leaves]
      perturbed = [l.perturbed for l in leaves]
    else:
      vals, perturbed = list(leaves), [True] * n

    def one(*vals):
      out, res = rules.fwd(*call.full_args(call.fwd_inputs(vals, perturbed)))
      return tuple(tree_util.tree_leaves(out)), res
    return _vmap(one, list(in_dims), axis_data, note)(*vals)
  fwd.mapped_outputs = seen

  def bwd(res, g):
    arrays, rebuild = _split_symbolic(list(g))

    def one(res, arrays):
      with _jax_api.collecting_logs() as sink:   # per example, batched out
        cts = flatten_cotangents(
            call, _call_bwd(rules, call, res, rebuild(arrays)), "bwd")
      return _none_for_zeros(cts), _jax_api.merged_logs(sink)
    out, logs = _vmap(one, (0, 0), axis_data)(res, arrays)
    _jax_api.deposit_logs(logs)
    return _sum_unbatched(out, in_dims)

  def fwd_bwd(*args):
    leaves, g = args[:n], args[n]
    if rules.symbolic_zeros:
      vals = [l.value for l in leaves]
      perturbed = [l.perturbed for l in leaves]
    else:
      vals, perturbed = list(leaves), [True] * n
    arrays, rebuild = _split_symbolic(list(g))

    def one(vals, arrays):
      args = call.full_args(call.fwd_inputs(vals, perturbed))
      py_g = tree_util.tree_unflatten(call.out_tree, rebuild(arrays))
      cts = flatten_cotangents(call, rules.fwd_bwd(*args, py_g), "fwd_bwd")
      return _none_for_zeros(cts)
    out = _vmap(one, (list(in_dims), 0), axis_data)(vals, arrays)
    return _sum_unbatched(out, in_dims)

  return Rules(
      fun=_named(fun, rules.fun),
      fwd=_named(fwd, rules.fwd) if rules.fwd is not None else None,
      bwd=_named(bwd, rules.bwd) if rules.bwd is not None else None,
      fwd_bwd=(_named(fwd_bwd, rules.fwd_bwd)
               if rules.fwd_bwd is not None else None),
      symbolic_zeros=rules.symbolic_zeros, nondiff_argnums=(),
      always_save=rules.always_save, generic_batching=rules.generic_batching,
      remat=(batched_rules(remat_call(call), consts, const_dims, in_dims,
                           axis_data) if rules.remat is not None else None))


def _call_bwd(rules, call, res, g_leaves):
  py_g = tree_util.tree_unflatten(call.out_tree, g_leaves)
  return rules.bwd(*call.nondiff, res, py_g)


def _batched_avals(call, in_dims, axis_data):
  return tuple(_compat.unmapped_aval(axis_data.size, 0, a,
                                    axis_data.explicit_mesh_axis)
               if d is not None else a for a, d in zip(call.in_avals, in_dims))


def batched_call(call, consts, const_dims, in_dims, axis_data):
  """``(batched CallSpec, its consts)``; ``in_dims`` are 0 or None."""
  key = (tuple(const_dims), tuple(in_dims), axis_data)
  hit = call.batch_cache.get(key)
  if hit is not None:
    return hit
  rules = batched_rules(call, consts, const_dims, in_dims, axis_data)
  in_avals = _batched_avals(call, in_dims, axis_data)
  in_tree = tree_util.tree_structure(tuple(range(len(in_avals))))
  out = trace_call(rules, (), len(in_avals), in_tree, in_avals)
  call.batch_cache.put(key, out, [*consts, *out[1]])
  return out


def linear_only_call(call, in_dims, axis_data):
  """A batched CallSpec for the linear primitives: rules only, no ``f`` jaxpr."""
  key = ("linear", tuple(in_dims), axis_data)
  hit = call.batch_cache.get(key)
  if hit is not None:
    return hit
  rules = batched_rules(call, (), (), in_dims, axis_data)
  in_avals = _batched_avals(call, in_dims, axis_data)
  out_avals = tuple(_compat.unmapped_aval(axis_data.size, 0, a,
                                         axis_data.explicit_mesh_axis)
                    for a in call.out_avals)
  spec = CallSpec(
      rules=rules, nondiff=(), num_args=len(in_avals),
      in_tree=tree_util.tree_structure(tuple(range(len(in_avals)))),
      in_avals=in_avals,
      out_tree=tree_util.tree_structure(tuple(range(len(out_avals)))),
      out_avals=out_avals, jaxpr=None, num_consts=0, origin=call)
  call.batch_cache.put(key, spec)
  return spec


def _front(axis_data, x, d):
  return _compat.bdim_at_front(x, d, axis_data.size,
                                  axis_data.explicit_mesh_axis)


def _to_front_or_none(axis_data, xs, dims):
  """Mapped values to axis 0; ``"broadcast"`` ones get a new axis 0."""
  return ([x if d is None else
           _front(axis_data, x, None if d == "broadcast" else d)
           for x, d in zip(xs, dims)],
          [None if d is None else 0 for d in dims])


# -- smartvjp_call ------------------------------------------------------------

def _unbatched(axis_data, dims, effects):
  """No input is mapped and the rule names no collective over the mapped
  axis: the primitive can run once, outside the vmap. (A ``psum`` over the
  axis must see the axis even when its operand is not mapped.)"""
  return (all(d is None for d in dims)
          and not _compat.uses_axis_name(effects, axis_data.name))


def _call_batch(axis_data, args, dims, *, call):
  if call.full is not None:   # pruned by DCE: the whole call, selected
    outs, out_dims = _call_batch(axis_data, args, dims, call=call.full)
    return select_outputs(call, outs), select_outputs(call, out_dims)
  if _unbatched(axis_data, dims, call.jaxpr.effects):
    return call_p.bind(*args, call=call), [None] * call.num_outs
  consts, primals = args[:call.num_consts], args[call.num_consts:]
  cdims, pdims = dims[:call.num_consts], dims[call.num_consts:]
  primals, pdims = _to_front_or_none(axis_data, primals, pdims)
  bcall, bconsts = batched_call(call, consts, cdims, pdims, axis_data)
  outs = call_p.bind(*bconsts, *primals, call=bcall)
  # an output f computes from unbatched inputs only is the same for every
  # example: return one copy, unbatched, as JAX does; differentiated, fwd
  # ran and its outputs decide (see _output_batching)
  _, out_batched = _compat.batch_jaxpr(
      call.jaxpr, axis_data, [d is not None for d in (*cdims, *pdims)], False)
  out_batched = _output_batching(bcall, outs, out_batched)
  outs = [o if b else o[0] for o, b in zip(outs, out_batched)]
  return outs, [0 if b else None for b in out_batched]


def _output_batching(bcall, outs, f_batched):
  """Which outputs of a batched call are mapped: ``f``'s answer, except when
  the call was just differentiated (its outputs carry tangents), where
  ``fwd`` ran and its mapped outputs decide, as for ``jax.custom_vjp``. (A
  ``fwd`` whose output is mapped where ``f``'s is not then gets per-example
  cotangents, not one cotangent for the whole batch.) With
  ``generic_batching=True`` ``f`` always decides, as in JAX: such an output
  takes the first example's value and its whole cotangent goes to the first
  example."""
  if (all(f_batched) or bcall.rules.generic_batching
      or not any(_compat.carries_tangent(o) for o in outs)):
    return f_batched
  fwd = bcall.rules.fwd
  mapped = getattr(fwd, "mapped_outputs", {}).get("fwd")
  if mapped is None or len(mapped) != len(f_batched):
    return f_batched
  return list(mapped)


# -- smartvjp_primal: batched as the f call it evaluates ----------------------
#
# Under vmap nothing differentiates the batched equation any more (vmap of a
# derivative batches what the derivative produced), so it becomes the
# batched ``smartvjp_call``.

def _primal_batch(axis_data, args, dims, *, call, fwd):
  f_consts, _, primals = split_primal_args(args, call, fwd)
  cdims, _, pdims = split_primal_args(dims, call, fwd)
  return _call_batch(axis_data, [*f_consts, *primals], [*cdims, *pdims],
                     call=call)


# -- smartvjp_fwd: batch the traced jaxpr, keep the output layout -------------

def batched_fwd(call, fwd, axis_data, dims, out_dims):
  """``(bfwd, extra, out_batched)``: ``fwd``'s jaxpr batched (inputs at
  ``dims``, outputs as ``out_dims`` asks), its new constants ``extra`` as
  leading inputs, and its primal output types the batched ones."""
  batched, out_batched = _compat.batch_jaxpr_axes(
      fwd.jaxpr, axis_data, dims, out_dims)
  extra = list(batched.consts)
  jaxpr = _compat.convert_constvars_jaxpr(batched.jaxpr)
  bfwd = fwd.shifted(_compat.ClosedJaxpr(jaxpr, ()), len(extra))
  bfwd = dataclasses.replace(
      bfwd, out_avals=tuple(v.aval for v in jaxpr.outvars[:call.num_outs])
      if fwd.out_avals else ())
  return bfwd, extra, out_batched


def _fwd_batch(axis_data, args, dims, *, call, fwd, offload):
  if _unbatched(axis_data, dims, fwd.jaxpr.effects):
    return fwd_p.bind(*args, call=call, fwd=fwd, offload=offload), \
        [None] * len(fwd.jaxpr.out_avals)
  n_out = len(fwd.jaxpr.out_avals)
  bfwd, extra, out_batched = batched_fwd(
      call, fwd, axis_data, dims, [_compat.zero_if_mapped] * n_out)
  outs = fwd_p.bind(*extra, *args, call=call, fwd=bfwd, offload=offload)
  return outs, [0 if b else None for b in out_batched]


# -- smartvjp_jvp -------------------------------------------------------------

def _jvp_batch(axis_data, args, dims, *, call, fwd, in_nz, remat):
  effects = call.jaxpr.effects | (fwd.jaxpr.effects if fwd is not None
                                  and fwd.jaxpr is not None else set())
  if _unbatched(axis_data, dims, effects):
    return jvp_p.bind(*args, call=call, fwd=fwd, in_nz=in_nz, remat=remat), \
        [None] * (call.num_outs + sum(call.out_nz))
  f_consts, fwd_consts, primals, tangents = split_jvp_args(args, call, fwd)
  cdims, wdims, pdims, tdims = split_jvp_args(dims, call, fwd)
  if all(d is None for d in (*cdims, *wdims, *pdims)):
    return _jvp_batch_tangents_only(axis_data, call, fwd, in_nz, f_consts,
                                    fwd_consts, primals, tangents, tdims)
  pdims, tdims = _batch_primals_of_batched_tangents(pdims, tdims, in_nz)
  primals, pdims = _to_front_or_none(axis_data, primals, pdims)
  tangents = [_front(axis_data, t, d) for t, d in zip(tangents, tdims)]
  bcall, bconsts = batched_call(call, f_consts, cdims, pdims, axis_data)
  bfwd, bfwd_consts = bcall.fwd_for(in_nz)
  outs = jvp_p.bind(*bconsts, *bfwd_consts, *primals, *tangents, call=bcall,
                    fwd=bfwd, in_nz=in_nz, remat=remat)
  return outs, [0] * len(outs)


def _jvp_batch_tangents_only(axis_data, call, fwd, in_nz, f_consts, fwd_consts,
                             primals, tangents, tdims):
  """Only tangents mapped (``jacfwd``): primal rules once, tangents batched."""
  if fwd is None:
    primal_outs = call_p.bind(*f_consts, *primals, call=call)
    tangent_outs, _ = _fused_lin_batch(
        axis_data, [*primals, *tangents], [None] * len(primals) + list(tdims),
        call=call, in_nz=in_nz)
  else:
    primal_outs, res = bind_primal_and_residuals(call, fwd, f_consts,
                                                 fwd_consts, primals)
    tangent_outs, _ = _lin_batch(
        axis_data, [*res, *tangents], [None] * len(res) + list(tdims),
        call=call, fwd=fwd, in_nz=in_nz, reload=None)
  return ([*primal_outs, *tangent_outs],
          [None] * len(primal_outs) + [0] * len(tangent_outs))


def _batch_primals_of_batched_tangents(pdims, tdims, in_nz):
  """Tangents are always mapped at 0 (broadcast if needed), so a primal with
  a tangent gets mapped too: the batched rules then see one batch, and
  ``bwd``'s cotangent for it is per example, like its tangent."""
  return [d if d is not None or not nz else "broadcast"
          for d, nz in zip(pdims, in_nz)], tdims


def _lin_batch(axis_data, args, dims, *, call, fwd, in_nz, reload):
  if all(d is None for d in dims):
    return lin_p.bind(*args, call=call, fwd=fwd, in_nz=in_nz, reload=reload), \
        [None] * sum(call.out_nz)
  args = [_front(axis_data, x, d) for x, d in zip(args, dims)]
  bcall = linear_only_call(call, [0] * call.num_primals, axis_data)
  n_res = len(fwd.res_avals)
  bfwd = dataclasses.replace(
      fwd, res_avals=tuple(_compat.get_aval(r) for r in args[:n_res]),
      out_avals=tuple(_compat.unmapped_aval(axis_data.size, 0, a,
                                      axis_data.explicit_mesh_axis)
                      for a in fwd.out_avals))
  outs = lin_p.bind(*args, call=bcall, fwd=bfwd, in_nz=in_nz, reload=reload)
  return outs, [0] * len(outs)


def _fused_lin_batch(axis_data, args, dims, *, call, in_nz):
  if all(d is None for d in dims):
    return fused_lin_p.bind(*args, call=call, in_nz=in_nz), \
        [None] * sum(call.out_nz)
  args = [_front(axis_data, x, d) for x, d in zip(args, dims)]
  bcall = linear_only_call(call, [0] * call.num_primals, axis_data)
  outs = fused_lin_p.bind(*args, call=bcall, in_nz=in_nz)
  return outs, [0] * len(outs)


# -- smartvjp_bwd: batch the traced rule --------------------------------------

def _bwd_batch(axis_data, args, dims, *, call, which, jaxpr):
  n_out = len(jaxpr.out_avals)
  if _unbatched(axis_data, dims, jaxpr.effects):
    return bwd_p.bind(*args, call=call, which=which, jaxpr=jaxpr), \
        [None] * n_out
  batched, out_batched = _compat.batch_jaxpr_axes(
      jaxpr, axis_data, dims, [_compat.zero_if_mapped] * n_out)
  new = _compat.ClosedJaxpr(_compat.convert_constvars_jaxpr(batched.jaxpr), ())
  outs = bwd_p.bind(*batched.consts, *args, call=call, which=which, jaxpr=new)
  return outs, [0 if b else None for b in out_batched]


