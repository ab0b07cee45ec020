"""Partial evaluation of ``smartvjp_jvp``: where each rule runs.

Two of JAX's partial evaluators meet ``smartvjp_jvp``:

* **Policy-driven** (``pe.partial_eval_jaxpr_custom_rules``), used by
  ``jax.checkpoint`` to split its differentiated body into the forward pass
  (known) and the rematerialized backward region (staged). See
  :func:`_jvp_partial_eval_custom`.
* **Trace-time** (``pe.custom_partial_eval_rules``, a ``JaxprTrace``), reached
  by the backward pass of ``jax.checkpoint`` (``remat_transpose``) and by
  linearize when ``jax_use_direct_linearize=False``. See
  :func:`_jvp_partial_eval`.

The design is the one asked for in jax-ml/jax#21303 ("avoid making the mess
in the first place"): under remat the forward pass runs ``f``, and ``fwd``
(or the fused ``fwd_bwd``) runs only in the backward region; no dead-code
elimination of kernels is relied upon.
"""

from __future__ import annotations

from smartvjp import _compat
from smartvjp._check import maybe_check
from smartvjp._jax_api import remat_variant
from smartvjp._policy import plan_split
from smartvjp._primitives import (
    bind_primal, bind_primal_and_residuals, fused_lin_p, fwd_p, jvp_p, lin_p,
    primal_eqn, split_jvp_args, uses_references)


# -- the policy ---------------------------------------------------------------

def residual_policy(saveable, eqn):
  """How a remat policy treats one call's residuals.

  Returns ``None`` to recompute, or a tuple with one entry per residual that
  ``fwd`` computes: ``None`` to save it in place, or the memory space to
  offload it to (``Offloadable.dst``).

  A residual is saveable if the policy says so, as it would be asked inside
  ``fwd``'s own jaxpr, for the equation producing it (a ``checkpoint_name``
  equation, so ``save_only_these_names`` works; through it, the equation
  producing the named value; so a ``dot_general`` output under
  ``dots_saveable`` is saveable, as with ``jax.custom_vjp`` and JAX-coded
  rules, while a Pallas or callback output is not), or for the call's own
  primitive (so ``everything_saveable`` saves and ``nothing_saveable``
  recomputes). Residuals that are
  inputs of the call cost nothing to keep and are not asked about.

  The decision for the whole call (``_jvp_partial_eval_custom``), for any mix
  of opaque and transparent equations in ``fwd``: the forward pass runs the
  cheapest program that produces the primal outputs and the saved values, and
  the backward region recomputes only what was not saved. Concretely:

  * a JAX-coded ``fwd`` is split by the policy equation by equation, exactly
    as ``jax.checkpoint`` splits ``fwd`` inlined (``_policy.plan_split``):
    the forward pass runs the part of ``fwd`` producing the primal outputs
    and the saved values, the backward region rebuilds the rest from them and
    the inputs, then runs ``bwd``. Primal outputs follow the policy too, also
    when every residual is saveable: an unsaveable primal output that the
    backward region reads is recomputed there, and where nothing reads it
    the backward side is only the linear primitive on the saved values
    (``_primitives._linear_part``, at dead-code elimination).
  * The call is recomputed whole instead (``f`` forward, ``fwd`` + ``bwd`` or
    ``fwd_bwd`` backward) when the split saves nothing ``fwd`` computes, when
    an opaque kernel (one equation producing several values: a Pallas call,
    a custom call, a callback) would run in both passes (keeping part of a
    kernel's outputs still needs the kernel again), or when what would run in
    both passes costs more than ``f`` (``_policy.cost``).
  * When this function's answers save or offload every residual and the
    split does not apply (an opaque ``fwd``, offloading), the forward pass
    runs ``fwd`` and the backward pass only ``bwd``.

  ``fwd_bwd`` runs only where nothing of the call is saved.
  """
  fwd = eqn.params["fwd"]
  if fwd is None:
    return None
  if eqn.params["call"].rules.always_save:  # defremat: the user decides
    return (None,) * fwd.num_new_res
  call_answer = _compat.policy_answer(
      saveable, jvp_p, [v.aval for v in eqn.invars], eqn.params)
  recompute = type(_compat.Recompute)
  if fwd.num_new_res == 0:
    # residuals are all inputs: f runs in the forward pass either way; a
    # policy that saves the call keeps its outputs there too (as jax.custom_vjp
    # keeps fwd's), instead of running f again in the backward region
    return None if isinstance(call_answer, recompute) else ()
  answers = []
  chains = fwd.new_res_eqns or ((),) * fwd.num_new_res
  for chain in chains:
    answer = call_answer
    for producer in chain:   # checkpoint_name's equation, then the named value's
      if not isinstance(answer, recompute):
        break
      answer = _compat.policy_answer(saveable, producer.primitive,
                               [v.aval for v in producer.invars],
                               producer.params)
    answers.append(answer)
  if any(isinstance(a, recompute) for a in answers):
    return None
  return tuple(_compat.memory_space(a.dst) if isinstance(a, _compat.Offloadable) else None
               for a in answers)


