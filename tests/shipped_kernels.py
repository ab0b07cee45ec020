"""JAX's shipped Pallas kernels for the tests, as shipped and swapped, with
two independent ways to count their launches.

* **Lowered (static)**: ``examples/pallas_ops_transformer.py``'s
  ``kernel_launches`` over the program JAX lowers for a GPU (interpret mode
  off): what a GPU runs, after JAX's dead-code elimination. ``jit`` only.
* **At run time**: an instrumented copy of a kernel module whose
  ``pl.pallas_call`` adds a ``jax.debug.callback`` to each kernel, fired by
  the grid's first program (every ``program_id`` 0), in interpret mode. It
  counts executions in ``jit`` and eager mode alike. Two caveats, both
  accounted for in ``instances``: ``vmap`` (the user's, or the one the kernel
  module itself applies, as ``rms_norm`` does) runs the kernel body once per
  batch element, each seeing program id 0; and the callback is an effect,
  so JAX never removes an instrumented kernel (a real one is removed when
  all its outputs are unused; none is, in the programs tested here).
"""

from __future__ import annotations

import collections
import dataclasses
import functools
import importlib
import importlib.util
import math
import os
import sys
import types
import warnings
from typing import Callable

import jax
import jax.numpy as jnp
import pytest
from jax.experimental import pallas as pl

import smartvjp
from smartvjp import _versions

# JAX's Triton-lowered kernels (KERNELS below, and the example that uses
# them): jax 0.12.1 removed them from jax.experimental.pallas.ops.gpu
TRITON = pytest.mark.skipif(
    not _versions.SHIPS_TRITON_PALLAS_OPS,
    reason="jax 0.12.1 removed JAX's Triton Pallas kernels (attention, "
    "layer_norm, rms_norm)")

ROOT = os.path.join(os.path.dirname(os.path.abspath(__file__)), os.pardir)


def load_example():
  """``examples/pallas_ops_transformer.py``, imported (its dataclasses need
  it in ``sys.modules``)."""
  name = "pallas_ops_transformer"
  if name not in sys.modules:
    path = os.path.join(ROOT, "examples", f"{name}.py")
    spec = importlib.util.spec_from_file_location(name, path)
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module
    try:
      spec.loader.exec_module(module)
    except BaseException:
      del sys.modules[name]
      raise
  return sys.modules[name]


# -- run-time counting --------------------------------------------------------------

FIRES: collections.Counter = collections.Counter()


def _fired(label):
  FIRES[label] += 1


def _counting_pallas_call(kernel, *args, grid=(), name=None, out_shape=None,
                          **kwargs):
  rank = len(grid) if isinstance(grid, (tuple, list)) else (
      0 if grid is None else 1)
  outputs = len(out_shape) if isinstance(out_shape, (list, tuple)) else 1
  base = kernel.func if isinstance(kernel, functools.partial) else kernel
  label = (name or base.__name__, outputs)

  def counted(*refs):
    if rank:
      first = functools.reduce(jnp.logical_and,
                               [pl.program_id(i) == 0 for i in range(rank)])
      pl.when(first)(lambda: jax.debug.callback(
          functools.partial(_fired, label)))     # runs the body under when
    else:
      jax.debug.callback(functools.partial(_fired, label))
    return kernel(*refs)

  return pl.pallas_call(counted, *args, grid=grid, name=name,
                        out_shape=out_shape, **kwargs)


class _CountingPallas(types.ModuleType):
  """``jax.experimental.pallas`` whose ``pallas_call`` counts launches."""

  def __init__(self):
    super().__init__(pl.__name__)
    vars(self)["pallas_call"] = _counting_pallas_call

  def __getattr__(self, attr):
    return getattr(pl, attr)


def fresh_copy(name):
  """A plain (unswapped) fresh copy of module ``name``: JAX's code, as
  shipped, in a module object the instrumentation may change."""
  spec = importlib.util.find_spec(name)
  module = importlib.util.module_from_spec(spec)
  before = sys.modules.get(name)
  sys.modules[name] = module          # dataclasses look the module up
  try:
    spec.loader.exec_module(module)
  finally:
    if before is None:
      del sys.modules[name]
    else:
      sys.modules[name] = before
  return module


def load(name, swapped, counting=False):
  """Module ``name`` as shipped (``importlib``, or a fresh copy when
  counting) or swapped (``smartvjp.import_swapped``); with ``counting``, its
  kernels count their launches in ``FIRES``."""
  with warnings.catch_warnings():
    warnings.simplefilter("ignore", DeprecationWarning)   # "use tokamax"
    if swapped:
      module = smartvjp.import_swapped(name)
    elif counting:
      module = fresh_copy(name)
    else:
      module = importlib.import_module(name)
  if counting:
    module.pl = _CountingPallas()
  return module


# -- the kernels ------------------------------------------------------------------

@dataclasses.dataclass(frozen=True)
class ShippedKernel:
  """One of JAX's shipped ``custom_vjp`` Pallas kernels.

  ``call(module, *args, interpret)`` applies it to the arrays ``args()``
  (all differentiated); ``rules`` maps f, fwd and bwd to the kernels (name,
  number of outputs) each launches; ``instances(kernel, args)`` is how often
  one launch fires the run-time counter (see the module docstring).
  """
  id: str
  module: str
  function: str
  call: Callable
  args: Callable[[], tuple]
  rules: dict[str, tuple[tuple[str, int], ...]]
  instances: Callable

  def expected(self, rule_calls: dict[str, int]) -> dict[tuple[str, int], int]:
    """``{(kernel name, outputs): launches}`` for ``{rule: calls}``."""
    out = collections.Counter()
    for rule, n in rule_calls.items():
      for kernel in self.rules[rule]:
        out[kernel] += n
    return {k: v for k, v in out.items() if v}


