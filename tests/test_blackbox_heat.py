"""The black-box simulator example: adjoint gradients against a pure-JAX
solver, and which endpoints run in each mode."""

import importlib.util
import os

import jax
import jax.numpy as jnp
import numpy as np
import pytest

PATH = os.path.join(os.path.dirname(__file__), os.pardir, "examples",
                    "blackbox_heat.py")
spec = importlib.util.spec_from_file_location("blackbox_heat", PATH)
BH = importlib.util.module_from_spec(spec)
spec.loader.exec_module(BH)

SIM = BH.HeatSimulator(nx=24, nt=40, stride=7)   # stride does not divide nt
T0 = jnp.asarray(SIM.initial_state(), jnp.float32)


@pytest.mark.parametrize("mode,expected", [
    ("no_remat", {"apply_with_residuals": 1, "bwd": 1}),
    ("remat", {"apply": 1, "vector_jacobian_product": 1}),
    ("tesseract", {"apply": 1, "vector_jacobian_product": 1}),
])
def test_gradients_and_endpoints(mode, expected):
  comp, apply_then_vjp = BH.make_component(SIM)
  F = {"no_remat": comp, "remat": jax.checkpoint(comp),
       "tesseract": apply_then_vjp}[mode]
  fn = jax.jit(jax.grad(BH.loss(F)))
  BH.CALLS.clear()
  g = jax.block_until_ready(fn(T0))
  assert dict(BH.CALLS) == expected
  ref = jax.grad(BH.loss(BH.jax_reference(SIM)))(T0)
  np.testing.assert_allclose(g, ref, rtol=2e-4, atol=2e-4 * float(jnp.max(jnp.abs(ref))))


def test_primal_matches_jax_solver():
  comp, _ = BH.make_component(SIM)
  np.testing.assert_allclose(comp(T0), BH.jax_reference(SIM)(T0), rtol=1e-5)


def test_example_runs(capsys):
  BH.main(nx=32, nt=60)
  out = capsys.readouterr().out
  assert "residual path" in out and "apply_with_residuals 1, bwd 1" in out
