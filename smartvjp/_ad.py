"""Differentiation rules: JVP, linearize, transpose, forward mode.

Which JAX machinery calls which rule (jax 0.10):

* ``jax.grad``/``jax.vjp`` (and ``jit``/``scan``/``cond`` bodies) use direct
  linearize: :func:`_call_linearize` runs ``fwd`` now and stages
  ``smartvjp_lin`` for the backward pass.
* ``jax.checkpoint`` (and linearize with ``jax_use_direct_linearize=False``)
  uses the JVP rule :func:`_call_jvp`, which binds the combined
  ``smartvjp_jvp``; partial evaluation (``_partial_eval.py``) decides then
  which of ``f``/``fwd``/``bwd``/``fwd_bwd`` run where.
* The transpose of ``smartvjp_lin`` runs ``bwd``; that of
  ``smartvjp_fused_lin`` runs ``fwd_bwd``.
* Forward mode (``jax.jvp``/``jacfwd``/``linearize`` evaluation) evaluates
  ``smartvjp_jvp``/``smartvjp_lin`` directly: the tangent map is the
  transpose of the linear map ``g -> bwd(res, g)`` (an extension over
  ``jax.custom_vjp``, which refuses forward mode).
"""

from __future__ import annotations

from functools import partial

import jax

from smartvjp import _compat
from smartvjp import _jax_api
from smartvjp._bwd import run_bwd, run_fwd_bwd
from smartvjp._errors import expect_used_up
from smartvjp._spec import (blame_eager_fwd, check_aliased_refs,
                            check_f_output_invariance,
                            check_fwd_output_invariance,
                            check_fwd_output_types,
                            eager_f, eager_fwd, select_outputs)
from smartvjp._primitives import (
    bind_primal_and_residuals, call_p, eval_scoped, fused_lin_p, fwd_eval,
    fwd_p, jvp_p, lin_out_avals, lin_p, primal_p, bwd_eval, bwd_p,
    split_jvp_args, split_primal_args, tangent_avals)


def closure_error(call) -> Exception:
  return TypeError(
      f"smart_custom_vjp function {call.name} is being differentiated with "
      "respect to a value it closes over and, by the same transformation, "
      "with respect to its arguments. That isn't supported (as with "
      "jax.custom_vjp) because the custom rules only say how to "
      "differentiate with respect to explicit arguments. Pass the value as "
      "an argument instead, or use jax.closure_convert.")


def _classify(call, nonzeros):
  """``"args"``, ``"closure"`` (only closed-over values move: an outer
  differentiation, handled by differentiating ``f`` itself, as JAX does
  through the rules' operations) or ``"none"``; raises when both move."""
  const_nz = any(nonzeros[:call.num_consts])
  arg_nz = any(nz and possible for nz, possible in
               zip(nonzeros[call.num_consts:], call.in_nz_possible))
  if const_nz and arg_nz:
    raise closure_error(call)
  return "closure" if const_nz else ("args" if arg_nz else "none")


def _closure_jvp(call, primals, tangents):
  """JVP of ``f`` itself, for values it closes over (see ``_classify``)."""
  def f(*args):
    return eval_scoped(call.jaxpr, f"smartvjp/{call.name}/f", args)
  return _rule_jvp(call_p, lambda *a, call: f(*a), "fun", primals, tangents,
                   call=call)


def _split_tangents(call, tangents):
  prim_t = tangents[call.num_consts:]
  in_nz = tuple(type(t) is not _compat.Zero and possible
                for t, possible in zip(prim_t, call.in_nz_possible))
  nz_tangents = [t for t, nz in zip(prim_t, in_nz) if nz]
  return in_nz, nz_tangents


def expand_tangents(call, nz_outs):
  """Per-output tangents: the nonzero ones given, ``Zero`` for the rest."""
  it = iter(nz_outs)
  outs = [next(it) if nz else _compat.Zero(a.to_tangent_aval())
          for a, nz in zip(call.out_avals, call.out_nz)]
  expect_used_up(it, "tangents")
  return outs


# -- JVP (reached by jax.checkpoint and jax.jvp) -----------------------------

