"""smartvjp's primitives and their evaluation rules.

Seven primitives, all with multiple results:

``smartvjp_call``       ``[*f_consts, *primals] -> primal_outs``: evaluates ``f``.
``smartvjp_primal``     ``[*f_consts, *fwd_consts, *primals] -> primal_outs``:
                        evaluates ``f`` where a differentiated call needs only
                        its primal outputs (the forward pass under remat, or
                        a ``fwd`` whose residuals are all inputs); an outer
                        derivative differentiates ``fwd``'s code, as it does
                        with ``jax.custom_vjp`` (whose forward pass runs
                        ``fwd``).
``smartvjp_fwd``        ``[*fwd_consts, *primals] -> [*primal_outs, *new_res]``:
                        evaluates ``fwd``.
``smartvjp_jvp``        ``[*f_consts, *fwd_consts, *primals, *nz_tangents]
                        -> [*primal_outs, *nz_tangent_outs]``: "primal and
                        tangent outputs together"; only partial evaluation
                        decides which rules it becomes. ``remat=True`` marks a
                        call whose forward pass ran ``f`` and whose backward
                        region must run ``fwd`` (or ``fwd_bwd``).
``smartvjp_lin``        ``[*residuals, *nz_tangents] -> nz_tangent_outs``:
                        linear in the tangents; its transpose runs ``bwd``.
``smartvjp_fused_lin``  ``[*primals, *nz_tangents] -> nz_tangent_outs``:
                        linear in the tangents; its transpose runs ``fwd_bwd``.
``smartvjp_bwd``        ``[*consts, *inputs, *nz_cotangents] -> nz_cotangents_in``:
                        evaluates ``bwd`` or ``fwd_bwd`` (param ``which``),
                        traced when the transpose runs.

This module holds what every primitive needs to be evaluated: abstract
evaluation, eager implementation (the traced jaxpr evaluated op by op, as
``jax.custom_vjp`` does, so no compiled executable keeps a per-step function
alive), lowering (under a ``smartvjp/<f>/<rule>``
named scope), dead-code elimination and printing. Differentiation rules live
in ``_ad.py``, partial evaluation in ``_partial_eval.py``.
"""

from __future__ import annotations

import jax

from smartvjp import _compat
from smartvjp._spec import pruned

call_p = _compat.new_primitive("smartvjp_call")
primal_p = _compat.new_primitive("smartvjp_primal")
fwd_p = _compat.new_primitive("smartvjp_fwd")
jvp_p = _compat.new_primitive("smartvjp_jvp")
lin_p = _compat.new_primitive("smartvjp_lin")
fused_lin_p = _compat.new_primitive("smartvjp_fused_lin")
# a backward-pass rule: ``bwd``, or the fused ``fwd_bwd`` (param ``which``)
bwd_p = _compat.new_primitive("smartvjp_bwd")


def eval_scoped(jaxpr: _compat.ClosedJaxpr, scope: str, args):
  """Evaluates a traced rule under the named scope ``scope``."""
  with jax.named_scope(scope):
    return _compat.eval_jaxpr(jaxpr.jaxpr, jaxpr.consts, *args)


def tangent_avals(avals, nz):
  return [a.to_tangent_aval() for a, n in zip(avals, nz) if n]


def split_jvp_args(args, call, fwd):
  """``[*f_consts, *fwd_consts, *primals, *nz_tangents]`` -> four lists."""
  n1 = call.num_consts
  n2 = n1 + (fwd.num_consts if fwd is not None else 0)
  n3 = n2 + call.num_primals
  return list(args[:n1]), list(args[n1:n2]), list(args[n2:n3]), list(args[n3:])


def bind_primal_and_residuals(call, fwd, f_consts, fwd_consts, primals):
  """Runs ``fwd``; returns ``(primal_outs, residuals)`` (all residual leaves).

  When every residual of ``fwd`` is an input forwarded unchanged (as in the
  seed's ``fwd`` that returns ``(sin(x), (x,))``), ``fwd`` computes nothing
  that ``f`` does not, so ``f`` runs in its place, unless ``f`` or ``fwd``
  has effects: then ``fwd`` runs, as with ``jax.custom_vjp`` (its effects,
  such as a ``jax.debug.print``, happen; ``f``'s do not).
  """
  fwd_inputs = [*fwd_consts, *primals]
  if (fwd.num_new_res == 0 and not has_effects(call, fwd)
      and _f_types_match(call, fwd)):
    outs = bind_primal(call, fwd, f_consts, fwd_consts, primals)
    return list(outs), fwd.assemble_residuals(fwd_inputs, [])
  outs = fwd_p.bind(*fwd_inputs, call=call, fwd=fwd, offload=None)
  primal_outs, new_res = outs[:call.num_outs], outs[call.num_outs:]
  return list(primal_outs), fwd.assemble_residuals(fwd_inputs, new_res)


