"""``smartvjp_call``: a ``smart_custom_vjp`` call, with all its rules.

``[*f_consts, *primals] -> primal_outs``: evaluates ``f``. It is the equation
JAX's transformations meet first; its rules decide where the user's rules
run, each by asking ``_plan.plan``:

* linearization (``jax.grad``/``jax.vjp``, also in ``jit``/``scan``/``cond``
  bodies): ``fwd`` now and ``smartvjp_lin`` staged (its transpose runs
  ``bwd``); with ``fwd_bwd`` alone, ``f`` now and ``fwd_bwd`` in the
  transpose;
* JVP (``jax.checkpoint``'s ``remat_jvp``, ``jax.jvp``): ``smartvjp_jvp``,
  which partial evaluation places (``_jvp.py``);
* remat3 (``jax_remat3`` + ``jax_custom_vjp3``): the forward pass's rule and
  the rematerialized side (``smartvjp_rem``, ``_rem.py``) as the plan says;
* batching: a new call whose rules are the user's rules under ``vmap``;
* transpose: where JAX finds the call linear (forward mode of a ``bwd`` that
  calls another smart function), the transpose of ``f``'s own code;
* checkify: a new smart call whose ``f`` is checked.

Values ``f`` closes over are its leading inputs. Differentiated with respect
to those alone (an outer differentiation), the call differentiates ``f``
itself; with respect to both them and the arguments, it is refused, as with
``jax.custom_vjp``.
"""

from __future__ import annotations

import contextlib
import contextvars
import dataclasses

import jax
from jax import tree_util
from jax.errors import UnexpectedTracerError

from smartvjp import _facade as jx
from smartvjp import _plan
from smartvjp import _policy
from smartvjp import _vmap
from smartvjp._fwd import bind_fwd
from smartvjp._jvp import lin_params
from smartvjp._primal import bind_primal
from smartvjp._primitive import (
    call_p, dce_whole, define, discharged, eval_scoped, jvp_p, lin_p, rem_p,
    rule_jvp, scope)
from smartvjp._refs import check_aliased_refs
from smartvjp._spec import (
    Rules, eager_f, eager_fwd, pruned, select_outputs, trace_call)
from smartvjp._typecheck import (
    check_fwd_output_types, check_primal_out, flatten_cotangents)


def closure_error(call, where: str = "", linearizing: bool = False):
  """What ``jax.custom_vjp`` raises where a value the function closes over
  is differentiated with its arguments (or, ``where`` says, in a context
  smartvjp does not differentiate ``f`` itself in): its type, our words.
  JAX's type depends on the path: linearizing (``jax.grad`` without remat),
  ``fwd`` runs on the closed-over tracer, which leaks
  (``UnexpectedTracerError``); differentiating a staged call (remat), JAX
  detects it (``CustomVJPException``)."""
  what = (f" {where}" if where else
          " and, by the same transformation, with respect to its arguments")
  message = (
      f"smart_custom_vjp function {call.name} is being differentiated with "
      f"respect to a value it closes over{what}. That isn't supported (as "
      "with jax.custom_vjp) because the custom rules only say how to "
      "differentiate with respect to explicit arguments. Pass the value as "
      "an argument instead, or use jax.closure_convert.")
  if linearizing:
    return UnexpectedTracerError(message)
  return jx.custom_vjp_exception(message)


# The call being bound by ``smart_custom_vjp.__call__`` while the current
# trace linearizes it where it is made (``jax.grad`` applied directly): there
# ``jax.custom_vjp`` runs ``fwd`` on a closed-over tracer, which leaks, while a
# staged call (a ``jit``, ``scan`` or ``cond`` body, ``jax.checkpoint``)
# differentiated later is refused by its rule; the two raise different types.
_made_under_linearize: contextvars.ContextVar = contextvars.ContextVar(
    "smartvjp_made_under_linearize", default=None)


@contextlib.contextmanager
def made_under_linearize(call):
  """Marks ``call`` as bound directly under a linearization (see above)."""
  token = _made_under_linearize.set(call)
  try:
    yield
  finally:
    _made_under_linearize.reset(token)