def _call_jvp(primals, tangents, *, call):
  if call.full is not None:   # pruned by DCE: the whole call's rule, selected
    outs, out_tangents = _call_jvp(primals, tangents, call=call.full)
    return select_outputs(call, outs), select_outputs(call, out_tangents)
  if _classify(call, [type(t) is not _compat.Zero for t in tangents]) == "closure":
    return _closure_jvp(call, primals, tangents)
  in_nz, nz_tangents = _split_tangents(call, tangents)
  f_consts, primals = primals[:call.num_consts], primals[call.num_consts:]
  if not any(in_nz):
    outs = call_p.bind(*f_consts, *primals, call=call)
    return outs, expand_tangents(call, [])
  check_aliased_refs(call, primals)
  fwd, fwd_consts = call.fwd_for(in_nz)
  check_fwd_output_types(call, fwd)  # f and fwd may both run (remat)
  outs = jvp_p.bind(*f_consts, *fwd_consts, *primals, *nz_tangents,
                    call=call, fwd=fwd, in_nz=in_nz, remat=False)
  primal_outs, nz_out = outs[:call.num_outs], outs[call.num_outs:]
  return primal_outs, expand_tangents(call, nz_out)


# -- linearize (jax.grad / jax.vjp) ------------------------------------------

def _call_linearize(is_vjp, nonzeros, *primals_in, call):
  if call.full is not None:   # pruned by DCE: the whole call's rule, selected
    outs, nzs, res, linearized = _call_linearize(is_vjp, nonzeros, *primals_in,
                                                 call=call.full)
    return (select_outputs(call, outs), select_outputs(call, nzs), res,
            lambda res, *t: select_outputs(call, linearized(res, *t)))
  if call.eager is not None:   # fwd (or f) already ran on concrete values
    in_nz, primal_outs, residuals, fwd = call.eager
    if fwd is None:
      prim, params = fused_lin_p, dict(call=call, in_nz=in_nz)
    else:
      prim, params = lin_p, dict(call=call, fwd=fwd, in_nz=in_nz, reload=None)
    return _linearized(call, in_nz, primal_outs, residuals, prim, params)
  if _classify(call, nonzeros) == "closure":
    return _compat.fallback_linearize(call_p, is_vjp, nonzeros, *primals_in,
                                        call=call)
  f_consts, primals = primals_in[:call.num_consts], primals_in[call.num_consts:]
  in_nz = tuple(nz and possible for nz, possible in
                zip(nonzeros[call.num_consts:], call.in_nz_possible))
  if not any(in_nz):
    outs = call_p.bind(*f_consts, *primals, call=call)
    return (outs, [False] * call.num_outs, [],
            lambda _res, *_t: expand_tangents(call, []))
  check_aliased_refs(call, primals)
  eager = _compat.is_eval_trace() and not any(
      isinstance(p, _compat.Tracer) for p in primals_in)
  if call.rules.fwd is None:  # only fwd_bwd: f now, fwd_bwd in the backward pass
    primal_outs = (eager_f(call, primals) if eager else
                   call_p.bind(*f_consts, *primals, call=call))
    residuals, prim = list(primals), fused_lin_p
    params = dict(call=call, in_nz=in_nz)
  elif eager:  # concrete values: call fwd itself, as jax.custom_vjp does
    primal_outs, residuals, fwd = eager_fwd(call, in_nz, primals)
    prim, params = lin_p, dict(call=call, fwd=fwd, in_nz=in_nz, reload=None)
  else:
    fwd, fwd_consts = call.fwd_for(in_nz)
    primal_outs, residuals = bind_primal_and_residuals(
        call, fwd, f_consts, fwd_consts, primals)
    prim, params = lin_p, dict(call=call, fwd=fwd, in_nz=in_nz, reload=None)
  return _linearized(call, in_nz, primal_outs, residuals, prim, params)


def _linearized(call, in_nz, primal_outs, residuals, prim, params):
  """The four values of a linearization rule whose tangent map binds
  ``prim`` (``smartvjp_lin`` or ``smartvjp_fused_lin``) on the residuals."""
  def linearized(residuals, *tangents):
    nz_t = [t for t, nz in zip(tangents[call.num_consts:], in_nz) if nz]
    return expand_tangents(call, prim.bind(*residuals, *nz_t, **params))

  return list(primal_outs), list(call.out_nz), list(residuals), linearized


