"""Differentiation rules: JVP, linearization, transposition, forward mode
(the forward rule ``defvjp(..., jvp=...)`` where given, else the transpose
of ``g -> bwd(res, g)``)."""

from __future__ import annotations

import jax
from jax.errors import UnexpectedTracerError

from smartvjp import _execute as ex
from smartvjp import _facade as jx
from smartvjp import _jax_api
from smartvjp import _jaxprs
from smartvjp import _policy
from smartvjp import _versions
from smartvjp._checks import (
    blame_fwd, check_aliased_refs, check_fwd_output_types, leaf_paths,
    rule_error)
from smartvjp._cache import made_where_differentiated
from smartvjp._forward import (
    forward_mode_error_type, raised_by_smartvjp, tangents_only,
    forward_mode_refusal)
from smartvjp._primitive import (
    call_p, define_evaluation, forward_role, jvp_p, lin_out_avals, lin_p,
    register, register_with_logs, rem_p, rule_jvp, rule_p,
    tangent_avals)
from smartvjp._spec import eager_f, eager_fwd


def closure_error(call, where: str = "", where_made: bool = False):
  """``jax.custom_vjp``'s exception type for a differentiated closure:
  ``UnexpectedTracerError`` where differentiated where made (``fwd``'s
  tracer leaks), ``CustomVJPException`` for a staged call."""
  what = (f" {where}" if where else
          " and, by the same transformation, with respect to its arguments")
  message = (
      f"smart_custom_vjp function {call.name} is being differentiated with "
      f"respect to a value it closes over{what}. That isn't supported (as "
      "with jax.custom_vjp) because the custom rules only say how to "
      "differentiate with respect to explicit arguments. Pass the value as "
      "an argument instead, or use jax.closure_convert.")
  if where_made:
    return UnexpectedTracerError(message)
  # JAX's CustomVJPException, whose constructor takes no message
  error = jx.ad.CustomVJPException.__new__(jx.ad.CustomVJPException)
  Exception.__init__(error, message)
  return error


def _classify(call, const_nz, in_nz) -> str:
  """``"args"``, ``"closure"`` (only closed-over values move: ``const_nz``)
  or ``"none"``; raises when both move."""
  const_nz = any(const_nz)
  if const_nz and any(in_nz):
    raise closure_error(call,
                        where_made=made_where_differentiated.get() is call)
  return "closure" if const_nz else ("args" if any(in_nz) else "none")


# -- smartvjp_call: JVP (jax.checkpoint, jax.jvp) ------------------------------------

def _call_jvp(primals_in, tangents, *, call):
  nonzeros = [type(t) is not jx.ad_util.Zero for t in tangents]
  const_nz, arg_nz = call.split_call_args(nonzeros)
  f_consts, primals = call.split_call_args(primals_in)
  arg_tangents = call.split_call_args(tangents)[1]
  in_nz = call.perturbed(arg_nz)
  if _classify(call, const_nz, in_nz) == "closure":   # f differentiated
    return rule_jvp(call_p.impl, "fun", primals_in, tangents, call=call,
                    what="differentiation with respect to values it closes "
                    "over")
  if not any(in_nz):
    return call_p.bind(*f_consts, *primals, call=call), call.expand_tangents([])
  check_aliased_refs(call, primals)
  try:
    fwd, fwd_consts = call.fwd_for(in_nz)
  except Exception as e:  # noqa: BLE001 - forward mode's refusal, or as is
    # on values, where jax.custom_vjp would not trace fwd (under jit it does)
    refusal = forward_mode_refusal(e, call.rules, "fwd", not any(
        isinstance(p, jx.core.Tracer) for p in primals))
    if refusal is None:
      raise
    raise refusal from e
  check_fwd_output_types(call, fwd)   # f and fwd may both run (remat)
  nz_tangents = [t for t, nz in zip(arg_tangents, in_nz) if nz]
  outs = jvp_p.bind(*f_consts, *fwd_consts, *primals, *nz_tangents,
                    call=call, fwd=fwd, in_nz=in_nz,
                    schedule=_policy.schedule_without_policy(call, fwd))
  return outs[:call.num_outs], call.expand_tangents(outs[call.num_outs:])


register(call_p, "jvp", _call_jvp)


# -- smartvjp_call: linearization (jax.grad, jax.vjp) --------------------------------