def _classify(call, nonzeros, linearizing=False) -> str:
  """``"args"``, ``"closure"`` (only closed-over values move) or ``"none"``;
  raises when both move."""
  const_nz = any(nonzeros[:call.num_consts])
  arg_nz = any(nz and possible for nz, possible in
               zip(nonzeros[call.num_consts:], call.in_nz_possible))
  if const_nz and arg_nz:
    raise closure_error(call, linearizing=linearizing)
  return "closure" if const_nz else ("args" if arg_nz else "none")


def _abstract_eval(*avals, call):
  return list(call.out_avals), jx.positional_effects(call.jaxpr)


def call_eval(*args, call):
  return eval_scoped(call.jaxpr, scope(call, "f"), args)


# -- JVP (jax.checkpoint, jax.jvp) -------------------------------------------------

def call_jvp(primals, tangents, *, call):
  if call.full is not None:   # pruned by DCE: the whole call's rule, selected
    outs, out_tangents = call_jvp(primals, tangents, call=call.full)
    return select_outputs(call, outs), select_outputs(call, out_tangents)
  nonzeros = [type(t) is not jx.Zero for t in tangents]
  if _classify(call, nonzeros) == "closure":   # f itself differentiated
    return rule_jvp(call_eval, "fun", primals, tangents, call=call,
                    what="differentiation with respect to values it closes "
                    "over")
  prim_t = tangents[call.num_consts:]
  in_nz = tuple(nz and possible for nz, possible in
                zip(nonzeros[call.num_consts:], call.in_nz_possible))
  f_consts, primals = primals[:call.num_consts], primals[call.num_consts:]
  if not any(in_nz):
    return call_p.bind(*f_consts, *primals, call=call), call.expand_tangents([])
  check_aliased_refs(call, primals)
  fwd, fwd_consts = call.fwd_for(in_nz)
  check_fwd_output_types(call, fwd)   # f and fwd may both run (remat)
  nz_tangents = [t for t, nz in zip(prim_t, in_nz) if nz]
  outs = jvp_p.bind(*f_consts, *fwd_consts, *primals, *nz_tangents,
                    call=call, fwd=fwd, in_nz=in_nz,
                    schedule=_policy.schedule_without_policy(call, fwd))
  return outs[:call.num_outs], call.expand_tangents(outs[call.num_outs:])


# -- linearization (jax.grad, jax.vjp) -------------------------------------------------

def _linearized(call, in_nz, primal_outs, residuals, fwd):
  """The four values of a linearization rule whose tangent map binds
  ``smartvjp_lin`` (``fwd=None``: the fused form) on the residuals."""
  params = lin_params(call, fwd, in_nz)

  def linearized(residuals, *tangents):
    nz_t = [t for t, nz in zip(tangents[call.num_consts:], in_nz) if nz]
    return call.expand_tangents(lin_p.bind(*residuals, *nz_t, **params))
  return list(primal_outs), list(call.out_nz), list(residuals), linearized


def call_linearize(is_vjp, nonzeros, *primals_in, call):
  if call.full is not None:   # pruned by DCE: the whole call's rule, selected
    outs, nzs, res, linearized = call_linearize(is_vjp, nonzeros, *primals_in,
                                                call=call.full)
    return (select_outputs(call, outs), select_outputs(call, nzs), res,
            lambda res, *t: select_outputs(call, linearized(res, *t)))
  if call.eager is not None:   # fwd (or f) already ran on concrete values
    in_nz, primal_outs, residuals, fwd = call.eager
    return _linearized(call, in_nz, primal_outs, residuals, fwd)
  direct = _made_under_linearize.get() is call
  if (call.fwd_only is None
      and _classify(call, nonzeros, linearizing=direct) == "closure"):
    return jx.fallback_linearize(call_p, is_vjp, nonzeros, *primals_in,
                                 call=call)
  f_consts, primals = primals_in[:call.num_consts], primals_in[call.num_consts:]
  in_nz = tuple(nz and possible for nz, possible in
                zip(nonzeros[call.num_consts:], call.in_nz_possible))
  if not any(in_nz):
    outs = call_p.bind(*f_consts, *primals, call=call)
    return (outs, [False] * call.num_outs, [],
            lambda _res, *_t: call.expand_tangents([]))
  check_aliased_refs(call, primals)
  eager = jx.is_eval_trace() and not any(
      isinstance(p, jx.Tracer) for p in primals_in)
  decided = _plan.plan(_policy.facts(call, None), None)
  if decided.kind is _plan.Kind.RECOMPUTE:   # fwd_bwd alone: f now
    primal_outs = (eager_f(call, primals) if eager else
                   bind_primal(call, None, f_consts, [], primals))
    return _linearized(call, in_nz, primal_outs, primals, None)
  if call.fwd_only is not None:   # fwd traced where the call was made
    fwd, fwd_consts = call.fwd_only, f_consts
  elif eager:   # concrete values: fwd itself runs, as with jax.custom_vjp
    primal_outs, residuals, fwd = eager_fwd(call, in_nz, primals)
    return _linearized(call, in_nz, primal_outs, residuals, fwd)
  else:
    fwd, fwd_consts = call.fwd_for(in_nz)
  fwd_inputs = [*fwd_consts, *primals]
  outs = bind_fwd(*fwd_inputs, call=call, fwd=fwd)
  residuals = fwd.assemble_residuals(fwd_inputs, outs[call.num_outs:])
  return _linearized(call, in_nz, outs[:call.num_outs], residuals, fwd)


