"""A Tesseract: 1-D nonlinear plasma heat diffusion (seed 003's workload).

Each of ``nt`` implicit steps solves ``(I + A(k)) T_new = T`` with
``k = dt * T**2.5 / 3.5 / dx**2`` (tridiagonal, reflecting ends) in
numpy/scipy, outside JAX. The adjoint (``vector_jacobian_product``) sweeps
back through the steps; without help it must first re-run the forward to
rebuild the trajectory, which is the cost seed 003 reports.

It takes part in smartvjp's residual contract (``smartvjp.tesseract``): its
schemas derive from ``contract_schemas``, which adds the input
``save_residuals`` (default False), with which ``apply`` also returns the
checkpointed trajectory as the output ``residuals``, and the optional input
``residuals``, given which ``vector_jacobian_product`` skips the forward;
``abstract_eval`` declares them through ``with_residuals``. A client that
knows nothing of the contract (tesseract-jax) sees a Tesseract with the
standard endpoints and two optional fields. The server keeps nothing between
requests: the residuals travel to the client and back.

Endpoint calls are counted in ``CALLS`` (``abstract_eval`` in
``ABSTRACT_EVALS``) and, where the environment variable
``HEAT_TESSERACT_CALLS`` names a file, appended to it one name per line (so
a test reads the counts of a served Tesseract too).

Serve:  TESSERACT_API_PATH=examples/tesseracts/heat/tesseract_api.py \\
          tesseract-runtime serve --host 127.0.0.1 --port 8000
"""

import collections
import os
from typing import Any

import numpy as np
from pydantic import Field
from scipy.linalg import solve_banded
from tesseract_core.runtime import Array, Differentiable, Float64

from smartvjp.tesseract import contract_schemas, with_residuals

CALLS: collections.Counter = collections.Counter()
ABSTRACT_EVALS: collections.Counter = collections.Counter()   # by the flag


def _count(name):
  CALLS[name] += 1
  log = os.environ.get("HEAT_TESSERACT_CALLS")
  if log:
    with open(log, "a") as f:
      f.write(name + "\n")


# the residual contract: the trajectory every `stride` steps
ContractInputs, ContractOutputs = contract_schemas(Array[(None, None), Float64])


class InputSchema(ContractInputs):
  T0: Differentiable[Array[(None,), Float64]] = Field(
      description="initial temperature profile, one value per cell")
  conductivity: Differentiable[Float64] = Field(
      default=1.0, description="scale of the T**2.5 conductivity")
  nt: int = Field(default=200, description="number of implicit steps")
  t1: float = Field(default=1e-3, description="final time")
  stride: int = Field(default=10, description="steps between checkpoints")


class OutputSchema(ContractOutputs):
  T: Differentiable[Array[(None,), Float64]] = Field(
      description="final temperature profile")


def _grid(inputs):
  nx = inputs.T0.shape[0]
  dx = 2.0 / nx
  dt = inputs.t1 / inputs.nt
  return dt / 3.5 / dx ** 2 * float(inputs.conductivity)


def _bands(T, coeff):
  k = coeff * T ** 2.5
  d = 1.0 + 2.0 * k
  d[0] -= k[0]
  d[-1] -= k[-1]
  ab = np.zeros((3, T.shape[0]))
  ab[0, 1:] = -k[1:]
  ab[1] = d
  ab[2, :-1] = -k[:-1]
  return ab, k


def _step(T, coeff):
  ab, _ = _bands(T, coeff)
  return solve_banded((1, 1), ab, T)


def _step_adjoint(T, T_new, lam, coeff):
  """Cotangents of ``T`` and of ``coeff`` given that of ``T_new``."""
  ab, k = _bands(T, coeff)
  abT = np.zeros_like(ab)
  abT[0, 1:] = ab[2, :-1]
  abT[1] = ab[1]
  abT[2, :-1] = ab[0, 1:]
  mu = solve_banded((1, 1), abT, lam)
  c = np.full(T.shape[0], 2.0)
  c[0] = c[-1] = 1.0
  mu_l = np.concatenate([[0.0], mu[:-1]])
  mu_r = np.concatenate([mu[1:], [0.0]])
  grad_k = T_new * (c * mu - mu_l - mu_r)       # d loss / d k, times -1
  g_T = mu - 2.5 * coeff * T ** 1.5 * grad_k
  g_coeff = -np.dot(grad_k, T ** 2.5)
  return g_T, g_coeff


