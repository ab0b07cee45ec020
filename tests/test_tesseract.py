"""smartvjp.tesseract against tesseract-jax itself, on real Tesseracts.

The heat Tesseract (examples/tesseracts/heat, with the residual contract)
and a nested one (tests/tesseracts/nested) run in-process through
``Tesseract.from_tesseract_api`` and served over HTTP by
``tesseract-runtime serve`` on 127.0.0.1 (one server per test process,
started and stopped here). Endpoint calls are counted inside the Tesseract.
Skipped where tesseract-core or tesseract-jax is not installed (the
``tesseract`` extra).
"""

import collections
import importlib.util
import pathlib
import subprocess
import sys
import time

import numpy as np
import pytest

tesseract_core = pytest.importorskip("tesseract_core")
tesseract_jax = pytest.importorskip("tesseract_jax")

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402

from smartvjp import tesseract as st  # noqa: E402

ROOT = pathlib.Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "examples" / "tesseracts"))
import tesseract_server  # noqa: E402
HEAT = ROOT / "examples" / "tesseracts" / "heat" / "tesseract_api.py"
NESTED = ROOT / "tests" / "tesseracts" / "nested" / "tesseract_api.py"
SLOW_HEAT = ROOT / "tests" / "tesseracts" / "slow_heat" / "tesseract_api.py"
Tesseract = tesseract_core.Tesseract


@pytest.fixture(autouse=True)
def _x64():
  with jax.enable_x64(True):
    yield


def _module(path, name):
  spec = importlib.util.spec_from_file_location(name, path)
  mod = importlib.util.module_from_spec(spec)
  spec.loader.exec_module(mod)
  return mod


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
  """Where the Tesseracts write their run logs (not the working directory)."""
  return tmp_path_factory.mktemp("tesseract_runs")


@pytest.fixture(scope="module")
def heat(runs):
  api = _module(HEAT, "heat_tesseract_api")
  return api, Tesseract.from_tesseract_api(api, output_path=runs)


def _T0(nx=24):
  return jnp.asarray(2.0 + np.tanh(5.0 * np.linspace(-1, 1, nx)))


def _program(apply, t, where, **kw):
  """``loss(T0, conductivity)``, with ``jax.checkpoint`` around the call
  (``where="call"``), the loss (``"loss"``) or nowhere (``None``)."""
  def call(T0, c):
    return apply(t, {"T0": T0, "conductivity": c, "nt": 30, "stride": 4},
                 **kw)["T"]
  if where == "call":
    call = jax.checkpoint(call)

  def loss(T0, c):
    T = call(T0, c)
    return jnp.sum(T ** 2) + jnp.sum(jnp.sin(T))
  return jax.checkpoint(loss) if where == "loss" else loss


def _counted(api, fn, *args):
  api.CALLS.clear()
  out = jax.block_until_ready(fn(*args))
  return out, dict(api.CALLS)


CONTRACT = {None: {"apply_with_residuals": 1, "vjp_from_residuals": 1},
            "call": {"apply": 1, "vector_jacobian_product": 1},
            # the loss's cotangent needs T, which remat recomputes
            "loss": {"apply": 2, "vector_jacobian_product": 1}}


@pytest.mark.parametrize("where", [None, "call", "loss"])
@pytest.mark.parametrize("jit", [False, True])
def test_gradients_and_calls_match_tesseract_jax(heat, where, jit):
  api, t = heat
  wrap = jax.jit if jit else (lambda f: f)
  ref_fn = wrap(jax.value_and_grad(_program(tesseract_jax.apply_tesseract, t,
                                            where), argnums=(0, 1)))
  fn = wrap(jax.value_and_grad(_program(st.apply_tesseract, t, where),
                               argnums=(0, 1)))
  (v_ref, g_ref), ref_calls = _counted(api, ref_fn, _T0(), 1.3)
  (v, g), calls = _counted(api, fn, _T0(), 1.3)
  np.testing.assert_allclose(v, v_ref, rtol=1e-13)
  for a, b in zip(g, g_ref):
    np.testing.assert_allclose(a, b, rtol=1e-12, atol=1e-14)
    assert a.dtype == b.dtype == jnp.float64
  # tesseract-jax: apply + the VJP that re-runs the forward, per call (and
  # apply again where remat recomputes the loss outside jit)
  assert ref_calls["vector_jacobian_product"] == 1 and ref_calls["apply"] >= 1
  assert calls == CONTRACT[where]
  for name in ("apply", "vector_jacobian_product"):
    assert calls.get(name, 0) <= ref_calls[name]
  assert sum(calls.values()) <= sum(ref_calls.values())


