"""``smartvjp_jvp`` and ``smartvjp_lin``, with all their rules.

``smartvjp_jvp``: ``[*f_consts, *fwd_consts, *primals, *nz_tangents] ->
[*primal_outs, *nz_tangent_outs]``, a call's primal and tangent outputs
together, as ``jax.checkpoint`` (``remat_jvp``) and ``jax.jvp`` bind it.
Partial evaluation, not dead-code elimination, decides where the rules run
(``_plan.plan``, jax-ml/jax#21303's "avoid making the mess in the first
place"):

* policy-driven (``jax.checkpoint``): :func:`_partial_eval_custom` splits the
  equation into the forward pass (known) and the rematerialized backward
  region (staged) as the plan says: ``f`` forward and the whole jvp staged
  (its ``schedule`` param the plan's, which recomputes), ``fwd`` forward and
  the linear part staged, or part of a JAX-coded ``fwd`` forward and the
  rest rebuilt in the staged jvp;
* trace-time (a ``JaxprTrace``: the backward pass of ``jax.checkpoint``, and
  linearize without direct linearize): :func:`_partial_eval` runs what the
  equation's ``schedule`` says the backward side starts with (the ``fwd``
  side, or ``f`` where ``fwd_bwd`` runs) and stages the linear part.

``smartvjp_lin``: ``[*residuals, *nz_tangents] -> nz_tangent_outs``, the
call's linear map: from ``fwd``'s residuals (``fwd`` given; the transpose
runs ``bwd``) or, where no residuals were kept (``fwd=None``), from the
primal inputs (the transpose runs ``fwd_bwd``). ``reload``: per residual,
whether a policy offloaded it.

Forward mode (``jax.jvp``, ``jax.jacfwd``, ``jax.linearize``), beyond
``jax.custom_vjp``: the tangent map is the transpose of the linear map
``g -> bwd(res, g)`` (or ``fwd_bwd``'s), so ``bwd`` must be JAX code linear in
``g``.
"""

from __future__ import annotations

import dataclasses
import functools

import jax

from smartvjp import _facade as jx
from smartvjp import _jax_api
from smartvjp import _plan
from smartvjp import _policy
from smartvjp import _vmap
from smartvjp._bwd import run_bwd, run_fwd_bwd
from smartvjp._check import maybe_check
from smartvjp._checkify import checked_rule
from smartvjp._forward import tangents_only
from smartvjp._fwd import bind_fwd_side
from smartvjp._primal import bind_primal, primal_eqn
from smartvjp._primitive import (
    define, discharge_by_tracing, eval_scoped, fwd_p, jvp_p, lin_p, rule_jvp,
    scope)
from smartvjp._spec import tangent_avals
from smartvjp._typecheck import (
    blame_fwd, check_f_output_invariance, check_fwd_output_invariance)


def lin_params(call, fwd, in_nz, reload=None) -> dict:
  """``smartvjp_lin``'s params; ``fwd=None`` for the fused form."""
  return dict(call=call, fwd=fwd, in_nz=tuple(in_nz), reload=reload)


def _nz_inputs(cts_in, in_nz):
  return [ct for ct, nz in zip(cts_in, in_nz) if nz]


def _lin_out_avals(call, fwd):
  """The primal output types a linear map's tangents follow: ``fwd``'s (as
  ``jax.custom_vjp``'s) where ``fwd`` ran, else ``f``'s."""
  if fwd is not None and fwd.out_avals:
    return fwd.out_avals
  return call.out_avals


def _num_nonlinear(call, fwd) -> int:
  return len(fwd.res_avals) if fwd is not None else call.num_primals


def _reloaded(res, reload):
  """Residuals a policy offloaded (``reload[i]`` true) back in device
  memory, where ``bwd`` expects them, as ``fwd`` returned them."""
  if reload is None:
    return list(res)
  return [jax.device_put(r, jx.memory_space("device")) if back else r
          for r, back in zip(res, reload)]


# -- smartvjp_lin ------------------------------------------------------------------

def _lin_abstract_eval(*avals, call, fwd, in_nz, reload):
  return tangent_avals(_lin_out_avals(call, fwd), call.out_nz), frozenset()