# -- transpose: a call in a linear position -------------------------------------------

def _transpose(cts, *args, call):
  """Transpose of a call JAX found linear in some of its inputs (a ``bwd``
  calling another smart function on its cotangent, transposed by forward
  mode): the transpose of ``f``'s own code with respect to those inputs, the
  others held fixed. JAX checks that ``f`` is linear in them."""
  if call.full is not None:   # pruned by DCE: zero cotangents for the rest
    full_cts = [jx.Zero(a.to_tangent_aval()) for a in call.full.out_avals]
    for i, ct in zip(call.kept, cts):
      full_cts[i] = ct
    return _transpose(full_cts, *args, call=call.full)
  undefined = [jx.is_undefined_primal(a) for a in args]
  lin_avals = [a.aval for a, u in zip(args, undefined) if u]  # full types

  def f(*lin):
    it = iter(lin)
    return call_eval(*[next(it) if u else a for a, u in zip(args, undefined)],
                     call=call)

  try:
    transposed = jax.linear_transpose(f, *lin_avals)
  except Exception as e:  # noqa: BLE001 - re-raised naming f
    raise NotImplementedError(
        f"Transpose rule for smart_custom_vjp function {call.name} used in a "
        f"linear position: its f is not linear JAX code in the inputs being "
        f"transposed ({type(e).__name__}: {e})") from e
  it = iter(transposed([jx.instantiate_zeros(c) for c in cts]))
  return [next(it) if u else None for u in undefined]


# -- batching ---------------------------------------------------------------------------

def batch_call(axis_data, args, dims, *, call):
  if call.full is not None:   # pruned by DCE: the whole call, selected
    outs, out_dims = batch_call(axis_data, args, dims, call=call.full)
    return select_outputs(call, outs), select_outputs(call, out_dims)
  if _vmap.unbatched(axis_data, dims, call.jaxpr.effects):
    return call_p.bind(*args, call=call), [None] * call.num_outs
  consts, primals = args[:call.num_consts], args[call.num_consts:]
  cdims, pdims = dims[:call.num_consts], dims[call.num_consts:]
  primals, pdims = _vmap.to_front_or_none(axis_data, primals, pdims)
  bcall, bconsts = _vmap.batched_call(call, consts, cdims, pdims, axis_data)
  outs = call_p.bind(*bconsts, *primals, call=bcall)
  # an output f computes from unbatched inputs only is the same for every
  # example: one copy, unbatched, as JAX returns it; differentiated, fwd ran
  # and its outputs decide (_output_batching)
  _, out_batched = jx.batch_jaxpr(
      call.jaxpr, axis_data, [d is not None for d in (*cdims, *pdims)], False)
  out_batched = _output_batching(bcall, outs, out_batched)
  outs = [o if b else o[0] for o, b in zip(outs, out_batched)]
  return outs, [0 if b else None for b in out_batched]