# -- policy-driven partial eval (jax.checkpoint) ------------------------------

def _residuals(eqn, inst_in, staged, new_vars=()):
  """What the staged side needs from the known side: ``new_vars`` (outputs of
  the known equation), then each input of ``eqn`` that the staged equation
  reads and that is not already instantiated there (known primals and known
  tangents alike), once."""
  out, seen = list(new_vars), set(new_vars)
  reads = {v for v in staged.invars if type(v) is _compat.Var}
  for v, inst in zip(eqn.invars, inst_in):
    if type(v) is _compat.Var and not inst and v in reads and v not in seen:
      out.append(v)
      seen.add(v)
  return out


def _stage_all(unks_in, inst_in, eqn):
  n = len(eqn.outvars)
  return None, eqn, [True] * n, [True] * n, _residuals(eqn, inst_in, eqn)


def _jvp_partial_eval_custom(saveable, unks_in, inst_in, eqn):
  call, fwd = eqn.params["call"], eqn.params["fwd"]
  n_known = len(eqn.invars) - sum(eqn.params["in_nz"])
  if not any(unks_in):   # tangents known too (a custom_jvp's zero tangent)
    n = len(eqn.outvars)
    return eqn, None, [False] * n, [False] * n, []
  if any(unks_in[:n_known]):
    return _stage_all(unks_in, inst_in, eqn)
  n_out = call.num_outs
  n_tan = len(eqn.outvars) - n_out
  f_consts, fwd_consts, primals, tangents = split_jvp_args(eqn.invars, call, fwd)
  unks_out = [False] * n_out + [True] * n_tan

  kept = residual_policy(saveable, eqn)
  if ((kept is None or not any(s is not None for s in kept))
      and call.rules.remat is None and not call.rules.always_save
      and not uses_references(call)):
    # save what the policy saves and recompute the rest, primal outputs
    # included (when nothing is recomputed, fwd runs whole forward)
    split = plan_split(saveable, call, fwd)
    if split is not None:
      return _split_call(eqn, inst_in, split, f_consts, fwd_consts, primals,
                         tangents, unks_out)
  if kept is None and call.rules.remat is not None:
    swapped = remat_variant(eqn, inst_in)  # defremat's rules where recomputed
    if swapped is not None:
      eqn, inst_in = swapped
      call, fwd = eqn.params["call"], eqn.params["fwd"]
      f_consts, fwd_consts, primals, tangents = split_jvp_args(
          eqn.invars, call, fwd)
      kept = residual_policy(saveable, eqn)
  if kept is not None:
    fwd_inputs = [*fwd_consts, *primals]
    offload = kept if any(s is not None for s in kept) else None
    new_res = [_compat.Var(a if s is None else a.update(memory_space=s))
               for a, s in zip(fwd.jaxpr.out_avals[n_out:], kept)]
    if fwd.num_new_res:
      known = _compat.new_jaxpr_eqn(
          fwd_inputs, [*eqn.outvars[:n_out], *new_res], fwd_p,
          dict(call=call, fwd=fwd, offload=offload),
          _compat.eqn_effects(fwd.jaxpr, fwd_inputs), eqn.source_info, eqn.ctx)
    else:   # fwd computes nothing that f does not
      known = primal_eqn(call, fwd, f_consts, fwd_consts, primals,
                         eqn.outvars[:n_out], eqn)
    residuals = fwd.assemble_residuals(fwd_inputs, new_res)
    reload = None
    if offload is not None:
      reload = tuple(fwd.assemble_residuals(
          [False] * len(fwd_inputs), [s is not None for s in kept]))
    staged = _compat.new_jaxpr_eqn(
        [*residuals, *tangents], eqn.outvars[n_out:], lin_p,
        dict(call=call, fwd=fwd, in_nz=eqn.params["in_nz"], reload=reload),
        set(), eqn.source_info, eqn.ctx)
    inst_out = [False] * n_out + [True] * n_tan
    return (known, staged, unks_out, inst_out,
            _residuals(eqn, inst_in, staged, new_res))

  # Recompute: f in the forward pass, the whole jvp in the backward region.
  known = primal_eqn(call, fwd, f_consts, fwd_consts, primals,
                     eqn.outvars[:n_out], eqn)
  staged = eqn.replace(params=dict(eqn.params, remat=True))
  return (known, staged, unks_out, [True] * len(eqn.outvars),
          _residuals(eqn, inst_in, staged))


