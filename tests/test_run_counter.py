"""``smartvjp.testing.RunCounter`` counts what the README's contract table
says runs: each row of the table, built with counted JAX-coded rules, gives
the table's ``smart_custom_vjp`` cell, on JAX's default path and under the
remat3 flags, and its ``jax.custom_vjp`` cell on the default path."""

import os
import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.ad_checkpoint import checkpoint_name

from smartvjp import smart_custom_vjp
from smartvjp.testing import RunCounter

ROOT = os.path.abspath(os.path.join(os.path.dirname(__file__), os.pardir))
X = jnp.array([0.3, -1.2, 2.0], jnp.float32)


def contract_table() -> dict[str, dict[str, dict[str, int]]]:
  """``{program: {column: {rule: runs}}}`` from the README's table."""
  text = open(os.path.join(ROOT, "README.md"), encoding="utf-8").read()
  section = text.split("\n## The contract: rule runs per call site\n")[1]
  section = section.split("\n## ")[0]
  lines = [l for l in section.splitlines() if l.startswith("|")]
  head = [c.strip().strip("`") for c in lines[0].strip("|").split("|")]
  table = {}
  for line in lines[2:]:
    cells = [c.strip() for c in line.strip("|").split("|")]
    table[cells[0]] = {
        col: ({} if cell == "—" else
              {r: int(n) for r, n in re.findall(r"([\w_]+) (\d+)", cell)})
        for col, cell in zip(head[1:], cells[1:])}
  return table


TABLE = contract_table()


def build(decorator, counter, *, seed_fwd=False, named=None, fused=False):
  """sin with counted rules, each rule's outputs passed through one count."""
  F = decorator(lambda x: counter.count("f", jnp.sin(x)))

  def fwd(x):
    if seed_fwd:   # the seed's fwd: its residual is its input
      return counter.count("fwd", jnp.sin(x)), x
    y, c = counter.count("fwd", jnp.sin(x), jnp.cos(x))
    return y, (checkpoint_name(c, named) if named else c)

  def bwd(res, g):
    d = jnp.cos(res) if seed_fwd else res
    return (counter.count("bwd", d * g),)

  def fwd_bwd(x, g):
    return (counter.count("fwd_bwd", jnp.cos(x) * g),)

  if fused:
    F.defvjp(fwd, bwd, fwd_bwd=fwd_bwd)
  else:
    F.defvjp(fwd, bwd)
  return F


def loss(F, remat=False, policy=None):
  G = jax.checkpoint(F, policy=policy) if remat else F
  return lambda x: jnp.sum(G(x) ** 2)


def scanned(F):
  body = lambda c, _: (jax.checkpoint(F)(c), None)
  return lambda x: jnp.sum(jax.lax.scan(body, x, None, length=4)[0] ** 2)


ROWS = {
    "`F(x)`, `jit(F)(x)`": (
        {}, [lambda F: F, lambda F: jax.jit(F)]),
    "`grad(loss)` without remat": (
        {}, [lambda F: jax.jit(jax.grad(loss(F)))]),
    "`grad(loss)` with `jax.checkpoint(F)`, jitted or eager": (
        {}, [lambda F: jax.jit(jax.grad(loss(F, True))),
             lambda F: jax.grad(loss(F, True))]),
    "the seed's `fwd` (its residual is the input), checkpoint": (
        dict(seed_fwd=True), [lambda F: jax.jit(jax.grad(loss(F, True)))]),
    "`lax.scan` of a checkpointed layer, length 4": (
        {}, [lambda F: jax.jit(jax.grad(scanned(F)))]),
    "checkpoint with `everything_saveable`": (
        {}, [lambda F: jax.jit(jax.grad(loss(
            F, True, jax.checkpoint_policies.everything_saveable)))]),
    "residual named in `fwd`, `save_only_these_names(name)`": (
        dict(named="res"), [lambda F: jax.jit(jax.grad(loss(
            F, True, jax.checkpoint_policies.save_only_these_names("res"))))]),
    "checkpoint, `fwd_bwd` also given": (
        dict(fused=True), [lambda F: jax.jit(jax.grad(loss(F, True)))]),
}

def test_every_row_of_the_table_is_counted_here():
  assert sorted(ROWS) == sorted(TABLE)


