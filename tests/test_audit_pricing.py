"""The audit's prices come from compiled programs, and kernels are seen at
any depth through the one walker (``smartvjp/_jaxprs.py``:
``inner_jaxprs``, ``is_opaque_kernel``, ``kernel_cost_estimate``,
``kernel_totals``), which the plan (``_jaxprs.plan_cost``) reads too."""

import collections

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import Mesh, PartitionSpec

import smartvjp
from smartvjp import _jaxprs
from smartvjp.audit import _analysis as A
from smartvjp.audit import _count as C


def _priced(fn, *args):
  """A program's cost as the audit prices a step: compiled, loops scaled."""
  closed = jax.make_jaxpr(fn)(*args)
  compiled = jax.jit(fn).lower(*args).compile()
  notes: list = []
  return A.program_cost(closed, A._cost(compiled), compiled.as_text(), notes,
                        {}), notes


@pytest.mark.parametrize("unroll,within", [(True, 0.03), (4, 0.12)])
def test_a_rolled_and_an_unrolled_scan_are_priced_alike(unroll, within):
  """One matmul body (which XLA cannot fuse across iterations), scanned
  16 times rolled and unrolled: priced within 3% (the uncompiled body the
  audit used to price priced the rolled loop's bytes several times over).
  Unrolled 4 times, the loop's 4 compiled copies (each also slicing its
  input, 360 kB) are counted beside 12 copies compiled alone (229 kB):
  within 12%. Where XLA fuses across unrolled iterations (an elementwise
  body, or a whole gradient: 21% faster unrolled on this CPU, priced 21%
  cheaper) the two compiled programs really differ, and so do their
  prices."""
  w = jnp.full((128, 128), 0.01)
  body = lambda c, x: (jnp.tanh(c @ w + x), None)
  c, xs = jnp.ones((64, 128)), jnp.ones((16, 64, 128))
  rolled, notes = _priced(
      lambda c, xs: jax.lax.scan(body, c, xs)[0], c, xs)
  unrolled, _ = _priced(
      lambda c, xs: jax.lax.scan(body, c, xs, unroll=unroll)[0], c, xs)
  assert not notes
  assert rolled["flops"] >= 16 * 2 * 64 * 128 * 128
  for k in ("flops", "transcendentals", "bytes_accessed"):
    assert rolled[k] == pytest.approx(unrolled[k], rel=within), k


def test_a_nested_loop_is_scaled_by_both_trip_counts():
  w = jnp.full((64, 64), 0.01)
  inner = lambda c, _: (jnp.tanh(c @ w), None)
  outer = lambda c, _: (jax.lax.scan(inner, c, None, length=3)[0], None)
  x = jnp.ones((8, 64))
  cost, notes = _priced(
      lambda x: jax.lax.scan(outer, x, None, length=5)[0], x)
  assert not notes
  assert cost["flops"] == pytest.approx(15 * 2 * 8 * 64 * 64, rel=0.02)


# -- kernels at any depth -------------------------------------------------------------

def _callback(x):
  return jax.pure_callback(lambda v: np.asarray(np.sin(v), v.dtype),
                           jax.ShapeDtypeStruct(x.shape, x.dtype), x)


def _custom_jvp(x):
  f = jax.custom_jvp(_callback)
  f.defjvp(lambda p, t: (_callback(p[0]), t[0]))
  return f(x)


def _custom_vjp(x):
  f = jax.custom_vjp(_callback)
  f.defvjp(lambda x: (_callback(x), None), lambda _, g: (g,))
  return f(x)


def _shard_map(x):
  mesh = Mesh(np.array(jax.devices()[:1]), ("i",))
  return jax.shard_map(_callback, mesh=mesh, in_specs=PartitionSpec(),
                       out_specs=PartitionSpec())(x)


# depth -> (rule, kernel launches per run)
DEPTHS = {
    "top": (_callback, 1),
    "jit": (jax.jit(_callback), 1),
    "nested jit": (jax.jit(lambda x: jax.jit(_callback)(x) + 1), 1),
    "closed_call": (lambda x: jax.named_call(_callback, name="inner")(x), 1),
    "custom_jvp": (_custom_jvp, 1),
    "custom_vjp": (_custom_vjp, 1),
    "cond": (lambda x: jax.lax.cond(x[0] > 0, _callback, jnp.cos, x), 1),
    "cond both": (lambda x: jax.lax.cond(
        x[0] > 0, _callback, lambda x: _callback(_callback(x)), x), 2),
    "scan": (lambda x: jax.lax.scan(lambda c, _: (_callback(c), None), x,
                                    None, length=3)[0], 3),
    "while": (lambda x: jax.lax.fori_loop(0, 4, lambda i, c: _callback(c),
                                          x), 4),
    "scan in jit in scan": (lambda x: jax.lax.scan(
        lambda c, _: (jax.jit(lambda c: jax.lax.scan(
            lambda d, _: (_callback(d), None), c, None, length=2)[0])(c),
            None), x, None, length=3)[0], 6),
    "shard_map": (_shard_map, 1),
}