def _split_call(eqn, inst_in, split, f_consts, fwd_consts, primals, tangents,
                unks_out):
  """Some of fwd's values saved: the forward pass runs the part of ``fwd``
  that produces the primal outputs and the saved values; the backward region
  rebuilds the rest of ``fwd`` from them (a ``smartvjp_jvp`` whose ``fwd``
  takes the saved values as leading constants) and runs ``bwd``."""
  call = eqn.params["call"]
  n_out = call.num_outs
  saved = [_compat.Var(a) if o is None else eqn.outvars[o]
           for a, o in zip(split.saved_avals, split.saved_outputs)]
  extra = [v for v, o in zip(saved, split.saved_outputs) if o is None]
  known = _compat.new_jaxpr_eqn(
      [*fwd_consts, *primals], [*eqn.outvars[:n_out], *extra], fwd_p,
      dict(call=call, fwd=split.known, offload=None),
      split.known.jaxpr.effects, eqn.source_info, eqn.ctx)
  # a primal output the policy saves is read from the forward pass, not
  # recomputed: the staged equation's copy of it goes unused
  kept_outs = set(o for o in split.saved_outputs if o is not None)
  outvars = [_compat.Var(v.aval) if i in kept_outs else v
             for i, v in enumerate(eqn.outvars)]
  staged = _compat.new_jaxpr_eqn(
      [*f_consts, *saved, *fwd_consts, *primals, *tangents], outvars,
      jvp_p, dict(eqn.params, fwd=split.staged, remat=False),
      call.jaxpr.effects | split.staged.jaxpr.effects, eqn.source_info,
      eqn.ctx)
  inst_out = [i not in kept_outs for i in range(len(eqn.outvars))]
  return (known, staged, unks_out, inst_out,
          _residuals(eqn, inst_in, staged, saved))


# -- trace-time partial eval (the JaxprTrace of the remat backward pass) ------

def _jvp_partial_eval(trace, *tracers, call, fwd, in_nz, remat):
  params = dict(call=call, fwd=fwd, in_nz=in_nz, remat=remat)
  n_known = len(tracers) - sum(in_nz)
  known_tracers, tangent_tracers = tracers[:n_known], tracers[n_known:]
  if (not all(t.is_known() for t in known_tracers)
      or all(t.is_known() for t in tangent_tracers)):
    return trace.default_process_primitive(jvp_p, tracers, params)
  vals = [t.pval.get_known() for t in known_tracers]
  f_consts, fwd_consts, primals, _ = split_jvp_args(vals, call, fwd)
  use_fused = fwd is None or (remat and call.rules.fwd_bwd is not None)
  with _compat.set_current_trace(trace.parent_trace):
    if use_fused:
      primal_outs = bind_primal(call, fwd, f_consts, fwd_consts, primals)
      lin_inputs, prim = primals, fused_lin_p
      lin_params = dict(call=call, in_nz=in_nz)
    else:
      primal_outs, lin_inputs = bind_primal_and_residuals(
          call, fwd, f_consts, fwd_consts, primals)
      prim, lin_params = lin_p, dict(call=call, fwd=fwd, in_nz=in_nz,
                                     reload=None)
      if remat and fwd.num_new_res:  # f ran in the forward pass, fwd here
        maybe_check(call, f_consts, primals, primal_outs)
  staged_in = [*map(trace.new_instantiated_const, lin_inputs), *tangent_tracers]
  tangent_outs = trace.default_process_primitive(prim, staged_in, lin_params)
  return [*primal_outs, *tangent_outs]


