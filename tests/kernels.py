"""Counting kernels for the tests: opaque to JAX and XLA.

Both kinds are opaque: neither JAX nor XLA can drop some of a kernel's
outputs and keep the rest, so a kernel whose primal output is used runs
whole, residual writes included, as a real kernel (Pallas, Triton, an FFI
call) does.

* ``callback`` kernels: ``jax.pure_callback`` to numpy. JAX and XLA remove
  one whose outputs are all unused, as JAX does with a ``pallas_call``.
* ``never_dce`` kernels: a test primitive whose dead-code-elimination rule
  keeps it and which lowers to a side-effecting host callback, so that
  nothing removes it even when its outputs are all unused: stricter than a
  real kernel, so that a schedule which counts on a dead call being removed
  shows in the counts.
"""

from __future__ import annotations

import collections
import contextlib
import functools
import glob
import os
import re
import tempfile

import jax
import jax.numpy as jnp
import numpy as np
from jax.ad_checkpoint import checkpoint_name
from jax.experimental import io_callback
from jax.interpreters import mlir
from jax.extend.core import Primitive

from smartvjp import _facade  # registration adapters (DCE rule signature)
from smartvjp import _jaxprs

COUNTS: collections.Counter = collections.Counter()


def has_flag(name):
  """Whether this JAX defines the config flag ``name``."""
  try:
    getattr(jax.config, name)
    return True
  except AttributeError:
    return False


@contextlib.contextmanager
def config(**values):
  """``jax.config`` flags set to ``values`` inside the block, restored after."""
  old = {k: getattr(jax.config, k) for k in values}
  for k, v in values.items():
    jax.config.update(k, v)
  try:
    yield
  finally:
    for k, v in old.items():
      jax.config.update(k, v)


def reset():
  COUNTS.clear()


def run(fn, *args):
  """``(fn(*args), the kernel counts it caused)``."""
  reset()
  out = jax.block_until_ready(fn(*args))
  return out, dict(COUNTS)


def counts(*names):
  return {n: COUNTS[n] for n in names if COUNTS[n]}


def _host(name, fn, *args):
  COUNTS[name] += 1
  outs = fn(*[np.asarray(a) for a in args])
  return tuple(np.asarray(o) for o in outs)


# -- never-DCE'd kernel primitive ------------------------------------------------

kernel_p = Primitive("test_opaque_kernel")
kernel_p.multiple_results = True
_jaxprs.register_opaque_kernel(kernel_p.name)


@kernel_p.def_abstract_eval
def _kernel_abstract_eval(*avals, name, fn, out_avals):
  return list(out_avals)


def _kernel_lower(*args, name, fn, out_avals):
  shapes = [jax.ShapeDtypeStruct(a.shape, a.dtype) for a in out_avals]
  return io_callback(functools.partial(_host, name, fn), tuple(shapes), *args,
                     ordered=False)


kernel_p.def_impl(functools.partial(jax._src.dispatch.apply_primitive, kernel_p))
# not cacheable, as JAX's own callbacks are not: on a TPU a host callback
# moves its operands over a channel, and a lowering cached once and called
# for two equations would send both over the same one (seen on a TPU v5e:
# one kernel received another's operands)
mlir.register_lowering(kernel_p, mlir.lower_fun(_kernel_lower,
                                                multiple_results=True),
                       cacheable=False)
_facade.register_dce(kernel_p, lambda used, eqn: ([True] * len(eqn.invars), eqn))


def kernel(name, fn, out_like, *args, never_dce=False):
  """Runs numpy ``fn(*args) -> tuple`` as an opaque kernel counted as ``name``."""
  out_avals = tuple(jax.core.ShapedArray(o.shape, o.dtype) for o in out_like)
  if never_dce:
    return kernel_p.bind(*args, name=name, fn=fn, out_avals=out_avals)
  shapes = tuple(jax.ShapeDtypeStruct(a.shape, a.dtype) for a in out_avals)
  return jax.pure_callback(functools.partial(_host, name, fn), shapes, *args,
                           vmap_method="sequential")


# -- the standard test function F(x) = sin(x) with all four rules as kernels ---

