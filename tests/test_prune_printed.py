"""What ``smartvjp.print_schedule`` prints is what runs, for every row of
``tests/test_plan.py``'s PRUNE table (issue 55).

A corpus of programs (rule variants x uses of the call x both remat paths)
runs with never-DCE'd opaque kernels (``tests/kernels.py``: each rule one
counted kernel that neither JAX nor XLA removes on its own). For each
program the rules ``print_schedule`` lists, times their repeats, equal the
kernel runs of ``jax.jit`` of the program. While the corpus is traced,
every question dead-code elimination asks ``_plan.prune`` is recorded, and
each PRUNE row must be answered for at least one program: the same read
outputs, the same answer, and the facts the row sets (those ``prune``
reads) the same."""

import collections
import contextlib
import dataclasses
import io
import os
import sys

import jax
import jax.numpy as jnp
import pytest
from jax.ad_checkpoint import checkpoint_name

import kernels
import smartvjp
from smartvjp import _plan, smart_custom_vjp

sys.path.insert(0, os.path.dirname(__file__))
import test_plan  # noqa: E402  (the PRUNE table itself)

X = jnp.linspace(0.1, 0.9, 4, dtype=jnp.float32)
W = jnp.eye(4, dtype=jnp.float32) * 0.5
RULES = ("f", "fwd", "bwd", "fwd_bwd")


def _make(kind):
  """sin with never-DCE'd kernel rules, in one of the variants the PRUNE rows
  tell apart."""
  f, fwd, bwd, fwd_bwd = kernels.sin_rules(never_dce=True)
  k = lambda name, fn, like, *a: kernels.kernel(name, fn, like, *a,
                                                never_dce=True)

  def fwd_input(x):         # the seed's fwd: its residual is its input
    (y,) = k("fwd", lambda x: (jnp.sin(x),), [x], x)
    return y, (x,)

  def bwd_input(res, g):
    (x,) = res
    return tuple(k("bwd", lambda x, g: (jnp.cos(x) * g,), [g], x, g))

  def printing(rule):
    def rule_that_prints(*args):
      jax.debug.print("rule {}", args[0])
      return rule(*args)
    return rule_that_prints

  if kind == "dot_then_kernel":   # fwd = a dot (saveable) then a kernel
    # a kernel JAX may remove where nothing reads it (pure_callback), as it
    # removes a pallas_call: the split's backward side then does not run it
    k = lambda name, fn, like, *a: kernels.kernel(name, fn, like, *a)

    def f_dot(x):
      (z,) = k("f", lambda y: (jnp.sin(y),), [x], x @ W)
      return z

    def fwd_dot(x):   # the residual: JAX code on the dot, cheap to redo
      y = x @ W
      (z,) = k("fwd", lambda y: (jnp.sin(y),), [x], y)
      return z, (jnp.cos(y),)

    def bwd_dot(res, g):
      (c,) = res
      (dy,) = k("bwd", lambda c, g: (c * g,), [g], c, g)
      return (dy @ W.T,)
    F = smart_custom_vjp(f_dot)
    F.defvjp(fwd_dot, bwd_dot)
    return F
  if kind == "closes_over":   # rules closing over a traced value: see _uses
    return None
  if kind == "two_outputs":    # (sin x, cos x), cos x a residual too
    def f2(x):
      return tuple(k("f", lambda x: (jnp.sin(x), jnp.cos(x)), [x, x], x))

    def fwd2(x):
      s, c = k("fwd", lambda x: (jnp.sin(x), jnp.cos(x)), [x, x], x)
      return (s, c), (c, s)

    def bwd2(res, g):
      c, s = res
      (dx,) = k("bwd", lambda c, s, a, b: (c * a - s * b,), [c], c, s, *g)
      return (dx,)
    F = smart_custom_vjp(f2)
    F.defvjp(fwd2, bwd2)
    return F
  if kind == "unused_residual":   # bwd never reads its second residual
    def fwd3(x):
      y, c = k("fwd", lambda x: (jnp.sin(x), jnp.cos(x)), [x, x], x)
      return y, (c, y)
    F = smart_custom_vjp(f)
    F.defvjp(fwd3, lambda res, g: bwd((res[0],), g))
    return F
  F = smart_custom_vjp(printing(f) if kind in ("f_prints", "seed_f_prints",
                                               "only_fused_f_prints") else f)
  if kind in ("plain", "f_prints"):
    F.defvjp(fwd, bwd)
  elif kind == "fwd_prints":
    F.defvjp(printing(fwd), bwd)
  elif kind == "fused":
    F.defvjp(fwd, bwd, fwd_bwd=fwd_bwd)
  elif kind in ("only_fused", "only_fused_f_prints"):
    F.defvjp(None, None, fwd_bwd=fwd_bwd)
  elif kind in ("seed", "seed_f_prints"):
    F.defvjp(fwd_input, bwd_input)
  elif kind == "twin":
    F.defvjp(lambda x: (fwd_input(x)[0], (checkpoint_name(x, "x"),)),
             bwd_input)
  return F