def _output_batching(bcall, outs, f_batched):
  """Which outputs of a batched call are mapped: ``f``'s answer, except when
  the call was just differentiated (its outputs carry tangents), where
  ``fwd`` ran and its mapped outputs decide, as for ``jax.custom_vjp``. With
  ``generic_batching=True`` ``f`` always decides, as in JAX."""
  if (all(f_batched) or bcall.rules.generic_batching
      or not any(jx.carries_tangent(o) for o in outs)):
    return f_batched
  mapped = getattr(bcall.rules.fwd, "mapped_outputs", {}).get("fwd")
  if mapped is None or len(mapped) != len(f_batched):
    return f_batched
  return list(mapped)


# -- dead-code elimination, discharge ----------------------------------------------------

def _dce(used_outputs, eqn):
  """Per output, as JAX prunes ``jax.custom_vjp``'s ``f``: only the work for
  the used outputs stays (every input is kept)."""
  if all(used_outputs) or not any(used_outputs):
    return dce_whole(used_outputs, eqn)
  kept = tuple(i for i, u in enumerate(used_outputs) if u)
  new_eqn = jx.eqn_with(
      eqn, outvars=[eqn.outvars[i] for i in kept],
      params=dict(eqn.params, call=pruned(eqn.params["call"], kept)))
  return [True] * len(eqn.invars), new_eqn


def _discharge(should, *args, call):
  with jax.named_scope(scope(call, "f")):
    return discharged(call.jaxpr, should, args)


# -- checkify: a new smart call whose f is checked ------------------------------------------

def _checkify(ctx, error, enabled, *args, call):
  """``f`` checked inside a new smart call over ``[*error_leaves,
  *primals]`` whose ``fwd``/``bwd``/``fwd_bwd`` are the user's around it,
  so the result stays differentiable with the same rules. As with
  ``jax.custom_vjp``, ``fwd`` is not checked: where the call is
  differentiated after ``checkify`` (``jax.vjp`` of a checkified function),
  the error that comes out is the one that went in, with none of ``f``'s
  checks added."""
  err_vals, err_tree = tree_util.tree_flatten(error)
  f_consts, primals = args[:call.num_consts], args[call.num_consts:]
  leaves = [*err_vals, *primals]
  store = {}
  rules = _checked_rules(ctx, call, enabled, err_tree, len(err_vals),
                         list(f_consts), store)
  avals = tuple(jx.get_aval(x) for x in leaves)
  new_call, consts = trace_call(rules, (), len(leaves),
                                tree_util.tree_structure(tuple(leaves)), avals)
  outs = call_p.bind(*consts, *leaves, call=new_call)
  n_out_err = store["tree"].num_leaves
  if store.get("fwd_ran"):
    return error, list(outs[n_out_err:])
  return (tree_util.tree_unflatten(store["tree"], outs[:n_out_err]),
          list(outs[n_out_err:]))


def _value(x):
  return x.value if isinstance(x, jx.CustomVJPPrimal) else x


def _checked_rules(ctx, call, enabled, err_tree, n_err, f_consts, store):
  """The user's rules over ``[*error_leaves, *primal_leaves]``: ``f``
  checked, ``fwd`` passing the incoming error through, the errors'
  cotangents ``None``."""
  user = call.rules

  def fun(*leaves):
    err, outs = jx.checkify_jaxpr(ctx, call.jaxpr.jaxpr, enabled, err_tree,
                                  *leaves[:n_err], *f_consts, *leaves[n_err:])
    err_leaves, store["tree"] = tree_util.tree_flatten(err)
    store["effects"] = jx.error_effects(err)
    return [*err_leaves, *outs]

  def fwd(*leaves):
    store["fwd_ran"] = True   # traced or run for this call: it is its rule
    in_err = tree_util.tree_unflatten(err_tree,
                                      [_value(e) for e in leaves[:n_err]])
    out, res = user.fwd(*call.full_args(leaves[n_err:]))
    check_primal_out(call, out)
    widened = jx.widen_error(in_err, store["effects"])
    return [*tree_util.tree_leaves(widened), *tree_util.tree_leaves(out)], res

  def user_cts(out, which):
    cts = flatten_cotangents(call, out, which)
    return tuple([None] * n_err + [None if type(c) is jx.Zero else c
                                   for c in cts])

  def bwd(res, g):
    ct = tree_util.tree_unflatten(call.out_tree,
                                  list(g[store["tree"].num_leaves:]))
    return user_cts(user.bwd(*call.nondiff, res, ct), "bwd")

  def fwd_bwd(*args):
    leaves, g = args[:-1], args[-1]
    ct = tree_util.tree_unflatten(call.out_tree,
                                  list(g[store["tree"].num_leaves:]))
    return user_cts(user.fwd_bwd(*call.full_args(leaves[n_err:]), ct),
                    "fwd_bwd")

  for fn, like in ((fun, user.fun), (fwd, user.fwd), (bwd, user.bwd),
                   (fwd_bwd, user.fwd_bwd)):
    fn.__name__ = getattr(like, "__name__", fn.__name__)
  return Rules(fun=fun, fwd=fwd if user.fwd is not None else None,
               bwd=bwd if user.bwd is not None else None,
               fwd_bwd=fwd_bwd if user.fwd_bwd is not None else None,
               symbolic_zeros=user.symbolic_zeros, nondiff_argnums=(),
               generic_batching=user.generic_batching)