def normal(key, shape):
  return jax.random.normal(jax.random.key(key), shape, jnp.float32)


def mha_args():
  b, t, h, d = 2, 16, 2, 16
  return tuple(normal(i, (b, t, h, d)) for i in range(3))


def norm_args():
  return (normal(3, (2, 8, 32)), 1.0 + 0.1 * normal(4, (32,)),
          0.1 * normal(5, (32,)))


def _rows(kernel, args):
  """Launch instances of a normalization kernel: its module vmaps the row
  kernels over every row of ``x``; the dw/db kernel is not vmapped."""
  return 1 if kernel[0] == "ln_backward_dw_db" else math.prod(
      args[0].shape[:-1])


MHA_BLOCKS = dict(block_q=16, block_k=16, block_q_dkv=16, block_kv_dkv=16,
                  block_q_dq=16, block_kv_dq=16)


def _mha(module, q, k, v, interpret):
  return module.mha(q, k, v, None, sm_scale=0.25, causal=True,
                    block_sizes=module.BlockSizes(**MHA_BLOCKS),
                    interpret=interpret)


KERNELS = {
    "attention": ShippedKernel(
        "attention", "jax.experimental.pallas.ops.gpu.attention", "mha", _mha,
        mha_args,
        rules={"f": (("mha_forward", 1),), "fwd": (("mha_forward", 2),),
               "bwd": (("mha_preprocess_backward", 1), ("mha_backward", 3))},
        instances=lambda kernel, args: 1),
    "rms_norm": ShippedKernel(
        "rms_norm", "jax.experimental.pallas.ops.gpu.rms_norm", "rms_norm",
        lambda m, x, w, b, interpret: m.rms_norm(x, w, b, interpret=interpret),
        norm_args,
        rules={"f": (("rms_norm_forward_kernel", 1),),
               "fwd": (("rms_forward", 2),),
               "bwd": (("ln_backward_dx", 1), ("ln_backward_dw_db", 2))},
        instances=_rows),
    "layer_norm": ShippedKernel(
        "layer_norm", "jax.experimental.pallas.ops.gpu.layer_norm",
        "layer_norm",
        lambda m, x, w, b, interpret: m.layer_norm(x, w, b,
                                                   interpret=interpret),
        norm_args,
        rules={"f": (("layer_norm_forward_kernel", 1),),
               "fwd": (("ln_forward", 3),),
               "bwd": (("ln_backward_dx", 1), ("ln_backward_dw_db", 2))},
        instances=_rows),
}

# Rule calls per checkpointed call under each schedule (the seed issue:
# jax.custom_vjp runs fwd in both passes; smartvjp f forward, fwd backward).
REMAT = {"shipped": {"fwd": 2, "bwd": 1},
         "swapped": {"f": 1, "fwd": 1, "bwd": 1}}
NO_REMAT = {"shipped": {"fwd": 1, "bwd": 1}, "swapped": {"fwd": 1, "bwd": 1}}


def scaled(rule_calls, n):
  return {k: v * n for k, v in rule_calls.items()}


def runtime_launches(kernel: ShippedKernel, args, batch=1):
  """``FIRES`` turned into launches (see ``instances``)."""
  out = {}
  for label, fires in FIRES.items():
    per_launch = kernel.instances(label, args) * batch
    assert fires % per_launch == 0, (label, fires, per_launch)
    out[label] = fires // per_launch
  return out


def static_launches(example, fn, *args):
  """``{(kernel name, outputs): launches}`` in ``jit(fn)`` lowered for a GPU."""
  counts = example.kernel_launches(example.lower_for_gpu(fn, *args))
  out = collections.Counter()
  for kernel, n in counts.items():
    out[kernel.name, len(kernel.outputs)] += n
  return dict(out)


# -- JAX's Mosaic GPU attention (attention_mgpu), lowered only -----------------------

MGPU = "jax.experimental.pallas.ops.gpu.attention_mgpu"


class CudaVersionsStub:
  """What attention_mgpu reads of ``jax._src.lib.cuda_versions`` (``None``
  in a CPU-only jaxlib): a CUDA 12.9.1 runtime, outside the range where the
  module refuses causal masking. Set on a module with ``monkeypatch``."""

  @staticmethod
  def cuda_runtime_get_version():
    return 12091


def mgpu_config(module, block=64):
  """A ``TuningConfig`` with forward and backward blocks (the backward
  pass needs them), non-causal (its backward pass refuses causal)."""
  return module.TuningConfig(
      block_q=block, block_kv=block, max_concurrent_steps=2, causal=False,
      block_q_dkv=block, block_kv_dkv=block, block_q_dq=block,
      block_kv_dq=block)


# The Mosaic GPU kernels of attention_mgpu per rule, ``(name, outputs)`` as
# the example's counter names them (``mosaic_gpu/<operands>``): f and fwd
# read q, k, v; the two backward kernels (dq; dk and dv) six operands each.
MGPU_RULES = {"f": (("mosaic_gpu/3", 1),), "fwd": (("mosaic_gpu/3", 2),),
              "bwd": (("mosaic_gpu/6", 1), ("mosaic_gpu/6", 2))}