def sin_rules(never_dce=False, prefix=""):
  """(f, fwd, bwd, fwd_bwd) for sin, each one opaque kernel."""
  k = functools.partial(kernel, never_dce=never_dce)
  n = lambda s: prefix + s

  def f(x):
    (y,) = k(n("f"), lambda x: (np.sin(x),), [x], x)
    return y

  def fwd(x):
    y, c = k(n("fwd"), lambda x: (np.sin(x), np.cos(x)), [x, x], x)
    return y, (c,)

  def bwd(res, g):
    (c,) = res
    (dx,) = k(n("bwd"), lambda c, g: (c * g,), [g], c, g)
    return (dx,)

  def fwd_bwd(x, g):
    (dx,) = k(n("fwd_bwd"), lambda x, g: (np.cos(x) * g,), [g], x, g)
    return (dx,)

  return f, fwd, bwd, fwd_bwd


def counting_sin(decorator, counts=None, *, concrete=False,
                 with_fwd_bwd=False):
  """``(F, counts)``: ``F`` is sin under ``decorator`` (``jax.custom_vjp`` or
  ``smart_custom_vjp``) with JAX-coded rules whose Python bodies count their
  runs, traced or eager, in ``counts`` (a new ``Counter`` by default; a dict
  given must hold a key for every rule). With ``concrete``, ``f`` branches on
  a value, which fails on a tracer; with ``with_fwd_bwd``, ``fwd_bwd`` is
  given too (smartvjp only)."""
  counts = collections.Counter() if counts is None else counts

  def f(x):
    counts["f"] += 1
    if concrete and bool(jnp.all(x > -10.0)):   # needs a concrete x
      return jnp.sin(x)
    return jnp.sin(x)

  def fwd(x):
    counts["fwd"] += 1
    return jnp.sin(x), jnp.cos(x)

  def bwd(c, g):
    counts["bwd"] += 1
    return (c * g,)

  def fwd_bwd(x, g):
    counts["fwd_bwd"] += 1
    return (jnp.cos(x) * g,)

  F = decorator(f)
  if with_fwd_bwd:
    F.defvjp(fwd, bwd, fwd_bwd=fwd_bwd)
  else:
    F.defvjp(fwd, bwd)
  return F, counts


def xw_rules(prefix=""):
  """(f, fwd, bwd, fwd_bwd) for sin(x) * w, each one callback kernel.

  The kernels are elementwise with ``w`` broadcast against ``x``; ``bwd``
  reduces ``dw`` to ``w``'s shape, so a batched ``x`` with an unbatched ``w``
  needs the cotangent of ``w`` summed over the batch.
  """
  n = lambda s: prefix + s

  def reduce_to(a, shape):
    while a.ndim > len(shape):
      a = a.sum(0)
    return a

  def f(x, w):
    (y,) = kernel(n("f"), lambda x, w: (np.sin(x) * w,), [x], x, w)
    return y

  def fwd(x, w):
    y, c, s = kernel(n("fwd"), lambda x, w: (np.sin(x) * w, np.cos(x), np.sin(x)),
                     [x, x, x], x, w)
    return y, (c, s, w)

  def bwd(res, g):
    c, s, w = res
    dx, dw = kernel(n("bwd"), lambda c, s, w, g: (c * w * g,
                                                  reduce_to(s * g, w.shape)),
                    [g, w], c, s, w, g)
    return dx, dw

  def fwd_bwd(x, w, g):
    dx, dw = kernel(n("fwd_bwd"),
                    lambda x, w, g: (np.cos(x) * w * g,
                                     reduce_to(np.sin(x) * g, w.shape)),
                    [g, w], x, w, g)
    return dx, dw

  return f, fwd, bwd, fwd_bwd


def matmul_tanh_rules(extra_unnamed=False):
  """(f, fwd, bwd) for tanh(x @ w), JAX-coded; ``fwd``'s residual ``y = x @
  w`` is named "y" (``checkpoint_name``), and with ``extra_unnamed`` ``fwd``
  also returns an unnamed ``sum(x, 1)`` (a residual no name policy saves)."""
  def f(x, w):
    return jnp.tanh(x @ w)

  def fwd(x, w):
    y = checkpoint_name(x @ w, "y")
    res = (x, w, y, jnp.sum(x, 1)) if extra_unnamed else (x, w, y)
    return jnp.tanh(y), res

  def bwd(res, g):
    x, w, y = res[:3]
    d = g * (1 - jnp.tanh(y) ** 2)
    return d @ w.T, x.T @ d
  return f, fwd, bwd