# -- remat3 (jax_remat3 + jax_custom_vjp3) ------------------------------------------------
#
# Under those flags jax.checkpoint runs its body once on the forward pass's
# trace and once more on the rematerialized region's (the "rem" side), which
# the backward pass then differentiates. This rule carries out the plan
# there: f forward and a smartvjp_rem on the rem side that, differentiated,
# runs fwd (or fwd_bwd) and bwd; fwd forward and its outputs handed to bwd;
# or part of a JAX-coded fwd forward and the rest rebuilt on the rem side.

def _full_remat(prim, in_vals, params):
  """JAX's default: the primitive runs in both passes."""
  outs = prim.bind(*in_vals, **params)
  return outs, (), lambda _res, *rem_in: prim.bind(*rem_in, **params)


def _handled(ctx, call) -> bool:
  return (ctx.custom_vjp_rules and call.eager is None
          and call.jaxpr is not None and call.rules.fwd is not None
          and not _policy.uses_references(call))


def _remat3(ctx, *in_vals, call):
  if call.full is not None and _handled(ctx, call.full):
    outs, res, rem = _remat3(ctx, *in_vals, call=call.full)
    return (select_outputs(call, outs), res,
            lambda res, *rem_in: select_outputs(call, rem(res, *rem_in)))
  in_nz = call.in_nz_possible
  if call.full is not None or not _handled(ctx, call) or not any(in_nz):
    return _full_remat(call_p, in_vals, dict(call=call))
  fwd, fwd_consts = call.fwd_for(in_nz)
  check_fwd_output_types(call, fwd)   # f and fwd may both run
  n = call.num_consts
  f_consts, primals = list(in_vals[:n]), list(in_vals[n:])
  swapped = []

  def remat_rules_usable():
    alt = _vmap.remat_call(call)
    alt_fwd, alt_consts = alt.fwd_for(in_nz)
    swapped.append((alt, alt_fwd))
    return not alt_consts

  if ctx.policy is None:   # plain jax.checkpoint: nothing saveable
    answers = _plan.Answers(_plan.RECOMPUTE,
                            (_plan.RECOMPUTE,) * fwd.num_new_res)
  else:
    avals = [jx.get_aval(x) for x in (*f_consts, *fwd_consts, *primals)]
    avals += [a.to_tangent_aval() for a, nz in zip(call.in_avals, in_nz) if nz]
    answers = _policy.answers(
        ctx.policy, call, fwd, jvp_p, avals,
        dict(call=call, fwd=fwd, in_nz=in_nz,
             schedule=_policy.schedule_without_policy(call, fwd)))
  decided = _plan.plan(_policy.facts(call, fwd, remat_rules_usable), answers)
  if decided.kind is _plan.Kind.REMAT_RULES:
    call, fwd = swapped[-1]
    fwd_consts = []
    decided = _plan.fwd_or_f(_policy.facts(call, fwd),
                             (None,) * fwd.num_new_res)
  if decided.kind is _plan.Kind.RECOMPUTE:
    return _recompute(call, fwd, decided, f_consts, fwd_consts, primals)
  if decided.kind is _plan.Kind.SPLIT:
    return _split(call, decided, f_consts, fwd_consts, primals)
  return _save(call, fwd, decided, f_consts, fwd_consts, primals)