def test_abstract_eval_runs_once_per_input_structure(runs):
  # a fresh module and Tesseract object: nothing cached yet
  api = _module(HEAT, "heat_api_abstract_eval")
  t = Tesseract.from_tesseract_api(api, output_path=runs)
  loss = _program(st.apply_tesseract, t, None)
  T0 = _T0()
  jax.jit(jax.value_and_grad(loss, argnums=(0, 1)))(T0, 1.3)
  jax.grad(loss)(T0, 1.3)
  jax.grad(jax.checkpoint(loss))(T0, 1.3)
  jax.jvp(lambda x: st.apply_tesseract(
      t, {"T0": x, "conductivity": 1.3, "nt": 30, "stride": 4})["T"], (T0,),
          (T0,))
  jax.vmap(jax.grad(loss), (0, None))(jnp.stack([T0, T0]), 1.3)
  # one structure, several traces: once, and once with the contract's flag
  assert api.ABSTRACT_EVALS == {"plain": 1, "with_residuals": 1}
  jax.grad(loss)(_T0(16), 1.3)                       # another shape
  st.apply_tesseract(t, {"T0": T0, "nt": 31})        # other static inputs
  jax.grad(loss)(T0.astype(jnp.float32), 1.3)       # another dtype
  assert api.ABSTRACT_EVALS == {"plain": 4, "with_residuals": 4}
  jax.grad(loss)(_T0(16), 1.3)
  assert api.ABSTRACT_EVALS == {"plain": 4, "with_residuals": 4}
  # tesseract-jax asks at every trace
  api.ABSTRACT_EVALS.clear()
  ref = _program(tesseract_jax.apply_tesseract, t, None)
  jax.jit(jax.value_and_grad(ref, argnums=(0, 1)))(T0, 1.3)
  jax.grad(ref)(T0, 1.3)
  jax.grad(jax.checkpoint(ref))(T0, 1.3)
  assert api.ABSTRACT_EVALS["plain"] >= 3


def test_evaluation_runs_apply_only(heat):
  api, t = heat
  run = lambda T0: st.apply_tesseract(t, {"T0": T0, "nt": 5})
  for fn in (run, jax.jit(run)):
    out, calls = _counted(api, fn, _T0())
    ref = tesseract_jax.apply_tesseract(t, {"T0": _T0(), "nt": 5})
    np.testing.assert_array_equal(out["T"], ref["T"])
    assert out["residuals"] is None and calls == {"apply": 1}


def test_vmap_of_value_and_grad(heat):
  api, t = heat
  T0s = jnp.stack([_T0(), 1.1 * _T0(), 0.9 * _T0()])
  ref = jax.vmap(jax.value_and_grad(_program(
      tesseract_jax.apply_tesseract, t, None, vmap_method="sequential")),
      in_axes=(0, None))(T0s, 1.0)
  (v, g), calls = _counted(api, jax.jit(jax.vmap(jax.value_and_grad(
      _program(st.apply_tesseract, t, None)), in_axes=(0, None))), T0s, 1.0)
  np.testing.assert_allclose(v, ref[0], rtol=1e-13)
  np.testing.assert_allclose(g, ref[1], rtol=1e-12)
  # sequential (the schema's T0 has a fixed rank): one call per example
  assert calls == {"apply_with_residuals": 3, "vjp_from_residuals": 3}


def test_gradient_against_finite_differences(heat):
  _, t = heat
  loss = _program(st.apply_tesseract, t, "loss")
  T0, c = _T0(), 1.3
  g = jax.grad(loss, argnums=(0, 1))(T0, c)
  rng = np.random.default_rng(0)
  d = jnp.asarray(rng.normal(size=T0.shape))
  eps = 1e-6
  fd = (loss(T0 + eps * d, c + eps) - loss(T0 - eps * d, c - eps)) / (2 * eps)
  np.testing.assert_allclose(jnp.dot(g[0], d) + g[1], fd, rtol=1e-6)


@pytest.fixture(scope="module")
def nested(runs):
  return Tesseract.from_tesseract_api(NESTED, output_path=runs)


def test_check_residual_contract(heat, nested, tmp_path):
  _, t = heat
  inputs = {"T0": np.asarray(_T0()), "conductivity": 1.3, "nt": 30,
            "stride": 4}
  st.check_residual_contract(t, inputs)
  broken = {
      "abstract_eval declares": ('{"shape": [n_ckpt, nx]',
                                 '{"shape": [n_ckpt + 1, nx]'),
      "cotangent of T0 differs": (
          "checkpoints = np.asarray(inputs.residuals, np.float64)",
          "checkpoints = 1.001 * np.asarray(inputs.residuals, np.float64)"),
      "apply's output T differs": ("return OutputSchema(T=T, residuals=",
                             "return OutputSchema(T=T + inputs.save_residuals,"
                             " residuals="),
  }
  for i, (error, (old, new)) in enumerate(broken.items()):
    src = HEAT.read_text()
    assert old in src
    (tmp_path / f"api{i}.py").write_text(src.replace(old, new))
    bad = Tesseract.from_tesseract_api(tmp_path / f"api{i}.py",
                                       output_path=tmp_path)
    with pytest.raises(st.ResidualContractError, match=error):
      st.check_residual_contract(bad, inputs)
  with pytest.raises(st.ResidualContractError,
                     match="does not declare the residual contract"):
    st.check_residual_contract(nested, _nested_inputs())




