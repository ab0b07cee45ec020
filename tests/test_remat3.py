"""smartvjp under JAX's remat3 path (``jax_remat3`` + ``jax_custom_vjp3``).

Under those flags ``jax.checkpoint`` consults JAX's remat3 rule table, where
smartvjp registers its rules (``smartvjp/_remat.py``). Every test compares
values with ``jax.custom_vjp`` under the same flags (or with the plain
function where ``jax.custom_vjp`` itself fails) and counts which rules run.
"""

import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.ad_checkpoint import checkpoint_name

import kernels as K
from kernels import run
from smartvjp import smart_custom_vjp

FLAGS = ("jax_remat3", "jax_custom_vjp3")
X = jnp.array([0.3, -1.2, 2.0], jnp.float32)

pytestmark = pytest.mark.skipif(
    not all(K.has_flag(f) for f in FLAGS),
    reason="jax_remat3 and jax_custom_vjp3 first appear in jax 0.10.1")


def remat3():
  return K.config(**{f: True for f in FLAGS})


def default_path():
  """Both flags off (inside a test, where the fixture turned them on)."""
  return K.config(**{f: False for f in FLAGS})


@pytest.fixture(autouse=True)
def _flags():
  with remat3():
    yield


def both(f, fwd, bwd, **kw):
  """(smart, jax.custom_vjp) with the same rules."""
  s = smart_custom_vjp(f)
  s.defvjp(fwd, bwd, **kw)
  r = jax.custom_vjp(f)
  r.defvjp(fwd, bwd)
  return s, r


def kernel_calls(fused=False, never_dce=False):
  f, fwd, bwd, fb = K.sin_rules(never_dce)
  return both(f, fwd, bwd, **({"fwd_bwd": fb} if fused else {}))


def loss(F, policy=None, remat=True):
  G = jax.checkpoint(F, policy=policy) if remat else F
  return lambda x: jnp.sum(G(x) ** 2)


# -- issue 15: the two failures ------------------------------------------------

@pytest.mark.parametrize("jit", [False, True], ids=["eager", "jit"])
def test_closure_over_a_concrete_array(jit):
  scale = jnp.float32(1.5)

  def f(x):
    return jnp.sin(x) * scale

  def fwd(x):
    return f(x), (x,)

  def bwd(res, g):
    return (jnp.cos(res[0]) * scale * g,)
  S, R = both(f, fwd, bwd)
  wrap = jax.jit if jit else (lambda p: p)
  got = wrap(jax.grad(jax.checkpoint(S)))(0.3)
  want = wrap(jax.grad(jax.checkpoint(R)))(0.3)
  np.testing.assert_allclose(got, want, rtol=1e-6)
  np.testing.assert_allclose(got, 1.5 * np.cos(0.3), rtol=1e-6)


@pytest.mark.parametrize("remat", [False, True], ids=["plain", "checkpoint"])
def test_checkpoint_name_inside_bwd_under_jit(remat):
  def f(x):
    return jnp.sin(x)

  def fwd(x):
    return f(x), (x,)

  def bwd(res, g):
    return (checkpoint_name(jnp.cos(res[0]), "c") * g,)
  S, R = both(f, fwd, bwd)
  got = jax.jit(jax.grad(loss(S, remat=remat)))(X)
  want = jax.jit(jax.grad(loss(R, remat=remat)))(X)
  np.testing.assert_allclose(got, want, rtol=1e-6)


# -- which rules run where -------------------------------------------------------

NOTHING = jax.checkpoint_policies.nothing_saveable
EVERYTHING = jax.checkpoint_policies.everything_saveable
DOTS = jax.checkpoint_policies.dots_saveable


@pytest.mark.parametrize("never_dce", [False, True], ids=["callback", "never_dce"])
@pytest.mark.parametrize("policy,fused,expected", [
    (None, False, {"f": 1, "fwd": 1, "bwd": 1}),
    (NOTHING, False, {"f": 1, "fwd": 1, "bwd": 1}),
    (DOTS, False, {"f": 1, "fwd": 1, "bwd": 1}),      # a kernel's output
    (EVERYTHING, False, {"fwd": 1, "bwd": 1}),
    (None, True, {"f": 1, "fwd_bwd": 1}),
    (NOTHING, True, {"f": 1, "fwd_bwd": 1}),
    (EVERYTHING, True, {"fwd": 1, "bwd": 1}),          # saved: no fwd_bwd
], ids=["checkpoint", "nothing", "dots", "everything", "fused",
        "fused_nothing", "fused_everything"])