def _closing_over(scale):
  """sin(scale * x), its rules closing over ``scale`` (traced where the
  caller traces it)."""
  f, fwd, bwd, _ = kernels.sin_rules(never_dce=True)
  F = smart_custom_vjp(lambda x: f(scale * x))
  F.defvjp(lambda x: fwd(scale * x),
           lambda res, g: tuple(scale * d for d in bwd(res, g)))
  return F


def _uses(F):
  """Programs of ``x`` using ``F``, each a way dead-code elimination meets
  its equations."""
  ones = jnp.ones_like(X)
  ck = jax.checkpoint
  sg = jax.lax.stop_gradient
  if F is None:   # built inside the program, closing over a traced value
    return {
        "vjp, primal only": lambda x: jax.vjp(_closing_over(sg(x[0])), x)[0],
        "grad, output read": jax.grad(lambda x: jnp.sum(
            ck(_closing_over(sg(x[0])))(x) ** 2)),
    }
  dots = jax.checkpoint_policies.dots_saveable
  first = lambda x: jax.tree.leaves(F(x))[0]
  return {
      "vjp of the first output": lambda x: jax.vjp(first, x)[1](ones),
      "vjp of the first output, and it": lambda x: (
          lambda y, pull: (y, pull(ones)))(*jax.vjp(first, x)),
      "grad, output read": jax.grad(lambda x: jnp.sum(ck(first)(x) ** 2)),
      "grad, output unread": jax.grad(lambda x: jnp.sum(ck(first)(x) * 3.0)),
      "grad, primal only": jax.grad(lambda x: jnp.sum(ck(
          lambda x: jax.lax.stop_gradient(first(x)) * x)(x))),
      "grad, nothing read": jax.grad(lambda x: jnp.sum(ck(
          lambda x: (first(x), x ** 2)[1])(x))),
      "vjp, primal only": lambda x: jax.vjp(first, x)[0],
      "linearize, primal only": lambda x: jax.linearize(first, x)[0],
      "grad, scan of two": jax.grad(lambda x: jnp.sum(jax.lax.scan(
          lambda c, _: (ck(first)(c), None), x, None, length=2)[0])),
      "grad, dots_saveable": jax.grad(lambda x: jnp.sum(
          ck(first, policy=dots)(x) ** 2)),
      "grad, dots_saveable, primal only": jax.grad(lambda x: jnp.sum(ck(
          lambda x: jax.lax.stop_gradient(first(x)) * x, policy=dots)(x))),
  }


KINDS = ("plain", "fused", "only_fused", "only_fused_f_prints", "seed",
         "twin", "f_prints", "fwd_prints", "seed_f_prints", "dot_then_kernel",
         "closes_over", "two_outputs", "unused_residual")
FLAGS = {"default": {}, "remat3": dict(jax_remat3=True, jax_custom_vjp3=True)}


def _printed(fn):
  with contextlib.redirect_stdout(io.StringIO()):
    rules = smartvjp.print_schedule(fn, X)
  printed = collections.Counter()
  for r in rules:   # a split fwd's two sides run fwd once between them
    if r.part != "rest":
      printed[r.which] += r.repeats or 1
  return {k: v for k, v in printed.items() if k in RULES and v}