def _lin_transpose(cts, *args, call, fwd, in_nz, reload):
  """``bwd`` on the residuals (or ``fwd_bwd`` on the primal inputs). ``bwd``
  runs even when every output cotangent is zero, as with ``jax.custom_vjp``:
  its result need not depend on them (flax's fp8 scales)."""
  n = _num_nonlinear(call, fwd)
  cts_out = call.expand_tangents(cts)
  if fwd is None:
    if any(type(ct) is not jx.Zero for ct in cts):
      check_f_output_invariance(call)   # the cotangent has f's type here
    cts_in = run_fwd_bwd(call, args[:n], in_nz, cts_out)
  else:
    try:
      cts_in = run_bwd(call, fwd, _reloaded(args[:n], reload), cts_out)
    except Exception as e:  # noqa: BLE001 - re-raised unless fwd is at fault
      blame_fwd(call, e)
      raise
  return [None] * n + _nz_inputs(cts_in, in_nz)


def _transpose_cotangent_map(call, which, cotangent_map, in_nz, nz_tangents,
                             out_avals):
  """Tangent outputs: the transpose of ``g -> cotangent_map(g)`` at the
  tangents. Cotangents are typed fully (sharding, varying manual axes): one
  typed by shape and dtype only would be made varying inside ``shard_map``,
  and that cast transposes into a ``psum``."""
  ct_avals = tangent_avals(out_avals, call.out_nz)
  rule_failed = []

  def nz_map(*nz_cts):
    try:
      cts = cotangent_map(call.expand_tangents(nz_cts))
    except Exception as e:  # noqa: BLE001 - the rule's own error, as is
      rule_failed.append(e)
      raise
    return [jx.instantiate_zeros(c) for c in _nz_inputs(cts, in_nz)]

  try:
    transposed = jax.linear_transpose(nz_map, *ct_avals)
    return list(transposed(list(nz_tangents)))
  except Exception as e:  # noqa: BLE001 - re-raised with context below
    if rule_failed and e is rule_failed[0]:
      raise   # the rule failed (or returned bad cotangents): its own error
    raise _not_transposable_error(type(e))(
        f"forward-mode differentiation (jax.jvp, jax.jacfwd, jax.linearize) "
        f"of smart_custom_vjp function {call.name} needs a {which} rule "
        f"({call.rules.rule_name(which)}) that JAX can transpose in its "
        f"cotangent argument (JAX code, linear in g); transposing it failed "
        f"with: {type(e).__name__}: {e}") from e


@functools.cache
def _not_transposable_error(cause: type) -> type:
  """The exception for a rule JAX cannot transpose: a ``TypeError`` (what
  ``jax.custom_vjp`` raises for forward mode) that is also an instance of
  the transposition's own error type, which is what ``jax.custom_vjp``
  raises where it differentiates the rule instead (``jax.jvp`` of
  ``jax.grad`` with a ``bwd`` that calls a ``jax.pure_callback``: its
  ``ValueError``)."""
  if issubclass(TypeError, cause) or issubclass(cause, TypeError):
    return TypeError
  try:
    return type("NotTransposableError", (TypeError, cause), {})
  except TypeError:   # base classes whose instance layouts conflict
    return TypeError


def lin_forward(*args, call, fwd, in_nz, reload):
  """Forward mode: the tangents, from the forward rule (on the primals the
  residuals carry for it) or else the transpose of the cotangent map."""
  n = _num_nonlinear(call, fwd)
  nonlinear, nz_t = args[:n], args[n:]
  if call.rules.jvp is not None:
    primals = nonlinear[n - call.num_primals:]
    return tangents_only(call, primals, in_nz, nz_t)
  if fwd is None:
    check_f_output_invariance(call)   # the tangent follows f's output type
    return _transpose_cotangent_map(
        call, "fwd_bwd",
        lambda cts: run_fwd_bwd(call, nonlinear, in_nz, cts), in_nz, nz_t,
        call.out_avals)
  check_fwd_output_invariance(call, fwd)   # the tangent follows fwd's types
  res = _reloaded(nonlinear, reload)
  return _transpose_cotangent_map(
      call, "bwd", lambda cts: run_bwd(call, fwd, res, cts), in_nz, nz_t,
      _lin_out_avals(call, fwd))