# -- transposes ---------------------------------------------------------------

def _nz_inputs(cts_in, in_nz):
  return [ct for ct, nz in zip(cts_in, in_nz) if nz]


def _reloaded(res, reload):
  """Residuals a policy offloaded (``reload[i]`` true) back in device memory,
  where ``bwd`` expects them, as ``fwd`` returned them."""
  if reload is None:
    return list(res)
  return [jax.device_put(r, _compat.device_memory_space()) if back else r
          for r, back in zip(res, reload)]


def _lin_transpose(cts, *args, call, fwd, in_nz, reload):
  n_res = len(fwd.res_avals)
  # bwd runs even when every output cotangent is zero, as with
  # jax.custom_vjp: its result need not depend on them (flax's fp8 scales)
  cts_out = expand_tangents(call, cts)
  try:
    cts_in = run_bwd(call, fwd, _reloaded(args[:n_res], reload), cts_out)
  except Exception as e:  # noqa: BLE001 - re-raised unless fwd is at fault
    blame_eager_fwd(call, e)
    raise
  return [None] * n_res + _nz_inputs(cts_in, in_nz)


def _fused_lin_transpose(cts, *args, call, in_nz):
  n = call.num_primals
  if any(type(ct) is not _compat.Zero for ct in cts):
    check_f_output_invariance(call)   # f's type is the cotangent's here
  cts_out = expand_tangents(call, cts)
  cts_in = run_fwd_bwd(call, args[:n], in_nz, cts_out)
  return [None] * n + _nz_inputs(cts_in, in_nz)


# -- forward mode: the tangent map is the transpose of the cotangent map ------

def _transpose_cotangent_map(call, which, cotangent_map, in_nz, nz_tangents,
                             out_avals):
  """Tangent outputs = transpose of ``g -> cotangent_map(g)`` at the tangents."""
  # full types (sharding, varying manual axes, memory space, weak type): a
  # cotangent typed by shape and dtype only would be implicitly made varying
  # inside shard_map, and that cast transposes into a psum
  ct_avals = tangent_avals(out_avals, call.out_nz)

  rule_failed = []

  def nz_map(*nz_cts):
    try:
      cts = cotangent_map(expand_tangents(call, nz_cts))
    except Exception as e:  # noqa: BLE001 - the rule's own error, as is
      rule_failed.append(e)
      raise
    return [_compat.instantiate_zeros(c) for c in _nz_inputs(cts, in_nz)]

  try:
    transposed = jax.linear_transpose(nz_map, *ct_avals)
    return list(transposed(list(nz_tangents)))
  except Exception as e:  # noqa: BLE001 - re-raised with context below
    if rule_failed and e is rule_failed[0]:
      raise   # the rule failed (or returned bad cotangents): its own error
    name = call.rules.rule_name(which)
    raise TypeError(
        f"forward-mode differentiation (jax.jvp, jax.jacfwd, jax.linearize) "
        f"of smart_custom_vjp function {call.name} needs a {which} rule "
        f"({name}) that JAX can transpose in its cotangent argument (JAX "
        f"code, linear in g); transposing it failed with: "
        f"{type(e).__name__}: {e}") from e


def _lin_forward(*args, call, fwd, in_nz, reload):
  check_fwd_output_invariance(call, fwd)   # the tangent follows fwd's types
  n_res = len(fwd.res_avals)
  res, nz_t = _reloaded(args[:n_res], reload), args[n_res:]
  return _transpose_cotangent_map(
      call, "bwd", lambda cts: run_bwd(call, fwd, res, cts), in_nz, nz_t,
      lin_out_avals(call, fwd))


def _fused_lin_forward(*args, call, in_nz):
  check_f_output_invariance(call)   # the tangent follows f's output type
  n = call.num_primals
  primals, nz_t = args[:n], args[n:]
  return _transpose_cotangent_map(
      call, "fwd_bwd", lambda cts: run_fwd_bwd(call, primals, in_nz, cts),
      in_nz, nz_t, call.out_avals)


