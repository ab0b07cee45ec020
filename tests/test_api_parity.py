"""jax.custom_vjp's newer definition methods on smart_custom_vjp.

Each method is tested where the installed ``jax.custom_vjp`` has it (values,
rule executions, errors, against ``jax.custom_vjp`` with the same rules), and
where it does not (a ``NotImplementedError`` naming the JAX release).
"""

import contextlib
import inspect
import sys

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import kernels as K
from smartvjp import smart_custom_vjp

METHODS = {"defvjp_with_logs": "0.11.2", "defvjp_with_accums": "0.12.0",
           "defremat": "0.12.0", "defremat_with_logs": "0.12.0"}
HAS = {m: hasattr(jax.custom_vjp, m) for m in METHODS}
HAS_GB = "generic_batching" in inspect.signature(jax.custom_vjp.defvjp).parameters


def needs(method):
  return pytest.mark.skipif(not HAS[method],
                            reason=f"jax {jax.__version__} lacks {method}")


_has_flag = K.has_flag


flags = K.config


def jax_remat_path():
  """JAX runs defremat's rules only under jax_remat3 + jax_custom_vjp3."""
  return flags(jax_remat3=True, jax_custom_vjp3=True)


X = jnp.array([0.3, -1.2, 2.0], jnp.float32)
W = jnp.array([1.5, 0.5, -2.0], jnp.float32)


def _sin_rules():
  """(f, fwd, bwd) for sin(x) * w, plain JAX (differentiable, no kernels)."""
  def f(x, w):
    return jnp.sin(x) * w

  def fwd(x, w):
    return f(x, w), (jnp.cos(x), jnp.sin(x), w)

  def bwd(res, g):
    c, s, w = res
    return c * w * g, s * g
  return f, fwd, bwd


def _both(define):
  """(smart, jax) functions defined by ``define(F, f)``."""
  f = _sin_rules()[0]
  out = []
  for cv in (smart_custom_vjp, jax.custom_vjp):
    F = cv(f)
    define(F)
    out.append(F)
  return out


def _programs(F):
  loss = lambda x, w: jnp.sum(F(x, w) ** 2)
  return {
      "value": jax.jit(F),
      "grad": jax.jit(jax.grad(loss, (0, 1))),
      "grad_eager": jax.grad(loss, (0, 1)),
      "checkpoint": jax.jit(jax.grad(
          lambda x, w: jnp.sum(jax.checkpoint(F)(x, w) ** 2), (0, 1))),
      "vmap": jax.jit(jax.grad(
          lambda x, w: jnp.sum(jax.vmap(F)(jnp.stack([x, 2 * x]),
                                           jnp.stack([w, w])) ** 2), (0, 1))),
  }


def _assert_same(a, b):
  for x, y in zip(jax.tree_util.tree_leaves(a), jax.tree_util.tree_leaves(b)):
    assert x.dtype == y.dtype
    np.testing.assert_allclose(np.asarray(x), np.asarray(y), rtol=1e-6,
                               atol=1e-6)


# -- methods the installed JAX lacks -------------------------------------------

@pytest.mark.parametrize("method", [
    pytest.param(m, marks=pytest.mark.skipif(
        HAS[m], reason=f"jax {jax.__version__} has {m}")) for m in METHODS])
def test_missing_method_raises(method):
  F = smart_custom_vjp(lambda x: x)
  rules = [lambda x: (x, None), lambda r, g: (g,)]
  if method.startswith("defremat"):
    rules.insert(1, lambda r, x: (x, None))
  with pytest.raises(NotImplementedError,
                     match=rf"{method}.*jax {METHODS[method]}") as e:
    getattr(F, method)(*rules)
  assert not hasattr(jax.custom_vjp, method)  # as JAX: no such method
  if sys.version_info < (3, 12):   # no newer JAX installs here
    assert "needs Python 3.12 or newer" in str(e.value), e.value


