"""The heat Tesseract (examples/tesseracts/heat) with a VJP that can hang.

For tests/test_tesseract.py's fault tests, served by ``tesseract-runtime
serve``: while the file that the environment variable ``SLOW_TESSERACT_FLAG``
names exists, ``vector_jacobian_product`` waits (at most 60 s) before it
answers, as a stuck server would; the other endpoints, the schemas and the
call counts are the heat Tesseract's own.
"""

import importlib.util
import os
import pathlib
import time
from typing import Any

_HEAT = (pathlib.Path(__file__).resolve().parents[3] / "examples" /
         "tesseracts" / "heat" / "tesseract_api.py")
_spec = importlib.util.spec_from_file_location("heat_tesseract_api", _HEAT)
heat = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(heat)

InputSchema = heat.InputSchema
OutputSchema = heat.OutputSchema
apply = heat.apply
abstract_eval = heat.abstract_eval
jacobian_vector_product = heat.jacobian_vector_product
jacobian = heat.jacobian


def _wait_while_flagged(limit: float = 60.0) -> None:
  flag = os.environ.get("SLOW_TESSERACT_FLAG")
  deadline = time.monotonic() + limit
  while flag and os.path.exists(flag) and time.monotonic() < deadline:
    time.sleep(0.02)


def vector_jacobian_product(inputs: InputSchema, vjp_inputs: set[str],
                            vjp_outputs: set[str],
                            cotangent_vector: dict[str, Any]):
  _wait_while_flagged()
  return heat.vector_jacobian_product(inputs, vjp_inputs, vjp_outputs,
                                      cotangent_vector)