def _lin_jvp(primals, tangents, **params):
  """When only the tangent inputs move, the JVP of a linear map is itself;
  otherwise (higher order) the rule's code is differentiated."""
  n = _num_nonlinear(params["call"], params["fwd"])
  if all(type(t) is jx.Zero for t in tangents[:n]):
    lin_tangents = [jx.instantiate_zeros(t) for t in tangents[n:]]
    return (lin_p.bind(*primals, **params),
            lin_p.bind(*primals[:n], *lin_tangents, **params))
  role = "bwd" if params["fwd"] is not None else "fwd_bwd"
  return rule_jvp(lin_forward, role, primals, tangents, **params)


def _lin_batch(axis_data, args, dims, *, call, fwd, in_nz, reload):
  if all(d is None for d in dims):
    return (lin_p.bind(*args, **lin_params(call, fwd, in_nz, reload)),
            [None] * sum(call.out_nz))
  n = _num_nonlinear(call, fwd)
  if call.rules.jvp is not None and all(d is None for d in dims[:n]):
    # only tangents mapped (jax.jacfwd): the forward rule with its primals
    # unmapped, evaluated here
    tangents = [_vmap.front(axis_data, t, d) for t, d in zip(args[n:],
                                                             dims[n:])]
    rule = _vmap.jvp_rule_over_tangents(call, len(tangents), axis_data)
    outs = tangents_only(call, args[n - call.num_primals:n], in_nz, tangents,
                         rule)
    return outs, [0] * len(outs)
  args = [_vmap.front(axis_data, x, d) for x, d in zip(args, dims)]
  bcall = _vmap.linear_only_call(call, [0] * call.num_primals, axis_data)
  bfwd = fwd
  if fwd is not None:
    size, _, _, mesh_axis = jx.vmap_axis(axis_data)
    n = len(fwd.res_avals)
    bfwd = dataclasses.replace(
        fwd, res_avals=tuple(jx.get_aval(r) for r in args[:n]),
        out_avals=tuple(jx.unmapped_aval(size, 0, a, mesh_axis)
                        for a in fwd.out_avals))
  outs = lin_p.bind(*args, **lin_params(bcall, bfwd, in_nz, reload))
  return outs, [0] * len(outs)


def _checkify_forward_mode(impl, which_of):
  def rule(ctx, error, enabled, *args, **params):
    return checked_rule(ctx, error, enabled,
                        lambda *xs: impl(*xs, **params), args,
                        params["call"], which_of(params))
  return rule


def _which(params) -> str:
  return "bwd" if params["fwd"] is not None else "fwd_bwd"


define(lin_p, impl=lin_forward, abstract_eval=_lin_abstract_eval,
       jvp=_lin_jvp, transpose=_lin_transpose,
       transpose_with_logs=(_jax_api.collecting_logs, _jax_api.merged_logs),
       batching=_lin_batch,
       discharge=discharge_by_tracing(lin_forward, "smartvjp_lin"),
       checkify=_checkify_forward_mode(lin_forward, _which))


# -- smartvjp_jvp: evaluation (forward mode) ----------------------------------------

def _jvp_abstract_eval(*avals, call, fwd, in_nz, schedule):
  nc, nw = call.num_consts, (fwd.num_consts if fwd is not None else 0)
  # inputs [*f_consts, *fwd_consts, *primals, *tangents]: f's and fwd's own
  # input positions moved there
  effects = jx.move_input_effects(jx.positional_effects(call.jaxpr),
                                  lambda i: i if i < nc else i + nw)
  if fwd is not None:
    effects |= jx.move_input_effects(jx.positional_effects(fwd.jaxpr),
                                     lambda i: i + nc)
  return [*call.out_avals, *tangent_avals(call.out_avals, call.out_nz)], effects


def jvp_forward(*args, call, fwd, in_nz, schedule):
  """Forward mode: the forward rule where there is one; else ``fwd`` (or
  ``f``, with ``fwd_bwd`` alone) for the primal outputs, then the linear
  map's forward mode."""
  del schedule
  f_consts, fwd_consts, primals, nz_t = call.split_jvp_args(args, fwd)
  if call.rules.jvp is not None:   # the forward rule, instead of f and fwd
    outs, nz_touts = call.rules.jvp.run(call, primals, in_nz, nz_t)
    return [*outs, *nz_touts]
  if fwd is None:
    primal_outs = eval_scoped(call.jaxpr, scope(call, "f"),
                              [*f_consts, *primals])
    return [*primal_outs, *lin_forward(*primals, *nz_t,
                                       **lin_params(call, None, in_nz))]
  fwd_inputs = [*fwd_consts, *primals]
  outs = eval_scoped(fwd.jaxpr, scope(call, "fwd"), fwd_inputs)
  res = fwd.assemble_residuals(fwd_inputs, outs[call.num_outs:])
  return [*outs[:call.num_outs],
          *lin_forward(*res, *nz_t, **lin_params(call, fwd, in_nz))]