def _linearized(call, fwd, in_nz, primal_outs, residuals):
  params = ex.lin_params(call, fwd, in_nz)

  def linearized(residuals, *tangents):
    nz_t = [t for t, nz in zip(call.split_call_args(tangents)[1], in_nz)
            if nz]
    return call.expand_tangents(lin_p.bind(*residuals, *nz_t, **params))
  return list(primal_outs), list(call.out_nz), list(residuals), linearized


def _call_linearization(is_vjp, nonzeros, *primals_in, call):
  if call.eager is not None:   # fwd (or f) already ran on concrete values
    in_nz, primal_outs, residuals, fwd = call.eager
    return _linearized(call, fwd, in_nz, primal_outs, residuals)
  const_nz, arg_nz = call.split_call_args(nonzeros)
  f_consts, primals = call.split_call_args(primals_in)
  in_nz = call.perturbed(arg_nz)
  if (call.fwd_only is None
      and _classify(call, const_nz, in_nz) == "closure"):
    return jx.fallback_linearize(call_p, is_vjp, nonzeros, *primals_in,
                                 call=call)
  if not any(in_nz):
    outs = call_p.bind(*f_consts, *primals, call=call)
    return (outs, [False] * call.num_outs, [],
            lambda _res, *_t: call.expand_tangents([]))
  check_aliased_refs(call, primals)
  eager = isinstance(jx.core.trace_ctx.trace, jx.core.EvalTrace) and not any(
      isinstance(p, jx.core.Tracer) for p in primals_in)
  schedule = _policy.schedule_without_policy(call, None)
  if schedule.runs_fwd_bwd:   # fwd_bwd alone: f now
    outs = (eager_f(call, primals) if eager else
            ex.primal(ex.Bind(), call, None, f_consts, [], primals,
                      schedule.primal_by))
    return _linearized(call, None, in_nz, outs, primals)
  if call.fwd_only is not None:   # fwd traced where the call was made
    fwd, fwd_consts = call.fwd_only, f_consts
  elif eager:   # concrete values: fwd itself runs, as with jax.custom_vjp
    outs, residuals, fwd = eager_fwd(call, in_nz, primals)
    return _linearized(call, fwd, in_nz, outs, residuals)
  else:
    fwd, fwd_consts = call.fwd_for(in_nz)
  fwd_inputs = [*fwd_consts, *primals]
  outs = rule_p.bind(*fwd_inputs, **ex.fwd_params(call, fwd))
  residuals = fwd.assemble_residuals(fwd_inputs, outs[call.num_outs:])
  return _linearized(call, fwd, in_nz, outs[:call.num_outs], residuals)


register(call_p, "linearization", _call_linearization)


# -- transposes ----------------------------------------------------------------------

def _transposed(impl, args, params):
  """``impl`` as a linear function of the inputs JAX found linear, the
  others held fixed, transposed; with which inputs those are."""
  undefined = [jx.ad.is_undefined_primal(a) for a in args]
  lin_avals = [a.aval for a, u in zip(args, undefined) if u]  # full types

  def linear_part(*lin):
    it = iter(lin)
    return impl(*[next(it) if u else a for a, u in zip(args, undefined)],
                **params)
  return jax.linear_transpose(linear_part, *lin_avals), undefined


def _apply_transposed(transposed, undefined, cts):
  it = iter(transposed([jx.ad.instantiate_zeros(c) for c in cts]))
  return [next(it) if u else None for u in undefined]


def _call_transpose(cts, *args, call):
  """A call JAX found linear (a ``bwd`` calling another smart function on
  its cotangent, transposed by forward mode): ``f``'s code transposed."""
  try:
    transposed, undefined = _transposed(call_p.impl, args, dict(call=call))
  except Exception as e:  # noqa: BLE001 - re-raised naming f
    raise NotImplementedError(
        f"Transpose rule for smart_custom_vjp function {call.name} used in a "
        f"linear position: its f is not linear JAX code in the inputs being "
        f"transposed ({type(e).__name__}: {e})") from e
  return _apply_transposed(transposed, undefined, cts)


register(call_p, "transpose", _call_transpose)


def _rule_transpose(cts, *args, **params):
  return _apply_transposed(*_transposed(rule_p.impl, args, params), cts)


register(rule_p, "transpose", _rule_transpose)


def _nz_inputs(cts_in, in_nz):
  return [ct for ct, nz in zip(cts_in, in_nz) if nz]


