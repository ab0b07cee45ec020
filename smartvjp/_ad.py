"""Differentiation rules: JVP, linearization, transposition, forward mode.

* ``smartvjp_call``'s linearization (``jax.grad``/``jax.vjp``, also in
  ``jit``/``scan``/``cond`` bodies): the plan without a policy, carried
  out: ``fwd`` now and ``smartvjp_lin`` staged (its transpose runs
  ``bwd``); with ``fwd_bwd`` alone, ``f`` now and ``fwd_bwd`` in the
  transpose.
* ``smartvjp_call``'s JVP (``jax.checkpoint``'s ``remat_jvp``,
  ``jax.jvp``): ``smartvjp_jvp``, which partial evaluation places
  (``_pe.py``); ``smartvjp_rem``'s JVP: the same with the rem side's
  ``fwd`` and schedule.
* ``smartvjp_lin``'s transpose: ``bwd`` on the residuals, or ``fwd_bwd``
  on the primal inputs; ``smartvjp_rule``'s (a ``bwd`` that forward mode
  transposes): the transpose of its code; ``smartvjp_call``'s (a call JAX
  found linear): the transpose of ``f``'s code.
* Forward mode, beyond ``jax.custom_vjp`` (evaluating ``smartvjp_jvp`` and
  ``smartvjp_lin``): the forward rule where the call has one
  (``defvjp(..., jvp=...)``), else the transpose of ``g -> bwd(res, g)``
  (or ``fwd_bwd``'s), so ``bwd`` must then be JAX code linear in ``g``.

Values ``f`` closes over are its leading inputs. Differentiated with respect
to those alone (an outer differentiation), the call differentiates ``f``
itself; with respect to both them and the arguments, it is refused, as with
``jax.custom_vjp``.
"""

from __future__ import annotations

import functools

import jax
from jax.errors import UnexpectedTracerError

from smartvjp import _execute as ex
from smartvjp import _facade as jx
from smartvjp import _jax_api
from smartvjp import _plan
from smartvjp import _policy
from smartvjp import _versions
from smartvjp._checks import (
    blame_fwd, check_aliased_refs, check_f_output_invariance,
    check_fwd_output_invariance, check_fwd_output_types)
from smartvjp._cache import made_where_differentiated
from smartvjp._forward import tangents_only
from smartvjp._primitive import (
    call_p, define_evaluation, forward_role, jvp_p, lin_out_avals, lin_p,
    register, register_with_logs, rem_p, rule_jvp, rule_p,
    tangent_avals)
from smartvjp._spec import eager_f, eager_fwd, select_outputs


def closure_error(call, where: str = "", where_made: bool = False):
  """What ``jax.custom_vjp`` raises where a value the function closes over
  is differentiated with its arguments (or, ``where`` says, in a context
  smartvjp does not differentiate ``f`` itself in): its type, our words.
  JAX's type depends on the path: differentiating the call where it is made
  (``jax.grad``, ``jax.jvp``, through ``vmap``s too), ``fwd`` runs on the
  closed-over tracer, which leaks (``UnexpectedTracerError``);
  differentiating a staged call (``jit``, remat), JAX detects it
  (``CustomVJPException``)."""
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


def _classify(call, nonzeros) -> str:
  """``"args"``, ``"closure"`` (only closed-over values move) or ``"none"``;
  raises when both move."""
  const_nz = any(nonzeros[:call.num_consts])
  arg_nz = any(nz and possible for nz, possible in
               zip(nonzeros[call.num_consts:], call.in_nz_possible))
  if const_nz and arg_nz:
    raise closure_error(call,
                        where_made=made_where_differentiated.get() is call)
  return "closure" if const_nz else ("args" if arg_nz else "none")


def _in_nz(call, nonzeros) -> tuple:
  return tuple(nz and possible for nz, possible in
               zip(nonzeros[call.num_consts:], call.in_nz_possible))


# -- smartvjp_call: JVP (jax.checkpoint, jax.jvp) ------------------------------------

def _call_jvp(primals, tangents, *, call):
  if call.full is not None:   # pruned by DCE: the whole call's rule, selected
    outs, out_tangents = _call_jvp(primals, tangents, call=call.full)
    return select_outputs(call, outs), select_outputs(call, out_tangents)
  nonzeros = [type(t) is not jx.ad_util.Zero for t in tangents]
  if _classify(call, nonzeros) == "closure":   # f itself differentiated
    return rule_jvp(call_p.impl, "fun", primals, tangents, call=call,
                    what="differentiation with respect to values it closes "
                    "over")
  in_nz = _in_nz(call, nonzeros)
  f_consts, primals = primals[:call.num_consts], primals[call.num_consts:]
  if not any(in_nz):
    return call_p.bind(*f_consts, *primals, call=call), call.expand_tangents([])
  check_aliased_refs(call, primals)
  fwd, fwd_consts = call.fwd_for(in_nz)
  check_fwd_output_types(call, fwd)   # f and fwd may both run (remat)
  nz_tangents = [t for t, nz in zip(tangents[call.num_consts:], in_nz) if nz]
  outs = jvp_p.bind(*f_consts, *fwd_consts, *primals, *nz_tangents,
                    call=call, fwd=fwd, in_nz=in_nz,
                    schedule=_policy.schedule_without_policy(call, fwd))
  return outs[:call.num_outs], call.expand_tangents(outs[call.num_outs:])