def _jvp_jvp(primals, tangents, **params):
  """Higher order: the forward-mode evaluation differentiated."""
  return rule_jvp(jvp_forward, _which(params), primals, tangents, **params)


# -- smartvjp_jvp: policy-driven partial evaluation (jax.checkpoint) ------------------

def _residuals(eqn, inst_in, staged, new_vars=()):
  """What the staged side needs from the known side: ``new_vars`` (outputs
  of the known equation), then each input of ``eqn`` that the staged
  equation reads and that is not already instantiated there, once."""
  out, seen = list(new_vars), set(new_vars)
  reads = {v for v in staged.invars if type(v) is jx.Var}
  for v, inst in zip(eqn.invars, inst_in):
    if type(v) is jx.Var and not inst and v in reads and v not in seen:
      out.append(v)
      seen.add(v)
  return out


def _remat_variant(eqn, inst_in):
  """The jvp equation with its call's ``defremat`` rules in place of its
  ``defvjp`` ones (``inst_in`` to match), or ``None`` when their ``fwd``
  closes over values (they would need new inputs)."""
  call, fwd, in_nz = (eqn.params[k] for k in ("call", "fwd", "in_nz"))
  alt = _vmap.remat_call(call)
  alt_fwd, alt_consts = alt.fwd_for(in_nz)
  if alt_consts:
    return None
  n1 = call.num_consts
  n2 = n1 + (fwd.num_consts if fwd is not None else 0)
  invars = [*eqn.invars[:n1], *eqn.invars[n2:]]
  inst = [*inst_in[:n1], *inst_in[n2:]]
  return (jx.eqn_with(eqn, invars=invars,
                      params=dict(eqn.params, call=alt, fwd=alt_fwd)), inst)


def _partial_eval_custom(saveable, unks_in, inst_in, eqn):
  call, fwd = eqn.params["call"], eqn.params["fwd"]
  n_known = len(eqn.invars) - sum(eqn.params["in_nz"])
  n_all = len(eqn.outvars)
  if not any(unks_in):   # tangents known too (a custom_jvp's zero tangent)
    return eqn, None, [False] * n_all, [False] * n_all, []
  if any(unks_in[:n_known]):   # primals unknown: all of it is staged
    return (None, eqn, [True] * n_all, [True] * n_all,
            _residuals(eqn, inst_in, eqn))
  swapped = []

  def remat_rules_usable():
    swapped.append(_remat_variant(eqn, inst_in))
    return swapped[-1] is not None

  answers = (_policy.answers(saveable, call, fwd, jvp_p,
                             [v.aval for v in eqn.invars], eqn.params)
             if fwd is not None else _plan.Answers(_plan.RECOMPUTE))
  decided = _plan.plan(_policy.facts(call, fwd, remat_rules_usable), answers)
  if decided.kind is _plan.Kind.SPLIT:
    return _split(eqn, inst_in, decided.split)
  if decided.kind is _plan.Kind.REMAT_RULES:
    eqn, inst_in = swapped[-1]
    call, fwd = eqn.params["call"], eqn.params["fwd"]
    decided = _plan.fwd_or_f(_policy.facts(call, fwd),
                             (None,) * fwd.num_new_res)
  f_consts, fwd_consts, primals, tangents = call.split_jvp_args(eqn.invars,
                                                                fwd)
  n_out = call.num_outs
  unks_out = [False] * n_out + [True] * (n_all - n_out)
  if decided.kind is _plan.Kind.RECOMPUTE:
    # f in the forward pass, the whole jvp in the backward region
    known, _ = primal_eqn(call, fwd, f_consts, fwd_consts, primals,
                          eqn.outvars[:n_out], eqn)
    staged = jx.eqn_with(eqn, params=dict(eqn.params,
                                          schedule=decided.schedule))
    return (known, staged, unks_out, [True] * n_all,
            _residuals(eqn, inst_in, staged))
  # fwd (or f in its place) forward, its residuals kept; the linear part
  # staged
  fwd_inputs = [*fwd_consts, *primals]
  spaces = decided.spaces
  offload = spaces if decided.offloads else None
  new_res = [jx.Var(a if s is None else a.update(memory_space=s))
             for a, s in zip(fwd.jaxpr.out_avals[n_out:], spaces)]
  if decided.kind is _plan.Kind.F_FOR_FWD:
    known, _ = primal_eqn(call, fwd, f_consts, fwd_consts, primals,
                          eqn.outvars[:n_out], eqn)
  else:
    known = jx.new_eqn(fwd_inputs, [*eqn.outvars[:n_out], *new_res], fwd_p,
                       dict(call=call, fwd=fwd, offload=offload),
                       jx.eqn_effects(fwd.jaxpr, fwd_inputs), eqn)
  reload = None
  if offload is not None:
    reload = tuple(fwd.assemble_residuals([False] * len(fwd_inputs),
                                          [s is not None for s in spaces]))
  staged = jx.new_eqn(
      [*fwd.assemble_residuals(fwd_inputs, new_res), *tangents],
      eqn.outvars[n_out:], lin_p,
      lin_params(call, fwd, eqn.params["in_nz"], reload), set(), eqn)
  return (known, staged, unks_out, [False] * n_out + [True] * (n_all - n_out),
          _residuals(eqn, inst_in, staged, new_res))