def _nested_inputs():
  return {"a": {"p": jnp.arange(3.0), "q.r": jnp.ones(3)},
          "b": [jnp.ones((2, 2)), jnp.linspace(0, 1, 4)],
          "c": {"w": jnp.linspace(0.0, 1.0, 3), "n": 2},
          "d": 0.5 * jnp.ones(3)}


def test_nested_inputs_and_outputs_match_tesseract_jax(nested):
  x = _nested_inputs()

  def loss(apply, diff):
    y = apply(nested, {**x, "a": diff["a"], "b": diff["b"],
                       "c": {"w": diff["w"], "n": 2}})
    return jnp.sum(y["y"]["p"] ** 2) + jnp.sum(jnp.cos(y["y"]["q.r"]))

  diff = {"a": x["a"], "b": x["b"], "w": x["c"]["w"]}
  ref = jax.grad(lambda d: loss(tesseract_jax.apply_tesseract, d))(diff)
  for fn in (jax.grad(lambda d: loss(st.apply_tesseract, d)),
             jax.jit(jax.grad(lambda d: loss(st.apply_tesseract, d)))):
    got = fn(diff)
    assert jax.tree.structure(got) == jax.tree.structure(ref)
    for a, b in zip(jax.tree.leaves(got), jax.tree.leaves(ref)):
      np.testing.assert_allclose(a, b, rtol=1e-13)
  out = st.apply_tesseract(nested, x)
  ref_out = tesseract_jax.apply_tesseract(nested, x)
  assert jax.tree.structure(out) == jax.tree.structure(ref_out)
  for a, b in zip(jax.tree.leaves(out), jax.tree.leaves(ref_out)):
    np.testing.assert_array_equal(a, b)


def test_traced_non_differentiable_input_is_accepted(nested):
  x = _nested_inputs()
  f = jax.jit(lambda d: st.apply_tesseract(nested, {**x, "d": d})["z"])
  np.testing.assert_array_equal(f(x["d"]), 2.0 * x["d"])
  # and gradients with respect to other inputs go through
  g = jax.grad(lambda w, d: jnp.sum(st.apply_tesseract(
      nested, {**x, "c": {"w": w, "n": 2}, "d": d})["y"]["p"]))(x["c"]["w"],
                                                                  x["d"])
  assert g.shape == (3,)


def test_errors_name_the_path_before_any_endpoint_runs(heat, nested):
  x = _nested_inputs()
  with pytest.raises(ValueError, match=r"input d .*not mark it Differentiable"):
    jax.grad(lambda d: jnp.sum(st.apply_tesseract(
        nested, {**x, "d": d})["y"]["p"]))(x["d"])
  with pytest.raises(ValueError, match=r"output z .*receives a cotangent"):
    jax.grad(lambda w: jnp.sum(st.apply_tesseract(
        nested, {**x, "c": {"w": w, "n": 2}})["z"]))(x["c"]["w"])
  with pytest.raises(TypeError, match="tesseract_core.Tesseract"):
    st.apply_tesseract(object(), {})
  with pytest.raises(ValueError, match="vmap_method"):
    st.apply_tesseract(nested, x, vmap_method="batched")
  api, t = heat
  api.CALLS.clear()
  with pytest.raises(st.TesseractEndpointError,
                     match=r"\(in-process\): endpoint abstract_eval failed"):
    st.apply_tesseract(t, {"T0": _T0(), "nt": "many"})
  assert not api.CALLS


def test_missing_vjp_endpoint(tmp_path):
  src = NESTED.read_text().split("def vector_jacobian_product")[0]
  (tmp_path / "tesseract_api.py").write_text(src)
  t = Tesseract.from_tesseract_api(tmp_path / "tesseract_api.py",
                                   output_path=tmp_path)
  x = _nested_inputs()
  st.apply_tesseract(t, x)   # apply works
  with pytest.raises(Exception, match="no vector_jacobian_product endpoint"):
    jax.grad(lambda w: jnp.sum(st.apply_tesseract(
        t, {**x, "c": {"w": w, "n": 2}})["y"]["p"]))(x["c"]["w"])


# -- served over HTTP ----------------------------------------------------------