def uses_references(call) -> bool:
  """References are involved: an input, or an effect on one, whose position
  follows ``f``'s own inputs (so the call is kept whole wherever it goes)."""
  return (_compat.has_input_effects(call.jaxpr)
          or any(_compat.is_ref_aval(a) for a in call.in_avals))


def _plain_call(call, fwd) -> bool:
  """A plain ``smartvjp_call`` stands in: without ``fwd`` (only ``fwd_bwd``
  given; nothing else to differentiate), or when references are involved."""
  return fwd is None or uses_references(call)


def bind_primal(call, fwd, f_consts, fwd_consts, primals):
  """``f``'s outputs for a differentiated call (see ``smartvjp_primal``)."""
  if _plain_call(call, fwd):
    return call_p.bind(*f_consts, *primals, call=call)
  return primal_p.bind(*f_consts, *fwd_consts, *primals, call=call, fwd=fwd)


def primal_eqn(call, fwd, f_consts, fwd_consts, primals, outvars, eqn):
  """The equation of :func:`bind_primal`, with ``eqn``'s source info."""
  if _plain_call(call, fwd):
    return _compat.new_jaxpr_eqn(
        [*f_consts, *primals], outvars, call_p, dict(call=call),
        _compat.eqn_effects(call.jaxpr, [*f_consts, *primals]), eqn.source_info,
        eqn.ctx)
  return _compat.new_jaxpr_eqn([*f_consts, *fwd_consts, *primals], outvars, primal_p,
                         dict(call=call, fwd=fwd), call.jaxpr.effects,
                         eqn.source_info, eqn.ctx)


def uses_fwd_consts(eqn) -> bool:
  return eqn.primitive is primal_p


def _f_types_match(call, fwd) -> bool:
  """``f``'s primal outputs have ``fwd``'s full types (then ``f`` may stand
  in for a ``fwd`` that computes no residual)."""
  return not fwd.out_avals or all(
      _compat.typecompat(a, b) for a, b in zip(call.out_avals, fwd.out_avals))


def lin_out_avals(call, fwd):
  """The primal output types a linear primitive's tangents follow: ``fwd``'s
  (as jax.custom_vjp's) where ``fwd`` ran, else ``f``'s."""
  if fwd is not None and fwd.out_avals:
    return fwd.out_avals
  return call.out_avals


# -- smartvjp_call ------------------------------------------------------------

def _call_abstract_eval(*avals, call):
  return list(call.out_avals), _compat.positional_effects(call.jaxpr)


def call_eval(*args, call):
  return eval_scoped(call.jaxpr, f"smartvjp/{call.name}/f", args)


# -- smartvjp_primal ------------------------------------------------------------

def split_primal_args(args, call, fwd):
  """``[*f_consts, *fwd_consts, *primals]`` -> three lists."""
  n1, n2 = call.num_consts, call.num_consts + fwd.num_consts
  return list(args[:n1]), list(args[n1:n2]), list(args[n2:])


def _primal_abstract_eval(*avals, call, fwd):
  return list(call.out_avals), call.jaxpr.effects


def primal_eval(*args, call, fwd):
  f_consts, _, primals = split_primal_args(args, call, fwd)
  return call_eval(*f_consts, *primals, call=call)


# -- smartvjp_fwd -------------------------------------------------------------

def _fwd_abstract_eval(*avals, call, fwd, offload):
  outs = list(fwd.jaxpr.out_avals)
  if offload is not None:  # residuals a policy offloads (Offloadable.dst)
    n = call.num_outs
    outs[n:] = [a if space is None else a.update(memory_space=space)
                for a, space in zip(outs[n:], offload)]
  return outs, _compat.positional_effects(fwd.jaxpr)


def fwd_eval(*args, call, fwd, offload):
  outs = eval_scoped(fwd.jaxpr, f"smartvjp/{call.name}/fwd", args)
  if offload is not None:
    n = call.num_outs
    outs[n:] = [r if space is None else jax.device_put(r, space)
                for r, space in zip(outs[n:], offload)]
  return outs