def _split(eqn, inst_in, split):
  """Some of ``fwd``'s values saved: the forward pass runs the part of
  ``fwd`` producing the primal outputs and the saved values; the backward
  region rebuilds the rest (a jvp whose ``fwd`` takes the saved values as
  leading constants) and runs ``bwd``. A primal output the policy saves is
  read from the forward pass, not recomputed."""
  call, fwd = eqn.params["call"], eqn.params["fwd"]
  f_consts, fwd_consts, primals, tangents = call.split_jvp_args(eqn.invars,
                                                                fwd)
  n_out = call.num_outs
  saved = [jx.Var(a) if o is None else eqn.outvars[o]
           for a, o in zip(split.saved_avals, split.saved_outputs)]
  extra = [v for v, o in zip(saved, split.saved_outputs) if o is None]
  known = jx.new_eqn([*fwd_consts, *primals], [*eqn.outvars[:n_out], *extra],
                     fwd_p, dict(call=call, fwd=split.known, offload=None),
                     split.known.jaxpr.effects, eqn)
  kept_outs = {o for o in split.saved_outputs if o is not None}
  outvars = [jx.Var(v.aval) if i in kept_outs else v
             for i, v in enumerate(eqn.outvars)]
  staged = jx.new_eqn(
      [*f_consts, *saved, *fwd_consts, *primals, *tangents], outvars, jvp_p,
      dict(eqn.params, fwd=split.staged, schedule=_plan.SPLIT_REBUILT),
      call.jaxpr.effects | split.staged.jaxpr.effects, eqn)
  unks_out = [False] * n_out + [True] * (len(eqn.outvars) - n_out)
  inst_out = [i not in kept_outs for i in range(len(eqn.outvars))]
  return known, staged, unks_out, inst_out, _residuals(eqn, inst_in, staged,
                                                       saved)


# -- smartvjp_jvp: trace-time partial evaluation (the rematerialized region) --------

def _partial_eval(trace, *tracers, call, fwd, in_nz, schedule):
  """Primal inputs known, tangents not: the primal side runs now (the
  ``fwd`` side, or ``f`` where ``fwd_bwd`` will run, as ``schedule`` says)
  and the linear part is staged."""
  params = dict(call=call, fwd=fwd, in_nz=in_nz, schedule=schedule)
  n_known = len(tracers) - sum(in_nz)
  known_tracers, tangent_tracers = tracers[:n_known], tracers[n_known:]
  vals = jx.pe_known_values(known_tracers)
  if vals is None or jx.pe_all_known(tangent_tracers):
    return jx.pe_default(trace, jvp_p, tracers, params)
  f_consts, fwd_consts, primals, _ = call.split_jvp_args(vals, fwd)
  with jx.set_current_trace(jx.parent_trace(trace)):
    if schedule.runs_fwd_bwd:
      primal_outs = bind_primal(call, fwd, f_consts, fwd_consts, primals)
      lin_inputs, lin_fwd = primals, None
    else:
      primal_outs, lin_inputs = bind_fwd_side(call, fwd, f_consts, fwd_consts,
                                              primals)
      lin_fwd = fwd
      if schedule.recomputes and fwd.num_new_res:  # f ran forward, fwd here
        maybe_check(call, f_consts, primals, primal_outs)
  staged_in = [*(jx.pe_instantiate(trace, x) for x in lin_inputs),
               *tangent_tracers]
  tangent_outs = jx.pe_default(trace, lin_p, staged_in,
                               lin_params(call, lin_fwd, in_nz))
  return [*primal_outs, *tangent_outs]