# -- matmul examples (Pallas and Triton): data, loss, launches on a GPU --------

def matmul_data(m, k, n, dtype):
  """``x: [m, k]`` standard normal and ``w: [k, n]`` scaled by
  ``1 / sqrt(k)``, in ``dtype``, from a fixed key."""
  kx, kw = jax.random.split(jax.random.key(3))
  x = jax.random.normal(kx, (m, k), dtype)
  w = (jax.random.normal(kw, (k, n)) / np.sqrt(k)).astype(dtype)
  return x, w


def square_loss(F, remat):
  """``(x, w) -> sum(F(x, w) ** 2)`` in f32, ``F`` checkpointed if ``remat``."""
  G = jax.checkpoint(F) if remat else F
  return lambda x, w: jnp.sum(G(x, w).astype(jnp.float32) ** 2)


def assert_grads_close(got, want, tol):
  """Each gradient in ``got`` within ``tol`` of ``want``'s, relative to the
  largest entry of ``want``'s (the dtypes' rounding scales with it)."""
  for a, b in zip(got, want, strict=True):
    scale = float(jnp.max(jnp.abs(b.astype(jnp.float32))))
    np.testing.assert_allclose(np.float32(a), np.float32(b), rtol=tol,
                               atol=tol * scale)


def kernel_name_pattern(name):
  """Matches ``name`` as a whole word of a kernel's name, allowing a numeric
  suffix that a compiler may add: ``gelu_matmul_f`` matches
  ``gelu_matmul_f`` and ``gelu_matmul_f_1``, not ``gelu_matmul_fwd``."""
  return re.compile(rf"(?<![\w]){re.escape(name)}(?:[._]\d+)?(?![\w])")


def gpu_kernel_launches(fn, *args, names):
  """Runs ``fn(*args)`` once to compile and warm up, then once more under
  ``jax.profiler.trace``, and returns ``{name: launches}``: how many GPU
  kernel executions of that run had a name that ``kernel_name_pattern(name)``
  matches.

  A host counter cannot run inside a GPU kernel, and compiled-HLO counts are
  static under ``scan``; the profiler sees each execution. A device plane
  lists a kernel on its stream's line and may repeat it on summary lines, so
  each name's count is the largest over the lines of a plane, summed over
  GPU planes.
  """
  jax.block_until_ready(fn(*args))
  with tempfile.TemporaryDirectory() as folder:
    with jax.profiler.trace(folder):
      jax.block_until_ready(fn(*args))
    paths = glob.glob(os.path.join(folder, "**", "*.xplane.pb"),
                      recursive=True)
    assert len(paths) == 1, f"expected one profile, found {paths}"
    data = jax.profiler.ProfileData.from_file(paths[0])
  patterns = {n: kernel_name_pattern(n) for n in names}
  launches = dict.fromkeys(names, 0)
  for plane in data.planes:
    if "GPU" not in plane.name:
      continue
    most = collections.Counter()
    for line in plane.lines:
      here = collections.Counter(
          n for event in line.events for n, p in patterns.items()
          if p.search(event.name))
      most = most | here          # elementwise max
    for n in names:
      launches[n] += most[n]
  return launches


def per_rule(counts, kernel_names):
  """``{rule: launches}``, for the rules that launched, from ``{kernel:
  launches}`` and an example's ``KERNEL_NAMES`` (``{rule: (kernel, ...)}``)."""
  out = {}
  for rule, names in kernel_names.items():
    if n := sum(counts[name] for name in names):
      out[rule] = n
  return out


def gpu_rule_launches(fn, *args, kernel_names):
  """``per_rule`` of ``gpu_kernel_launches`` over every kernel that
  ``kernel_names`` lists."""
  names = [name for names in kernel_names.values() for name in names]
  return per_rule(gpu_kernel_launches(fn, *args, names=names), kernel_names)


# smartvjp_rule runs every user rule; jaxprs print it under the rule's name
_PRINTED = {"f": "smartvjp_primal", "fwd": "smartvjp_fwd",
            "bwd": "smartvjp_bwd", "fwd_bwd": "smartvjp_bwd"}


def printed_name(eqn) -> str:
  """The name a jaxpr prints for ``eqn``'s primitive."""
  if eqn.primitive.name == "smartvjp_rule":
    return _PRINTED[eqn.params["which"]]
  return eqn.primitive.name