def _compiled_launches(hlo: str) -> int:
  """Custom calls a compiled program launches per run: each kernel
  instruction times its loops' trip counts, a conditional's costliest
  branch."""
  comps, entry = C.parse_hlo(hlo)

  def launches(name) -> int:
    n = 0
    for ins in comps.get(name, ()):
      n += C.is_kernel(ins)
      if ins.opcode in ("fusion", "call"):
        n += sum(launches(c) for r, c in ins.callees.items()
                 if r in ("calls", "to_apply"))
      elif ins.opcode == "while":
        trips = ins.trips or C.condition_bound(
            comps, ins.callees.get("condition")) or 1
        n += trips * launches(ins.callees["body"])
      elif ins.opcode == "conditional":
        names = ins.branches or [ins.callees[k] for k in (
            "true_computation", "false_computation") if k in ins.callees]
        n += max(map(launches, names), default=0)
    return n
  return launches(entry)


@pytest.mark.parametrize("depth", list(DEPTHS))
def test_a_kernel_is_seen_at_any_depth(depth):
  """A host callback at each depth of item 2 of issue 63: the facade's
  walker finds it, and its launches per run equal the compiled program's
  custom calls (loops times their trip counts)."""
  rule, want = DEPTHS[depth]
  x = jnp.ones(4)
  closed = jax.make_jaxpr(rule)(x)
  assert any(_jaxprs.is_opaque_kernel(e) for e, _ in _jaxprs.equations(closed))
  assert A.opaque_count(closed) == want
  compiled = jax.jit(rule).lower(x).compile().as_text()
  assert _compiled_launches(compiled) == want


def test_a_pallas_kernels_body_is_not_walked():
  """A ``pallas_call`` is the kernel: the walker stops there (its body's
  equations are not the rule's)."""
  from jax.experimental import pallas as pl

  def kernel(x_ref, o_ref):
    o_ref[...] = jnp.sin(x_ref[...])
  call = pl.pallas_call(kernel, out_shape=jax.ShapeDtypeStruct((8, 128),
                                                               jnp.float32),
                        interpret=True)
  closed = jax.make_jaxpr(call)(jnp.ones((8, 128)))
  (eqn,) = closed.jaxpr.eqns
  assert _jaxprs.is_opaque_kernel(eqn) and _jaxprs.inner_jaxprs(eqn) == []
  assert [e.primitive.name for e, _ in _jaxprs.equations(closed)] == ["pallas_call"]


def _site_with_kernel_in(wrap):
  """A ``jax.custom_vjp`` whose ``fwd`` and ``bwd`` run their kernels
  inside ``wrap`` (a nesting)."""
  F = jax.custom_vjp(_callback)
  F.defvjp(lambda x: (wrap(_callback)(x), x),
           lambda x, g: (wrap(_callback)(g) * jnp.cos(x),))
  return F


@pytest.mark.parametrize("wrap", [
    lambda k: jax.jit(jax.jit(k)),
    lambda k: (lambda x: jax.lax.cond(x[0] > 0, k, k, x)),
    lambda k: (lambda x: jax.lax.scan(lambda c, _: (k(c), None), x, None,
                                      length=2)[0]),
], ids=["jit in jit", "cond", "scan"])
def test_the_audit_calls_a_site_with_a_nested_kernel_opaque(wrap):
  F = _site_with_kernel_in(wrap)
  step = jax.grad(lambda x: jnp.sum(jax.checkpoint(F)(x)))
  a = smartvjp.audit(step, jnp.ones(4), configs=("as_written", "smartvjp"))
  (s,) = a.sites
  assert s["opaque"]
  assert s["runs"]["as_written"]["kernel_launches"] > 0


# -- the plan and the audit price a kernel with one function -------------------------

