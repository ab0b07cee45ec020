"""Carrying out the plan: what each pass of a differentiated call runs,
emitted by binding (:class:`Bind`) or as equations (:class:`Eqn`, for
the rules that return equations)."""

from __future__ import annotations

import dataclasses

import jax
from jax import tree_util

from smartvjp import _check
from smartvjp import _facade as jx
from smartvjp import _jax_api
from smartvjp import _plan
from smartvjp import _policy
from smartvjp._checks import bwd_checks_disabled, flatten_cotangents
from smartvjp._primitive import call_p, lin_p, rule_p


# -- the emitter of what runs now ----------------------------------------------

class Bind:
  """Binds each equation now (``_remat.Eqn`` instead emits one in place of
  another)."""

  def __call__(self, prim, ins, params, first=None):
    del first
    return list(prim.bind(*ins, **params))


# -- what the forward pass runs ---------------------------------------------------

def fwd_params(call, fwd, offload=None) -> dict:
  """``part``: the side of a policy's split this ``fwd`` is (``"saved"``,
  ``"rest"``), else ``None``; a param so that readers of the program
  (``print_schedule``) need not look inside ``fwd``."""
  return dict(call=call, which="fwd", fwd=fwd, offload=offload,
              part=None if fwd is None else fwd.split_part)


def primal(emit, call, fwd, f_consts, fwd_consts, primals, by, first=None):
  """``f``'s outputs computed ``by`` ``f`` or the part of ``fwd`` producing
  them; with references, a plain ``smartvjp_call`` (its rules handle them)."""
  if by is _plan.Forward.PART_OF_FWD:
    part = fwd.computing_only([False] * fwd.num_new_res)
    return emit(rule_p, [*fwd_consts, *primals], fwd_params(call, part),
                first)[:call.num_outs]
  if call.references:
    return emit(call_p, [*f_consts, *primals], dict(call=call), first)
  return emit(rule_p, [*f_consts, *fwd_consts, *primals],
              dict(call=call, which="f", fwd=fwd), first)


def forward(emit, call, fwd, plan, f_consts, fwd_consts, primals,
            first=None) -> tuple[list, list]:
  """``(primal_outs, kept)``: ``kept`` is what the backward side reads."""
  n = call.num_outs
  if plan.kind is _plan.Kind.SPLIT:
    outs = emit(rule_p, [*fwd_consts, *primals],
                fwd_params(call, plan.split.known), first)
    return outs[:n], outs[n:]
  if plan.schedule.forward is not _plan.Forward.FWD:
    kept = (passed_inputs(fwd, [*fwd_consts, *primals])
            if plan.kind is _plan.Kind.FWD else [])
    return primal(emit, call, fwd, f_consts, fwd_consts, primals,
                  plan.schedule.forward, first), kept
  offload = plan.spaces if plan.offloads else None
  outs = emit(rule_p, [*fwd_consts, *primals], fwd_params(call, fwd, offload),
              first)
  return outs[:n], outs[n:]


def passed_inputs(fwd, fwd_inputs) -> list:
  """What a ``fwd`` computing nothing but its inputs (``Facts.inputs_only``)
  returns as computed residuals: those inputs."""
  return [fwd_inputs[i] for i in _policy.passed_through(fwd)]


def fwd_side(call, fwd, schedule, f_consts, fwd_consts, primals):
  """``fwd``, or ``f`` where the schedule runs ``bwd`` alone."""
  fwd_inputs = [*fwd_consts, *primals]
  if (schedule.forward is _plan.Forward.F
      and schedule.backward is _plan.Backward.BWD):
    outs = primal(Bind(), call, fwd, f_consts, fwd_consts, primals,
                  _plan.Forward.F)
    return outs, fwd.assemble_residuals(fwd_inputs,
                                        passed_inputs(fwd, fwd_inputs))
  return run_fwd(call, fwd, fwd_inputs)


def run_fwd(call, fwd, fwd_inputs):
  """``fwd`` bound on ``[*fwd_consts, *primals]``: ``(outputs, residuals)``."""
  outs = rule_p.bind(*fwd_inputs, **fwd_params(call, fwd))
  n = call.num_outs
  return outs[:n], fwd.assemble_residuals(fwd_inputs, outs[n:])


# -- the linear map ------------------------------------------------------------------

def lin_params(call, fwd, in_nz, reload=None) -> dict:
  return dict(call=call, fwd=fwd, in_nz=tuple(in_nz), reload=reload)