@pytest.mark.parametrize("python,says", [
    ((3, 11), "jax 0.12.0 needs Python 3.12 or newer and this is Python 3.11"),
    ((3, 12), "Upgrade JAX to 0.12.0 or newer"),
    ((3, 13), "Upgrade JAX to 0.12.0 or newer"),
])
def test_upgrade_advice_says_which_python_newer_jax_needs(python, says):
  from smartvjp import _jax_api
  assert _jax_api.upgrade_advice("0.12.0", python).startswith(says)


@pytest.mark.skipif(HAS_GB, reason="jax.custom_vjp.defvjp has generic_batching")
def test_generic_batching_missing_raises():
  F = smart_custom_vjp(lambda x: x)
  with pytest.raises(NotImplementedError, match=r"generic_batching.*0\.12"):
    F.defvjp(lambda x: (x, None), lambda r, g: (g,), generic_batching=False)
  with pytest.raises(TypeError):
    jax.custom_vjp(lambda x: x).defvjp(lambda x: (x, None), lambda r, g: (g,),
                                       generic_batching=False)


# -- generic_batching --------------------------------------------------------------

@pytest.mark.skipif(not HAS_GB, reason="no generic_batching in this jax")
@pytest.mark.parametrize("positional", [False, True])
def test_generic_batching_false_is_the_default(positional):
  def define(F):
    f, fwd, bwd = _sin_rules()
    if positional:   # fifth positional parameter, as in jax.custom_vjp.defvjp
      F.defvjp(fwd, bwd, False, False, False)
    else:
      F.defvjp(fwd, bwd, generic_batching=False)
  smart, ref = _both(define)
  for name, prog in _programs(smart).items():
    _assert_same(prog(X, W), _programs(ref)[name](X, W))


def _shared_output_calls(cv, generic_batching):
  """Calls with an output ``f`` computes from unmapped inputs only, under
  ``vmap(in_axes=(0, None))``: ``fwd`` maps it (``over``), or not (``shared``,
  where ``bwd`` sends its cotangent to the mapped input too)."""
  over = cv(lambda x, w: (x * w, w * 2))
  over.defvjp(lambda x, w: ((x * w, w * 2 + 0 * x), (x, w)),
              lambda r, g: (g[0] * r[1], g[0] * r[0] + 2 * g[1]),
              generic_batching=generic_batching)
  shared = cv(lambda x, w: (x * w, w * 2))
  shared.defvjp(lambda x, w: ((x * w, w * 2), (x, w)),
                lambda r, g: (g[0] * r[1] + g[1], g[0] * r[0] + 2 * g[1]),
                generic_batching=generic_batching)
  const = cv(lambda x, w: (np.zeros(x.shape, x.dtype), x * w))
  const.defvjp(lambda x, w: ((x * 0., x * w), w),
               lambda w, g: (g[0] + g[1] * w, None),
               generic_batching=generic_batching)
  return {"over": over, "shared": shared, "const": const}


def _vmapped_grads(F):
  xs, scale = jnp.arange(1., 4.), jnp.arange(2., 5.)
  loss = lambda x, w: sum(jnp.sum(o * scale) for o in jax.vmap(
      F, in_axes=(0, None))(x, w))
  return {"grad": lambda: jax.grad(loss, (0, 1))(xs, 1.5),
          "jit_grad": lambda: jax.jit(jax.grad(loss, (0, 1)))(xs, 1.5),
          "value": lambda: jax.jit(jax.vmap(F, in_axes=(0, None)))(xs, 1.5)}


@pytest.mark.skipif(not HAS_GB, reason="no generic_batching in this jax")
@pytest.mark.parametrize("call", ["over", "shared", "const"])
@pytest.mark.parametrize("program", ["grad", "jit_grad", "value"])
def test_generic_batching_true_as_jax(call, program):
  """The shared output keeps the first example's value and sends its whole
  cotangent to the first example, as JAX's generic batching does."""
  got, want = (_vmapped_grads(_shared_output_calls(cv, True)[call])[program]()
               for cv in (smart_custom_vjp, jax.custom_vjp))
  _assert_same(got, want)