def test_the_plan_and_the_audit_read_one_kernel_reader(monkeypatch):
  """``_jaxprs.plan_cost`` (the plan) and the audit's ``rule_cost`` and
  ``opaque_count`` take a kernel's launches and estimate from ``_jaxprs``'
  ``kernel_totals`` / ``kernel_cost_estimate``: replacing them changes
  both."""
  from jax.experimental import pallas as pl

  def kernel(x_ref, o_ref):
    o_ref[...] = x_ref[...] * 2.0
  est = pl.CostEstimate(flops=1000, transcendentals=10, bytes_accessed=4096)
  call = pl.pallas_call(kernel, out_shape=jax.ShapeDtypeStruct((8, 128),
                                                               jnp.float32),
                        interpret=True, cost_estimate=est)
  closed = jax.make_jaxpr(lambda x: jax.lax.scan(
      lambda c, _: (call(c), None), x, None, length=3)[0])(jnp.ones((8, 128)))
  k = _jaxprs.kernel_totals(closed)
  assert (k["kernels"], k["flops"], k["transcendentals"],
          k["bytes_accessed"]) == (3, 3000, 30, 3 * 4096)
  plan = _jaxprs.plan_cost(closed)
  assert (plan.kernels, plan.kernel_bytes) == (3, 3 * 4096)
  assert A.opaque_count(closed) == 3
  calls = collections.Counter()
  real = _jaxprs.kernel_totals

  def spy(jaxpr):
    calls["kernel_totals"] += 1
    return dict(real(jaxpr), kernels=7)
  monkeypatch.setattr(_jaxprs, "kernel_totals", spy)
  assert _jaxprs.plan_cost(closed).kernels == 7
  assert A.opaque_count(closed) == 7
  assert calls["kernel_totals"] == 2
  # the audit's price of the kernel is its estimate, per trip
  audit = A.rule_cost(closed)
  assert audit["flops"] == pytest.approx(3000, rel=0.01)
  assert audit["bytes_accessed"] >= 3 * 4096


# -- the advice follows the numbers -----------------------------------------------------

def _info(share, opaque=False, ran_fused=False, launches_saved=0,
          remat=True):
  runs = lambda fwd, fb: {"jaxpr": dict(f=0, fwd=fwd, bwd=4, fwd_bwd=fb)}
  return dict(
      name="m.layer", defined_at="/home/me/m.py:3", opaque=opaque,
      remat=remat, best_config="smartvjp_fused", residuals=[],
      runs={"as_written": runs(8, 0),
            "smartvjp_fused": runs(4 - 4 * ran_fused, 4 * ran_fused)},
      refused=None, kind="jax.custom_vjp",
      predicted=dict(share_of_step=share, launches_saved=launches_saved,
                     dropped_bytes_saved=0))


# (share of the step, opaque, fused pair ran, launches saved, remat)
# -> the advice's start, and whether it names fwd_bwd
ADVICE = [
    ((0.005, False, False, 0, True), "swap: decorate m.layer", False),
    ((0.0049, False, False, 0, True), "no action: XLA already removes", False),
    ((0.02, False, True, 0, True), "swap: decorate m.layer", True),
    ((0.02, True, True, 2, True), "swap: decorate m.layer", True),
    ((0.02, True, False, 2, True), "swap: decorate m.layer", False),
    ((0.001, True, True, 2, True), "no action: the swap's predicted saving "
     "is 0.10% of the step, too small to act on", False),
    ((-0.01, True, True, 0, True), "no action: the swap would cost time",
     False),
    ((None, True, False, 1, True), "swap: decorate m.layer", False),
    ((None, True, False, 0, True), "swap: decorate m.layer", False),  # fwd 8->4
    ((0.5, True, True, 4, False), "no action: no jax.checkpoint around this "
     "site, so every configuration runs fwd once and bwd once per call",
     False),
]


@pytest.mark.parametrize("args,start,fused", ADVICE)
def test_the_advice_follows_the_numbers(args, start, fused):
  """"swap" from a predicted saving of 0.5% of the step, "no action" below
  it; "use its fwd_bwd" only where the configuration priced ran the fused
  pair; without a time model, a kernel site's counts decide."""
  got = A.suggestion(_info(*args))
  assert got.startswith(start), got
  assert ("fwd_bwd" in got) == fused, got