def test_rule_counts_by_policy(policy, fused, expected, never_dce):
  S, R = kernel_calls(fused, never_dce)
  got, counts = run(jax.jit(jax.grad(loss(S, policy))), X)
  want, _ = run(jax.jit(jax.grad(loss(R, policy))), X)
  np.testing.assert_allclose(got, want, rtol=1e-6)
  assert counts == expected


def test_vmap_of_grad_of_checkpoint():
  S, R = kernel_calls()
  xs = jnp.stack([X, X * 0.5])
  got, counts = run(jax.jit(jax.vmap(jax.grad(loss(S)))), xs)
  want, _ = run(jax.jit(jax.vmap(jax.grad(loss(R)))), xs)
  np.testing.assert_allclose(got, want, rtol=1e-6)
  assert counts == {"f": 2, "fwd": 2, "bwd": 2}


def _jax_coded(extra_unnamed=False):
  """tanh(x @ w) with JAX-coded rules; fwd's residual y is named "y"."""
  return both(*K.matmul_tanh_rules(extra_unnamed))


XM, WM = jnp.linspace(-1, 1, 12).reshape(4, 3), jnp.full((3, 2), 0.1)


def _grad_text(F, policy):
  return str(jax.make_jaxpr(jax.grad(
      lambda x, w: jnp.sum(jax.checkpoint(F, policy=policy)(x, w)),
      (0, 1)))(XM, WM))


@pytest.mark.parametrize("policy,forward", [
    (DOTS, "smartvjp_fwd"),                       # y is a dot's output
    (jax.checkpoint_policies.save_only_these_names("y"), "smartvjp_fwd"),
    (jax.checkpoint_policies.save_only_these_names("z"), "smartvjp_primal"),
    (NOTHING, "smartvjp_primal"),
], ids=["dots", "named", "other_name", "nothing"])
@pytest.mark.parametrize("extra_unnamed", [False, True], ids=["all", "split"])
def test_jax_coded_fwd_follows_the_policy(policy, forward, extra_unnamed):
  S, R = _jax_coded(extra_unnamed)
  grad = lambda F: jax.jit(jax.grad(
      lambda x, w: jnp.sum(jax.checkpoint(F, policy=policy)(x, w) ** 2),
      (0, 1)))
  for a, b in zip(grad(S)(XM, WM), grad(R)(XM, WM)):
    np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-7)
  text = _grad_text(S, policy)
  # the backward region starts where remat3 pins the values it reads
  before, _, after = text.partition("optimization_barrier")
  prims = lambda t: set(re.findall(r"smartvjp_\w+", t))
  assert forward in prims(before)
  other = {"smartvjp_fwd", "smartvjp_primal"} - {forward}
  assert not other & prims(before)
  if forward == "smartvjp_primal":   # f forward; fwd only in the rem region
    assert "smartvjp_fwd" in prims(after)


def test_split_saves_the_named_dot_and_recomputes_the_rest():
  # y saved, sum(x, 1) recomputed: one matmul forward, two backward
  S, R = _jax_coded(extra_unnamed=True)
  policy = jax.checkpoint_policies.save_only_these_names("y")
  x, w = jnp.ones((64, 48)), jnp.full((48, 32), 0.1)
  flops = {}
  for name, G in (("smartvjp", S), ("jax", R)):
    grad = jax.jit(jax.grad(
        lambda x, w: jnp.sum(jax.checkpoint(G, policy=policy)(x, w)), (0, 1)))
    cost = grad.lower(x, w).compile().cost_analysis()
    flops[name] = (cost[0] if isinstance(cost, list) else cost)["flops"]
  matmul = 2 * 64 * 48 * 32
  # no matmul more than jax.custom_vjp (jax 0.10.2: a few elementwise flops
  # more), and three in all
  assert flops["smartvjp"] < flops["jax"] + matmul / 2
  assert flops["smartvjp"] < 4 * matmul


def _sin_coded():
  def f(x):
    return jnp.sin(x)

  def fwd(x):
    return jnp.sin(x), (jnp.cos(x),)

  def bwd(res, g):
    return (res[0] * g,)
  return both(f, fwd, bwd)


@pytest.mark.parametrize("policy", [None, EVERYTHING], ids=["remat", "saved"])
def test_grad_of_grad_of_checkpoint(policy):
  S, R = _sin_coded()
  second = lambda F: jax.grad(lambda x: jnp.sum(
      jax.grad(lambda x: jnp.sum(jax.checkpoint(F, policy=policy)(x)))(x)))
  np.testing.assert_allclose(jax.jit(second(S))(X), jax.jit(second(R))(X),
                             rtol=1e-6)
  np.testing.assert_allclose(second(S)(X), -np.sin(X), rtol=1e-6)


@pytest.mark.parametrize("policy", [None, EVERYTHING, NOTHING],
                         ids=["remat", "saved", "nothing"])