def _jvp_forward(*args, call, fwd, in_nz, remat):
  del remat
  f_consts, fwd_consts, primals, nz_t = split_jvp_args(args, call, fwd)
  if fwd is None:
    primal_outs = eval_scoped(call.jaxpr, f"smartvjp/{call.name}/f",
                              [*f_consts, *primals])
    return [*primal_outs, *_fused_lin_forward(*primals, *nz_t, call=call,
                                              in_nz=in_nz)]
  fwd_inputs = [*fwd_consts, *primals]
  outs = eval_scoped(fwd.jaxpr, f"smartvjp/{call.name}/fwd", fwd_inputs)
  primal_outs = outs[:call.num_outs]
  res = fwd.assemble_residuals(fwd_inputs, outs[call.num_outs:])
  return [*primal_outs, *_lin_forward(*res, *nz_t, call=call, fwd=fwd,
                                      in_nz=in_nz, reload=None)]


def _discharge_by_tracing(impl, name):
  """A state discharge rule for a forward-mode primitive whose inputs hold
  mutable array references (``jax.jvp`` under ``jit``): ``impl`` traced with
  those inputs as references, then discharged, as JAX discharges a plain
  function reading or writing them."""
  def rule(should, *args, **params):
    avals = [_compat.ref_aval(_compat.get_aval(a)) if d else _compat.get_aval(a)
             for a, d in zip(args, should)]
    jaxpr, consts = _compat.trace_to_closed_jaxpr(
        lambda *xs: impl(*xs, **params), avals, f"smartvjp {name}", impl,
        avals)
    outs = _compat.eval_discharged(jaxpr, [False] * len(consts) + list(should),
                             *consts, *args)
    n = len(outs) - sum(should)
    finals = iter(outs[n:])
    return [next(finals) if d else None for d in should], list(outs[:n])
  return rule



# -- higher order: JVPs of the rules' own primitives --------------------------
#
# Differentiating a program that already contains smartvjp's rules (grad of
# grad, jax.hessian, jacfwd of jacrev) differentiates the rules themselves:
# ``fwd`` (bound by the inner linearize) and, through the transposes, ``bwd``.
# Those are the user's JAX code, so their JVP is JAX's JVP of that code.

def _rule_jvp(prim, impl, role, primals, tangents, /, **params):
  """JAX's JVP of a rule's code, with respect to the inputs that move only
  (as ``jax.custom_vjp`` differentiates its rules): a nested call inside the
  rule then sees its closed-over constants held fixed."""
  call = params["call"]
  moving = [type(t) is not _compat.Zero for t in tangents]

  def on_moving(*moved):
    it = iter(moved)
    return impl(*[next(it) if m else p for p, m in zip(primals, moving)],
                **params)
  try:
    outs, out_tangents = jax.jvp(
        on_moving, tuple(p for p, m in zip(primals, moving) if m),
        tuple(t for t, m in zip(tangents, moving) if m))
  except Exception as e:  # noqa: BLE001 - JAX's error, with a note added
    # JAX's own exception goes on (its type and message, as with
    # jax.custom_vjp, which differentiates its rules the same way); the note
    # names the rule.
    name = call.rules.rule_name(role)
    what = ("differentiation with respect to values it closes over"
            if role == "fun" else "higher-order differentiation")
    e.add_note(
        f"smartvjp: {what} of smart_custom_vjp function "
        f"{call.name} needs the derivative of its {role} rule ({name}), "
        f"which JAX could not differentiate. Rules that are opaque kernels "
        "support one level of reverse mode; write the rule in "
        "differentiable JAX code, or give it a custom_vjp of its own, for "
        "higher orders.")
    raise
  return list(outs), list(out_tangents)


def _linear_in_tangents_jvp(prim, impl, role, n_nonlinear, primals,
                            tangents, /, **params):
  """Linear primitives: when only the tangent inputs move, the JVP is itself."""
  if all(type(t) is _compat.Zero for t in tangents[:n_nonlinear]):
    lin_tangents = [_compat.instantiate_zeros(t) for t in tangents[n_nonlinear:]]
    outs = prim.bind(*primals, **params)
    return outs, prim.bind(*primals[:n_nonlinear], *lin_tangents, **params)
  return _rule_jvp(prim, impl, role, primals, tangents, **params)


def _fwd_jvp(primals, tangents, **params):
  return _rule_jvp(fwd_p, fwd_eval, "fwd", primals, tangents, **params)