@pytest.mark.skipif(not HAS_GB, reason="no generic_batching in this jax")
@pytest.mark.parametrize("call", ["over", "const"])
def test_generic_batching_false_follows_fwd_as_jax(call):
  """Without it (JAX's default, classic path), fwd's mapping decides."""
  got, want = (_vmapped_grads(_shared_output_calls(cv, False)[call])["grad"]()
               for cv in (smart_custom_vjp, jax.custom_vjp))
  _assert_same(got, want)
  if call == "const":   # bwd disagrees with f there, so the flag matters
    other = _vmapped_grads(_shared_output_calls(smart_custom_vjp, True)[call])
    assert not np.allclose(other["grad"]()[0], got[0])


# -- defvjp_with_logs ----------------------------------------------------------------

def _logs_rules(logs):
  f, fwd, bwd = _sin_rules()
  return fwd, lambda res, g: (bwd(res, g), logs)


@needs("defvjp_with_logs")
@pytest.mark.parametrize("logs", [None, {}])
def test_with_logs_values_and_empty_logs(logs):
  smart, ref = _both(lambda F: F.defvjp_with_logs(*_logs_rules(logs)))
  for name, prog in _programs(smart).items():
    _assert_same(prog(X, W), _programs(ref)[name](X, W))
  for F in (smart, ref):
    _, vjp = jax.vjp(F, X, W)
    cts, got = vjp.with_logs(jnp.ones(3))
    assert got == {}
  _assert_same(jax.vjp(smart, X, W)[1].with_logs(jnp.ones(3))[0],
               jax.vjp(ref, X, W)[1].with_logs(jnp.ones(3))[0])


@needs("defvjp_with_logs")
def test_with_logs_bad_returns_are_type_errors():
  for bad in (lambda res, g: g, lambda res, g: ((g, g), [1.0])):
    for cv in (smart_custom_vjp, jax.custom_vjp):
      F = cv(_sin_rules()[0])
      F.defvjp_with_logs(_sin_rules()[1], bad)
      with pytest.raises(TypeError):
        jax.grad(lambda x: jnp.sum(F(x, W)))(X)


def _log_programs(F):
  """``(cotangents, logs)`` of ``F(x, w)`` through every transformation that
  carries backward-pass logs (JAX's test_defvjp_with_logs, on arrays)."""
  ct = jnp.ones(3)
  xs, ws = jnp.stack([X, 2 * X]), jnp.stack([W, W])

  def scanned(x):
    return jax.lax.scan(lambda c, xw: (c + F(*xw), None), jnp.zeros(3),
                        (jnp.stack([x, 2 * x]), ws))[0]
  return {
      "eager": lambda: jax.vjp(F, X, W)[1].with_logs(ct),
      "vjp_of_jit": lambda: jax.vjp(jax.jit(F), X, W)[1].with_logs(ct),
      "jit_of_vjp": lambda: jax.jit(
          lambda x, w, c: jax.vjp(F, x, w)[1].with_logs(c))(X, W, ct),
      "scan": lambda: jax.vjp(scanned, X)[1].with_logs(ct),
      "vmap_outside": lambda: jax.vmap(
          lambda x, w, c: jax.vjp(F, x, w)[1].with_logs(c))(xs, ws, 2 * xs),
      "vmap_inside": lambda: jax.vjp(
          lambda x: jax.vmap(F, in_axes=(0, None))(x, W), xs)[1].with_logs(
              2 * xs),
      "checkpoint": lambda: jax.vjp(
          jax.checkpoint(lambda x, w: F(x, w) * 3.), X, W)[1].with_logs(ct),
      "checkpoint_jit": lambda: jax.jit(lambda x, w: jax.vjp(
          jax.checkpoint(lambda x, w: F(x, w) * 3.), x, w)[1].with_logs(ct))(
              X, W),
  }


def _assert_same_logs(got, want):
  assert jax.tree_util.tree_structure(got) == \
      jax.tree_util.tree_structure(want)
  _assert_same(got, want)


@needs("defvjp_with_logs")
@pytest.mark.parametrize("program", list(_log_programs(None)))
def test_with_logs_entries_match_jax(program):
  def bwd(res, g):
    c, s, w = res
    return (c * w * g, s * g), {"f": {"ct_out": g, "w": w}}
  smart, ref = _both(lambda F: F.defvjp_with_logs(_sin_rules()[1], bwd))
  got, want = _log_programs(smart)[program](), _log_programs(ref)[program]()
  assert want[1], "JAX returned no logs"
  _assert_same_logs(got, want)
  _assert_same(jax.vjp(smart, X, W)[1](jnp.ones(3)),   # plain call drops them
               jax.vjp(ref, X, W)[1](jnp.ones(3)))