# -- smartvjp_jvp: dead-code elimination ------------------------------------------
#
# An effect jax.custom_vjp would run (a jax.debug.print in f, fwd or bwd) runs
# here too, even when the equation's outputs are unused, as JAX keeps any
# equation with effects. A jvp whose tangents are dead stands for the rule
# jax.custom_vjp runs for a differentiated call: fwd, when it has effects.

def _passed_through(fwd):
  """For a ``fwd`` each of whose computed residuals is one of its inputs
  (through ``checkpoint_name`` at most: the backward side of a split whose
  residuals were all saved), the input position of each; else ``None``."""
  jaxpr = fwd.jaxpr.jaxpr
  named = {e.outvars[0]: e.invars[0] for e in jaxpr.eqns
           if jx.checkpoint_name_of(e.primitive, e.params) is not None}
  pos = {v: i for i, v in enumerate(jaxpr.invars)}
  passed = []
  for v in jaxpr.outvars[len(jaxpr.outvars) - fwd.num_new_res:]:
    while type(v) is jx.Var and v in named:
      v = named[v]
    if type(v) is not jx.Var or v not in pos:
      return None
    passed.append(pos[v])
  return passed


def _linear_part(eqn):
  """A jvp equation whose primal outputs are unused, when its tangents need
  no rule to run first (``fwd``'s residuals are all inputs or saved values,
  or ``fwd_bwd`` runs): only its linear map, so that neither ``f`` nor
  ``fwd`` runs for outputs nobody reads (this matters eagerly, where nothing
  else removes them: the backward region of ``jax.checkpoint``, evaluated
  equation by equation)."""
  call, fwd, in_nz = (eqn.params[k] for k in ("call", "fwd", "in_nz"))
  if _policy.has_effects(call, fwd) or _policy.uses_references(call):
    return None
  _, fwd_consts, primals, tangents = call.split_jvp_args(eqn.invars, fwd)
  fwd_inputs = [*fwd_consts, *primals]
  if eqn.params["schedule"].runs_fwd_bwd:
    ins, params = primals, lin_params(call, None, in_nz)
  else:
    passed = _passed_through(fwd)
    if passed is None:
      return None
    ins = fwd.assemble_residuals(fwd_inputs, [fwd_inputs[i] for i in passed])
    params = lin_params(call, fwd, in_nz)
  new_eqn = jx.new_eqn([*ins, *tangents], eqn.outvars[call.num_outs:], lin_p,
                       params, set(), eqn)
  read = {id(v) for v in new_eqn.invars}
  return [id(v) in read for v in eqn.invars], new_eqn


def _jvp_dce(used_outputs, eqn):
  """Tangents unused: just ``f``; or ``fwd`` without its residuals when
  ``fwd`` has effects (``jax.custom_vjp`` would run them). Primal outputs
  unused: maybe just the linear map (:func:`_linear_part`)."""
  call, fwd = eqn.params["call"], eqn.params["fwd"]
  n = call.num_outs
  if any(used_outputs[n:]):
    if not any(used_outputs[:n]):
      linear = _linear_part(eqn)
      if linear is not None:
        return linear
    return [True] * len(eqn.invars), eqn
  f_consts, fwd_consts, primals, tangents = call.split_jvp_args(eqn.invars,
                                                                fwd)
  unused = lambda xs: [False] * len(xs)
  used = lambda xs: [True] * len(xs)
  if fwd is not None and jx.effects_keep_alive(fwd.jaxpr.effects):
    new_res = [jx.drop_var(a) for a in fwd.jaxpr.out_avals[n:]]
    new_eqn = jx.new_eqn(
        [*fwd_consts, *primals], [*eqn.outvars[:n], *new_res], fwd_p,
        dict(call=call, fwd=fwd, offload=None),
        jx.eqn_effects(fwd.jaxpr, [*fwd_consts, *primals]), eqn)
    return (unused(f_consts) + used(fwd_consts) + used(primals)
            + unused(tangents)), new_eqn
  if not any(used_outputs[:n]) and (
      fwd is not None or not jx.effects_keep_alive(call.jaxpr.effects)):
    return [False] * len(eqn.invars), None  # fwd, which JAX would run, is pure
  new_eqn, reads_consts = primal_eqn(call, fwd, f_consts, fwd_consts, primals,
                                     eqn.outvars[:n], eqn)
  return (used(f_consts) + [reads_consts] * len(fwd_consts) + used(primals)
          + unused(tangents)), new_eqn