def test_linearize_of_checkpoint(policy):
  S, _ = _sin_coded()
  out, lin = jax.linearize(jax.checkpoint(S, policy=policy), X)
  np.testing.assert_allclose(out, np.sin(X), rtol=1e-6)
  np.testing.assert_allclose(lin(jnp.ones_like(X)), np.cos(X), rtol=1e-6)


def test_two_layers_in_one_checkpoint_saved_by_name():
  # the second call reads the first's output on the rem side: it must be the
  # forward pass's value, and its tangent must still reach the first call
  S, R = _jax_coded()
  policy = jax.checkpoint_policies.save_only_these_names("y")
  w2 = jnp.full((2, 2), 0.3)
  two = lambda F: jax.jit(jax.grad(lambda x, w: jnp.sum(jax.checkpoint(
      lambda x, w: F(F(x, w), w2), policy=policy)(x, w) ** 2), (0, 1)))
  for a, b in zip(two(S)(XM, WM), two(R)(XM, WM)):
    np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-7)


def test_debug_callbacks_run_as_on_the_default_path():
  def counted(name):
    def fn(*_):
      K.COUNTS[name] += 1
    return fn

  def f(x):
    jax.debug.callback(counted("f"), x)
    return jnp.sin(x)

  def fwd(x):
    jax.debug.callback(counted("fwd"), x)
    return jnp.sin(x), (jnp.cos(x),)

  def bwd(res, g):
    jax.debug.callback(counted("bwd"), g)
    return (res[0] * g,)
  S, R = both(f, fwd, bwd)
  got, counts = run(jax.jit(jax.grad(loss(S))), X)
  want, _ = run(jax.jit(jax.grad(loss(R))), X)
  np.testing.assert_allclose(got, want, rtol=1e-6)
  assert counts == {"f": 1, "fwd": 1, "bwd": 1}
  with default_path():   # the same on JAX's default path
    _, default_counts = run(jax.jit(jax.grad(loss(S))), X)
  assert default_counts == counts


def _two_outputs():
  def f(x, n):
    return jnp.sin(x) * n, jnp.cos(x)

  def fwd(x, n):
    return f(x, n), (jnp.cos(x), jnp.sin(x), n)

  def bwd(res, g):
    c, s, n = res
    return (g[0] * c * n - g[1] * s, None)
  return both(f, fwd, bwd)


@pytest.mark.parametrize("policy", [None, EVERYTHING, DOTS],
                         ids=["remat", "saved", "dots"])
def test_one_of_two_outputs_used_and_an_integer_argument(policy):
  S, R = _two_outputs()
  prog = lambda F: jax.jit(jax.grad(lambda x: jnp.sum(jax.checkpoint(
      lambda x: F(x, 3)[0], policy=policy)(x) ** 2)))
  np.testing.assert_allclose(prog(S)(X), prog(R)(X), rtol=1e-6)


def test_fwd_output_type_error_names_fwd():
  raised = []
  for cv in (jax.custom_vjp, smart_custom_vjp):
    F = cv(lambda x: jnp.sin(x))
    F.defvjp(lambda x: (jnp.sin(x).astype(jnp.float16), (x,)),
             lambda r, g: (g,))
    with pytest.raises(Exception) as info:
      jax.grad(lambda x: jnp.sum(jax.checkpoint(F)(x)))(X)
    raised.append(info.value)
  assert type(raised[1]) is type(raised[0]) is TypeError
  assert "fwd rule" in str(raised[1]) and "float16" in str(raised[1])


NESTED = {
    "nested": lambda F: jax.checkpoint(lambda x: jax.checkpoint(F)(x) * 2),
    "checkpoint_of_vmap": lambda F: jax.checkpoint(jax.vmap(F)),
    "cond_in_checkpoint": lambda F: jax.checkpoint(
        lambda x: jax.lax.cond(True, F, lambda x: x, x)),
    "scan_in_checkpoint": lambda F: jax.checkpoint(lambda x: jax.lax.scan(
        lambda c, _: (F(c), None), x, None, length=3)[0]),
    "checkpointed_scan_of_checkpoints": lambda F: jax.checkpoint(
        lambda x: jax.lax.scan(lambda c, _: (jax.checkpoint(F)(c), None), x,
                               None, length=3)[0]),
}