class _Server(tesseract_server.Server):
  """The heat Tesseract served (tests/tesseracts/slow_heat: its VJP waits
  while the file ``flag`` exists), its endpoint calls logged to ``log``."""

  def __init__(self, api_path, log):
    self.flag = log.parent / "vjp_waits"
    super().__init__(api_path, env={"HEAT_TESSERACT_CALLS": str(log),
                                    "SLOW_TESSERACT_FLAG": str(self.flag)},
                     runs=log.parent)
    self.log = log

  def calls(self):
    text = self.log.read_text() if self.log.exists() else ""
    self.log.write_text("")
    return dict(collections.Counter(text.split()))

  def rss(self) -> int:
    """The server process's resident memory, bytes (Linux)."""
    status = pathlib.Path(f"/proc/{self.proc.pid}/status").read_text()
    kb = next(line for line in status.splitlines()
              if line.startswith("VmRSS:")).split()[1]
    return int(kb) * 1024


@pytest.fixture(scope="module")
def served(tmp_path_factory):
  # one server for the module's served tests (per test process)
  server = _Server(SLOW_HEAT, tmp_path_factory.mktemp("served") / "calls.txt")
  server.start()
  yield server
  server.stop()


def test_served_gradients_and_calls_match_tesseract_jax(served):
  t = Tesseract.from_url(served.url, timeout=60)
  for where in (None, "loss"):
    served.calls()
    ref = jax.jit(jax.value_and_grad(_program(
        tesseract_jax.apply_tesseract, t, where)))(_T0(), 1.3)
    ref_calls = served.calls()
    got = jax.jit(jax.value_and_grad(_program(st.apply_tesseract, t, where)))(
        _T0(), 1.3)
    np.testing.assert_allclose(got[1], ref[1], rtol=1e-12)
    assert served.calls() == CONTRACT[where]
    assert ref_calls["vector_jacobian_product"] == 1


def test_stopped_server_gives_a_clear_error_then_works_again(served):
  t = Tesseract.from_url(served.url, timeout=60)
  fn = jax.jit(jax.grad(_program(st.apply_tesseract, t, None)))
  want = fn(_T0(), 1.3)            # traced and compiled while the server is up
  served.stop()
  try:
    with pytest.raises(Exception) as info:
      jax.block_until_ready(fn(_T0(), 1.3))
    text = str(info.value)
    assert "endpoint apply failed" in text and served.url in text
  finally:
    served.start()
  np.testing.assert_array_equal(fn(_T0(), 1.3), want)


def test_timeout_in_a_gradient_gives_a_clear_error_then_works_again(served):
  # the VJP hangs after apply has answered: the client's read timeout ends
  # the call with an error naming the endpoint and the address
  t = Tesseract.from_url(served.url, timeout=(30, 2))
  fn = jax.jit(jax.grad(_program(st.apply_tesseract, t, None), argnums=(0, 1)))
  want = fn(_T0(), 1.3)
  served.calls()
  served.flag.write_text("")
  try:
    start = time.monotonic()
    with pytest.raises(Exception) as info:
      jax.block_until_ready(fn(_T0(), 1.3))
    waited = time.monotonic() - start
  finally:
    served.flag.unlink()
  text = str(info.value)
  assert "endpoint vector_jacobian_product failed" in text, text
  assert served.url in text and "did not answer within" in text, text
  assert waited < 20
  got = fn(_T0(), 1.3)             # the same compiled program, server freed
  for a, b in zip(got, want, strict=True):
    np.testing.assert_array_equal(a, b)
  # the VJP that timed out finishes on the server once released; nothing
  # was retried: two applies and two VJPs in all
  deadline = time.monotonic() + 20
  calls = collections.Counter()
  while time.monotonic() < deadline and calls["vjp_from_residuals"] < 2:
    calls.update(served.calls())
    time.sleep(0.05)
  assert calls == {"apply_with_residuals": 2, "vjp_from_residuals": 2}


@pytest.mark.skipif(not pathlib.Path("/proc/self/status").exists(),
                    reason="reads the server's memory from /proc (Linux)")
def test_a_long_training_loop_does_not_grow_the_server(served):
  # the contract's residuals travel to JAX and back: 51 kB a step here
  # (16 states of 400 cells), 10 MB over the loop if the server kept them
  # (a variant of the heat Tesseract that keeps them grows by 9.9 MiB)
  t = Tesseract.from_url(served.url, timeout=60)
  T0 = jnp.asarray(2.0 + np.tanh(5.0 * np.linspace(-1, 1, 400)))

  def loss(c):
    T = st.apply_tesseract(t, {"T0": T0, "conductivity": c, "nt": 16,
                               "stride": 1})["T"]
    return jnp.sum((T - 2.0) ** 2)
  step = jax.jit(jax.value_and_grad(loss))
  c = jnp.asarray(1.0)
  for _ in range(10):              # warm-up: buffers, caches, allocator
    _, g = step(c)
    c = c - 1e-4 * g
  served.calls()
  before = served.rss()
  for _ in range(200):
    _, g = step(c)
    c = c - 1e-4 * g
  grown = served.rss() - before
  assert served.calls() == {"apply_with_residuals": 200,
                            "vjp_from_residuals": 200}
  assert grown < 3 * 2 ** 20, f"the server grew by {grown / 2 ** 20:.1f} MiB"