# -- smartvjp_jvp: batching -----------------------------------------------------------

def _jvp_batch(axis_data, args, dims, *, call, fwd, in_nz, schedule):
  params = dict(call=call, fwd=fwd, in_nz=in_nz, schedule=schedule)
  effects = call.jaxpr.effects | (fwd.jaxpr.effects if fwd is not None
                                  and fwd.jaxpr is not None else set())
  if _vmap.unbatched(axis_data, dims, effects):
    return jvp_p.bind(*args, **params), [None] * (call.num_outs
                                                  + sum(call.out_nz))
  f_consts, fwd_consts, primals, tangents = call.split_jvp_args(args, fwd)
  cdims, wdims, pdims, tdims = call.split_jvp_args(dims, fwd)
  if all(d is None for d in (*cdims, *wdims, *pdims)):
    return _jvp_batch_tangents_only(axis_data, call, fwd, in_nz, f_consts,
                                    fwd_consts, primals, tangents, tdims)
  # tangents are mapped at 0 (broadcast if need be), so a primal with a
  # tangent is mapped too: the batched rules see one batch, and bwd's
  # cotangent for it is per example, like its tangent
  pdims = [d if d is not None or not nz else "broadcast"
           for d, nz in zip(pdims, in_nz)]
  primals, pdims = _vmap.to_front_or_none(axis_data, primals, pdims)
  tangents = [_vmap.front(axis_data, t, d) for t, d in zip(tangents, tdims)]
  bcall, bconsts = _vmap.batched_call(call, f_consts, cdims, pdims, axis_data)
  bfwd, bfwd_consts = bcall.fwd_for(in_nz)
  outs = jvp_p.bind(*bconsts, *bfwd_consts, *primals, *tangents, call=bcall,
                    fwd=bfwd, in_nz=in_nz, schedule=schedule)
  return outs, [0] * len(outs)


def _jvp_batch_tangents_only(axis_data, call, fwd, in_nz, f_consts, fwd_consts,
                             primals, tangents, tdims):
  """Only tangents mapped (``jacfwd``): the primal side once, the linear map
  batched (with a forward rule: ``f`` once and the rule's tangent part)."""
  if call.rules.jvp is not None:
    primal_outs = bind_primal(call, fwd, f_consts, fwd_consts, primals)
    tangents = [_vmap.front(axis_data, t, d) for t, d in zip(tangents, tdims)]
    rule = _vmap.jvp_rule_over_tangents(call, len(tangents), axis_data)
    tangent_outs = tangents_only(call, primals, in_nz, tangents, rule)
    return ([*primal_outs, *tangent_outs],
            [None] * len(primal_outs) + [0] * len(tangent_outs))
  if fwd is None:
    primal_outs = bind_primal(call, fwd, f_consts, fwd_consts, primals)
    lin_inputs = primals
  else:
    primal_outs, lin_inputs = bind_fwd_side(call, fwd, f_consts, fwd_consts,
                                            primals)
  tangent_outs, _ = _lin_batch(
      axis_data, [*lin_inputs, *tangents],
      [None] * len(lin_inputs) + list(tdims), **lin_params(call, fwd, in_nz))
  return ([*primal_outs, *tangent_outs],
          [None] * len(primal_outs) + [0] * len(tangent_outs))


define(jvp_p, impl=jvp_forward, abstract_eval=_jvp_abstract_eval,
       jvp=_jvp_jvp, partial_eval=_partial_eval,
       partial_eval_custom=_partial_eval_custom, dce=_jvp_dce,
       batching=_jvp_batch,
       discharge=discharge_by_tracing(jvp_forward, "smartvjp_jvp"),
       checkify=_checkify_forward_mode(jvp_forward, _which))