register(call_p, "jvp", _call_jvp)


# -- smartvjp_call: linearization (jax.grad, jax.vjp) --------------------------------

def _linearized(call, in_nz, primal_outs, residuals, params):
  """The four values of a linearization rule whose tangent map binds
  ``smartvjp_lin`` with ``params`` on the residuals."""
  def linearized(residuals, *tangents):
    nz_t = [t for t, nz in zip(tangents[call.num_consts:], in_nz) if nz]
    return call.expand_tangents(lin_p.bind(*residuals, *nz_t, **params))
  return list(primal_outs), list(call.out_nz), list(residuals), linearized


def _call_linearization(is_vjp, nonzeros, *primals_in, call):
  if call.full is not None:   # pruned by DCE: the whole call's rule, selected
    outs, nzs, res, linearized = _call_linearization(
        is_vjp, nonzeros, *primals_in, call=call.full)
    return (select_outputs(call, outs), select_outputs(call, nzs), res,
            lambda res, *t: select_outputs(call, linearized(res, *t)))
  if call.eager is not None:   # fwd (or f) already ran on concrete values
    in_nz, primal_outs, residuals, fwd = call.eager
    return _linearized(call, in_nz, primal_outs, residuals,
                       ex.lin_params(call, fwd, in_nz))
  if call.fwd_only is None and _classify(call, nonzeros) == "closure":
    return jx.fallback_linearize(call_p, is_vjp, nonzeros, *primals_in,
                                 call=call)
  f_consts, primals = primals_in[:call.num_consts], primals_in[call.num_consts:]
  in_nz = _in_nz(call, nonzeros)
  if not any(in_nz):
    outs = call_p.bind(*f_consts, *primals, call=call)
    return (outs, [False] * call.num_outs, [],
            lambda _res, *_t: call.expand_tangents([]))
  check_aliased_refs(call, primals)
  eager = isinstance(jx.core.trace_ctx.trace, jx.core.EvalTrace) and not any(
      isinstance(p, jx.core.Tracer) for p in primals_in)
  plan = _plan.plan(_policy.facts_of(call, None), None)
  if plan.schedule.runs_fwd_bwd:   # fwd_bwd alone: f now
    outs = (eager_f(call, primals) if eager else
            ex.primal(ex.Bind(), call, None, f_consts, [], primals,
                      plan.schedule.primal_by))
    return _linearized(call, in_nz, outs, primals,
                       ex.lin_params(call, None, in_nz))
  if call.fwd_only is not None:   # fwd traced where the call was made
    fwd, fwd_consts = call.fwd_only, f_consts
  elif eager:   # concrete values: fwd itself runs, as with jax.custom_vjp
    outs, residuals, fwd = eager_fwd(call, in_nz, primals)
    return _linearized(call, in_nz, outs, residuals,
                       ex.lin_params(call, fwd, in_nz))
  else:
    fwd, fwd_consts = call.fwd_for(in_nz)
  fwd_inputs = [*fwd_consts, *primals]
  outs = rule_p.bind(*fwd_inputs, **ex.fwd_params(call, fwd))
  residuals = fwd.assemble_residuals(fwd_inputs, outs[call.num_outs:])
  return _linearized(call, in_nz, outs[:call.num_outs], residuals,
                     ex.lin_params(call, fwd, in_nz))


register(call_p, "linearization", _call_linearization)


# -- transposes ----------------------------------------------------------------------

def _transposed(impl, args, params):
  """``impl`` (a rule's code) as a linear function of the inputs JAX found
  linear (undefined), the others held fixed, transposed (JAX checks the
  linearity when the transpose runs); with which inputs those are."""
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
  """A call JAX found linear in some of its inputs (a ``bwd`` calling
  another smart function on its cotangent, transposed by forward mode): the
  transpose of ``f``'s own code."""
  if call.full is not None:   # pruned by DCE: zero cotangents for the rest
    full_cts = [jx.ad_util.Zero(a.to_tangent_aval()) for a in call.full.out_avals]
    for i, ct in zip(call.kept, cts):
      full_cts[i] = ct
    return _call_transpose(full_cts, *args, call=call.full)
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
  """``bwd``/``fwd_bwd`` are linear in the cotangent; forward mode
  transposes them (which fails, and forward mode says so, when they are
  opaque)."""
  return _apply_transposed(*_transposed(rule_p.impl, args, params), cts)


register(rule_p, "transpose", _rule_transpose)


def _nz_inputs(cts_in, in_nz):
  return [ct for ct, nz in zip(cts_in, in_nz) if nz]