def _recompute(call, fwd, decided, f_consts, fwd_consts, primals):
  """``f`` forward; the rem side runs ``fwd`` (or ``fwd_bwd``) when
  differentiated."""
  outs = bind_primal(call, fwd, f_consts, fwd_consts, primals)
  k = len(f_consts)

  def rem(fwd_consts, *rem_in):
    return rem_p.bind(*rem_in[:k], *fwd_consts, *rem_in[k:], call=call,
                      fwd=fwd, schedule=decided.schedule)
  return list(outs), list(fwd_consts), rem


def _passthrough(call, fwd, out_avals):
  """A ``fwd`` for the rem side whose leading inputs are the forward pass's
  primal outputs (of types ``out_avals``) and computed residuals, returned
  as they are (residuals that are inputs keep coming from the inputs)."""
  avals = [*out_avals, *fwd.jaxpr.out_avals[call.num_outs:]]
  num_saved = len(avals)

  def same(*args):
    return list(args[:num_saved])
  closed, _ = jx.trace_to_closed_jaxpr(   # closes over nothing: no consts
      same, [*avals, *fwd.jaxpr.in_avals], "smartvjp remat3 saved", same,
      [jax.ShapeDtypeStruct(a.shape, a.dtype)
       for a in [*avals, *fwd.jaxpr.in_avals]])
  spec = fwd.shifted(closed, num_saved)
  return dataclasses.replace(spec, new_res_names=(None,) * fwd.num_new_res,
                             new_res_eqns=(), out_avals=tuple(out_avals))


def _save(call, fwd, decided, f_consts, fwd_consts, primals):
  """``fwd`` forward (or ``f`` in its place), its outputs kept (residuals
  offloaded where the policy says); the rem side hands them to ``bwd``."""
  n_out = call.num_outs
  if decided.kind is _plan.Kind.F_FOR_FWD:
    outs = bind_primal(call, fwd, f_consts, fwd_consts, primals)
  else:
    outs = bind_fwd(*fwd_consts, *primals, call=call, fwd=fwd,
                    offload=decided.spaces if decided.offloads else None)
  saved = list(outs)
  spec = _passthrough(call, fwd, [jx.get_aval(x) for x in outs[:n_out]])
  spaces = decided.spaces or (None,) * (len(outs) - n_out)
  k = len(f_consts)

  def rem(saved, *rem_in):
    back = [r if s is None else jax.device_put(r, jx.memory_space("device"))
            for r, s in zip(saved[n_out:], spaces)]
    return rem_p.bind(*rem_in[:k], *saved[:n_out], *back, *fwd_consts,
                      *rem_in[k:], call=call, fwd=spec,
                      schedule=decided.schedule)
  return list(outs[:n_out]), saved, rem


def _split(call, decided, f_consts, fwd_consts, primals):
  """The part of ``fwd`` producing the saved values forward; the rem side
  rebuilds the rest from them (a saved primal output is read, not
  rebuilt)."""
  split, n_out = decided.split, call.num_outs
  outs = bind_fwd(*fwd_consts, *primals, call=call, fwd=split.known)
  extra = iter(outs[n_out:])
  saved = [next(extra) if o is None else outs[o] for o in split.saved_outputs]
  jaxpr = split.staged.jaxpr.jaxpr
  outvars = list(jaxpr.outvars)
  for i, o in enumerate(split.saved_outputs):
    if o is not None:
      outvars[o] = jaxpr.invars[i]
  jaxpr, _ = jx.dce_jaxpr(jx.jaxpr_with(jaxpr, outvars=outvars),
                          [True] * len(outvars), True)
  staged = dataclasses.replace(split.staged, jaxpr=jx.ClosedJaxpr(jaxpr, ()))
  k = len(f_consts)

  def rem(saved, *rem_in):
    return rem_p.bind(*rem_in[:k], *saved, *fwd_consts, *rem_in[k:],
                      call=call, fwd=staged, schedule=decided.schedule)
  return list(outs[:n_out]), saved, rem


define(call_p, impl=call_eval, abstract_eval=_abstract_eval, jvp=call_jvp,
       linearization=call_linearize, transpose=_transpose, batching=batch_call,
       dce=_dce, discharge=_discharge, checkify=_checkify, remat3=_remat3)
