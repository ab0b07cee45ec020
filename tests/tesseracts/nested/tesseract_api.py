"""A small Tesseract with nested inputs and outputs, for tests/test_tesseract.py.

Inputs: a dict field ``a`` of differentiable vectors, a list ``b`` of
differentiable arrays of any shape, a model ``c`` with a differentiable
``w`` and a static ``n``, and a non-differentiable array ``d``. Outputs: a
dict ``y`` of differentiable vectors and a non-differentiable ``z``.
"""

from typing import Any

import numpy as np
from pydantic import BaseModel
from tesseract_core.runtime import Array, Differentiable, Float64


class Sub(BaseModel):
  w: Differentiable[Array[(None,), Float64]]
  n: int = 1


class InputSchema(BaseModel):
  a: dict[str, Differentiable[Array[(None,), Float64]]]
  b: list[Differentiable[Array[..., Float64]]]
  c: Sub
  d: Array[(None,), Float64]


class OutputSchema(BaseModel):
  y: dict[str, Differentiable[Array[(None,), Float64]]]
  z: Array[(None,), Float64]


def _y(inputs):
  s = sum(float(np.sum(b)) for b in inputs.b)
  return {k: np.sin(v) * inputs.c.w * inputs.c.n + s * inputs.d
          for k, v in inputs.a.items()}


def apply(inputs: InputSchema) -> OutputSchema:
  return OutputSchema(y=_y(inputs), z=inputs.d * 2.0)


def abstract_eval(abstract_inputs):
  nx = abstract_inputs.c.w.shape[0]
  return {"y": {k: {"shape": [nx], "dtype": "float64"}
                for k in abstract_inputs.a},
          "z": {"shape": list(abstract_inputs.d.shape), "dtype": "float64"}}


def vector_jacobian_product(inputs: InputSchema, vjp_inputs: set[str],
                            vjp_outputs: set[str],
                            cotangent_vector: dict[str, Any]):
  out = {}
  w, n, d = inputs.c.w, inputs.c.n, inputs.d
  cts = {k: cotangent_vector.get(f"y.{{{k}}}", np.zeros_like(w))
         for k in inputs.a}
  for k, v in inputs.a.items():
    if f"a.{{{k}}}" in vjp_inputs:
      out[f"a.{{{k}}}"] = cts[k] * np.cos(v) * w * n
  if "c.w" in vjp_inputs:
    out["c.w"] = sum(cts[k] * np.sin(v) * n for k, v in inputs.a.items())
  total = sum(float(np.dot(cts[k], d)) for k in inputs.a)
  for i, b in enumerate(inputs.b):
    if f"b.[{i}]" in vjp_inputs:
      out[f"b.[{i}]"] = np.full(np.shape(b), total)
  return out