# -- every transformation tesseract-jax supports, against it -------------------
#
# The programs of tesseract-jax's own tests (tests/test_endtoend.py,
# tests/test_linearize.py: jit, grad, vjp, jvp, linearize, linear_transpose,
# derivatives of a vjp or linearize function, jacfwd, jacrev, vmap and its
# nestings, loops) and the checkpoint variants, on the heat Tesseract (every
# endpoint), eager and under jit. Endpoint calls are counted inside the
# Tesseract; an apply with residuals counts as an apply and a VJP from
# residuals as a VJP.

def _small():   # float64: made under the tests' x64
  T0 = jnp.asarray(2.0 + np.tanh(5.0 * np.linspace(-1, 1, 8)))
  return T0, jnp.asarray(1.3), 0.1 * jnp.ones(8), jnp.asarray(0.2)


def _pair(apply, t, **kw):
  """``F(T0, c)``: the final profile; ``L(T0, c)``: a scalar loss of it."""
  def F(T0, c):
    return apply(t, {"T0": T0, "conductivity": c, "nt": 10, "stride": 5},
                 **kw)["T"]

  def L(T0, c):
    T = F(T0, c)
    return jnp.sum(T ** 2) + jnp.sum(jnp.sin(T))
  return F, L


def _stack(x, n=2):
  return jnp.stack([x * (1.0 + 0.1 * i) for i in range(n)])