@pytest.mark.parametrize("row", sorted(ROWS))
def test_counts_match_the_contract_table(row, ad_mode):
  kwargs, programs = ROWS[row]
  for column, decorator in (("smart_custom_vjp", smart_custom_vjp),
                            ("jax.custom_vjp", jax.custom_vjp)):
    want = TABLE[row][column]
    # the table's JAX columns are JAX's default path (remat3 + vjp3 change
    # jax.custom_vjp's own counts: docs/contract.md)
    if not want or (decorator is jax.custom_vjp and ad_mode != "default"):
      continue
    for program in programs:
      counter = RunCounter()
      F = build(decorator, counter, **kwargs)
      out = jax.block_until_ready(program(F)(X))
      assert dict(counter.counts) == want, (row, column, program)
      if decorator is smart_custom_vjp:
        anchor = RunCounter()
        R = build(jax.custom_vjp, anchor, **{**kwargs, "fused": False})
        np.testing.assert_allclose(out, program(R)(X), rtol=1e-6)


def test_tracing_counts_nothing_and_reset():
  counter = RunCounter()
  F = build(smart_custom_vjp, counter)
  jax.make_jaxpr(jax.grad(loss(F, True)))(X)
  jax.jit(jax.grad(loss(F, True))).lower(X)
  assert counter.counts == {}
  jax.jit(F)(X)
  jax.jit(F)(X)
  assert counter.counts == {"f": 2}
  counter.reset()
  assert counter.counts == {}


def test_vmap_counts_one_run_per_batched_rule():
  counter = RunCounter()
  F = build(smart_custom_vjp, counter)
  xs = jnp.stack([X, 2 * X])
  g = jax.jit(jax.vmap(jax.grad(loss(F, True))))(xs)
  assert dict(counter.counts) == {"f": 1, "fwd": 1, "bwd": 1}
  np.testing.assert_allclose(g, 2 * jnp.sin(xs) * jnp.cos(xs), rtol=1e-6)


def test_values_pass_through_unchanged():
  counter = RunCounter()
  a = jnp.arange(6, dtype=jnp.int32).reshape(2, 3)
  b = jnp.array([True, False])
  c = jnp.ones((2,), jnp.bfloat16)
  for fn in (counter.count, jax.jit(counter.count, static_argnums=0)):
    got = fn("k", a, b, c)
    assert [(x.dtype, x.shape) for x in got] == [
        (a.dtype, a.shape), (b.dtype, b.shape), (c.dtype, c.shape)]
    for x, y in zip(got, (a, b, c)):
      np.testing.assert_array_equal(x, y)
  assert counter.count("one", a).shape == a.shape   # one array: not a tuple
  assert counter.counts == {"k": 2, "one": 1}
  # forward mode passes tangents through; second order differentiates it
  t = jax.jvp(lambda x: counter.count("k", x) * 2.0, (X,), (jnp.ones(3),))[1]
  np.testing.assert_allclose(t, 2.0 * np.ones(3))
  h = jax.grad(jax.grad(lambda x: jnp.sin(counter.count("k", x))))(0.5)
  np.testing.assert_allclose(h, -np.sin(0.5), rtol=1e-6)


def test_raises():
  counter = RunCounter()
  with pytest.raises(TypeError, match="at least one array"):
    counter.count("f")
  with pytest.raises(TypeError, match="name must be a string"):
    counter.count(3, X)


def test_a_debug_callback_changes_what_runs_the_counter_does_not():
  """The getting-started page's warning: a jax.debug.callback in f runs
  twice with a fused rule under checkpoint (JAX keeps the rematerialized f
  for its effect); the counter in the same place counts the contract's
  once."""
  def fused(counter, f):
    F = smart_custom_vjp(f)
    F.defvjp(lambda x: (jnp.sin(x), x), lambda x, g: (jnp.cos(x) * g,),
             fwd_bwd=lambda x, g: (counter.count("fwd_bwd", jnp.cos(x) * g),))
    jax.block_until_ready(jax.jit(jax.grad(loss(F, True)))(X))
    jax.effects_barrier()

  counter, printed = RunCounter(), []

  def f_with_callback(x):
    jax.debug.callback(lambda: printed.append("f"))
    return jnp.sin(x)

  fused(counter, f_with_callback)
  assert printed == ["f", "f"] and counter.counts == {"fwd_bwd": 1}
  counter = RunCounter()
  fused(counter, lambda x: counter.count("f", jnp.sin(x)))
  assert counter.counts == {"f": 1, "fwd_bwd": 1}
