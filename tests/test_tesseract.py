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
import sys

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


# -- served over HTTP ------------------------------------------------------------

class _Server(tesseract_server.Server):
  """The heat Tesseract served, its endpoint calls logged to ``log``."""

  def __init__(self, api_path, log):
    super().__init__(api_path, env={"HEAT_TESSERACT_CALLS": str(log)},
                     runs=log.parent)
    self.log = log

  def calls(self):
    text = self.log.read_text() if self.log.exists() else ""
    self.log.write_text("")
    return dict(collections.Counter(text.split()))


@pytest.fixture(scope="module")
def served(tmp_path_factory):
  server = _Server(HEAT, tmp_path_factory.mktemp("served") / "calls.txt")
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


# -- forward mode (the forward rule: the JVP and jacobian endpoints) ---------------

def _tangents():   # float64: made under the tests' x64
  return (0.1 * jnp.ones(24), 0.2)


FORWARD = {
    "jvp": lambda F: jax.jvp(F, (_T0(), 1.3), _tangents()),
    "jit(jvp)": lambda F: jax.jit(lambda a, b: jax.jvp(F, (a, b), _tangents()))(
        _T0(), 1.3),
    "linearize": lambda F: jax.linearize(F, _T0(), 1.3)[1](*_tangents()),
    "jit(linearize)": lambda F: jax.jit(
        lambda a, b: jax.linearize(F, a, b)[1](*_tangents()))(_T0(), 1.3),
    "jvp(checkpoint)": lambda F: jax.jvp(jax.checkpoint(F), (_T0(), 1.3),
                                         _tangents()),
    "jacfwd": lambda F: jax.jacfwd(F, argnums=(0, 1))(_T0(), 1.3),
    "jit(jacfwd)": lambda F: jax.jit(jax.jacfwd(F, argnums=(0, 1)))(_T0(),
                                                                    1.3),
    "jacrev": lambda F: jax.jacrev(F)(_T0(), 1.3),
    "jit(jacrev)": lambda F: jax.jit(jax.jacrev(F))(_T0(), 1.3),
}


def _heat_T(apply, t):
  return lambda T0, c: apply(t, {"T0": T0, "conductivity": c, "nt": 30,
                                 "stride": 4})["T"]


@pytest.mark.parametrize("program", sorted(FORWARD))
def test_forward_mode_matches_tesseract_jax(heat, program):
  api, t = heat
  ref, ref_calls = _counted(api, FORWARD[program],
                            _heat_T(tesseract_jax.apply_tesseract, t))
  got, calls = _counted(api, FORWARD[program], _heat_T(st.apply_tesseract, t))
  for a, b in zip(jax.tree.leaves(got), jax.tree.leaves(ref), strict=True):
    np.testing.assert_allclose(a, b, rtol=1e-12, atol=1e-14)
  # never more endpoint calls (an apply with residuals counts as an apply:
  # outside jit, linearize and jacrev run fwd as reverse mode does)
  merged = collections.Counter(
      {k.replace("apply_with_residuals", "apply"): v for k, v in calls.items()})
  for name, n in merged.items():
    assert n <= ref_calls.get(name, 0), (name, calls, ref_calls)
  if program.endswith(("jacfwd", "jacfwd)", "jacrev", "jacrev)")):
    assert calls.get("jacobian") == 1   # one call for the whole Jacobian
  assert "vector_jacobian_product" not in calls


def test_jacobian_of_the_conductivity_where_tesseract_jax_fails(heat):
  # tesseract-jax 0.5.1's jacrev cannot take a Python-float input's block;
  # compared with finite differences instead
  _, t = heat
  F = _heat_T(st.apply_tesseract, t)
  jac = jax.jacrev(F, argnums=1)(_T0(), 1.3)
  eps = 1e-6
  fd = (F(_T0(), 1.3 + eps) - F(_T0(), 1.3 - eps)) / (2 * eps)
  np.testing.assert_allclose(jac, fd, rtol=1e-6, atol=1e-9)
  np.testing.assert_allclose(jax.jacfwd(F, argnums=1)(_T0(), 1.3), jac,
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
  for rows in (local, served):
    ours = {name: row["smartvjp"][1] for name, row in rows.items()}
    assert ours["jit(grad(loss))"] == {"apply_with_residuals": 1,
                                       "vjp_from_residuals": 1}
    assert ours["jit(grad(loss)), checkpoint(call)"] == {
        "apply": 1, "vector_jacobian_product": 1}
    assert ours["jax.jvp"] == {"apply": 1, "jacobian_vector_product": 1}
    assert ours["jit(jacfwd)"] == {"jacobian": 1}
    for name, row in rows.items():   # never more calls than tesseract-jax
      theirs = row["tesseract-jax"][1]
      assert sum(ours[name].values()) <= sum(theirs.values()), (name, theirs)
  assert "identical" in capsys.readouterr().out