def _lin_transpose(cts, *args, call, fwd, in_nz, reload):
  """``bwd`` runs even when every cotangent is zero, as with
  ``jax.custom_vjp`` (flax's fp8 scales)."""
  n = call.num_nonlinear(fwd)
  cts_out = call.expand_tangents(cts)
  if fwd is None:
    if any(type(ct) is not jx.ad_util.Zero for ct in cts):
      check_f_output_invariance(call)   # the cotangent has f's type here
    cts_in = ex.checked_fwd_bwd(call, args[:n], in_nz, cts_out)
  else:
    try:
      cts_in = ex.run_bwd(call, fwd,
                          ex.with_offload_reloaded(args[:n], reload), cts_out)
    except Exception as e:  # noqa: BLE001 - re-raised unless fwd is at fault
      blame_fwd(call, e)
      raise
  return [None] * n + _nz_inputs(cts_in, in_nz)


register(lin_p, "transpose", _lin_transpose)
register_with_logs(lin_p, _lin_transpose, _jax_api.collecting_logs,
                   _jax_api.merged_logs)


# -- forward mode: smartvjp_lin and smartvjp_jvp evaluated ---------------------------

def _transpose_cotangent_map(call, which, cotangent_map, in_nz, nz_tangents,
                             out_avals):
  """The transpose of ``g -> cotangent_map(g)`` at the tangents, cotangents
  fully typed (one typed by shape only is made varying inside ``shard_map``,
  which transposes into a ``psum``)."""
  ct_avals = tangent_avals(out_avals, call.out_nz)
  rule_failed = []

  def nz_map(*nz_cts):
    try:
      cts = cotangent_map(call.expand_tangents(nz_cts))
    except Exception as e:  # noqa: BLE001 - our check of its result, as is
      if raised_by_smartvjp(e):
        rule_failed.append(e)
      raise
    return [jx.ad.instantiate_zeros(c) for c in _nz_inputs(cts, in_nz)]

  try:
    transposed = jax.linear_transpose(nz_map, *ct_avals)
    return list(transposed(list(nz_tangents)))
  except Exception as e:  # noqa: BLE001 - re-raised with context below
    if rule_failed and e is rule_failed[0]:
      raise   # the rule returned bad cotangents: our error naming it
    # else JAX could not transpose it, or the rule could not be traced for
    # it (NumPy on the cotangent): the transposition was our choice
    raise forward_mode_error_type(type(e))(
        f"forward-mode differentiation (jax.jvp, jax.jacfwd, jax.linearize) "
        f"of smart_custom_vjp function {call.name} needs a {which} rule "
        f"({call.rules.rule_name(which)}) that JAX can transpose in its "
        f"cotangent argument (JAX code, linear in g); transposing it failed "
        f"(JAX said: {type(e).__name__}: {str(e).rstrip('. ')}). For an "
        f"opaque {which} (a kernel, a callback), give a forward rule "
        f"instead: {call.name}.defvjp(..., jvp=rule), with rule(primals, "
        f"tangents) -> (primal_out, tangent_out) as for jax.custom_jvp; "
        f"forward mode then runs it and never transposes {which}.") from e


def lin_forward(*args, call, fwd, in_nz, reload):
  n = call.num_nonlinear(fwd)
  nonlinear, nz_t = args[:n], args[n:]
  if call.rules.jvp is not None:
    primals = nonlinear[n - call.num_primals:]
    return tangents_only(call, primals, in_nz, nz_t)
  if fwd is None:
    check_f_output_invariance(call)   # the tangent follows f's output type
    return _transpose_cotangent_map(
        call, "fwd_bwd",
        lambda cts: ex.run_fwd_bwd(call, nonlinear, in_nz, cts), in_nz, nz_t,
        call.out_avals)
  check_fwd_output_invariance(call, fwd)   # the tangent follows fwd's types
  res = ex.with_offload_reloaded(nonlinear, reload)
  return _transpose_cotangent_map(
      call, "bwd", lambda cts: ex.run_bwd(call, fwd, res, cts), in_nz, nz_t,
      lin_out_avals(call, fwd))


def _lin_jvp(primals, tangents, **params):
  """Itself where only the tangents move; else (higher order) its code's."""
  n = params["call"].num_nonlinear(params["fwd"])
  if all(type(t) is jx.ad_util.Zero for t in tangents[:n]):
    lin_tangents = [jx.ad.instantiate_zeros(t) for t in tangents[n:]]
    return (lin_p.bind(*primals, **params),
            lin_p.bind(*primals[:n], *lin_tangents, **params))
  return rule_jvp(lin_forward, forward_role(params), primals, tangents,
                  **params)


