"""One side of a port comparison, run as a subprocess by ``conftest.py``.

A program script under ``tests/ports/`` calls :func:`start` first thing,
which reads ``--smart 0|1 --out PATH [--case NAME]`` and imports the
program's library; with ``--smart 1`` it imports it inside
``smartvjp.swap_custom_vjp()`` (the public API: ``jax.custom_vjp`` and
``jax.custom_derivatives.custom_vjp`` are ``smart_custom_vjp`` while the
library's decorators run), and checks that the names are JAX's again after
the block. The program then records its arrays with :meth:`Recorder.add` and
calls :meth:`Recorder.save`, which writes them to an ``.npz`` file: each
array as its raw bytes (so that the parent can compare bit for bit, NaN and
-0.0 included, and dtypes numpy cannot store, such as float8, survive) plus
its dtype name and shape.
"""

from __future__ import annotations

import argparse
import json
import sys

import numpy as np


def start(*modules_not_yet_imported: str):
  """Parses the command line and imports the library, swapped when asked.

  Args:
    modules_not_yet_imported: modules the program uses, imported here (inside
      ``smartvjp.swap_custom_vjp()`` with ``--smart 1``); it is an error if
      one of them is already imported (the swap would then come too late for
      its module-level ``@custom_vjp`` decorators).

  Returns:
    A :class:`Recorder`.
  """
  parser = argparse.ArgumentParser()
  parser.add_argument("--smart", type=int, choices=(0, 1), required=True)
  parser.add_argument("--out", required=True)
  parser.add_argument("--case", default="")
  args = parser.parse_args()
  import importlib
  import jax
  jax.config.update("jax_platforms", "cpu")
  for name in modules_not_yet_imported:
    if name in sys.modules:
      raise RuntimeError(f"{name} was imported before the swap")
  jax_custom_vjp = jax.custom_vjp
  if args.smart:
    import smartvjp
    with smartvjp.swap_custom_vjp():
      for name in modules_not_yet_imported:
        importlib.import_module(name)
    import jax.custom_derivatives
    if (jax.custom_vjp is not jax_custom_vjp
        or jax.custom_derivatives.custom_vjp is not jax_custom_vjp):
      raise RuntimeError("swap_custom_vjp did not restore jax.custom_vjp")
  else:
    for name in modules_not_yet_imported:
      importlib.import_module(name)
  return Recorder(bool(args.smart), args.out, args.case)


class Recorder:
  """Collects named arrays and writes them as raw bytes to an ``.npz``."""

  def __init__(self, smart: bool, out: str, case: str):
    self.smart = smart
    self.case = case  # which program of the script (``--case``), if several
    self.out = out
    self.arrays: dict[str, np.ndarray] = {}
    self.meta: dict[str, list] = {}

  def add(self, name: str, value) -> None:
    """Records ``value`` (an array, or a pytree of arrays) under ``name``."""
    import jax
    leaves = jax.tree_util.tree_flatten_with_path(value)[0]
    for path, leaf in leaves:
      key = name + jax.tree_util.keystr(path)
      if key in self.meta:
        raise KeyError(f"recorded twice: {key}")
      arr = _to_numpy(leaf)
      self.meta[key] = [str(arr.dtype), list(arr.shape)]
      self.arrays[key] = np.frombuffer(
          np.ascontiguousarray(arr).tobytes(), dtype=np.uint8)

  def check_swap(self, jaxpr_text: str) -> None:
    """Fails unless a jaxpr of the program shows the side's custom_vjp:
    smartvjp's primitives (``smartvjp_call``, or ``smartvjp_fwd`` and
    ``smartvjp_bwd`` in a gradient) and no ``custom_vjp_call`` with the swap,
    the reverse without it."""
    ours, jaxs = "smartvjp_" in jaxpr_text, "custom_vjp_call" in jaxpr_text
    if (ours, jaxs) != ((True, False) if self.smart else (False, True)):
      want = "smartvjp's primitives" if self.smart else "custom_vjp_call"
      raise AssertionError(
          f"the program's jaxpr should show {want} only (smartvjp: {ours}, "
          f"custom_vjp_call: {jaxs}); the swap did not reach the library:\n"
          f"{jaxpr_text[:2000]}")

  def save(self) -> None:
    np.savez(self.out, __meta__=np.array(json.dumps(self.meta)), **{
        f"a{i}": v for i, v in enumerate(self.arrays.values())})
    names = list(self.arrays)
    with open(self.out + ".names.json", "w") as fh:
      json.dump(names, fh)


def _to_numpy(x) -> np.ndarray:
  import jax
  import jax.numpy as jnp
  if isinstance(x, jax.Array) and jnp.issubdtype(x.dtype, jax.dtypes.extended):
    # an extended dtype (e.g. flax's fp8 meta dtype): its float payload
    x = jax.lax.convert_element_type(x, x.dtype.float_dtype)
  return np.asarray(x)


def load(path: str) -> dict[str, tuple[str, tuple, bytes]]:
  """``name -> (dtype name, shape, raw bytes)`` as written by ``save``."""
  with open(path + ".names.json") as fh:
    names = json.load(fh)
  with np.load(path) as data:
    meta = json.loads(str(data["__meta__"]))
    return {n: (meta[n][0], tuple(meta[n][1]), data[f"a{i}"].tobytes())
            for i, n in enumerate(names)}


def decode(entry) -> np.ndarray:
  """The array of a ``load`` entry (for messages)."""
  import ml_dtypes  # noqa: F401  (registers float8 names with numpy)
  dtype, shape, raw = entry
  dt = np.dtype(getattr(ml_dtypes, dtype, dtype))
  return np.frombuffer(raw, dtype=dt).reshape(shape)