def linear(call, fwd, plan, in_nz, fwd_inputs, primals, kept):
  if plan.schedule.runs_fwd_bwd:
    return list(primals), lin_params(call, None, in_nz)
  reload = None
  if plan.offloads:
    reload = tuple(fwd.assemble_residuals([False] * len(fwd_inputs),
                                          [s is not None for s in plan.spaces]))
  return (fwd.assemble_residuals(fwd_inputs, kept),
          lin_params(call, fwd, in_nz, reload))


def backward_region(call, fwd, schedule, in_nz, f_consts, fwd_consts,
                    primals):
  """``(primal_outs, linear inputs, linear params)``."""
  if schedule.runs_fwd_bwd:
    outs = primal(Bind(), call, fwd, f_consts, fwd_consts, primals,
                  schedule.primal_by)
    return outs, list(primals), lin_params(call, None, in_nz)
  outs, residuals = fwd_side(call, fwd, schedule, f_consts, fwd_consts,
                             primals)
  if schedule.recomputes and fwd.num_new_res and _check.option.value:
    # f ran forward, fwd here: check_primals compares them where it is set
    _check.maybe_check(
        call, lambda: call_p.bind(*f_consts, *primals, call=call), outs)
  return outs, residuals, lin_params(call, fwd, in_nz)


# -- the backward rules ---------------------------------------------------------------

def _prepare_cts(call, cts_out):
  if call.rules.symbolic_zeros:
    return [jx.ad_util.SymbolicZero(ct.aval) if type(ct) is jx.ad_util.Zero else ct
            for ct in cts_out]
  return [jx.ad.instantiate_zeros(ct) for ct in cts_out]


def _bwd_user(call, fwd):
  def user(res, cts):
    py_ct = tree_util.tree_unflatten(call.out_tree, list(cts))
    out = call.rules.bwd(*call.nondiff, fwd.residual_tree(res), py_ct)
    return flatten_cotangents(call, out, "bwd")
  return user


def _fwd_bwd_user(call, in_nz):
  def user(primals, cts):
    args = call.full_args(call.fwd_inputs(primals, in_nz))
    py_ct = tree_util.tree_unflatten(call.out_tree, list(cts))
    out = call.rules.fwd_bwd(*args, py_ct)
    return flatten_cotangents(call, out, "fwd_bwd")
  return user


def run_bwd(call, fwd, residuals, cts_out) -> list:
  return _bind_rule(call, "bwd", fwd, _bwd_user(call, fwd), list(residuals),
                    _prepare_cts(call, cts_out))


def run_fwd_bwd(call, primals, in_nz, cts_out) -> list:
  return _bind_rule(call, "fwd_bwd", tuple(in_nz), _fwd_bwd_user(call, in_nz),
                    list(primals), _prepare_cts(call, cts_out))


def checked_fwd_bwd(call, primals, in_nz, cts_out) -> list:
  """``fwd_bwd``'s cotangents; where ``check_primals`` is set and ``fwd``
  and ``bwd`` are given too, compared with ``bwd(fwd(*args)[1], g)`` (what
  runs without remat), which then also runs."""
  cts_in = run_fwd_bwd(call, primals, in_nz, cts_out)
  if not (_check.option.value and call.rules.fwd is not None
          and call.rules.bwd is not None):
    return cts_in
  fwd, fwd_consts = call.fwd_for(in_nz)
  _, residuals = run_fwd(call, fwd, [*fwd_consts, *primals])
  unfused = run_bwd(call, fwd, residuals, cts_out)
  _check.maybe_check_fused(call, cts_in, unfused)
  return cts_in


def traced_backward_rules(call, fwd, in_nz):
  """``(bwd's jaxpr, fwd_bwd's jaxpr)`` as the backward pass will bind them
  (nonzero cotangents), traced once and kept with them."""
  ct_avals = [a.to_tangent_aval() for a in call.out_avals]
  zero_in = (False,) * len(ct_avals)
  bwd = _traced_rule(call, "bwd", fwd, _bwd_user(call, fwd),
                     len(fwd.res_avals), (*fwd.res_avals, *ct_avals), zero_in)
  fused = _traced_rule(call, "fwd_bwd", tuple(in_nz),
                       _fwd_bwd_user(call, in_nz), call.num_primals,
                       (*call.in_avals, *ct_avals), zero_in)
  return bwd[0], fused[0]