@needs("defvjp_with_logs")
def test_with_logs_nondiff_argnums_and_two_calls():
  """Logs of two calls in one backward pass merge; a repeated key is a
  ValueError, as in JAX."""
  got = []
  for cv in (smart_custom_vjp, jax.custom_vjp):
    G = cv(lambda n, x: x * n, nondiff_argnums=(0,))
    G.defvjp_with_logs(lambda n, x: (G(n, x), None),
                       lambda n, _, g: ((g * n,), {f"g{n}": g * n}))
    two = lambda x: G(2., G(3., x))
    got.append(jax.vjp(two, X)[1].with_logs(jnp.ones(3)))
    got.append(jax.jit(lambda x: jax.vjp(two, x)[1].with_logs(
        jnp.ones(3)))(X))
    with pytest.raises(ValueError):
      jax.vjp(lambda x: G(2., G(2., x)), X)[1].with_logs(jnp.ones(3))
  _assert_same_logs(got[:2], got[2:])


# -- defvjp_with_accums -------------------------------------------------------------

def _accums_rules(twice=False):
  f, fwd, _ = _sin_rules()

  def bwd(res, g, x_acc, w_acc):
    c, s, w = res
    x_acc.accum(c * w * g)
    if twice:   # several contributions add up
      x_acc.accum(c * w * g)
    w_acc.accum(s * g)
  return fwd, bwd


@needs("defvjp_with_accums")
@pytest.mark.parametrize("twice", [False, True])
def test_with_accums_values(twice):
  smart, ref = _both(lambda F: F.defvjp_with_accums(*_accums_rules(twice)))
  for name, prog in _programs(smart).items():
    _assert_same(prog(X, W), _programs(ref)[name](X, W))


@needs("defvjp_with_accums")
def test_with_accums_untouched_accumulator_is_zero():
  def define(F):
    fwd = _sin_rules()[1]
    F.defvjp_with_accums(fwd, lambda res, g, x_acc, w_acc: x_acc.accum(g))
  smart, ref = _both(define)
  loss = lambda F: jax.grad(lambda x, w: jnp.sum(F(x, w)), (0, 1))(X, W)
  _assert_same(loss(smart), loss(ref))


@needs("defvjp_with_accums")
def test_with_accums_nondiff_and_pytrees():
  def f(n, xs):
    return jnp.sin(xs["a"]) * n + xs["b"]

  def fwd(n, xs):
    return f(n, xs), jnp.cos(xs["a"])

  def bwd(n, c, g, acc):
    acc["a"].accum(c * n * g)
    acc["b"].accum(g)
  got = []
  for cv in (smart_custom_vjp, jax.custom_vjp):
    F = cv(f, nondiff_argnums=(0,))
    F.defvjp_with_accums(fwd, bwd)
    got.append(jax.jit(jax.grad(lambda xs: jnp.sum(F(3.0, xs) ** 2)))(
        {"a": X, "b": W}))
  _assert_same(*got)


@needs("defvjp_with_accums")
def test_with_accums_rule_counts():
  def make(cv):
    def fwd(x):
      y, c = K.kernel("fwd", lambda x: (np.sin(x), np.cos(x)), [x, x], x)
      return y, c

    def bwd(c, g, acc):
      (dx,) = K.kernel("bwd", lambda c, g: (c * g,), [g], c, g)
      acc.accum(dx)
    F = cv(lambda x: K.kernel("f", lambda x: (np.sin(x),), [x], x)[0])
    F.defvjp_with_accums(fwd, bwd)
    return jax.jit(jax.grad(lambda x: jnp.sum(F(x) ** 2)))
  out = {}
  for cv in (smart_custom_vjp, jax.custom_vjp):
    K.reset()
    v = make(cv)(X)
    out[cv] = (v, K.counts("f", "fwd", "bwd"))
  _assert_same(out[smart_custom_vjp][0], out[jax.custom_vjp][0])
  assert out[smart_custom_vjp][1] == out[jax.custom_vjp][1] == {"fwd": 1, "bwd": 1}