_POL = jax.checkpoint_policies
PROGRAMS = {
    "jit": lambda F, L, T0, c, dT, dc: jax.jit(F)(T0, c),
    "grad": lambda F, L, T0, c, dT, dc: jax.grad(L, (0, 1))(T0, c),
    "jit(grad)": lambda F, L, T0, c, dT, dc: jax.jit(jax.grad(L, (0, 1)))(
        T0, c),
    "value_and_grad": lambda F, L, T0, c, dT, dc: jax.value_and_grad(
        L, (0, 1))(T0, c),
    "jit(value_and_grad)": lambda F, L, T0, c, dT, dc: jax.jit(
        jax.value_and_grad(L, (0, 1)))(T0, c),
    "vjp": lambda F, L, T0, c, dT, dc: jax.vjp(F, T0, c)[1](dT),
    "jit(vjp_fn)": lambda F, L, T0, c, dT, dc: jax.jit(jax.vjp(F, T0, c)[1])(
        dT),
    "vjp(jit)": lambda F, L, T0, c, dT, dc: jax.vjp(jax.jit(F), T0, c)[1](dT),
    "jvp": lambda F, L, T0, c, dT, dc: jax.jvp(F, (T0, c), (dT, dc)),
    "jit(jvp)": lambda F, L, T0, c, dT, dc: jax.jit(
        lambda a, b: jax.jvp(F, (a, b), (dT, dc)))(T0, c),
    "linearize": lambda F, L, T0, c, dT, dc: jax.linearize(F, T0, c)[1](
        dT, dc),
    "jit(linearize)": lambda F, L, T0, c, dT, dc: jax.jit(
        lambda a, b: jax.linearize(F, a, b)[1](dT, dc))(T0, c),
    "linear_transpose(linearize)": lambda F, L, T0, c, dT, dc: (
        jax.linear_transpose(jax.linearize(F, T0, c)[1], T0, c)(dT)),
    "jvp(linearize)": lambda F, L, T0, c, dT, dc: jax.jvp(
        jax.linearize(F, T0, c)[1], (dT, dc), (2.0 * dT, 2.0 * dc)),
    "jacfwd(linearize)": lambda F, L, T0, c, dT, dc: jax.jacfwd(
        jax.linearize(F, T0, c)[1])(dT, dc),
    "jacrev(linearize)": lambda F, L, T0, c, dT, dc: jax.jacrev(
        jax.linearize(F, T0, c)[1])(dT, dc),
    "jvp(vjp_fn)": lambda F, L, T0, c, dT, dc: jax.jvp(
        jax.vjp(F, T0, c)[1], (dT,), (2.0 * dT,)),
    "jit(jvp(vjp_fn))": lambda F, L, T0, c, dT, dc: jax.jit(
        lambda a, b: jax.jvp(jax.vjp(F, a, b)[1], (dT,), (2.0 * dT,)))(T0, c),
    "jacfwd": lambda F, L, T0, c, dT, dc: jax.jacfwd(F, (0, 1))(T0, c),
    "jit(jacfwd)": lambda F, L, T0, c, dT, dc: jax.jit(jax.jacfwd(F, (0, 1)))(
        T0, c),
    "jacrev": lambda F, L, T0, c, dT, dc: jax.jacrev(F, (0, 1))(T0, c),
    "jit(jacrev)": lambda F, L, T0, c, dT, dc: jax.jit(jax.jacrev(F, (0, 1)))(
        T0, c),
    "vmap(vjp_fn)": lambda F, L, T0, c, dT, dc: jax.vmap(
        jax.vjp(F, T0, c)[1])(_stack(dT)),
    "vmap(linearize)": lambda F, L, T0, c, dT, dc: jax.vmap(
        jax.linearize(F, T0, c)[1])(_stack(dT), _stack(dc)),
    "vmap": lambda F, L, T0, c, dT, dc: jax.vmap(F, (0, None))(_stack(T0), c),
    "jit(vmap)": lambda F, L, T0, c, dT, dc: jax.jit(jax.vmap(F))(
        _stack(T0), _stack(c)),
    "vmap(vmap)": lambda F, L, T0, c, dT, dc: jax.vmap(
        jax.vmap(F, (0, None)), (None, 0))(_stack(T0), _stack(c, 3)),
    "jit(vmap(grad))": lambda F, L, T0, c, dT, dc: jax.jit(jax.vmap(
        jax.grad(L, (0, 1)), (0, None)))(_stack(T0), c),
    "grad(vmap)": lambda F, L, T0, c, dT, dc: jax.grad(
        lambda a, b: jnp.sum(jax.vmap(F, (0, None))(a, b) ** 2), (0, 1))(
            _stack(T0), c),
    "vmap(jvp)": lambda F, L, T0, c, dT, dc: jax.vmap(
        lambda a: jax.jvp(F, (a, c), (dT, dc)))(_stack(T0)),
    "jit(grad(checkpoint(call)))": lambda F, L, T0, c, dT, dc: jax.jit(
        jax.grad(lambda a, b: jnp.sum(jax.checkpoint(F)(a, b) ** 2),
                 (0, 1)))(T0, c),
    "grad(checkpoint(loss))": lambda F, L, T0, c, dT, dc: jax.grad(
        jax.checkpoint(L), (0, 1))(T0, c),
    "jit(grad(checkpoint(loss)))": lambda F, L, T0, c, dT, dc: jax.jit(
        jax.grad(jax.checkpoint(L), (0, 1)))(T0, c),
    "checkpoint everything_saveable": lambda F, L, T0, c, dT, dc: jax.jit(
        jax.grad(jax.checkpoint(L, policy=_POL.everything_saveable),
                 (0, 1)))(T0, c),
    "checkpoint nothing_saveable": lambda F, L, T0, c, dT, dc: jax.jit(
        jax.grad(jax.checkpoint(L, policy=_POL.nothing_saveable),
                 (0, 1)))(T0, c),
    "checkpoint dots_saveable": lambda F, L, T0, c, dT, dc: jax.jit(
        jax.grad(jax.checkpoint(L, policy=_POL.dots_saveable), (0, 1)))(T0, c),
    "checkpoint prevent_cse=False": lambda F, L, T0, c, dT, dc: jax.jit(
        jax.grad(jax.checkpoint(L, prevent_cse=False), (0, 1)))(T0, c),
    "remat static_argnums": lambda F, L, T0, c, dT, dc: jax.jit(jax.grad(
        lambda a, b: jax.remat(lambda a, b, k: k * L(a, b),
                               static_argnums=(2,))(a, b, 2.0), (0, 1)))(T0, c),
    "jvp(checkpoint)": lambda F, L, T0, c, dT, dc: jax.jvp(
        jax.checkpoint(F), (T0, c), (dT, dc)),
    "jacfwd(checkpoint)": lambda F, L, T0, c, dT, dc: jax.jacfwd(
        jax.checkpoint(F), (0, 1))(T0, c),
    "grad(scan)": lambda F, L, T0, c, dT, dc: jax.grad(
        lambda a, b: jnp.sum(jax.lax.scan(lambda x, _: (F(x, b), None), a,
                                          None, length=2)[0] ** 2),
        (0, 1))(T0, c),
    "jit(fori_loop)": lambda F, L, T0, c, dT, dc: jax.jit(
        lambda a, b: jax.lax.fori_loop(0, 2, lambda i, x: F(x, b), a))(T0, c),
    "jit(grad(fori_loop))": lambda F, L, T0, c, dT, dc: jax.jit(jax.grad(
        lambda a, b: jnp.sum(jax.lax.fori_loop(
            0, 2, lambda i, x: F(x, b), a) ** 2), (0, 1)))(T0, c),
}
# tesseract-jax needs vmap_method for vmap (it refuses the default None) and
# for materialize_jacobian=False; smartvjp picks "sequential" by itself here
TJ_KW = {name: {"vmap_method": "sequential"} for name in PROGRAMS
         if "vmap" in name}