def _lin_transpose(cts, *args, call, fwd, in_nz, reload):
  """``bwd`` on the residuals (or ``fwd_bwd`` on the primal inputs). ``bwd``
  runs even when every output cotangent is zero, as with ``jax.custom_vjp``:
  its result need not depend on them (flax's fp8 scales)."""
  n = ex.num_nonlinear(call, fwd)
  cts_out = call.expand_tangents(cts)
  if fwd is None:
    if any(type(ct) is not jx.ad_util.Zero for ct in cts):
      check_f_output_invariance(call)   # the cotangent has f's type here
    cts_in = ex.run_fwd_bwd(call, args[:n], in_nz, cts_out)
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
    return [jx.ad.instantiate_zeros(c) for c in _nz_inputs(cts, in_nz)]

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
        f"(JAX said: {type(e).__name__}: {str(e).rstrip('. ')}). For an "
        f"opaque {which} (a kernel, a callback), give a forward rule "
        f"instead: {call.name}.defvjp(..., jvp=rule), with rule(primals, "
        f"tangents) -> (primal_out, tangent_out) as for jax.custom_jvp; "
        f"forward mode then runs it and never transposes {which}.") from e


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
  n = ex.num_nonlinear(call, fwd)
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
  """When only the tangent inputs move, the JVP of a linear map is itself;
  otherwise (higher order) the rule's code is differentiated."""
  n = ex.num_nonlinear(params["call"], params["fwd"])
  if all(type(t) is jx.ad_util.Zero for t in tangents[:n]):
    lin_tangents = [jx.ad.instantiate_zeros(t) for t in tangents[n:]]
    return (lin_p.bind(*primals, **params),
            lin_p.bind(*primals[:n], *lin_tangents, **params))
  return rule_jvp(lin_forward, forward_role(params), primals, tangents,
                  **params)


define_evaluation(lin_p, lin_forward, forward_role, jvp=_lin_jvp)


def jvp_forward(*args, call, fwd, in_nz, schedule):
  """Forward mode: the forward rule where there is one; else ``fwd`` (or
  ``f``, with ``fwd_bwd`` alone) for the primal outputs, then the linear
  map's forward mode. The schedule is not read: it says where the reverse
  passes run each rule, and forward mode has no reverse pass; it runs the
  equation whole, ``fwd``'s residuals feeding the tangents."""
  del schedule
  f_consts, fwd_consts, primals, nz_t = call.split_jvp_args(args, fwd)
  if call.rules.jvp is not None:   # the forward rule, instead of f and fwd
    outs, nz_touts = call.rules.jvp.run(call, primals, in_nz, nz_t)
    return [*outs, *nz_touts]
  if fwd is None:
    outs = call_p.impl(*f_consts, *primals, call=call)
    return [*outs, *lin_forward(*primals, *nz_t,
                                **ex.lin_params(call, None, in_nz))]
  fwd_inputs = [*fwd_consts, *primals]
  outs = rule_p.impl(*fwd_inputs, **ex.fwd_params(call, fwd))
  res = fwd.assemble_residuals(fwd_inputs, outs[call.num_outs:])
  return [*outs[:call.num_outs],
          *lin_forward(*res, *nz_t, **ex.lin_params(call, fwd, in_nz))]


define_evaluation(jvp_p, jvp_forward, forward_role)


# -- smartvjp_rem: JVP (remat3's rem side, differentiated) ----------------------------

def _rem_jvp(primals, tangents, *, call, fwd, schedule):
  """``smartvjp_jvp`` with the rem side's ``fwd`` and schedule. A tangent of
  what ``f`` closes over is refused, with the error ``jax.custom_vjp``
  raises under remat3, except where remat3 perturbs every input of the
  checkpoint, closed-over values included (``_versions``): there such a
  tangent says nothing and is ignored."""
  n1, n2 = call.num_consts, call.num_consts + fwd.num_consts
  f_consts, fwd_consts, args = primals[:n1], primals[n1:n2], primals[n2:]
  in_nz = tuple(type(t) is not jx.ad_util.Zero and possible
                for t, possible in zip(tangents[n2:], call.in_nz_possible))
  if (any(type(t) is not jx.ad_util.Zero for t in tangents[:n1])
      and not _versions.REMAT3_PERTURBS_EVERY_INPUT):
    raise closure_error(call, "inside jax.checkpoint under JAX's jax_remat3 "
                        "flag")
  if not any(in_nz):
    return (rem_p.bind(*primals, call=call, fwd=fwd, schedule=schedule),
            call.expand_tangents([]))
  nz_t = [t for t, nz in zip(tangents[n2:], in_nz) if nz]
  outs = jvp_p.bind(*f_consts, *fwd_consts, *args, *nz_t, call=call, fwd=fwd,
                    in_nz=in_nz, schedule=schedule)
  return outs[:call.num_outs], call.expand_tangents(outs[call.num_outs:])


register(rem_p, "jvp", _rem_jvp)
