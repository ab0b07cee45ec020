"""``smartvjp.testing.RunCounter`` counts what the README's contract table
says runs: each row of the table, built with counted JAX-coded rules, gives
the table's ``smart_custom_vjp`` cell, on JAX's default path and under the
remat3 flags, and its ``jax.custom_vjp`` cell on the default path (a
removable kernel's, where the cell gives one). The count is removed where
nothing reads it, as a kernel is, and ``smartvjp.print_schedule`` of the
same program places the rules it counts."""

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


def _runs(cell: str) -> dict[str, int]:
  return {r: int(n) for r, n in re.findall(r"([\w_]+) (\d+)", cell)}


def contract_table() -> dict[str, dict[str, dict[str, int]]]:
  """``{program: {column: {rule: runs}}}`` from the README's table; a
  cell's ``(removable kernel: ...)`` counts, where it gives them, are what
  a kernel that JAX and XLA remove when nothing reads it runs, as
  ``RunCounter``'s step is."""
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
              _runs(cell.split("(removable kernel: ")[-1]))
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


# -- removable as a kernel; what it changes --------------------------------------

def _removable_kernel_counter(counts):
  """A ``jax.pure_callback`` on all a rule returns: XLA removes it where
  nothing reads its outputs, as it removes a kernel's custom call."""
  def count(name, *arrays):
    def run(*xs):
      counts[name] += 1
      return xs
    outs = jax.pure_callback(run, tuple(jax.ShapeDtypeStruct(a.shape, a.dtype)
                                        for a in arrays), *arrays,
                             vmap_method="sequential")
    return outs[0] if len(arrays) == 1 else tuple(outs)
  return count


@pytest.mark.parametrize("decorator", [jax.custom_vjp, smart_custom_vjp],
                         ids=["jax.custom_vjp", "smart_custom_vjp"])
def test_counts_what_a_removable_kernel_runs(decorator):
  """Issue 58: under save_only_these_names with the residual named,
  jax.custom_vjp's rematerialized fwd is dead (its residual is saved, its
  primal output unread): a kernel there is removed, and so is the count
  (fwd 1, bwd 1; a counter that is never removed said fwd 2)."""
  import collections

  class Callback:   # RunCounter's interface over the pure_callback counter
    counts = collections.Counter()
    count = staticmethod(_removable_kernel_counter(counts))

  program = lambda F: jax.jit(jax.grad(loss(
      F, True, jax.checkpoint_policies.save_only_these_names("res"))))
  counter = RunCounter()
  jax.block_until_ready(program(build(decorator, counter, named="res"))(X))
  jax.block_until_ready(program(build(decorator, Callback, named="res"))(X))
  assert dict(counter.counts) == dict(Callback.counts) == {"fwd": 1, "bwd": 1}


def test_the_count_is_removed_where_nothing_reads_it():
  counter = RunCounter()

  def program(x):
    a, b = counter.count("both", jnp.sin(x), jnp.cos(x))
    counter.count("unread", jnp.exp(x))           # removed, as a kernel
    return a                                     # b unread: kept whole
  jaxpr = jax.make_jaxpr(program)(X)
  jaxpr = jax.make_jaxpr(jax.jit(program))(X)   # jit's DCE
  printed = str(jax.jit(program).lower(X).as_text())
  assert printed.count("callback") >= 1
  jax.block_until_ready(jax.jit(program)(X))
  assert counter.counts == {"both": 1}
  del jaxpr
  # the unread count under grad(checkpoint): gone from the program too
  assert "unread" not in str(jax.make_jaxpr(
      jax.grad(lambda x: jnp.sum(jax.checkpoint(program)(x))))(X))


def _jax_coded_dots_saveable(counter):
  """The getting-started page's h: matmul + GELU, JAX-coded rules, each
  output passed through one count when ``counter`` is given."""
  count = counter.count if counter else (
      lambda name, *a: a[0] if len(a) == 1 else a)

  @smart_custom_vjp
  def h(x, w):
    return count("f", jax.nn.gelu(x @ w))

  def h_fwd(x, w):
    z, y = count("fwd", jax.nn.gelu(x @ w), x @ w)
    return z, (x, w, y)

  def h_bwd(res, g):
    x, w, y = res
    dy = g * jax.vmap(jax.grad(jax.nn.gelu))(y.ravel()).reshape(y.shape)
    return count("bwd", dy @ w.T, x.T @ dy)
  h.defvjp(h_fwd, h_bwd)
  return jax.grad(lambda x, w: jnp.sum(jax.checkpoint(
      h, policy=jax.checkpoint_policies.dots_saveable)(x, w) ** 2), (0, 1))