PROGRAMS["jacfwd, materialize_jacobian=False"] = PROGRAMS["jacfwd"]
PROGRAMS["jit(jacrev), materialize_jacobian=False"] = PROGRAMS["jit(jacrev)"]
OUR_KW = {"jacfwd, materialize_jacobian=False": {"materialize_jacobian": False},
          "jit(jacrev), materialize_jacobian=False": {
              "materialize_jacobian": False}}
for _name, _kw in OUR_KW.items():
  TJ_KW[_name] = {**_kw, "vmap_method": "sequential"}

ONE_MORE_APPLY = {"jit(jvp(vjp_fn))", "jit(jacrev), materialize_jacobian=False"}
FORWARD_ONLY = {"jvp", "jit(jvp)", "linearize", "jit(linearize)",
                "jvp(linearize)", "jacfwd", "jit(jacfwd)", "jvp(checkpoint)",
                "jacfwd(checkpoint)", "vmap(jvp)",
                "jacfwd, materialize_jacobian=False"}
_SAME_WORK = {"apply_with_residuals": "apply",
              "vjp_from_residuals": "vector_jacobian_product"}


def _merged(calls):
  out = collections.Counter()
  for k, v in calls.items():
    out[_SAME_WORK.get(k, k)] += v
  return out


@pytest.mark.parametrize("program", list(PROGRAMS))
def test_every_transformation_matches_tesseract_jax(heat, program):
  api, t = heat
  args = _small()
  ref, ref_calls = _counted(api, PROGRAMS[program],
                            *_pair(tesseract_jax.apply_tesseract, t,
                                   **TJ_KW.get(program, {})), *args)
  got, calls = _counted(api, PROGRAMS[program],
                        *_pair(st.apply_tesseract, t,
                               **OUR_KW.get(program, {})), *args)
  assert jax.tree.structure(got) == jax.tree.structure(ref)
  for a, b in zip(jax.tree.leaves(got), jax.tree.leaves(ref), strict=True):
    assert a.dtype == b.dtype and a.shape == b.shape
    np.testing.assert_allclose(a, b, rtol=1e-12, atol=1e-14)
  ours, theirs = _merged(calls), _merged(ref_calls)
  if program in ONE_MORE_APPLY:
    # see test_gradient_of_an_unused_primal_output_runs_one_endpoint: under
    # jit no primal output is used and tesseract-jax drops apply; smartvjp
    # runs an apply with residuals, and its VJPs do not re-run the forward
    assert theirs["apply"] == 0 and calls["apply_with_residuals"] == 1
    ours["apply"] -= 1
  for name, n in ours.items():
    assert n <= theirs[name], (calls, ref_calls)
  if "materialize_jacobian=False" in program:
    assert "jacobian" not in calls
  elif program.startswith(("jacfwd", "jit(jacfwd", "jacrev", "jit(jacrev")):
    assert calls["jacobian"] == 1   # one call for the whole Jacobian
  if program in FORWARD_ONLY:
    assert "vector_jacobian_product" not in ours


@pytest.mark.parametrize("program", [
    "jax.hessian", "jacfwd(grad)", "jacrev(grad)", "jit(jacfwd(grad))"])
def test_second_derivatives_raise_before_any_endpoint_runs(heat, program):
  # tesseract-jax refuses these too (RuntimeError, after running endpoints)
  api, t = heat
  T0, c, _, _ = _small()
  F, L = _pair(st.apply_tesseract, t)
  fn = {"jax.hessian": jax.hessian(L), "jacfwd(grad)": jax.jacfwd(jax.grad(L)),
        "jacrev(grad)": jax.jacrev(jax.grad(L)),
        "jit(jacfwd(grad))": jax.jit(jax.jacfwd(jax.grad(L)))}[program]
  api.CALLS.clear()
  with pytest.raises(NotImplementedError,
                     match=r"endpoint of the Tesseract \(in-process\) .*"
                           r"second derivative"):
    fn(T0, c)
  assert not api.CALLS
  with pytest.raises(RuntimeError, match="second derivative|higher-order"):
    _, L_ref = _pair(tesseract_jax.apply_tesseract, t)
    jax.jacfwd(jax.grad(L_ref))(T0, c)


@pytest.mark.xfail(strict=True, reason=(
    "core: a smartvjp_fwd none of whose primal outputs is used, whose "
    "residuals only its smartvjp_bwd reads, should become fwd_bwd at the "
    "bwd (one VJP call, as tesseract-jax's DCE of apply gives)"))