def _bind_fwd(*args, call, fwd, offload):
  """Binds ``smartvjp_fwd``; a residual that ``fwd`` named with
  ``checkpoint_name`` leaves it through a ``checkpoint_name`` equation, as it
  leaves ``jax.custom_vjp``'s inlined ``fwd``, so that outer remat policies
  and ``jax.ad_checkpoint.print_saved_residuals`` see the name."""
  outs = _compat.Primitive.bind(fwd_p, *args, call=call, fwd=fwd, offload=offload)
  n = call.num_outs
  named = [r if name is None else _compat.name_p.bind(r, name=name)
           for r, name in zip(outs[n:], fwd.new_res_names)]
  return [*outs[:n], *named]


fwd_p.bind = _bind_fwd


# -- smartvjp_jvp -------------------------------------------------------------

def _jvp_abstract_eval(*avals, call, fwd, in_nz, remat):
  nc, nw = call.num_consts, (fwd.num_consts if fwd is not None else 0)
  # inputs [*f_consts, *fwd_consts, *primals, *tangents]: f's and fwd's own
  # input positions moved there
  effects = _compat.move_input_effects(_compat.positional_effects(call.jaxpr),
                                 lambda i: i if i < nc else i + nw)
  if fwd is not None:
    effects |= _compat.move_input_effects(_compat.positional_effects(fwd.jaxpr),
                                    lambda i: i + nc)
  outs = [*call.out_avals, *tangent_avals(call.out_avals, call.out_nz)]
  return outs, effects


# -- smartvjp_lin / smartvjp_fused_lin ------------------------------------------

def _lin_abstract_eval(*avals, call, fwd=None, **_):
  return tangent_avals(lin_out_avals(call, fwd), call.out_nz), frozenset()


# -- smartvjp_bwd (bwd or fwd_bwd, traced at transpose time) -------------------

def _bwd_abstract_eval(*avals, call, which, jaxpr):
  return list(jaxpr.out_avals), _compat.positional_effects(jaxpr)


def bwd_eval(*args, call, which, jaxpr):
  return eval_scoped(jaxpr, f"smartvjp/{call.name}/{which}", args)


# -- dead-code elimination ----------------------------------------------------
#
# Effects and DCE. An effect that jax.custom_vjp would run at least once
# (a jax.debug.print in f, fwd or bwd) must run at least once here too, even
# when the equation's outputs are unused, exactly as JAX keeps any equation
# with effects. So an equation with effects is never dropped whole. Which
# rule a jvp equation stands for is the subtle case: jax.custom_vjp runs fwd
# for a differentiated call, so when the tangents of a smartvjp_jvp are dead
# and fwd has effects, it becomes fwd (whose effects then happen once), not
# f. A call that smartvjp's partial evaluation put in the forward pass in
# place of fwd (remat's known side) is a smartvjp_call like any other: when
# f has effects they run there (the documented "f 1" of the contract); the
# effects of fwd run in the backward region.

def has_effects(call, fwd) -> bool:
  """True when ``f`` or ``fwd`` (traced) has effects that JAX would not
  remove (a debug print, a reference written)."""
  return _compat.effects_keep_alive(call.jaxpr.effects) or (
      fwd is not None and _compat.effects_keep_alive(fwd.jaxpr.effects))


def _dce_whole(used_outputs, eqn):
  """Drop an equation none of whose outputs is used and that has no effects,
  else keep it whole (as JAX's default rule does)."""
  if not any(used_outputs) and not _compat.effects_keep_alive(eqn.effects):
    return [False] * len(eqn.invars), None
  return [True] * len(eqn.invars), eqn