def test_the_count_makes_a_jax_coded_fwd_a_kernel_as_the_docs_say():
  """The counter's step is one opaque step over all a rule returns: a
  JAX-coded fwd with it is a kernel to smartvjp, which does not split it
  under dots_saveable (f forward, fwd backward, where without the count
  fwd's saved side runs forward and bwd reads it). The docstring and the
  getting-started page say so."""
  import smartvjp
  from smartvjp import testing
  x = jnp.linspace(-1.0, 1.0, 8 * 16).reshape(8, 16)
  w = jnp.linspace(0.5, -0.5, 16 * 4).reshape(16, 4)
  plain = [(r.which, r.part) for r in smartvjp.print_schedule(
      _jax_coded_dots_saveable(None), x, w)]
  assert plain == [("fwd", "saved"), ("bwd", None)]
  counter = RunCounter()
  counted = [(r.which, r.part) for r in smartvjp.print_schedule(
      _jax_coded_dots_saveable(counter), x, w)]
  assert counted == [("f", None), ("fwd", None), ("bwd", None)]
  for text in (testing.RunCounter.__doc__, open(os.path.join(
      ROOT, "docs", "getting-started.md"), encoding="utf-8").read()):
    text = " ".join(text.split())
    assert "dots_saveable" in text and "part=saved" in text
    assert "checkpoint_name" in text and "after the count" in text


def test_checkpoint_name_goes_on_the_count_s_output():
  """Named after the count, the policy saves the residual (the README's
  row: fwd 1, bwd 1); named before it, the name is on a value the count
  reads, the residual fwd returns is unnamed and nothing is saved."""
  policy = jax.checkpoint_policies.save_only_these_names("res")

  def counts(name_first):
    counter = RunCounter()
    F = smart_custom_vjp(lambda x: counter.count("f", jnp.sin(x)))

    def fwd(x):
      c = jnp.cos(x)
      if name_first:
        c = checkpoint_name(c, "res")
      y, c = counter.count("fwd", jnp.sin(x), c)
      return y, (c if name_first else checkpoint_name(c, "res"))
    F.defvjp(fwd, lambda c, g: (counter.count("bwd", c * g),))
    jax.block_until_ready(jax.jit(jax.grad(loss(F, True, policy)))(X))
    return dict(counter.counts)
  assert counts(name_first=False) == TABLE[
      "residual named in `fwd`, `save_only_these_names(name)`"][
      "smart_custom_vjp"] == {"fwd": 1, "bwd": 1}
  assert counts(name_first=True) == {"f": 1, "fwd": 1, "bwd": 1}


@pytest.mark.parametrize("row", sorted(ROWS))
def test_print_schedule_places_what_the_counter_counts(row, ad_mode):
  """For the same program, the rule equations print_schedule lists (times
  their scan length; a split fwd's two sides one run) are the runs
  RunCounter counts."""
  import collections
  import smartvjp
  kwargs, programs = ROWS[row]
  for program in programs:
    counter = RunCounter()
    fn = program(build(smart_custom_vjp, counter, **kwargs))
    placed = collections.Counter()
    for r in smartvjp.print_schedule(fn, X):
      placed[r.which] += 0 if r.part == "rest" else r.repeats
    jax.block_until_ready(fn(X))
    if ad_mode == "remat3" and ("saveable" in row or "named" in kwargs):
      # print_schedule's documented exception: under the remat3 flags the
      # program can hold a fwd that nothing reads (its residuals saved),
      # which compiling removes; the counter never sees it run
      assert placed - counter.counts in ({}, {"fwd": 1}), (row, placed)
      placed -= placed - counter.counts
    assert dict(placed) == dict(counter.counts), (row, program)