@needs("defvjp_with_accums")
def test_with_accums_bad_return_is_type_error():
  for cv in (smart_custom_vjp, jax.custom_vjp):
    F = cv(_sin_rules()[0])
    F.defvjp_with_accums(_sin_rules()[1], lambda res, g, a, b: [1.0])
    with pytest.raises(TypeError):
      jax.grad(lambda x: jnp.sum(F(x, W)))(X)


# -- defremat -------------------------------------------------------------------------

def _kernel_rules():
  """Kernel rules for sin, each counted under its own name: the primal ``f``,
  defvjp's ``fwd``/``bwd`` and defremat's ``rfwd``/``rem``/``rbwd``."""
  def f(x):
    return K.kernel("f", lambda x: (np.sin(x),), [x], x)[0]

  def fwd(x):
    y, c = K.kernel("fwd", lambda x: (np.sin(x), np.cos(x)), [x, x], x)
    return y, c

  def bwd(c, g):
    return (K.kernel("bwd", lambda c, g: (c * g,), [g], c, g)[0],)

  def rfwd(x):  # saves sin(x) only
    y, s = K.kernel("rfwd", lambda x: (np.sin(x), np.sin(x)), [x, x], x)
    return y, s

  def rem(s, x):  # recomputes cos(x) from the saved value and x
    y, c = K.kernel("rem", lambda s, x: (s, np.cos(x)), [x, x], s, x)
    return y, c

  def rbwd(c, g):
    return (K.kernel("rbwd", lambda c, g: (c * g,), [g], c, g)[0],)
  return f, fwd, bwd, rfwd, rem, rbwd


def _remat_programs(F):
  ck = lambda policy=None: jax.checkpoint(F, policy=policy)

  def scan4(x):
    c, _ = jax.lax.scan(lambda c, _: (ck()(c), None), x, None, length=4)
    return jnp.sum(c)
  return {
      "grad": jax.jit(jax.grad(lambda x: jnp.sum(F(x) ** 2))),
      "checkpoint": jax.jit(jax.grad(lambda x: jnp.sum(ck()(x) ** 2))),
      "everything_saveable": jax.jit(jax.grad(lambda x: jnp.sum(
          ck(jax.checkpoint_policies.everything_saveable)(x) ** 2))),
      "nothing_saveable": jax.jit(jax.grad(lambda x: jnp.sum(
          ck(jax.checkpoint_policies.nothing_saveable)(x) ** 2))),
      "scan4": jax.jit(jax.grad(scan4)),
      "eager": jax.grad(lambda x: jnp.sum(ck()(x) ** 2)),
      "vmap_checkpoint": jax.jit(jax.grad(lambda x: jnp.sum(
          jax.vmap(ck())(jnp.stack([x, 2 * x])) ** 2))),
      "checkpoint_vmap": jax.jit(jax.grad(lambda x: jnp.sum(
          jax.checkpoint(jax.vmap(F))(jnp.stack([x, 2 * x])) ** 2))),
  }


NAMES = ("f", "fwd", "bwd", "rfwd", "rem", "rbwd")


def _run_remat(cv, with_defvjp, program, jax_flags):
  f, fwd, bwd, rfwd, rem, rbwd = _kernel_rules()
  F = cv(f)
  if with_defvjp:
    F.defvjp(fwd, bwd)
  F.defremat(rfwd, rem, rbwd)
  with jax_flags:
    prog = _remat_programs(F)[program]
    K.reset()
    v = prog(X)
    jax.block_until_ready(v)
    return v, K.counts(*NAMES)


@needs("defremat")
@pytest.mark.parametrize("program", ["grad", "checkpoint", "everything_saveable",
                                     "nothing_saveable", "scan4", "eager",
                                     "vmap_checkpoint", "checkpoint_vmap"])