@pytest.mark.parametrize("fused", [False, True], ids=["fwd_bwd_none", "fused"])
@pytest.mark.parametrize("program", list(NESTED))
def test_nested_programs_count_as_on_the_default_path(program, fused):
  xs = jnp.stack([X, X * 0.5]) if program == "checkpoint_of_vmap" else X
  S, R = kernel_calls(fused)
  prog = lambda F: jax.jit(jax.grad(lambda x: jnp.sum(NESTED[program](F)(x) ** 2)))
  got, counts = run(prog(S), xs)
  want, _ = run(prog(R), xs)
  np.testing.assert_allclose(got, want, rtol=1e-6)
  with default_path():
    S2, _ = kernel_calls(fused)
    _, default_counts = run(prog(S2), xs)
  assert counts == default_counts


def test_nested_policies_never_run_more_kernels_than_jax():
  # remat3 applies the inner checkpoint's policy to the inner body (the outer
  # everything_saveable does not reach it), for jax.custom_vjp as for smartvjp
  S, R = kernel_calls()
  prog = lambda F: jax.jit(jax.grad(lambda x: jnp.sum(jax.checkpoint(
      lambda x: jax.checkpoint(F)(x) * 2, policy=EVERYTHING)(x) ** 2)))
  got, counts = run(prog(S), X)
  want, ref_counts = run(prog(R), X)
  np.testing.assert_allclose(got, want, rtol=1e-6)
  assert counts["fwd"] == 1 and counts["bwd"] == 1
  assert sum(counts.values()) <= sum(ref_counts.values())


# -- the rem side batched before it is differentiated ---------------------------

@pytest.mark.parametrize("policy", [
    None, EVERYTHING, DOTS,
    jax.checkpoint_policies.save_only_these_names("y")],
    ids=["remat", "everything", "dots_split", "named"])
@pytest.mark.parametrize("extra_unnamed", [False, True], ids=["all", "split"])
@pytest.mark.parametrize("jit", [False, True], ids=["eager", "jit"])
def test_vmap_of_grad_that_leaves_the_call_undifferentiated(
    policy, extra_unnamed, jit):
  # grad with respect to s only: the call's inputs carry no tangent, so its
  # rem side is still a smartvjp_rem equation when the vmap batches it
  S, R = _jax_coded(extra_unnamed)

  def per_example(F):
    def g(x, s):
      return jax.grad(lambda s: jnp.sum(
          jax.checkpoint(lambda x, s: F(x, WM) * s, policy=policy)(x, s)))(s)
    fn = jax.vmap(g)
    return jax.jit(fn) if jit else fn
  xs, ss = jnp.stack([XM + 1.0, XM * 0.5 + 2.0, 1.5 - XM]), jnp.ones(3)
  same_outcome(per_example(S), per_example(R), xs, ss)


def same_outcome(smart, ref, *args):
  """Equal values, or the same exception type where ``jax.custom_vjp``
  raises (jax 0.10.2 cannot vmap a remat3 ``checkpoint_name``)."""
  try:
    want = ref(*args)
  except Exception as e:  # noqa: BLE001 - compared below
    with pytest.raises(type(e)):
      smart(*args)
    return
  np.testing.assert_allclose(smart(*args), want, rtol=1e-6, atol=1e-7)


@pytest.mark.parametrize("policy", [None, EVERYTHING, DOTS],
                         ids=["remat", "everything", "dots_split"])
def test_grad_through_a_batched_rem_side_uses_bwd(policy):
  # the batched rem side differentiated again: its derivative is bwd's
  # (a straight-through floor), not that of fwd's code
  def f(x, w):
    return jnp.floor(x @ w)

  def fwd(x, w):
    y = x @ w
    return jnp.floor(y), (x, w)

  def bwd(res, g):
    x, w = res
    return g @ w.T, x.T @ g
  S, R = both(f, fwd, bwd)

  def outer(F):
    def inner(x, s):
      return jax.grad(lambda s: jnp.sum(
          jax.checkpoint(lambda x, s: F(x, WM) * s, policy=policy)(x, s)))(s)
    return jax.jit(jax.grad(lambda xs: jnp.sum(
        jax.vmap(inner)(xs, jnp.ones(xs.shape[0])))))
  xs = jnp.stack([XM + 1.0, XM * 0.5 + 2.0])
  # what bwd defines: d sum(F(x)) / dx = ones @ w.T (floor's would be 0)
  want = jnp.broadcast_to(WM.sum(1), xs.shape)
  with jax.default_matmul_precision("float32"):   # a TPU's default: bf16
    np.testing.assert_allclose(outer(S)(xs), want, rtol=1e-6)
    # jax.custom_vjp agrees where its remat3 path runs this program (0.12;
    # 0.11.2 fails inside JAX, 0.10.2 evaluates f inline and returns floor's 0)
    if tuple(int(p) for p in jax.__version__.split(".")[:2]) >= (0, 12):
      np.testing.assert_allclose(outer(R)(xs), want, rtol=1e-6)