def _forward(inputs, keep):
  coeff = _grid(inputs)
  T = np.asarray(inputs.T0, np.float64)
  checkpoints = []
  for n in range(inputs.nt):
    if keep and n % inputs.stride == 0:
      checkpoints.append(T)
    T = _step(T, coeff)
  return T, (np.stack(checkpoints) if keep else None)


def _adjoint(inputs, checkpoints, lam):
  coeff = _grid(inputs)
  g_coeff = 0.0
  for seg in reversed(range(len(checkpoints))):
    start = seg * inputs.stride
    steps = min(inputs.stride, inputs.nt - start)
    states = [checkpoints[seg]]
    for _ in range(steps):
      states.append(_step(states[-1], coeff))
    for n in reversed(range(steps)):
      lam, gc = _step_adjoint(states[n], states[n + 1], lam, coeff)
      g_coeff += gc
  # coeff = base * conductivity
  return lam, g_coeff * coeff / float(inputs.conductivity)


def apply(inputs: InputSchema) -> OutputSchema:
  _count("apply_with_residuals" if inputs.save_residuals else "apply")
  T, checkpoints = _forward(inputs, inputs.save_residuals)
  return OutputSchema(T=T, residuals=checkpoints)


def abstract_eval(abstract_inputs):
  ABSTRACT_EVALS["with_residuals" if abstract_inputs.save_residuals
                 else "plain"] += 1
  nx = abstract_inputs.T0.shape[0]
  n_ckpt = -(-abstract_inputs.nt // abstract_inputs.stride)
  return with_residuals(abstract_inputs,
                        {"T": {"shape": [nx], "dtype": "float64"}},
                        {"shape": [n_ckpt, nx], "dtype": "float64"})


def vector_jacobian_product(inputs: InputSchema, vjp_inputs: set[str],
                            vjp_outputs: set[str],
                            cotangent_vector: dict[str, Any]):
  if inputs.residuals is not None:
    _count("vjp_from_residuals")
    checkpoints = np.asarray(inputs.residuals, np.float64)
  else:
    _count("vector_jacobian_product")
    _, checkpoints = _forward(inputs, keep=True)   # the forward, again
  lam = np.asarray(cotangent_vector.get("T", np.zeros(inputs.T0.shape)),
                   np.float64)
  g_T0, g_cond = _adjoint(inputs, checkpoints, lam)
  out = {}
  if "T0" in vjp_inputs:
    out["T0"] = g_T0
  if "conductivity" in vjp_inputs:
    out["conductivity"] = np.float64(g_cond)
  return out


def jacobian_vector_product(inputs: InputSchema, jvp_inputs: set[str],
                            jvp_outputs: set[str],
                            tangent_vector: dict[str, Any]):
  """Forward-mode sensitivity, stepped alongside the primal."""
  _count("jacobian_vector_product")
  T0 = np.asarray(inputs.T0, np.float64)
  return {"T": _tangent(inputs,
                        tangent_vector.get("T0", np.zeros_like(T0)),
                        tangent_vector.get("conductivity", 0.0))}


def jacobian(inputs: InputSchema, jac_inputs: set[str],
             jac_outputs: set[str]):
  """The whole Jacobian in one call: a forward sweep per input direction."""
  _count("jacobian")
  nx = np.shape(inputs.T0)[0]
  out = {}
  if "T0" in jac_inputs:
    out["T0"] = np.stack([_tangent(inputs, np.eye(nx)[i], 0.0)
                          for i in range(nx)], axis=-1)
  if "conductivity" in jac_inputs:
    out["conductivity"] = _tangent(inputs, np.zeros(nx), 1.0)
  return {"T": out}


def _tangent(inputs, dT0, dcond):
  coeff = _grid(inputs)
  T = np.asarray(inputs.T0, np.float64)
  dT = np.asarray(dT0, np.float64)
  dc = float(dcond) * coeff / float(inputs.conductivity)
  for _ in range(inputs.nt):
    ab, k = _bands(T, coeff)
    T_new = solve_banded((1, 1), ab, T)
    # (I + A(k)) T_new = T  =>  (I + A(k)) dT_new = dT - dA T_new
    dk = 2.5 * coeff * T ** 1.5 * dT + (dc / coeff) * k
    c = np.full(T.shape[0], 2.0)
    c[0] = c[-1] = 1.0
    w = dk * T_new                 # column j of A(k) is k_j * (-1, c_j, -1)
    AdT = c * w
    AdT[:-1] -= w[1:]
    AdT[1:] -= w[:-1]
    dT = solve_banded((1, 1), ab, dT - AdT)
    T = T_new
  return dT