define_evaluation(lin_p, lin_forward, forward_role, jvp=_lin_jvp)


def jvp_forward(*args, call, fwd, in_nz, schedule):
  """Forward mode runs the equation whole (the schedule is for the reverse
  passes): the forward rule, or ``fwd`` then the linear map's forward mode."""
  del schedule
  f_consts, fwd_consts, primals, nz_t = call.split_jvp_args(args, fwd)
  if call.rules.jvp is not None:   # the forward rule, instead of f and fwd
    outs, nz_touts = call.rules.jvp.run(call, primals, in_nz, nz_t)
    return [*outs, *nz_touts]
  if fwd is None:
    outs = call_p.impl(*f_consts, *primals, call=call)
    res = primals
  else:
    fwd_inputs = [*fwd_consts, *primals]
    outs = rule_p.impl(*fwd_inputs, **ex.fwd_params(call, fwd))
    res = fwd.assemble_residuals(fwd_inputs, outs[call.num_outs:])
  return [*outs[:call.num_outs],
          *lin_forward(*res, *nz_t, **ex.lin_params(call, fwd, in_nz))]


define_evaluation(jvp_p, jvp_forward, forward_role)


# -- smartvjp_rem: JVP (remat3's rem side, differentiated) ----------------------------

def _rem_jvp(primals, tangents, *, call, fwd, schedule):
  """A closed-over value's tangent is refused as ``jax.custom_vjp`` refuses
  it under remat3, except where remat3 perturbs every input (``_versions``)."""
  f_consts, fwd_consts, args, _ = call.split_jvp_args(primals, fwd)
  const_t, _, arg_t, _ = call.split_jvp_args(tangents, fwd)
  in_nz = call.perturbed([type(t) is not jx.ad_util.Zero for t in arg_t])
  if (any(type(t) is not jx.ad_util.Zero for t in const_t)
      and not _versions.REMAT3_PERTURBS_EVERY_INPUT):
    raise closure_error(call, "inside jax.checkpoint under JAX's jax_remat3 "
                        "flag")
  if not any(in_nz):
    return (rem_p.bind(*primals, call=call, fwd=fwd, schedule=schedule),
            call.expand_tangents([]))
  nz_t = [t for t, nz in zip(arg_t, in_nz) if nz]
  outs = jvp_p.bind(*f_consts, *fwd_consts, *args, *nz_t, call=call, fwd=fwd,
                    in_nz=in_nz, schedule=schedule)
  return outs[:call.num_outs], call.expand_tangents(outs[call.num_outs:])


register(rem_p, "jvp", _rem_jvp)


# -- the output types forward mode follows (shard_map's manual axes) --------------

def check_fwd_output_invariance(call, fwd) -> None:
  if fwd is not None and fwd.jaxpr is not None:
    _check_invariance(
        call, fwd.jaxpr, "fwd", "a primal output",
        "Forward-mode differentiation follows that type, so the tangent would "
        "be summed over those axes. Make the output varying with "
        "jax.lax.pcast(out, {axes!r}, to='varying').")


def check_f_output_invariance(call) -> None:
  """Only ``fwd_bwd`` given, the cotangent follows ``f``'s output type:
  an unjustified invariant output would have it summed over those axes."""
  while call.origin is not None:
    call = call.origin
  if call.rules.fwd is None and call.jaxpr is not None:
    _check_invariance(
        call, call.jaxpr, "fun", "a value",
        "Only fwd_bwd was given, so the derivative follows f's output type, "
        "and the cotangent of that output would be summed over those axes: "
        "the gradient would be wrong. Make f's output varying with "
        "jax.lax.pcast(out, {axes!r}, to='varying'), or give fwd and bwd.")


def _check_invariance(call, jaxpr, role, what, consequence) -> None:
  outs = jaxpr.jaxpr.outvars[:call.num_outs]
  for path, v, missing in zip(leaf_paths(call.out_tree), outs,
                              _jaxprs.unjustified_invariance(jaxpr)):
    if missing:
      axes = tuple(sorted(missing))
      raise rule_error(
          TypeError, call.rules, role,
          f"returns at output{path} {what} of type {v.aval.str_short()}, "
          f"invariant along the manual mesh axes {axes} of jax.shard_map, "
          "although it is computed from arguments that vary along them and "
          "no collective over those axes produced it (a jax.pure_callback "
          "result inside shard_map(check_vma=True) is typed this way). "
          + consequence.format(axes=axes))