@pytest.fixture(scope="module")
def corpus():
  """``{(flags, kind, use): (printed, run)}`` and the recorded prune
  questions, for every program of the corpus."""
  asked = []
  real = _plan.prune

  def recording(facts, schedule, outputs_used, tangents_used,
                carries_f=True, **kw):
    left = real(facts, schedule, outputs_used, tangents_used, carries_f, **kw)
    asked.append((facts, schedule, outputs_used, tangents_used, carries_f,
                  kw, left))
    return left
  results = {}
  _plan.prune = recording
  try:
    for flag_name, flags in FLAGS.items():
      if flags and not kernels.has_flag("jax_remat3"):
        continue
      with kernels.config(**flags):
        for kind in KINDS:
          for use, fn in _uses(_make(kind)).items():
            if kind == "dot_then_kernel" and "dots_saveable" not in use:
              continue   # XLA drops its kernel where fwd's output is unread
            printed = _printed(fn)
            _, run = kernels.run(jax.jit(fn), X)
            run = {k: v for k, v in run.items() if k in RULES and v}
            results[(flag_name, kind, use)] = (printed, run)
  finally:
    _plan.prune = real
  return results, asked


def _replay_not_listed(key, printed, run) -> bool:
  """print_schedule's one listed exception: jax 0.11 under the remat3 flags
  drops, in dead-code elimination, the replay of an ``f`` with effects that
  only a ``fwd_bwd`` follows, which still runs (twice the listed ``f``)."""
  return (key[0] == "remat3" and key[1] == "only_fused_f_prints"
          and jax.__version_info__[:2] == (0, 11)
          and run == {**printed, "f": 2 * printed["f"]})


def test_printed_is_what_runs(corpus):
  results, _ = corpus
  differ = {key: got for key, got in results.items()
            if got[0] != got[1] and not _replay_not_listed(key, *got)}
  assert not differ, "\n".join(f"{k}: printed {p}, ran {r}"
                               for k, (p, r) in differ.items())


# The fields of Facts that prune reads, and their values where a row does not
# set them.
READ = ("has_fwd", "keeps_effects", "references", "inputs_only",
        "fwd_keeps_effects", "fwd_reads_saved", "f_traced", "f_closes_over",
        "f_matches_fwd")
DEFAULTS = {"all_outputs_used": True, "all_tangents_used": True,
            "offloaded": False}
# Rows this corpus does not reach, and why; each is still pinned by the
# PRUNE table itself. The test fails when one becomes reached (move it out).
UNREACHED = {
    "all read": "both outputs read: a checkpointed call's backward region "
                "holds rule equations, not the jvp; only forward mode "
                "keeps the jvp whole, and an opaque bwd cannot run forward "
                "mode (a JAX-coded one counts no runs)",
    "references": "rules using JAX references (jax.new_ref): not in the "
                  "corpus",
    "fwd alone, references involved": "likewise",
    "fwd alone, reading saved values: its primal part, cheaper than f":
        "a split's backward side alone with its residuals unread: not "
        "reached by the corpus's dots_saveable programs",
    "fwd alone, reading saved values and printing": "likewise, with an "
                                                    "effect",
    "fwd alone, not traced (eager): whole": "fwd run eagerly has no "
                                            "program to print",
    "some residuals unread, fwd not traced: whole": "likewise",
    "the same with a residual offloaded: the residuals read only":
        "offloading needs a host memory space the CPU backend's programs "
        "lack",
}


def _answers(row, question) -> bool:
  name, facts, schedule, outputs, tangents, carries_f, left = row[:7]
  more = {**DEFAULTS, **(row[7] if len(row) > 7 else {})}
  q_facts, q_schedule, q_out, q_tan, q_carries, q_kw, q_left = question
  if (q_out, q_tan, q_carries, q_left) != (outputs, tangents, carries_f,
                                           left):
    return False
  # prune reads these only for fwd's own equation with residuals read
  if not carries_f and tangents and any(
      {**DEFAULTS, **q_kw}[k] != v for k, v in more.items()):
    return False
  base = _plan.Facts(has_fwd=True, has_fwd_bwd=False)
  for field in READ:
    if getattr(facts, field) != getattr(base, field) or field == "has_fwd":
      if getattr(q_facts, field) != getattr(facts, field):
        return False
  if (facts.num_computed is None) != (q_facts.num_computed is None):
    return False
  if schedule is not None and tangents and carries_f:
    return (q_schedule is not None
            and q_schedule.runs_fwd_bwd == schedule.runs_fwd_bwd)
  return True


def test_every_prune_row_is_reached(corpus):
  _, asked = corpus
  unreached = [row[0] for row in test_plan.PRUNE
               if not any(_answers(row, q) for q in asked)]
  assert sorted(unreached) == sorted(UNREACHED), unreached
