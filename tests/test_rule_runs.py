"""How often each rule's Python body runs (traced or eager), against
``jax.custom_vjp``: ``f`` runs where ``jax.custom_vjp``'s does (plain calls,
``jit(F)``, staged bodies) plus, under remat, in the forward pass; ``fwd``
and ``bwd`` never more often."""

import collections

import jax
import jax.numpy as jnp
import pytest

import kernels as K
import smartvjp

X = jnp.linspace(-1.0, 1.0, 3)


def _build(decorator, counts, with_fwd_bwd=False):
  return K.counting_sin(decorator, counts, with_fwd_bwd=with_fwd_bwd)[0]


def _loss(F):
  return lambda x: jnp.sum(F(x) ** 2)


PROGRAMS = {
    "jit(grad)": lambda F: jax.jit(jax.grad(_loss(F)))(X),
    "jit(value_and_grad)": lambda F: jax.jit(jax.value_and_grad(_loss(F)))(X),
    "jit(grad(scan))": lambda F: jax.jit(jax.grad(lambda x: jnp.sum(
        jax.lax.scan(lambda c, _: (F(c), None), x, None, length=3)[0])))(X),
    "jit(vmap(grad))": lambda F: jax.jit(jax.vmap(jax.grad(_loss(F))))(
        jnp.stack([X, X + 1.0])),
    "vmap(grad)": lambda F: jax.vmap(jax.grad(_loss(F)))(
        jnp.stack([X, X + 1.0])),
    "eager grad": lambda F: jax.grad(_loss(F))(X),
    "eager vjp": lambda F: jax.vjp(F, X)[1](X),
    "jit(F)": lambda F: jax.jit(F)(X),
    "F": lambda F: F(X),
    "grad(jit(F))": lambda F: jax.grad(_loss(jax.jit(F)))(X),
    "jit(grad(checkpoint))": lambda F: jax.jit(jax.grad(
        _loss(jax.checkpoint(F))))(X),
    "grad(checkpoint)": lambda F: jax.grad(_loss(jax.checkpoint(F)))(X),
    "grad(vmap(F))": lambda F: jax.grad(lambda x: jnp.sum(
        jax.vmap(F)(jnp.stack([x, x + 1.0]))))(X),
    "jit(grad(vmap(F)))": lambda F: jax.jit(jax.grad(lambda x: jnp.sum(
        jax.vmap(F)(jnp.stack([x, x + 1.0])))))(X),
    "grad(vmap(vmap(F)))": lambda F: jax.grad(lambda x: jnp.sum(
        jax.vmap(jax.vmap(F))(jnp.stack([jnp.stack([x, x + 1.0])] * 2))))(X),
    "jit(grad(vmap(vmap(F))))": lambda F: jax.jit(jax.grad(lambda x: jnp.sum(
        jax.vmap(jax.vmap(F))(jnp.stack([jnp.stack([x, x + 1.0])] * 2)))))(X),
    "jit(vjp(F)[0])": lambda F: jax.jit(lambda x: jax.vjp(F, x)[0])(X),
    "jit(linearize(F)[0])": lambda F: jax.jit(
        lambda x: jax.linearize(F, x)[0])(X),
    "jit(grad(checkpoint(scan)))": lambda F: jax.jit(jax.grad(lambda x: jnp.sum(
        jax.lax.scan(lambda c, _: (jax.checkpoint(F)(c), None), x, None,
                     length=3)[0])))(X),
}
REMAT = {"jit(grad(checkpoint))", "grad(checkpoint)",
         "jit(grad(checkpoint(scan)))"}


def _runs(decorator, program, **kw):
  counts = collections.Counter()
  PROGRAMS[program](_build(decorator, counts, **kw))
  return counts


@pytest.mark.parametrize("program", sorted(PROGRAMS))
def test_rule_bodies_run_as_with_custom_vjp(program):
  ref = _runs(jax.custom_vjp, program)
  got = _runs(smartvjp.smart_custom_vjp, program)
  assert got["fwd"] <= ref["fwd"] and got["bwd"] <= ref["bwd"], (ref, got)
  if program in REMAT:   # the forward pass runs f: traced once
    assert got["f"] == max(ref["f"], 1), (ref, got)
  else:
    assert got["f"] == ref["f"], (ref, got)


@pytest.mark.parametrize("program", ["jit(grad)", "eager grad",
                                     "jit(vmap(grad))", "grad(vmap(F))",
                                     "jit(grad(vmap(F)))",
                                     "grad(vmap(vmap(F)))",
                                     "jit(grad(vmap(vmap(F))))"])
def test_f_is_not_traced_where_only_fwd_runs(program):
  """The examples of the issue: no trace of ``f`` at all, and values equal."""
  got = _runs(smartvjp.smart_custom_vjp, program)
  assert got["f"] == 0 and got["fwd"] == 1 and got["bwd"] == 1, got


@pytest.mark.parametrize("program", sorted(REMAT))
def test_fwd_bwd_runs_instead_of_fwd_and_bwd_under_remat(program):
  """``fwd`` is traced once (the policy is asked about what it computes),
  as ``jax.custom_vjp`` traces it, and does not run; ``bwd`` never does."""
  ref = _runs(jax.custom_vjp, program)
  got = _runs(smartvjp.smart_custom_vjp, program, with_fwd_bwd=True)
  assert got["fwd_bwd"] == 1 and not got["bwd"], got
  assert got["fwd"] <= ref["fwd"], (ref, got)


def test_values_of_the_linearized_call_equal_custom_vjps():
  for program in ("jit(grad)", "jit(value_and_grad)", "jit(vmap(grad))",
                  "eager grad", "grad(vmap(F))", "grad(vmap(vmap(F)))",
                  "jit(grad(vmap(vmap(F))))"):
    ref = PROGRAMS[program](_build(jax.custom_vjp, collections.Counter()))
    got = PROGRAMS[program](_build(smartvjp.smart_custom_vjp,
                                   collections.Counter()))
    for a, b in zip(jax.tree_util.tree_leaves(got),
                    jax.tree_util.tree_leaves(ref)):
      assert a.dtype == b.dtype and bool(jnp.all(a == b)), program