def _dce_jvp(used_outputs, eqn):
  """A jvp equation whose tangents are unused is just ``f``; or ``fwd``,
  without its residuals, when ``fwd`` has effects (``jax.custom_vjp`` would
  run them). One whose primal outputs are unused may be just its linear
  primitive (:func:`_linear_part`)."""
  call, fwd = eqn.params["call"], eqn.params["fwd"]
  n = call.num_outs
  if any(used_outputs[n:]):
    if not any(used_outputs[:n]):
      linear = _linear_part(eqn)
      if linear is not None:
        return linear
    return [True] * len(eqn.invars), eqn
  f_consts, fwd_consts, primals, tangents = split_jvp_args(eqn.invars, call, fwd)
  if fwd is not None and _compat.effects_keep_alive(fwd.jaxpr.effects):
    new_res = [_compat.drop_var(a) for a in fwd.jaxpr.out_avals[n:]]
    new_eqn = _compat.new_jaxpr_eqn(
        [*fwd_consts, *primals], [*eqn.outvars[:n], *new_res], fwd_p,
        dict(call=call, fwd=fwd, offload=None),
        _compat.eqn_effects(fwd.jaxpr, [*fwd_consts, *primals]),
        eqn.source_info, eqn.ctx)
    used = ([False] * len(f_consts) + [True] * len(fwd_consts)
            + [True] * len(primals) + [False] * len(tangents))
    return used, new_eqn
  if not any(used_outputs[:n]) and (
      fwd is not None or not _compat.effects_keep_alive(call.jaxpr.effects)):
    return [False] * len(eqn.invars), None  # fwd, which JAX would run, is pure
  new_eqn = primal_eqn(call, fwd, f_consts, fwd_consts, primals,
                       eqn.outvars[:n], eqn)
  used = ([True] * len(f_consts) + [uses_fwd_consts(new_eqn)] * len(fwd_consts)
          + [True] * len(primals) + [False] * len(tangents))
  return used, new_eqn


def _pure(call, fwd) -> bool:
  """Neither rule has effects nor touches references: which of them runs
  (or whether one runs at all) changes nothing but the work done."""
  return not (has_effects(call, fwd) or uses_references(call))


def _passed_through(fwd):
  """For a ``fwd`` each of whose computed residuals is one of its inputs
  (through ``checkpoint_name`` at most: the backward side of a split whose
  residuals were all saved), the input position of each; else ``None``."""
  jaxpr = fwd.jaxpr.jaxpr
  named = {e.outvars[0]: e.invars[0] for e in jaxpr.eqns
           if e.primitive is _compat.name_p}
  pos = {v: i for i, v in enumerate(jaxpr.invars)}
  passed = []
  for v in jaxpr.outvars[len(jaxpr.outvars) - fwd.num_new_res:]:
    while type(v) is _compat.Var and v in named:
      v = named[v]
    if type(v) is not _compat.Var or v not in pos:
      return None
    passed.append(pos[v])
  return passed


def _linear_part(eqn):
  """A jvp equation whose primal outputs are unused, when its tangents need
  no rule to run first (``fwd``'s residuals are all inputs or saved values,
  or ``fwd_bwd`` stands in under remat): only its linear primitive, so that
  neither ``f`` nor ``fwd`` runs for outputs nobody reads (this matters
  eagerly, where nothing else removes them: the backward region of
  ``jax.checkpoint``, evaluated equation by equation)."""
  call, fwd, in_nz = (eqn.params[k] for k in ("call", "fwd", "in_nz"))
  if not _pure(call, fwd):
    return None
  _, fwd_consts, primals, tangents = split_jvp_args(eqn.invars, call, fwd)
  fwd_inputs = [*fwd_consts, *primals]
  if fwd is None or (eqn.params["remat"] and call.rules.fwd_bwd is not None):
    ins, prim, params = primals, fused_lin_p, dict(call=call, in_nz=in_nz)
  else:
    passed = _passed_through(fwd)
    if passed is None:
      return None
    ins = fwd.assemble_residuals(fwd_inputs, [fwd_inputs[i] for i in passed])
    prim, params = lin_p, dict(call=call, fwd=fwd, in_nz=in_nz, reload=None)
  new_eqn = _compat.new_jaxpr_eqn([*ins, *tangents], eqn.outvars[call.num_outs:],
                            prim, params, set(), eqn.source_info, eqn.ctx)
  read = {id(v) for v in new_eqn.invars}
  return [id(v) in read for v in eqn.invars], new_eqn


def _dce_fwd(used_outputs, eqn):
  """``fwd`` none of whose residuals is used (no cotangent reaches the call:
  a ``stop_gradient`` of its output) is just ``f``, as ``optimize_remat``'s
  rule makes it; kept when ``f`` closes over values ``fwd``'s equation
  does not carry, or when either rule has effects."""
  call, fwd = eqn.params["call"], eqn.params["fwd"]
  n = call.num_outs
  if (any(used_outputs[n:]) or not any(used_outputs[:n]) or call.num_consts
      or fwd.jaxpr is None or not _pure(call, fwd)
      or not _f_types_match(call, fwd)):
    return _dce_whole(used_outputs, eqn)
  fwd_consts, primals = eqn.invars[:fwd.num_consts], eqn.invars[fwd.num_consts:]
  new_eqn = primal_eqn(call, fwd, [], fwd_consts, primals, eqn.outvars[:n], eqn)
  used = [uses_fwd_consts(new_eqn)] * len(fwd_consts) + [True] * len(primals)
  return used, new_eqn