def _stages_nothing() -> bool:
  """True where every trace from the current one down to plain evaluation
  is ``vmap``, ``jvp`` or a linearization's primal side: values are
  computed now, nothing is staged into a jaxpr."""
  t = jx.core.trace_ctx.trace
  while isinstance(t, (jx.batching.BatchTrace, jx.ad.JVPTrace,
                       jx.ad.LinearizeTrace)):
    t = getattr(t, "parent_trace", None)
  return isinstance(t, jx.core.EvalTrace)


def _bind_rule(call, which, key, user, inputs, cts):
  """Traced once per signature and bound as ``smartvjp_rule``;
  ``SymbolicZero`` cotangents are part of the signature, not inputs."""
  zero_in = tuple(type(c) is jx.ad_util.SymbolicZero for c in cts)
  args = [*inputs, *(c for c, z in zip(cts, zero_in) if not z)]
  if _stages_nothing():
    # eager (perhaps under vmap or jvp, as in an eager vmap(grad(F))): the
    # rule runs on the values themselves, as jax.custom_vjp runs bwd, so an
    # unbatched residual reaches it as a concrete array
    return user(inputs, cts)
  avals = tuple(jx.core.typeof(a) for a in args)
  jaxpr, consts, zero_out, logs_tree = _traced_rule(
      call, which, key, user, len(inputs), avals, zero_in,
      [c if z else None for c, z in zip(cts, zero_in)])
  outs = rule_p.bind(*consts, *args, call=call, which=which, jaxpr=jaxpr)
  n_logs = logs_tree.num_leaves
  if n_logs:   # the logs bwd returned, as outputs of the equation
    outs, log_leaves = outs[:-n_logs], outs[-n_logs:]
    _jax_api.deposit_logs(tree_util.tree_unflatten(logs_tree, log_leaves))
  outs = iter(outs)
  return [jx.ad_util.Zero(a.to_ct_aval()) if z else next(outs)
          for a, z in zip(call.in_avals, zero_out)]


def _traced_rule(call, which, key, user, num_inputs, avals, zero_in,
                 zero_cts=None):
  """``user`` traced on ``avals`` (inputs, then the nonzero cotangents;
  ``zero_cts``: the ``SymbolicZero`` in each zero place), once per signature:
  ``(jaxpr, consts, zero_out, logs_tree)``."""
  zero_cts = zero_cts or [None] * len(zero_in)
  cache_key = (which, key, tuple(avals), zero_in, jx.config.trace_context(),
               bwd_checks_disabled())
  hit = call.rule_cache.get(cache_key)
  if hit is None:
    store = {}

    def flat(*args):
      ins, nz_cts = args[:num_inputs], iter(args[num_inputs:])
      full = [c if z else next(nz_cts) for c, z in zip(zero_cts, zero_in)]
      with _jax_api.collecting_logs() as sink:
        outs = user(ins, full)
      log_leaves, store["logs"] = tree_util.tree_flatten(
          _jax_api.merged_logs(sink))
      store["zero_out"] = tuple(type(o) is jx.ad_util.Zero for o in outs)
      return [o for o in outs if type(o) is not jx.ad_util.Zero] + log_leaves

    jaxpr, consts = jx.trace_to_closed_jaxpr(
        flat, tuple(avals), f"smart_custom_vjp {which}",
        getattr(call.rules, which), tuple(avals))
    hit = (jaxpr, consts, store["zero_out"], store["logs"])
    call.rule_cache.put(cache_key, hit, consts)
  return hit


def with_offload_reloaded(res, reload):
  if reload is None:
    return list(res)
  return [jax.device_put(r, jx.core.mem_kind_to_space("device")) if back else r
          for r, back in zip(res, reload)]


def passthrough(call, fwd, out_avals):
  """remat3's rem side ``fwd`` when everything is kept: the saved primal
  outputs and residuals, returned as they are."""
  avals = [*out_avals, *fwd.jaxpr.out_avals[call.num_outs:]]
  num_saved = len(avals)

  def same(*args):
    return list(args[:num_saved])
  closed, _ = jx.trace_to_closed_jaxpr(   # closes over nothing: no consts
      same, [*avals, *fwd.jaxpr.in_avals], "smartvjp remat3 saved", same,
      [jax.ShapeDtypeStruct(a.shape, a.dtype)
       for a in [*avals, *fwd.jaxpr.in_avals]])
  spec = fwd.reading_saved(closed, num_saved)
  return dataclasses.replace(spec, new_res_names=(None,) * fwd.num_new_res,
                             new_res_eqns=(), out_avals=tuple(out_avals))
