"""Forward over reverse, compared with the plain function and jax.custom_vjp.

Run in a subprocess with 4 CPU devices (see tests/test_forward_over_reverse.py).

Each program differentiates a loss twice, forward over reverse (``jvp`` of
``grad``, ``jacfwd`` of ``jacrev``, ``hessian``, ``vmap`` of a Hessian-vector
product), through a context around the smart call (``shard_map`` with
``check_vma=True``, ``lax.map``, ``fori_loop``, ``scan``, ``checkpoint``),
for each set of given rules (``fwd`` + ``bwd``, ``fwd_bwd`` only, all three)
and each rule made an opaque kernel (``jax.pure_callback``: its result type
carries no varying manual axes, and it has no derivative).

What each case must give:

* the plain function's values, when ``jax.custom_vjp`` (given the same rules;
  ``fwd_bwd`` alone as ``fwd`` returning the inputs and ``bwd`` calling it)
  computes them;
* where ``jax.custom_vjp`` raises, the same exception type, or the plain
  function's values (smartvjp differentiates forward through a transposable
  ``fwd_bwd``, which ``jax.custom_vjp`` cannot);
* a ``TypeError`` naming ``f`` where ``f`` is an opaque kernel inside
  ``shard_map`` and its output type is the one the derivative follows (see
  ``smartvjp._spec.check_f_output_invariance``): never a wrong value.

Prints one line per case and ``forward over reverse ok`` at the end; exits 1
on any case that breaks these rules.
"""

from __future__ import annotations

import itertools
import sys

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import PartitionSpec as P

from smartvjp import smart_custom_vjp

assert jax.device_count() == 4, jax.devices()
try:  # axis types where this JAX has them
  MESH = jax.make_mesh((4,), ("i",), axis_types=(jax.sharding.AxisType.Auto,))
except (AttributeError, TypeError):
  MESH = jax.make_mesh((4,), ("i",))

X = jnp.linspace(-1.0, 1.0, 8, dtype=jnp.float32)
W = jnp.linspace(0.5, 1.5, 8, dtype=jnp.float32)


def _callback(fn, out_like, *args):
  shapes = tuple(jax.ShapeDtypeStruct(o.shape, o.dtype) for o in out_like)
  outs = jax.pure_callback(
      lambda *a: tuple(np.asarray(o, np.float32) for o in fn(*a)), shapes,
      *args, vmap_method="sequential")
  return outs


def rules(opaque):
  """``f(x, w) = sin(x) * w`` with its rules; the one named ``opaque`` is a
  host callback."""
  def f(x, w):
    if opaque == "f":
      return _callback(lambda x, w: (np.sin(x) * w,), (x,), x, w)[0]
    return jnp.sin(x) * w

  def fwd(x, w):
    if opaque == "fwd":
      y, c = _callback(lambda x, w: (np.sin(x) * w, np.cos(x)), (x, x), x, w)
    else:
      y, c = jnp.sin(x) * w, jnp.cos(x)
    return y, (c, jnp.sin(x), w)

  def bwd(res, g):
    c, s, w = res
    if opaque == "bwd":
      return _callback(lambda c, s, w, g: (g * c * w, g * s), (g, g),
                       c, s, w, g)
    return g * c * w, g * s

  def fwd_bwd(x, w, g):
    if opaque == "bwd":
      return _callback(lambda x, w, g: (g * np.cos(x) * w, g * np.sin(x)),
                       (g, g), x, w, g)
    return g * jnp.cos(x) * w, g * jnp.sin(x)
  return f, fwd, bwd, fwd_bwd


def build(kind, given, opaque):
  f, fwd, bwd, fwd_bwd = rules(opaque)
  if kind == "plain":
    return lambda x, w: jnp.sin(x) * w
  if kind == "jax":
    F = jax.custom_vjp(f)
    if given == "fwd_bwd":   # the same schedule written as fwd + bwd
      F.defvjp(lambda x, w: (f(x, w), (x, w)),
               lambda res, g: fwd_bwd(*res, g))
    else:
      F.defvjp(fwd, bwd)
    return F
  F = smart_custom_vjp(f)
  if given == "fwd+bwd":
    F.defvjp(fwd, bwd)
  elif given == "fwd_bwd":
    F.defvjp(fwd_bwd=fwd_bwd)
  else:
    F.defvjp(fwd, bwd, fwd_bwd=fwd_bwd)
  return F