def _dce_call(used_outputs, eqn):
  """Per output, as JAX prunes ``jax.custom_vjp``'s ``f``: only the work for
  the used outputs stays (every input is kept)."""
  if all(used_outputs) or not any(used_outputs):
    return _dce_whole(used_outputs, eqn)
  kept = tuple(i for i, u in enumerate(used_outputs) if u)
  new_eqn = eqn.replace(
      outvars=[eqn.outvars[i] for i in kept],
      params=dict(eqn.params, call=pruned(eqn.params["call"], kept)))
  return [True] * len(eqn.invars), new_eqn


# -- printing -----------------------------------------------------------------

def _pp_rule(eqn, context, settings):
  params = dict(eqn.params)
  call = params.pop("call")
  shown = {"f": call.name}
  fwd = params.pop("fwd", None)
  if (eqn.primitive in (fwd_p, lin_p, jvp_p, primal_p)
      and call.rules.fwd is not None):
    shown["fwd"] = call.rules.rule_name("fwd")
  if eqn.primitive in (lin_p, jvp_p) and call.rules.bwd is not None:
    shown["bwd"] = call.rules.rule_name("bwd")
  if eqn.primitive in (fused_lin_p, jvp_p) and call.rules.fwd_bwd is not None:
    shown["fwd_bwd"] = call.rules.rule_name("fwd_bwd")
  which = params.pop("which", None)
  if which is not None:
    params.pop("jaxpr")
    shown[which] = call.rules.rule_name(which)
  if fwd is not None and fwd.num_new_res:
    shown["num_res"] = fwd.num_new_res
  shown.update((k, v) for k, v in params.items() if v is not None)
  return _compat.pp_eqn(eqn.replace(params=shown), context, settings)


# -- state discharge (mutable array references in a rule's inputs) -----------
#
# A reference passed to f, fwd or bwd (or a residual reference bwd writes
# into) becomes, under jit, a value threaded through the rule: the rule's
# traced jaxpr is discharged and its final reference values returned.

def _discharged(jaxpr, should, args, prefix=0):
  outs = _compat.eval_discharged(jaxpr, should, *args)
  n = len(outs) - sum(should)
  it = iter(outs[n:])
  return [next(it) if d else None for d in should], list(outs[:n])


def discharged_on(jaxpr, should, args, positions):
  """:func:`_discharged` for a rule that reads only ``args[i]`` for ``i`` in
  ``positions`` (a primitive whose inputs also feed another rule): final
  reference values at those positions, ``None`` elsewhere."""
  sub_new, outs = _discharged(jaxpr, [should[i] for i in positions],
                              [args[i] for i in positions])
  new_args = [None] * len(args)
  for i, v in zip(positions, sub_new):
    new_args[i] = v
  return new_args, outs


def _call_discharge(should, *args, call):
  with jax.named_scope(f"smartvjp/{call.name}/f"):
    return _discharged(call.jaxpr, should, args)


def _primal_discharge(should, *args, call, fwd):
  """``f`` on its own inputs (``fwd``'s constants are not read): ``f`` may
  create and free references of its own (``jax.new_ref`` inside ``f``)."""
  n1, n2 = call.num_consts, call.num_consts + fwd.num_consts
  with jax.named_scope(f"smartvjp/{call.name}/f"):
    return discharged_on(call.jaxpr, should, args,
                         [*range(n1), *range(n2, len(args))])


def _fwd_discharge(should, *args, call, fwd, offload):
  with jax.named_scope(f"smartvjp/{call.name}/fwd"):
    new_args, outs = _discharged(fwd.jaxpr, should, args)
  if offload is not None:
    n = call.num_outs
    outs[n:] = [r if space is None else jax.device_put(r, space)
                for r, space in zip(outs[n:], offload)]
  return new_args, outs


def _bwd_discharge(should, *args, call, which, jaxpr):
  with jax.named_scope(f"smartvjp/{call.name}/{which}"):
    return _discharged(jaxpr, should, args)