def _primal_jvp(primals, tangents, *, call, fwd):
  """``smartvjp_primal`` ran ``f`` where ``jax.custom_vjp`` runs ``fwd``: an
  outer derivative differentiates ``fwd``'s code for the primal outputs
  (so a straight-through estimator's ``floor`` has derivative zero there)."""
  _, fwd_consts, xs = split_primal_args(primals, call, fwd)
  _, fwd_consts_t, xs_t = split_primal_args(tangents, call, fwd)

  def fwd_primal_outs(*args, call):
    return fwd_eval(*args, call=call, fwd=fwd, offload=None)[:call.num_outs]
  return _rule_jvp(primal_p, fwd_primal_outs, "fwd", [*fwd_consts, *xs],
                   [*fwd_consts_t, *xs_t], call=call)


def _jvp_of_smartvjp_jvp(primals, tangents, **params):
  # the tangent map is bwd's, or fwd_bwd's for a function without fwd/bwd
  role = "bwd" if params["fwd"] is not None else "fwd_bwd"
  return _rule_jvp(jvp_p, _jvp_forward, role, primals, tangents, **params)


def _lin_jvp(primals, tangents, **params):
  n_res = len(params["fwd"].res_avals)
  return _linear_in_tangents_jvp(lin_p, _lin_forward, "bwd", n_res, primals,
                                 tangents, **params)


def _fused_lin_jvp(primals, tangents, **params):
  n = params["call"].num_primals
  return _linear_in_tangents_jvp(fused_lin_p, _fused_lin_forward, "fwd_bwd",
                                 n, primals, tangents, **params)


def _bwd_jvp(primals, tangents, **params):
  return _rule_jvp(bwd_p, bwd_eval, params["which"], primals, tangents,
                   **params)


def _bwd_transpose(cts, *args, call, which, jaxpr):
  """``bwd``/``fwd_bwd`` are linear in the cotangent; forward mode transposes
  them (this fails, and forward mode reports it, when they are opaque)."""
  undefined = [_compat.is_undefined_primal(a) for a in args]
  lin_avals = [a.aval for a, u in zip(args, undefined) if u]

  def linear_part(*lin):
    it = iter(lin)
    full = [next(it) if u else a for a, u in zip(args, undefined)]
    return bwd_eval(*full, call=call, which=which, jaxpr=jaxpr)

  transposed = jax.linear_transpose(linear_part, *lin_avals)  # full types
  out_cts = transposed([_compat.instantiate_zeros(c) for c in cts])
  it = iter(out_cts)
  return [next(it) if u else None for u in undefined]


# -- a smart_custom_vjp call in a linear position ------------------------------

def _call_transpose(cts, *args, call):
  """Transpose of a call that JAX found linear in some of its inputs (for
  instance a ``bwd`` that calls another smart_custom_vjp function on its
  cotangent and on values of the primals, transposed by forward mode): the
  transpose of ``f``'s own traced jaxpr with respect to the linear inputs,
  the others held fixed. JAX checks that ``f`` is linear in them; an ``f``
  that is not (or is opaque) gets JAX's error, as a plain function does."""
  if call.full is not None:   # pruned by DCE: zero cotangents for the rest
    full_cts = [_compat.Zero(a.to_tangent_aval()) for a in call.full.out_avals]
    for i, ct in zip(call.kept, cts):
      full_cts[i] = ct
    return _call_transpose(full_cts, *args, call=call.full)
  undefined = [_compat.is_undefined_primal(a) for a in args]
  lin_avals = [a.aval for a, u in zip(args, undefined) if u]  # full types

  def f(*lin):
    it = iter(lin)
    full = [next(it) if u else a for a, u in zip(args, undefined)]
    return eval_scoped(call.jaxpr, f"smartvjp/{call.name}/f", full)

  try:
    transposed = jax.linear_transpose(f, *lin_avals)
  except Exception as e:  # noqa: BLE001 - re-raised naming f
    raise NotImplementedError(
        f"Transpose rule for smart_custom_vjp function {call.name} used in a "
        f"linear position: its f is not linear JAX code in the inputs being "
        f"transposed ({type(e).__name__}: {e})") from e
  it = iter(transposed([_compat.instantiate_zeros(c) for c in cts]))
  return [next(it) if u else None for u in undefined]