@pytest.mark.parametrize("with_defvjp", [False, True])
def test_defremat_matches_jax(ad_mode, with_defvjp, program):
  """Values as JAX's (with the flags it needs); each rule runs where JAX runs
  it, and as often."""
  ref_v, ref_n = _run_remat(jax.custom_vjp, with_defvjp, program,
                            jax_remat_path())
  v, n = _run_remat(smart_custom_vjp, with_defvjp, program,
                    contextlib.nullcontext())
  _assert_same(v, ref_v)
  assert n == ref_n


@needs("defremat")
def test_defremat_rules_alone_without_jax_flags_jax_refuses():
  """JAX's default path refuses defremat without defvjp; smartvjp runs it."""
  F = jax.custom_vjp(_kernel_rules()[0])
  F.defremat(*_kernel_rules()[3:])
  with pytest.raises(NotImplementedError):
    jax.grad(lambda x: jnp.sum(F(x)))(X)


@needs("defremat")
def test_defremat_nondiff_argnums_matches_jax():
  def f(n, x, w):
    return jnp.sin(x) * w * n

  def rfwd(n, x, w):
    return f(n, x, w), jnp.sin(x)

  def rem(s, n, x, w):
    return s * w * n, (jnp.cos(x), s, w)

  def rbwd(n, res, g):
    c, s, w = res
    return c * w * n * g, s * n * g
  got = []
  for cv in (smart_custom_vjp, jax.custom_vjp):
    F = cv(f, nondiff_argnums=(0,))
    F.defremat(rfwd, rem, rbwd)
    loss = lambda x, w: jnp.sum(jax.checkpoint(lambda x, w: F(2.0, x, w))(x, w) ** 2)
    with jax_remat_path() if cv is jax.custom_vjp else contextlib.nullcontext():
      got.append((jax.jit(jax.grad(loss, (0, 1)))(X, W),
                  jax.jit(jax.grad(lambda x, w: jnp.sum(F(2.0, x, w)), (0, 1)))(X, W),
                  jax.jit(F, static_argnums=0)(2.0, X, W)))
  _assert_same(*got)


@needs("defremat_with_logs")
@pytest.mark.parametrize("logs", [None, {}])
def test_defremat_with_logs_values(logs):
  got = []
  for cv in (smart_custom_vjp, jax.custom_vjp):
    f, fwd, bwd = _sin_rules()
    F = cv(f)
    F.defremat_with_logs(lambda x, w: (f(x, w), None),
                         lambda _, x, w: fwd(x, w),
                         lambda res, g: (bwd(res, g), logs))
    with jax_remat_path() if cv is jax.custom_vjp else contextlib.nullcontext():
      got.append([p(X, W) for n, p in _programs(F).items()])
  _assert_same(*got)


@needs("defremat_with_logs")
def test_defremat_and_accums_log_entries_match_jax():
  """Log entries of defremat_with_logs' and defvjp_with_accums' bwd reach
  VJP.with_logs as JAX's (JAX's defremat needs its remat3 flags)."""
  f, fwd, bwd = _sin_rules()

  def acc_bwd(res, g, x_acc, w_acc):
    c, s, w = res
    x_acc.accum(c * w * g)
    w_acc.accum(s * g)
    return {"a": 2 * g}
  got = []
  for cv in (smart_custom_vjp, jax.custom_vjp):
    R, A = cv(f), cv(f)
    R.defremat_with_logs(lambda x, w: (f(x, w), None),
                         lambda _, x, w: fwd(x, w),
                         lambda res, g: (bwd(res, g), {"r": g}))
    A.defvjp_with_accums(fwd, acc_bwd)
    ct = jnp.ones(3)
    with jax_remat_path() if cv is jax.custom_vjp else contextlib.nullcontext():
      got.append([jax.vjp(jax.checkpoint(R), X, W)[1].with_logs(ct),
                  jax.vjp(R, X, W)[1].with_logs(ct)])
    got[-1] += [jax.vjp(A, X, W)[1].with_logs(ct),
                jax.jit(lambda x, w: jax.vjp(jax.checkpoint(A), x, w)[1]
                        .with_logs(ct))(X, W)]
  assert all(logs for _, logs in got[1])
  _assert_same_logs(*got)