def test_smartvjp_fused_forces_the_fused_pair():
  """The ``smartvjp_fused`` configuration runs ``fwd_bwd`` even where the
  plan's costs would pick ``fwd`` + ``bwd`` (a fused rule that costs
  more), so the advice priced from it is the fused pair's."""
  sm = smartvjp.smart_custom_vjp(lambda x: jnp.sin(x))
  # fwd_bwd costs far more than fwd + bwd: left to itself the plan picks
  # fwd + bwd where the output is read
  big = lambda x: jnp.sum(jnp.outer(x, x) @ jnp.outer(x, x))
  sm.defvjp(lambda x: (jnp.sin(x), jnp.cos(x)), lambda c, g: (c * g,),
            fwd_bwd=lambda x, g: (jnp.cos(x) * g + 0 * big(x),))
  step = jax.grad(lambda x: jnp.sum(jax.checkpoint(lambda x: jnp.sin(sm(x)))(x)))
  a = smartvjp.audit(step, jnp.ones(8), configs=("as_written", "smartvjp",
                                                 "smartvjp_fused"))
  (s,) = a.sites
  assert s["runs"]["smartvjp_fused"]["jaxpr"]["fwd_bwd"] > 0
  assert s["runs"]["smartvjp"]["jaxpr"]["fwd_bwd"] == 0


# -- the audit's size ---------------------------------------------------------------------

def _code_lines(path):
  """``(code lines, name)`` of each function in a file (its docstring,
  blank lines and comment lines left out)."""
  import ast
  lines = path.read_text().splitlines()
  out = []
  for node in ast.walk(ast.parse(path.read_text())):
    if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
      body = node.body
      doc = (len(body) > 1 and isinstance(body[0], ast.Expr)
             and isinstance(getattr(body[0], "value", None), ast.Constant)
             and isinstance(body[0].value.value, str))
      start = body[0].end_lineno if doc else body[0].lineno - 1
      n = sum(1 for line in lines[start:node.end_lineno]
              if line.strip() and not line.strip().startswith("#"))
      out.append((n, f"{path.name}:{node.name}"))
  return out


def test_no_audit_function_is_longer_than_the_cores_longest():
  import pathlib
  pkg = pathlib.Path(smartvjp.__file__).parent
  core = max(n for p in pkg.glob("_*.py") for n, _ in _code_lines(p))
  audit = max(x for p in (pkg / "audit").glob("*.py") for x in _code_lines(p))
  assert audit[0] <= core, audit


@pytest.mark.parametrize("model,calibrated,start", [
    (0.001, 0.05, "swap: decorate m.layer"),
    (0.05, 0.001, "no action: the swap's predicted saving is 0.10%"),
    (0.05, None, "swap: decorate m.layer"),
])
def test_the_advice_follows_the_leading_estimate(model, calibrated, start):
  """With ``calibrate=True`` the report leads with the rules' timings
  (a host callback the model prices at its launch alone); the advice and
  the share it quotes are that estimate's, not the model's."""
  info = _info(model, opaque=True, launches_saved=4)
  if calibrated is not None:
    info["predicted"]["calibrated"] = dict(
        share_of_step=calibrated, rounds=20, level=0.96,
        share_of_step_interval=[calibrated - 0.001, calibrated + 0.001])
  got = A.suggestion(info)
  assert got.startswith(start), got
  lead = calibrated if calibrated is not None else model
  assert f"{lead:.1%}" in got or f"{lead:.2%}" in got, got


@pytest.mark.parametrize("interval,start", [
    ((-0.004, 0.006), "no action: the swap's predicted saving is 0.10%"),
    ((-0.05, 0.07), "cannot tell (±6.0 points): the swap's predicted "
     "saving is 0.10%"),
    ((0.01, 0.03), "swap: decorate m.layer"),
])
def test_the_words_follow_the_timed_interval(interval, start):
  """"Why" 9: "within noise" was printed where nothing said so. Now the
  advice is the interval's (``_calibrate.advice``) and the words say it:
  an interval holding 0 narrower than the tolerance is no action, a wider
  one cannot tell, with its half-width; the swap launches fewer kernels
  in each case, which no longer decides over the timings."""
  info = _info(0.05, opaque=True, launches_saved=3)
  info["predicted"]["calibrated"] = dict(
      share_of_step=0.001 if interval[0] < 0 else 0.02, rounds=20,
      level=0.96, share_of_step_interval=list(interval))
  kind, got = A.advise(info)
  assert got.startswith(start), got
  assert kind == got.split(":")[0].split(" (")[0]
  assert "within noise" not in got