@pytest.mark.parametrize("program", ["jit(grad(sum))", "jit(grad(cond))"])
def test_gradient_of_an_unused_primal_output_runs_one_endpoint(heat, program):
  # d sum(T) / d T0 needs no T: tesseract-jax's jit drops apply and runs the
  # VJP alone; smartvjp runs apply with residuals and the VJP from them
  api, t = heat
  T0, c, _, _ = _small()
  def prog(apply):
    F, _ = _pair(apply, t)
    if program == "jit(grad(sum))":
      return jax.jit(jax.grad(lambda a, b: jnp.sum(F(a, b)), (0, 1)))
    return jax.jit(jax.grad(lambda a, b: jnp.sum(jax.lax.cond(
        b > 1.0, lambda: F(a, b), lambda: a)), (0, 1)))
  ref, ref_calls = _counted(api, prog(tesseract_jax.apply_tesseract), T0, c)
  got, calls = _counted(api, prog(st.apply_tesseract), T0, c)
  for a, b in zip(got, ref):
    np.testing.assert_allclose(a, b, rtol=1e-12)
  assert ref_calls == {"vector_jacobian_product": 1}
  assert sum(calls.values()) <= 1, calls


def test_a_tesseract_is_a_jit_argument(heat):
  _, t = heat
  T0, c, _, _ = _small()
  f = jax.jit(lambda T0, c, tess: jnp.sum(st.apply_tesseract(
      tess, {"T0": T0, "conductivity": c, "nt": 10, "stride": 5})["T"]))
  np.testing.assert_array_equal(f(T0, c, t), jnp.sum(_pair(
      tesseract_jax.apply_tesseract, t)[0](T0, c)))
  # without tesseract-jax installed, smartvjp.tesseract registers it itself
  code = ("import sys; sys.modules['tesseract_jax'] = None\n"
          "import jax, smartvjp.tesseract\n"
          "from tesseract_core import Tesseract\n"
          "t = Tesseract.__new__(Tesseract)\n"
          "assert jax.tree_util.tree_leaves(t) == []\n"
          "assert jax.tree_util.tree_unflatten(\n"
          "    jax.tree_util.tree_structure(t), []) is t\n")
  proc = subprocess.run([sys.executable, "-c", code], cwd=ROOT,
                        capture_output=True, text=True, timeout=120)
  assert proc.returncode == 0, proc.stderr


def test_auto_experimental_is_auto(heat):
  _, t = heat
  T0, c, _, _ = _small()
  F, _ = _pair(st.apply_tesseract, t, vmap_method="auto_experimental")
  F_ref, _ = _pair(st.apply_tesseract, t)
  np.testing.assert_array_equal(jax.vmap(F, (0, None))(_stack(T0), c),
                                jax.vmap(F_ref, (0, None))(_stack(T0), c))


def test_jacobian_of_the_conductivity_where_tesseract_jax_fails(heat):
  # tesseract-jax 0.5.1's jacrev cannot take a Python-float input's block;
  # compared with finite differences instead
  _, t = heat
  F, _ = _pair(st.apply_tesseract, t)
  T0 = _small()[0]
  jac = jax.jacrev(F, argnums=1)(T0, 1.3)
  eps = 1e-6
  fd = (F(T0, 1.3 + eps) - F(T0, 1.3 - eps)) / (2 * eps)
  np.testing.assert_allclose(jac, fd, rtol=1e-6, atol=1e-9)
  np.testing.assert_allclose(jax.jacfwd(F, argnums=1)(T0, 1.3), jac,
                             rtol=1e-12)


def test_missing_jvp_endpoint(nested):
  # the nested Tesseract has apply, abstract_eval and the VJP only
  x = _nested_inputs()
  f = lambda w: st.apply_tesseract(nested, {**x, "c": {"w": w, "n": 2}})[
      "y"]["p"]
  jax.grad(lambda w: jnp.sum(f(w)))(x["c"]["w"])   # reverse mode works
  with pytest.raises(NotImplementedError,
                     match="no jacobian_vector_product endpoint"):
    jax.jvp(f, (x["c"]["w"],), (jnp.ones(3),))


def test_the_example_runs_in_process_and_served(capsys):
  spec = importlib.util.spec_from_file_location(
      "tesseract_heat_example", ROOT / "examples" / "tesseract_heat.py")
  example = importlib.util.module_from_spec(spec)
  spec.loader.exec_module(example)
  local, served = example.main()
  for counts in (local, served):
    ours = {name: row["smartvjp"][1] for name, row in counts.items()}
    theirs = {name: row["tesseract-jax"][1] for name, row in counts.items()}
    assert ours["jit(grad(loss))"] == {"apply_with_residuals": 1,
                                       "vjp_from_residuals": 1}
    assert theirs["jit(grad(loss))"] == {"apply": 1,
                                         "vector_jacobian_product": 1}
    assert ours["jit(grad(loss)), checkpoint(call)"] == theirs[
        "jit(grad(loss)), checkpoint(call)"] == {
            "apply": 1, "vector_jacobian_product": 1}
    assert ours["jax.jvp"] == theirs["jax.jvp"] == {
        "apply": 1, "jacobian_vector_product": 1}
    assert ours["jit(jacfwd)"] == theirs["jit(jacfwd)"] == {"jacobian": 1}
  assert "identical" in capsys.readouterr().out