def contexts(F):
  """``inner(x, w) -> f32[8]``: ``F`` reached through each context."""
  body = lambda x, w: F(x, w) + 0.2 * x
  return {
      "shard_map": jax.shard_map(body, mesh=MESH, in_specs=(P("i"), P("i")),
                                 out_specs=P("i"), check_vma=True),
      "lax.map": lambda x, w: jax.lax.map(lambda xw: body(*xw),
                                          (x.reshape(4, 2), w.reshape(4, 2))
                                          ).reshape(8),
      "fori_loop": lambda x, w: jax.lax.fori_loop(
          0, 2, lambda i, c: body(c, w), x),
      "scan": lambda x, w: jax.lax.scan(
          lambda c, _: (body(c, w), None), x, None, length=2)[0],
      "checkpoint": jax.checkpoint(body),
      "shard_map(checkpoint)": jax.shard_map(
          jax.checkpoint(body), mesh=MESH, in_specs=(P("i"), P("i")),
          out_specs=P("i"), check_vma=True),
  }


def programs(inner):
  loss = lambda x: 0.5 * jnp.sum(inner(x, W) ** 2)
  hvp = lambda x, v: jax.jvp(jax.grad(loss), (x,), (v,))[1]
  return {
      "jvp(grad)": jax.jit(lambda x: hvp(x, jnp.cos(3.0 * x))),
      "jacfwd(jacrev)": jax.jit(jax.jacfwd(jax.jacrev(loss))),
      "hessian": jax.jit(jax.hessian(loss)),
      "vmap(hvp)": jax.jit(lambda x: jax.vmap(lambda v: hvp(x, v))(
          jnp.stack([jnp.ones_like(x), jnp.cos(x)]))),
  }


def _same_build(kind, given, opaque):
  """The arguments ``build`` tells apart: the plain function ignores the
  rules, and ``jax.custom_vjp`` is given ``fwd`` + ``bwd`` alike for
  ``"fwd+bwd"`` and ``"all three"``."""
  if kind == "plain":
    return kind, None, None
  if kind == "jax" and given == "all three":
    return kind, "fwd+bwd", opaque
  return kind, given, opaque


_OUTCOMES = {}


def outcome(kind, given, opaque, context, program):
  """``(values, None)`` or ``(None, exception)``; computed (compiled) once per
  distinct program: the references recur across the cases."""
  key = (*_same_build(kind, given, opaque), context, program)
  if key not in _OUTCOMES:
    fn = programs(contexts(build(*key[:3]))[context])[program]
    try:
      _OUTCOMES[key] = np.asarray(fn(X)), None
    except Exception as e:  # noqa: BLE001 - compared below
      _OUTCOMES[key] = None, e
  return _OUTCOMES[key]


def _f_type_error(err) -> bool:
  """smartvjp's refusal of an opaque f's output type inside shard_map."""
  msg = str(err)
  return isinstance(err, TypeError) and (
      "invariant along the manual mesh axes" in msg
      or "whose type differs from that of" in msg)


def check(given, opaque, context, program) -> tuple[bool, str]:
  """``(ok, what happened)``: ok when the case behaves as the module
  docstring says."""
  got, got_err = outcome("smart", given, opaque, context, program)
  ref, ref_err = outcome("jax", given, opaque, context, program)
  plain, _ = outcome("plain", given, opaque, context, program)
  if got_err is not None:
    if ref_err is not None and type(ref_err) is type(got_err):
      return True, f"both raise {type(got_err).__name__}"
    if opaque == "f" and context.startswith("shard_map") and _f_type_error(got_err):
      return True, "refused: f's output type (TypeError)"
    return False, (f"smartvjp raised {type(got_err).__name__}: {got_err}"[:400]
                   + (f" (jax.custom_vjp: {type(ref_err).__name__})" if ref_err
                      else " (jax.custom_vjp computes it)"))
  if not np.allclose(got, plain, rtol=2e-5, atol=2e-5):
    return False, (f"differs from the plain function by "
                   f"{np.max(np.abs(got - plain)):.3g}")
  return True, ("plain's values" if ref_err is None else
                f"plain's values (jax.custom_vjp raises "
                f"{type(ref_err).__name__})")


def main():
  failures = 0
  cases = itertools.product(("fwd+bwd", "fwd_bwd", "all three"),
                            ("none", "f", "fwd", "bwd"),
                            ("shard_map", "lax.map", "fori_loop", "scan",
                             "checkpoint", "shard_map(checkpoint)"))
  names = list(programs(lambda x, w: x))
  for n, (given, opaque, context) in enumerate(cases):
    if given == "fwd_bwd" and opaque == "fwd":
      continue   # no fwd to make opaque
    # every program for JAX-coded rules and for an opaque f inside shard_map
    # (whose declared output type is the one to get right); one program, in
    # turn, for each other case
    every = opaque == "none" or (opaque == "f" and
                                 context.startswith("shard_map"))
    chosen = names if every else [names[n % len(names)]]
    for program in chosen:
      ok, what = check(given, opaque, context, program)
      print(f"{given:9} opaque={opaque:4} {context:21} {program:15} "
            f"{'ok' if ok else 'FAIL'}: {what}")
      failures += not ok
  if failures:
    print(f"{failures} cases failed")
    sys.exit(1)
  print("forward over reverse ok")


if __name__ == "__main__":
  main()
