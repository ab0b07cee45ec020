"""The audit's ground truth on the CPU (issue 68, "What to build" item 10).

Ten steps, each a ``scan`` of four ``jax.checkpoint``-ed layers (RMSNorm of
``c @ w`` to a standard deviation of 2, then the step's sites), the sites
written with ``jax.custom_vjp``: host kernels reached through
``jax.pure_callback``, ``io_callback`` and a C++ FFI call (built here with
the system compiler and ``jax.ffi.include_dir()``; that entry is skipped
where there is none), behind a nested ``jit``, inside a ``custom_jvp``, in
a ``cond`` branch (beside a JAX fallback that never runs), in a ``scan``
and a ``while_loop`` in ``fwd``, in ``shard_map`` on 4 host devices,
JAX-coded sites, a site with a fused ``fwd_bwd``, and steps with several
sites. One saves over 25%, one nothing, one has a site worth ~15% beside
one worth 1-2%.

The kernels compute a GELU, ``x * Phi(x)``, and its derivative
``Phi(x) + x * phi(x)``, with ``Phi`` taken ``work`` times on slightly
scaled arguments (a kernel's cost in units). Their cost is real and
depends on the values: ``erf`` (scipy's on the host, ``std::erf`` in C++)
is cheapest near 0, so a rule timed on inputs drawn from N(0, 0.1^2) costs
about a quarter of what it costs on this step's layer inputs (std 2).

**The truth, built without the audit's code.** Per step, by hand: the step
as written, the step with every site swapped (the same rules through
``smartvjp.smart_custom_vjp``, with ``fwd_bwd`` and ``fused=True`` where
the site has one, as the audit's ``smartvjp_fused``), and one step per site
with only that site swapped. They are timed in interleaved paired rounds
(each round runs every variant once, the order rotated round by round;
``--pairs``, 40 by default), in wall time and in process CPU time
(``time.process_time``: all the process's threads). A saving is
``1 - median(variant / as written)`` over the rounds, with a 95% interval
from order statistics of the paired ratios (the binomial interval of a
median, distribution-free). The truth is the CPU-time saving (the wall-time
one is printed beside it; on a machine shared with other processes the
wall clock also times the others). Each kernel counts its runs on the host
(a Python counter in the callbacks, a C++ counter in the FFI handlers); one
"head" kernel runs once per run of its rule, so the counters give each
rule's runs per step, as written (also with ``optimize_remat=True``) and
swapped (with and without the fused rule). Under ``shard_map`` the counts
are per device (host counts over 4).

**Then the audit**: ``smartvjp.audit(step, *args, calibrate=True)`` and
``smartvjp.audit(step, *args, measure=True)``, each timed (wall seconds).
Everything read from its report goes through ``audit_estimates`` (one
function; keys of ``docs/audit.md`` and ``smartvjp.audit/2``; a key not
there is "not reported"), and its counts through ``report.runs(config)``.

**Held to** (issue 68): an estimate agrees with the truth within ±25% of
it or 1 point of the step, whichever is larger; its sign is right wherever
the truth's interval excludes 0; the advice is right ("swap" where the
truth's ratio interval lies below 1 and the saving is >= 0.5%, "no action"
where it holds 1; "cannot tell" is not right advice); the counts equal the
host counters. An entry meets the tolerance when the calibrated step
estimate and every site's calibrated and measured estimates agree; at most
one entry in eight may miss it, and none may have a wrong sign or advice.

Run:    python benchmarks/audit_truth.py [--load 2] [--only NAME ...]
Smoke:  python benchmarks/audit_truth.py --smoke --out /tmp/t.json  (tiny
        shapes, 4 pairs, one audit per entry: measure=True)
The JSON goes to ``benchmarks/results/audit_truth_<commit>.json`` unless
``--out`` says otherwise. The script sets
``XLA_FLAGS=--xla_force_host_platform_device_count=4`` before importing JAX
(the ``shard_map`` entry needs 4 devices; without them it is skipped).
"""

from __future__ import annotations

import os

if __name__ == "__main__" and "xla_force_host_platform_device_count" not in \
    os.environ.get("XLA_FLAGS", ""):   # run as a script: before JAX starts
  os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "")
                             + " --xla_force_host_platform_device_count=4"
                             ).strip()

import argparse            # noqa: E402
import atexit              # noqa: E402
import collections         # noqa: E402
import ctypes              # noqa: E402
import dataclasses         # noqa: E402
import functools           # noqa: E402
import hashlib             # noqa: E402
import inspect             # noqa: E402
import json                # noqa: E402
import math                # noqa: E402
import shutil              # noqa: E402
import subprocess          # noqa: E402
import sys                 # noqa: E402
import tempfile            # noqa: E402
import time                # noqa: E402
import traceback           # noqa: E402

import jax                 # noqa: E402
import jax.numpy as jnp    # noqa: E402
import numpy as np         # noqa: E402
from scipy import special  # noqa: E402

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
sys.path.insert(0, os.path.dirname(HERE))

import _report             # noqa: E402
import smartvjp            # noqa: E402

# -- the held-to tolerance (issue 68) ------------------------------------------

RELATIVE, POINTS = 0.25, 0.01     # ±25% of the truth or 1 point of the step
WORTH = 0.005                     # "swap" needs a saving of at least 0.5%
LAYERS = 4
SCALE = 1e-3                      # the work units' argument scaling

# -- host kernels and their counters ------------------------------------------

COUNTS: collections.Counter = collections.Counter()   # (site, role) -> runs


def _phi(x, work):
  """``Phi(x)`` taken ``work`` times (the kernel's cost), averaged."""
  s = np.zeros(x.shape, np.float64)
  for r in range(work):
    s += special.erf(x * (1.0 + r * SCALE) / math.sqrt(2.0))
  return 0.5 * (1.0 + s / work)


def _pdf(x, work=1):
  """``phi(x)`` in float32, taken ``work`` times (averaged)."""
  x = np.asarray(x, np.float32)
  s = sum(np.exp(np.float32(-0.5) * (x * np.float32(1.0 + r * SCALE)) ** 2)
          for r in range(work))
  return s / np.float32(work * math.sqrt(2 * math.pi))


def _d(x, work, wp=1):
  return _phi(x, work) + x * _pdf(x, wp)


# op name -> (numpy function of (arrays, work), number of outputs)
HOST_OPS = {
    "y": lambda x, *, wy, wd, wp: (x * _phi(x, wy),),
    "yd": lambda x, *, wy, wd, wp: _yd(x, wy, wd, wp),
    "d": lambda x, *, wy, wd, wp: (_d(x, wd or wy, wp),),
    "mul": lambda d, g, *, wy, wd, wp: (d * g,),
    "dx": lambda x, g, *, wy, wd, wp: (g * _d(x, wd or wy, wp),),
}


def _yd(x, wy, wd, wp):
  p = _phi(x, wy)
  d = (p if wd == 0 else _phi(x, wd)) + x * _pdf(x, wp)
  return x * p, d


def jnp_op(op, *arrays, wy, wd, wp=1):
  """The same ops in JAX (the JAX-coded sites, and ``cond``'s fallback)."""
  def phi(x, work):
    s = sum(jax.scipy.special.erf(x * (1.0 + r * SCALE) / math.sqrt(2.0))
            for r in range(work))
    return 0.5 * (1.0 + s / work)

  def pdf(x):
    return sum(jnp.exp(-0.5 * (x * (1.0 + r * SCALE)) ** 2)
               for r in range(wp)) / (wp * math.sqrt(2 * math.pi))
  if op == "y":
    (x,) = arrays
    return (x * phi(x, wy),)
  if op == "yd":
    (x,) = arrays
    p = phi(x, wy)
    return x * p, (p if wd == 0 else phi(x, wd)) + x * pdf(x)
  if op == "d":
    (x,) = arrays
    return (phi(x, wd or wy) + x * pdf(x),)
  if op == "mul":
    d, g = arrays
    return (d * g,)
  x, g = arrays
  return (g * (phi(x, wd or wy) + x * pdf(x)),)


def _host(op, key, wy, wd, wp):
  def run(*arrays):
    COUNTS[key] += 1
    outs = HOST_OPS[op](*[np.asarray(a) for a in arrays], wy=wy, wd=wd, wp=wp)
    return tuple(np.asarray(o, np.float32) for o in outs)
  return run


# -- the C++ FFI kernels ------------------------------------------------------

CXX_SOURCE = r"""
#include <cmath>
#include <cstdint>
#include "xla/ffi/api/ffi.h"

namespace ffi = xla::ffi;
static int64_t counts[256] = {0};
extern "C" int64_t truth_count(int i) { return counts[i]; }
extern "C" void truth_reset() { for (auto& c : counts) c = 0; }

static const double kScale = 1e-3, kRt2 = std::sqrt(2.0),
                    kRt2Pi = std::sqrt(2.0 * M_PI);
static double Phi(double x, int64_t work) {
  double s = 0;
  for (int64_t r = 0; r < work; ++r)
    s += std::erf(x * (1.0 + r * kScale) / kRt2);
  return 0.5 * (1.0 + s / work);
}
static double Pdf(double x) { return std::exp(-0.5 * x * x) / kRt2Pi; }

static ffi::Error Y(ffi::Buffer<ffi::F32> x, ffi::ResultBuffer<ffi::F32> y,
                    int64_t slot, int64_t wy, int64_t wd) {
  ++counts[slot];
  for (size_t i = 0; i < x.element_count(); ++i) {
    double v = x.typed_data()[i];
    y->typed_data()[i] = v * Phi(v, wy);
  }
  return ffi::Error::Success();
}
static ffi::Error YD(ffi::Buffer<ffi::F32> x, ffi::ResultBuffer<ffi::F32> y,
                     ffi::ResultBuffer<ffi::F32> d, int64_t slot, int64_t wy,
                     int64_t wd) {
  ++counts[slot];
  for (size_t i = 0; i < x.element_count(); ++i) {
    double v = x.typed_data()[i], p = Phi(v, wy);
    y->typed_data()[i] = v * p;
    d->typed_data()[i] = (wd == 0 ? p : Phi(v, wd)) + v * Pdf(v);
  }
  return ffi::Error::Success();
}
static ffi::Error Mul(ffi::Buffer<ffi::F32> d, ffi::Buffer<ffi::F32> g,
                      ffi::ResultBuffer<ffi::F32> out, int64_t slot,
                      int64_t wy, int64_t wd) {
  ++counts[slot];
  for (size_t i = 0; i < d.element_count(); ++i)
    out->typed_data()[i] = d.typed_data()[i] * g.typed_data()[i];
  return ffi::Error::Success();
}
static ffi::Error DX(ffi::Buffer<ffi::F32> x, ffi::Buffer<ffi::F32> g,
                     ffi::ResultBuffer<ffi::F32> out, int64_t slot,
                     int64_t wy, int64_t wd) {
  ++counts[slot];
  for (size_t i = 0; i < x.element_count(); ++i) {
    double v = x.typed_data()[i];
    out->typed_data()[i] =
        g.typed_data()[i] * (Phi(v, wd ? wd : wy) + v * Pdf(v));
  }
  return ffi::Error::Success();
}

#define B ffi::Buffer<ffi::F32>
#define R ffi::ResultBuffer<ffi::F32>
#define ATTRS .Attr<int64_t>("slot").Attr<int64_t>("wy").Attr<int64_t>("wd")
XLA_FFI_DEFINE_HANDLER_SYMBOL(truth_y, Y,
    ffi::Ffi::Bind().Arg<B>().Ret<B>() ATTRS);
XLA_FFI_DEFINE_HANDLER_SYMBOL(truth_yd, YD,
    ffi::Ffi::Bind().Arg<B>().Ret<B>().Ret<B>() ATTRS);
XLA_FFI_DEFINE_HANDLER_SYMBOL(truth_mul, Mul,
    ffi::Ffi::Bind().Arg<B>().Arg<B>().Ret<B>() ATTRS);
XLA_FFI_DEFINE_HANDLER_SYMBOL(truth_dx, DX,
    ffi::Ffi::Bind().Arg<B>().Arg<B>().Ret<B>() ATTRS);
"""

_FFI: dict = {}
FFI_OPS = ("y", "yd", "mul", "dx")


def build_ffi() -> str | None:
  """Compiles and registers the C++ handlers once (reused from the temp
  dir by later runs); returns None on success, else why not."""
  if "why" in _FFI:
    return _FFI["why"]
  cxx = shutil.which(os.environ.get("CXX", "g++")) or shutil.which("c++")
  why = None
  if cxx is None:
    why = "no C++ compiler (set CXX to use one)"
  else:
    digest = hashlib.sha1((CXX_SOURCE + jax.__version__).encode()
                          ).hexdigest()[:12]
    folder = os.path.join(tempfile.gettempdir(), f"smartvjp-truth-{digest}")
    os.makedirs(folder, exist_ok=True)
    lib_path = os.path.join(folder, "libtruth.so")
    if not os.path.exists(lib_path):
      src = os.path.join(folder, "truth.cc")
      with open(src, "w") as fh:
        fh.write(CXX_SOURCE)
      tmp = f"{lib_path}.{os.getpid()}.tmp"
      done = subprocess.run([cxx, "-O2", "-shared", "-fPIC", "-std=c++17",
                             f"-I{jax.ffi.include_dir()}", src, "-o", tmp],
                            capture_output=True, text=True)
      if done.returncode != 0:
        why = "compiling the C++ handlers failed: " + (
            done.stderr.strip().splitlines() or ["no message"])[-1][:200]
      else:
        os.replace(tmp, lib_path)
    if why is None:
      lib = ctypes.cdll.LoadLibrary(lib_path)
      for op in FFI_OPS:
        jax.ffi.register_ffi_target(
            f"truth_{op}", jax.ffi.pycapsule(getattr(lib, f"truth_{op}")),
            platform="cpu")
      lib.truth_count.restype = ctypes.c_int64
      _FFI["lib"], _FFI["slots"] = lib, {}
  _FFI["why"] = why
  return why


def _ffi_slot(key) -> int:
  slots = _FFI["slots"]
  if key not in slots:
    slots[key] = len(slots)
  return slots[key]


def reset_counts():
  COUNTS.clear()
  if _FFI.get("lib") is not None:
    _FFI["lib"].truth_reset()


def read_counts() -> collections.Counter:
  out = collections.Counter(COUNTS)
  if _FFI.get("lib") is not None:
    for key, slot in _FFI["slots"].items():
      n = _FFI["lib"].truth_count(slot)
      if n:
        out[key] += n
  return out


# -- sites ---------------------------------------------------------------------

@dataclasses.dataclass
class Site:
  """One ``custom_vjp`` site of a layer.

  kind: how its kernels are reached: ``pure_callback``, ``io_callback``,
  ``ffi`` or ``jax`` (JAX-coded). via: ``plain``, ``nested_jit``,
  ``custom_jvp``, ``cond``, ``scan_fwd`` or ``while_fwd`` (``fwd`` computes
  its residual in a loop over row chunks). shape: ``standard`` (``fwd``
  returns ``(y, d)``, ``bwd`` is ``g * d``) or ``input_residual`` (``fwd``
  saves its input, ``bwd`` computes ``d``: the swap saves nothing). wy, wd:
  work units of ``Phi`` for ``y`` and for ``d`` (``wd=0``: ``d`` reuses
  ``y``'s ``Phi``); wp: work units of ``phi`` in ``d`` (host kernels; the
  C++ handlers take one). fused: it has a ``fwd_bwd``. chunks, split: the
  loop of ``scan_fwd``/``while_fwd`` (``_loop_fwd``)."""
  name: str
  kind: str = "pure_callback"
  via: str = "plain"
  shape: str = "standard"
  wy: int = 1
  wd: int = 1
  wp: int = 1
  fused: bool = False
  chunks: int = 4
  split: bool = False

  def kernel(self, op, role, *arrays):
    """Runs ``op`` on ``arrays`` as this site's kind of kernel, counted
    under ``(site, role)``."""
    key = (self.name, role)
    n_out = 2 if op == "yd" else 1
    shape = jax.ShapeDtypeStruct(arrays[0].shape, jnp.float32)
    if self.kind == "jax":
      outs = jnp_op(op, *arrays, wy=self.wy, wd=self.wd, wp=self.wp)
    elif self.kind == "ffi":
      outs = jax.ffi.ffi_call(f"truth_{op}", (shape,) * n_out)(
          *arrays, slot=np.int64(_ffi_slot(key)), wy=np.int64(self.wy),
          wd=np.int64(self.wd))
    elif self.kind == "io_callback" and role in ("bwd", "fwd_bwd"):
      # JAX refuses effects in what checkpoint differentiates (f, fwd):
      # the io_callback kernels are the backward rules'; f's and fwd's
      # reach the host through pure_callback
      outs = jax.experimental.io_callback(
          _host(op, key, self.wy, self.wd, self.wp), (shape,) * n_out, *arrays,
          ordered=False)
    else:
      outs = jax.pure_callback(_host(op, key, self.wy, self.wd, self.wp),
                               (shape,) * n_out, *arrays)
    return tuple(outs)

  def call(self, op, role, *arrays):
    """``kernel`` reached the way ``via`` says."""
    run = functools.partial(self.kernel, op, role)
    if self.via == "nested_jit":
      return jax.jit(run)(*arrays)
    if self.via == "custom_jvp":
      inner = jax.custom_jvp(lambda *a: run(*a))
      inner.defjvp(lambda p, t: (inner(*p),
                                 tuple(jnp.zeros_like(o) for o in inner(*p))))
      return inner(*arrays)
    if self.via == "cond":
      fallback = lambda *a: jnp_op(op, *a, wy=self.wy, wd=self.wd, wp=self.wp)
      ok = jnp.all(jnp.isfinite(arrays[0]))
      return jax.lax.cond(ok, lambda *a: run(*a), fallback, *arrays)
    return run(*arrays)

  def rules(self):
    """``f, fwd, bwd, fwd_bwd`` (``fwd_bwd`` None unless ``fused``)."""
    if self.shape == "input_residual":
      f = lambda x: self.call("y", "f", x)[0]
      fwd = lambda x: (self.call("y", "fwd", x)[0], x)
      bwd = lambda x, g: (self.call("dx", "bwd", x, g)[0],)
      fwd_bwd = (lambda x, g: (self.call("dx", "fwd_bwd", x, g)[0],)
                 ) if self.fused else None
      return f, fwd, bwd, fwd_bwd
    f = lambda x: self.call("y", "f", x)[0]
    if self.via in ("scan_fwd", "while_fwd"):
      fwd = self._loop_fwd
    else:
      fwd = lambda x: self.call("yd", "fwd", x)
    bwd = lambda d, g: (self.call("mul", "bwd", d, g)[0],)
    fwd_bwd = (lambda x, g: (self.call("dx", "fwd_bwd", x, g)[0],)
               ) if self.fused else None
    return f, fwd, bwd, fwd_bwd

  def _loop_fwd(self, x):
    """``(y, d)`` chunk by chunk in a ``scan`` or a ``while_loop``, one
    kernel per chunk; with ``split``, ``y`` by one kernel first and only
    ``d`` in the loop (where ``d`` is dead, in the forward pass under
    remat, XLA drops the loop's kernels; where ``y`` is, the first)."""
    rows = x.shape[0] // self.chunks
    if self.split:
      y = self.kernel("y", "fwd", x)[0]
    op = "d" if self.split else "yd"

    def piece(part):
      return self.kernel(op, "fwd.loop", part)

    if self.via == "scan_fwd":
      parts = x.reshape(self.chunks, rows, *x.shape[1:])
      _, outs = jax.lax.scan(lambda c, p: (c, piece(p)), 0, parts)
      outs = [o.reshape(x.shape) for o in outs]
    else:
      def body(state):
        i, acc = state
        part = jax.lax.dynamic_slice_in_dim(x, i * rows, rows)
        return i + 1, tuple(
            jax.lax.dynamic_update_slice_in_dim(a, o, i * rows, 0)
            for a, o in zip(acc, piece(part)))
      zeros = tuple(jnp.zeros_like(x) for _ in range(1 if self.split else 2))
      _, outs = jax.lax.while_loop(lambda s: s[0] < self.chunks, body,
                                   (0, zeros))
    return (y, outs[0]) if self.split else tuple(outs)

  def make(self, how: str):
    """The site as ``how``: ``as_written`` (``jax.custom_vjp``),
    ``optimize_remat`` (``jax.custom_vjp(optimize_remat=True)``),
    ``smartvjp`` (``smart_custom_vjp``, ``fwd`` and ``bwd``) or
    ``smartvjp_fused`` (with ``fwd_bwd`` and ``fused=True`` where it has
    one; else as ``smartvjp``)."""
    f, fwd, bwd, fwd_bwd = self.rules()
    # the audit names a site by f's qualified name
    f.__name__ = f.__qualname__ = f"truth_{self.name}"
    if how == "audited":
      # what the audit is given: a site with a fwd_bwd can only say so as
      # smart_custom_vjp (the audit's as_written is its jax.custom_vjp)
      how = "smartvjp_fused" if self.fused else "as_written"
    if how in ("as_written", "optimize_remat"):
      site = jax.custom_vjp(f)
      site.defvjp(fwd, bwd, optimize_remat=how == "optimize_remat")
      return site
    site = smartvjp.smart_custom_vjp(f)
    if how == "smartvjp_fused" and fwd_bwd is not None:
      site.defvjp(fwd, bwd, fwd_bwd=fwd_bwd, fused=True)
    else:
      site.defvjp(fwd, bwd)
    return site


# -- steps ---------------------------------------------------------------------

@dataclasses.dataclass
class Entry:
  name: str
  sites: list
  what: str
  combine: str = "chain"      # "chain": site after site; "sum": each on h
  shard: bool = False         # the loss inside shard_map over 4 devices
  expect: str = ""            # what the entry was built to show

  def needs(self) -> str | None:
    """Why this entry cannot run here, or None."""
    if any(s.kind == "ffi" for s in self.sites):
      why = build_ffi()
      if why is not None:
        return why
    if self.shard and jax.device_count() < 4:
      return (f"needs 4 devices, has {jax.device_count()} (run with "
              "XLA_FLAGS=--xla_force_host_platform_device_count=4)")
    return None

  def step(self, hows: dict):
    """``jit(grad(loss))`` with each site made as ``hows[site.name]``."""
    made = {s.name: s.make(hows[s.name]) for s in self.sites}

    def layer(c, w):
      h = c @ w
      h = 2.0 * h * jax.lax.rsqrt(jnp.mean(h * h, -1, keepdims=True) + 1e-6)
      if self.combine == "sum":
        return sum(made[s.name](h) for s in self.sites)
      for s in self.sites:
        h = made[s.name](h)
      return h

    def stack(ws, x):
      body = lambda c, w: (jax.checkpoint(layer)(c, w), None)
      return jnp.sum(jax.lax.scan(body, x, ws)[0] ** 2)

    if self.shard:
      from jax.sharding import Mesh, PartitionSpec as P
      mesh = Mesh(np.array(jax.devices()[:4]), ("b",))

      def sharded(ws, x):
        return jax.lax.psum(stack(ws, x), "b")
      loss = _shard_map(sharded, mesh, (P(), P("b")), P())
    else:
      loss = stack
    return jax.jit(jax.grad(loss, argnums=(0, 1)))


def _shard_map(fn, mesh, in_specs, out_specs):
  if hasattr(jax, "shard_map"):
    return jax.shard_map(fn, mesh=mesh, in_specs=in_specs,
                         out_specs=out_specs, check_vma=False)
  from jax.experimental.shard_map import shard_map
  return shard_map(fn, mesh=mesh, in_specs=in_specs, out_specs=out_specs,
                   check_rep=False)


def entries() -> list[Entry]:
  """The benchmark's steps."""
  S = Site
  return [
      Entry("pure_callback_big", [S("cb_big", wy=1, wd=5)],
            "pure_callback; fwd computes an expensive residual",
            expect="saves over 25%"),
      Entry("pure_callback_nothing",
            [S("cb_none", shape="input_residual", wy=1, wd=2)],
            "pure_callback; fwd saves its input, bwd computes d",
            expect="saves nothing"),
      Entry("io_callback", [S("io", kind="io_callback", wy=1, wd=1)],
            "io_callback (unordered) kernels in bwd (JAX refuses effects "
            "under checkpoint's AD in f and fwd: pure_callback there)"),
      Entry("ffi", [S("ffi", kind="ffi", wy=1, wd=1)],
            "C++ FFI kernels (std::erf)"),
      Entry("jit_15_beside_custom_jvp_2",
            [S("jit15", via="nested_jit", wy=1, wd=2),
             S("jvp2", via="custom_jvp", wy=1, wd=0, wp=4)],
            "a kernel behind a nested jit beside one inside a custom_jvp",
            combine="sum", expect="a site worth ~15% beside one worth 1-2%"),
      Entry("cond_branch", [S("cond", via="cond", wy=1, wd=1)],
            "the kernel in a cond branch beside a JAX fallback"),
      Entry("loops_in_fwd",
            [S("scanfwd", via="scan_fwd", wy=1, wd=1),
             S("whilefwd", via="while_fwd", wy=1, wd=1)],
            "fwd's kernels in a scan / in a while_loop over row chunks"),
      Entry("residual_loop_dropped",
            [S("split", via="scan_fwd", wy=1, wd=2, split=True)],
            "fwd: one kernel for y, then d in a scan; XLA drops the dead "
            "part under remat (fwd's runs are partial: fwd not counted)",
            expect="saves little: the swap's work is already dropped"),
      Entry("shard_map", [S("shard", wy=1, wd=2)],
            "pure_callback inside shard_map on 4 host devices", shard=True),
      Entry("jax_coded",
            [S("jax_gelu", kind="jax", wy=2, wd=2),
             S("jax_gelu_b", kind="jax", wy=1, wd=0)],
            "JAX-coded sites (XLA drops the residual-only work)"),
      Entry("fused", [S("fused", wy=1, wd=1, fused=True),
                      S("plain", shape="input_residual", wy=1, wd=1)],
            "a site with a fused fwd_bwd beside an input-residual site"),
  ]


def arguments(entry: Entry, rows: int, width: int, seed: int = 0):
  """``(ws, x)``: ``LAYERS`` weights ``(width, width)`` and a batch
  ``(rows, width)``, std 1 (the layers' RMSNorm gives the sites std 2)."""
  rng = np.random.default_rng(seed)
  ws = rng.standard_normal((LAYERS, width, width)) / math.sqrt(width)
  x = rng.standard_normal((rows, width))
  return jnp.asarray(ws, jnp.float32), jnp.asarray(x, jnp.float32)


# -- statistics ----------------------------------------------------------------

def median_interval(values, level: float = 0.95) -> tuple[float, float]:
  """The distribution-free interval of a median from order statistics:
  ``(v[j], v[n-1-j])`` of the sorted values with the largest ``j`` whose
  coverage, ``1 - 2 P(B <= j)`` for ``B ~ Binomial(n, 1/2)``, is at least
  ``level`` (the whole range where no ``j`` reaches it)."""
  v = sorted(values)
  n = len(v)
  j, below = 0, 0.0
  for k in range(n // 2):
    below += math.comb(n, k) / 2 ** n        # P(B <= k)
    if 1 - 2 * below >= level:
      j = k
    else:
      break
  return v[j], v[n - 1 - j]


def saving(variant, base) -> dict:
  """``1 - median(variant / base)`` over paired rounds, with its 95%
  interval, and the ratio's."""
  ratios = [a / b for a, b in zip(variant, base)]
  r = float(np.median(ratios))
  lo, hi = median_interval(ratios)
  return dict(saving=1 - r, interval=[1 - hi, 1 - lo], ratio=r,
              ratio_interval=[lo, hi], ratio_min=min(ratios),
              ratio_max=max(ratios), pairs=len(ratios))


def paired_rounds(variants: dict, args, pairs: int) -> dict:
  """Times each compiled variant once per round, ``pairs`` rounds, the
  order rotated each round: ``{name: {"wall": [s], "cpu": [s]}}``."""
  names = list(variants)
  for fn in variants.values():
    for _ in range(2):
      jax.block_until_ready(fn(*args))
  out = {n: {"wall": [], "cpu": []} for n in names}
  for r in range(pairs):
    k = r % len(names)
    order = names[k:] + names[:k]
    if (r // len(names)) % 2:
      order = order[::-1]
    for n in order:
      w0, c0 = time.perf_counter(), time.process_time()
      jax.block_until_ready(variants[n](*args))
      c1, w1 = time.process_time(), time.perf_counter()
      out[n]["wall"].append(w1 - w0)
      out[n]["cpu"].append(c1 - c0)
  return out


# -- the truth ---------------------------------------------------------------

ROLES = ("f", "fwd", "bwd", "fwd_bwd")


def host_runs(entry: Entry, step, args) -> dict:
  """One run of ``step``: ``{site: {role: runs per step}}`` from the host
  counters (per device under ``shard_map``). A rule runs where any of its
  kernels runs: its head kernel once per run, a loop's kernel ``chunks``
  times (the head's output can be dead where the loop's is not)."""
  reset_counts()
  jax.block_until_ready(step(*args))
  counts = read_counts()
  per = 4 if entry.shard else 1
  out = {}
  for s in entry.sites:
    if s.kind == "jax":
      continue
    out[s.name] = {r: counts.get((s.name, r), 0) // per for r in ROLES}
    loop = counts.get((s.name, "fwd.loop"), 0) // per
    if s.split:
      # a run of fwd may run its head kernel only, or its loop only: the
      # host cannot tell runs apart, so fwd is not compared
      out[s.name]["fwd"] = None
    else:
      out[s.name]["fwd"] = max(out[s.name]["fwd"], loop // s.chunks)
  return out


def truth(entry: Entry, args, pairs: int) -> dict:
  """The entry's savings and counts, measured by hand."""
  names = [s.name for s in entry.sites]
  alls = {n: "smartvjp_fused" for n in names}
  variants = {"as_written": {n: "as_written" for n in names},
              "all_swapped": alls}
  if len(names) > 1:
    for n in names:
      variants[f"only:{n}"] = {m: ("smartvjp_fused" if m == n
                                   else "as_written") for m in names}
  t0 = time.perf_counter()
  steps = {k: entry.step(h) for k, h in variants.items()}
  grads = {k: jax.block_until_ready(s(*args)) for k, s in steps.items()}
  ref = grads["as_written"]
  for k, g in grads.items():   # every variant computes the same gradient
    for a, b in zip(jax.tree.leaves(g), jax.tree.leaves(ref)):
      np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=2e-3,
                                 atol=2e-3, err_msg=f"{entry.name}: {k}")
  counts = {}
  for config in ("as_written", "optimize_remat", "smartvjp",
                 "smartvjp_fused"):
    try:
      fused = any(s.fused for s in entry.sites)
      step = (steps["as_written"] if config == "as_written" else
              steps["all_swapped"] if config == "smartvjp_fused" or (
                  config == "smartvjp" and not fused) else
              entry.step({n: config for n in names}))
      counts[config] = host_runs(entry, step, args)
    except Exception as e:   # noqa: BLE001  (recorded)
      counts[config] = {"error": f"{type(e).__name__}: {str(e)[:200]}"}
  seconds_build = time.perf_counter() - t0
  t0 = time.perf_counter()
  times = paired_rounds(steps, args, pairs)
  base = times["as_written"]
  out = dict(seconds_build=seconds_build,
             seconds_timing=time.perf_counter() - t0, counts=counts,
             step={clock: _report.Spread(base[clock]).as_dict()
                   for clock in ("wall", "cpu")})
  site_keys = {n: ("all_swapped" if len(names) == 1 else f"only:{n}")
               for n in names}
  for clock in ("cpu", "wall"):
    out[clock] = dict(
        step=saving(times["all_swapped"][clock], base[clock]),
        sites={n: saving(times[k][clock], base[clock])
               for n, k in site_keys.items()},
        seconds={k: _report.Spread(v[clock]).as_dict()
                 for k, v in times.items()})
  return out


# -- the audit, read through one function -------------------------------------

def _advice_of(site: dict) -> str:
  """``site["advice"]`` where the report has it (``smartvjp.audit/2``),
  else read from the ``suggestion`` line."""
  if site.get("advice"):
    a = site["advice"]
    return "cannot tell" if a.startswith("cannot tell") else a
  text = site.get("suggestion") or ""
  if text.startswith("swap"):
    return "swap"
  if text.startswith("no action"):
    return "no action"
  return "cannot tell"


def audit_estimates(report) -> dict:
  """Everything this benchmark reads from an audit's report, in one place
  (``docs/audit.md``'s keys; ``None`` where the report does not have one:
  "not reported"). Shares are of the step as written, positive = saved.

  Returns ``{"step_calibrated", "step_calibrated_interval",
  "step_measured", "step_measured_interval", "step_time", "audit_cost",
  "sites": {name: {"calibrated", "calibrated_interval", "measured",
  "measured_interval", "advice", "suggestion"}}}``."""
  d = report.data
  cal = d.get("calibrated") or {}
  meas = d.get("measured") or {}
  out = dict(
      step_calibrated=cal.get("share_of_step"),
      step_calibrated_interval=cal.get("share_of_step_interval"),
      step_measured=meas.get("measured_saving"),
      step_measured_interval=meas.get("measured_saving_interval"),
      step_time=d.get("step_time"), audit_cost=d.get("audit_cost"),
      audit_seconds=d.get("audit_seconds"), sites={})
  for s in d["sites"]:
    name = s["name"].rsplit(".", 1)[-1].removeprefix("truth_")
    pc = (s.get("predicted") or {}).get("calibrated") or {}
    sm = s.get("measured")
    out["sites"][name] = dict(
        calibrated=pc.get("share_of_step"),
        calibrated_interval=pc.get("share_of_step_interval"),
        measured=(sm or {}).get("saving"),
        measured_interval=(sm or {}).get("interval"),
        measured_error=(sm or {}).get("error"),
        advice=_advice_of(s), suggestion=s.get("suggestion"))
  return out


def audit_counts(report, entry: Entry) -> dict:
  """``{config: {site: {role: runs}}}`` from ``report.runs`` (compiled)."""
  out = {}
  for config in ("as_written", "optimize_remat", "smartvjp",
                 "smartvjp_fused"):
    try:
      runs = report.runs(config)
    except KeyError as e:
      out[config] = {"error": str(e)}
      continue
    out[config] = {k.rsplit(".", 1)[-1].removeprefix("truth_").split("#")[0]:
                   v for k, v in runs.items()}
  return out


# -- verdicts ----------------------------------------------------------------

def within(est, true) -> bool | None:
  if est is None:
    return None
  return abs(est - true) <= max(RELATIVE * abs(true), POINTS)


def sign_right(est, t: dict) -> bool | None:
  lo, hi = t["interval"]
  if lo <= 0 <= hi:
    return True                 # the truth cannot tell the sign
  if est is None:
    return None
  return (est > 0) == (t["saving"] > 0) and est != 0


def right_advice(t: dict) -> str:
  """What the truth advises: "swap", "no action" or "either" (a certain
  saving below 0.5%)."""
  lo, hi = t["ratio_interval"]
  if hi < 1 and t["saving"] >= WORTH:
    return "swap"
  if lo <= 1 <= hi or lo > 1:
    return "no action"
  return "either"


def advice_ok(advice: str | None, t: dict) -> bool | None:
  if advice is None:
    return None
  want = right_advice(t)
  if want == "either":
    return advice in ("swap", "no action")
  return advice == want


def counts_equal(host: dict, audit: dict, entry: Entry) -> dict:
  """Per configuration: whether the audit's compiled runs equal the host
  counters for every opaque site (``None`` where neither traced)."""
  out = {}
  for config, h in host.items():
    a = audit.get(config, {})
    if "error" in h or "error" in a:
      out[config] = dict(ok=("error" in h) == ("error" in a) or None,
                         host=h.get("error"), audit=a.get("error"))
      continue
    diffs = []
    for site, roles in h.items():
      got = a.get(site)
      for r in ROLES:
        if roles[r] is None:
          continue
        if got is None or got.get(r, 0) != roles[r]:
          seen = None if got is None else got.get(r, 0)
          diffs.append(f"{site}.{r}: audit {seen}"
                       f", host {roles[r]}")
    out[config] = dict(ok=not diffs, diffs=diffs)
  return out


def judge(entry: Entry, t: dict, cal: dict, mea: dict, counts: dict) -> dict:
  """The held-to checks of one entry against the CPU-time truth."""
  tr = t["cpu"]
  step = tr["step"]
  v = dict(
      calibrated_step_within=within(cal["step_calibrated"], step["saving"]),
      measured_step_within=within(mea["step_measured"], step["saving"]),
      sign=[sign_right(cal["step_calibrated"], step),
            sign_right(mea["step_measured"], step)],
      sites={})
  for s in entry.sites:
    ts = tr["sites"][s.name]
    c, m = cal["sites"].get(s.name, {}), mea["sites"].get(s.name, {})
    v["sites"][s.name] = dict(
        truth_advice=right_advice(ts),
        calibrated_within=within(c.get("calibrated"), ts["saving"]),
        measured_within=within(m.get("measured"), ts["saving"]),
        sign=[sign_right(c.get("calibrated"), ts),
              sign_right(m.get("measured"), ts)],
        advice=[c.get("advice"), m.get("advice")],
        advice_ok=[advice_ok(c.get("advice"), ts),
                   advice_ok(m.get("advice"), ts)])
  # whether the truth's own interval is narrower than the tolerance band
  # (else a miss may be the truth's noise: more pairs, a quieter machine)
  v["truth_resolves"] = all(
      (t_["interval"][1] - t_["interval"][0]) / 2
      <= max(RELATIVE * abs(t_["saving"]), POINTS)
      for t_ in [step, *tr["sites"].values()])
  sites = v["sites"].values()
  v["counts_equal"] = all(c.get("ok") is not False for c in counts.values())
  v["tolerance"] = bool(v["calibrated_step_within"]) and all(
      x["calibrated_within"] and x["measured_within"] for x in sites)
  v["signs_right"] = all(x is not False for x in v["sign"]) and all(
      y is not False for x in sites for y in x["sign"])
  # a site written with smart_custom_vjp (to give the audit its fwd_bwd)
  # is already swapped: "no action: already smart_custom_vjp" is not
  # judged against the swap's saving
  v["advice_right"] = all(y is True for s in entry.sites if not s.fused
                          for y in v["sites"][s.name]["advice_ok"])
  v["met"] = (v["tolerance"] and v["signs_right"] and v["advice_right"]
              and v["counts_equal"])
  return v


# -- one entry ---------------------------------------------------------------

def audit_options(timing_budget: float | None) -> dict:
  """``smartvjp.audit``'s keyword for its timing budget, where this
  version of the audit has one (``timing_budget``) and one is given."""
  params = inspect.signature(smartvjp.audit.audit).parameters
  if timing_budget is None or "timing_budget" not in params:
    return {}
  return {"timing_budget": timing_budget}


def run_entry(entry: Entry, rows: int, width: int, pairs: int,
              modes=("calibrate", "measure"),
              timing_budget: float | None = None) -> dict:
  args = arguments(entry, rows, width)
  out = dict(name=entry.name, what=entry.what, expect=entry.expect,
             sites=[dataclasses.asdict(s) for s in entry.sites],
             shape=dict(layers=LAYERS, rows=rows, width=width))
  why = entry.needs()
  if why is not None:
    out["skipped"] = why
    return out
  out["truth"] = truth(entry, args, pairs)
  step = entry.step({s.name: "audited" for s in entry.sites})
  for mode in modes:
    t0 = time.perf_counter()
    try:
      report = smartvjp.audit(step, *args, **{mode: True},
                              **audit_options(timing_budget))
      seconds = time.perf_counter() - t0
      out[mode] = dict(estimates=audit_estimates(report), wall_s=seconds,
                       counts=audit_counts(report, entry),
                       errors=report.data.get("errors"))
    except Exception as e:   # noqa: BLE001  (recorded; the next one runs)
      out[mode] = dict(error=f"{type(e).__name__}: {e}",
                       wall_s=time.perf_counter() - t0,
                       trace=traceback.format_exc()[-2000:])
  if "calibrate" not in modes:   # --smoke: measure=True's report only
    out["calibrate"] = dict(out["measure"], stands_in="measure=True's report")
  host = out["truth"]["counts"]
  ok_modes = [m for m in ("calibrate", "measure") if "error" not in out[m]]
  out["counts_check"] = {m: counts_equal(host, out[m]["counts"], entry)
                         for m in ok_modes}
  if len(ok_modes) == 2:
    out["verdict"] = judge(entry, out["truth"], out["calibrate"]["estimates"],
                           out["measure"]["estimates"],
                           out["counts_check"]["measure"])
  else:
    out["verdict"] = dict(met=False, error="an audit raised")
  return out


# -- printing ----------------------------------------------------------------

def pct(x) -> str:
  return "n/r" if x is None else f"{x:+.1%}"


def interval(iv) -> str:
  return "" if not iv else f" [{iv[0]:+.1%}, {iv[1]:+.1%}]"


def yn(x) -> str:
  return {True: "yes", False: "NO", None: "n/r"}[x]


def print_entry(e: dict) -> None:
  print(f"\n== {e['name']}: {e['what']}"
        + (f" ({e['expect']})" if e["expect"] else ""), flush=True)
  if "skipped" in e:
    print(f"   skipped: {e['skipped']}")
    return
  t = e["truth"]
  ms = {c: _report.Spread(t["step"][c]["samples"]).fmt(1e3, 1, " ms")
        for c in ("cpu", "wall")}
  print(f"   step as written: cpu {ms['cpu']}, wall {ms['wall']}")
  for mode in ("calibrate", "measure"):
    if "error" in e[mode]:
      print(f"   audit {mode}=True RAISED: {e[mode]['error'][:300]}")
  cal = e["calibrate"].get("estimates", {"sites": {}})
  mea = e["measure"].get("estimates", {"sites": {}})
  ts, tw = t["cpu"]["step"], t["wall"]["step"]
  print(f"   step: truth cpu {pct(ts['saving'])}{interval(ts['interval'])}, "
        f"wall {pct(tw['saving'])}{interval(tw['interval'])} "
        f"({ts['pairs']} pairs); audit calibrate "
        f"{pct(cal.get('step_calibrated'))}"
        f"{interval(cal.get('step_calibrated_interval'))}, measure "
        f"{pct(mea.get('step_measured'))}"
        f"{interval(mea.get('step_measured_interval'))}")
  v = e["verdict"]
  for s in e["sites"]:
    n = s["name"]
    ts, tw = t["cpu"]["sites"][n], t["wall"]["sites"][n]
    c, m = cal["sites"].get(n, {}), mea["sites"].get(n, {})
    vs = v.get("sites", {}).get(n, {})
    print(f"   site {n:10} truth cpu {pct(ts['saving'])}"
          f"{interval(ts['interval'])} wall {pct(tw['saving'])} -> "
          f"{right_advice(ts)}; calibrate {pct(c.get('calibrated'))} "
          f"({c.get('advice')}), measure {pct(m.get('measured'))}"
          f"{interval(m.get('measured_interval'))} ({m.get('advice')}); "
          f"within: {yn(vs.get('calibrated_within'))}/"
          f"{yn(vs.get('measured_within'))}")
  for mode, checks in e.get("counts_check", {}).items():
    bad = {c: x for c, x in checks.items() if x.get("ok") is False}
    print(f"   counts ({mode}): " + ("equal to the host counters in "
                                     f"{len(checks)} configurations"
                                     if not bad else f"DIFFER: {bad}"))
  cost = " / ".join(f"{e[m]['wall_s']:.1f} s" for m in ("calibrate", "measure"))
  reported = [((e[m].get("estimates") or {}).get("audit_cost") or {}).get(
      "total_s") for m in ("calibrate", "measure")]
  for mode in ("calibrate", "measure"):
    st = (e[mode].get("estimates") or {}).get("step_time")
    if st and st.get("median"):
      wall, cpu = (t["step"][c]["median"] * 1e3 for c in ("wall", "cpu"))
      print(f"   the audit's step time ({mode}): {st['median'] * 1e3:.1f} ms "
            f"(the truth's as written: wall {wall:.1f} ms, cpu {cpu:.1f} ms)")
  print(f"   audit cost (calibrate / measure): {cost} wall"
        + (f"; reported {reported}" if any(reported) else ""))
  if "error" in v:
    print(f"   verdict: not met ({v['error']})")
  else:
    print(f"   verdict: {_report.verdict(v['met'])} (tolerance "
          f"{yn(v['tolerance'])}, signs {yn(v['signs_right'])}, advice "
          f"{yn(v['advice_right'])}, counts {yn(v['counts_equal'])}; the "
          f"truth's intervals within the tolerance band: "
          f"{yn(v['truth_resolves'])})")


def markdown(doc: dict) -> str:
  """The run's two tables (steps, then sites) in Markdown, for
  ``docs/audit.md``."""
  def cell(x, iv=None):
    return pct(x) + (f" ({iv[0]:+.1%} to {iv[1]:+.1%})" if iv else "")
  steps = ["| step | truth, CPU time (95% interval) | wall | calibrate=True "
           "| measure=True | within ±25%/1 pt (calibrate, measure) | sign "
           "| counts = host | audit s (calibrate, measure) | held to |",
           "|---|---:|---:|---:|---:|---|---|---|---:|---|"]
  sites = ["| step | site | truth, CPU time (95% interval) | right advice "
           "| calibrate=True (advice) | measure=True (advice) "
           "| within (calibrate, measure) |",
           "|---|---|---:|---|---|---|---|"]
  for e in doc["entries"]:
    if "verdict" not in e:
      why = e.get("skipped") or e.get("error", "")
      steps.append(f"| `{e['name']}` | {why[:80]} | | | | | | | | |")
      continue
    t, v = e["truth"], e["verdict"]
    cal, mea = e["calibrate"]["estimates"], e["measure"]["estimates"]
    ts = t["cpu"]["step"]
    steps.append(
        f"| `{e['name']}` | {cell(ts['saving'], ts['interval'])} | "
        f"{pct(t['wall']['step']['saving'])} | {pct(cal['step_calibrated'])}"
        f" | {pct(mea['step_measured'])} | "
        f"{yn(v['calibrated_step_within'])}, {yn(v['measured_step_within'])}"
        f" | {'right' if v['signs_right'] else 'WRONG'} | "
        f"{yn(v['counts_equal'])} | {e['calibrate']['wall_s']:.1f}, "
        f"{e['measure']['wall_s']:.1f} | {_report.verdict(v['met'])} |")
    for s in e["sites"]:
      n = s["name"]
      tsite, vs = t["cpu"]["sites"][n], v["sites"][n]
      c, m = cal["sites"].get(n, {}), mea["sites"].get(n, {})
      right = ("not judged (written as smart_custom_vjp)" if s["fused"]
               else vs["truth_advice"])
      measured = cell(m.get("measured"), m.get("measured_interval"))
      sites.append(
          f"| `{e['name']}` | `{n}` ({s['kind']}, {s['via']}) | "
          f"{cell(tsite['saving'], tsite['interval'])} | {right} | "
          f"{pct(c.get('calibrated'))} ({c.get('advice')}) | {measured} "
          f"({m.get('advice')}) | {yn(vs['calibrated_within'])}, "
          f"{yn(vs['measured_within'])} |")
  return "\n".join(steps) + "\n\n" + "\n".join(sites)


# -- load ----------------------------------------------------------------------

def start_load(n: int, limit_s: float) -> list:
  """``n`` CPU-bound processes, each ending by itself after ``limit_s``
  seconds and killed (by its id) when this one exits."""
  code = ("import time\nt = time.time() + %f\nx = 0\n"
          "while time.time() < t:\n  x = (x * 7 + 1) %% 1000003\n" % limit_s)
  procs = [subprocess.Popen([sys.executable, "-c", code]) for _ in range(n)]

  def stop():
    for p in procs:
      if p.poll() is None:
        p.kill()
        p.wait()
  atexit.register(stop)
  return procs


def loadavg() -> list | None:
  try:
    return list(os.getloadavg())
  except OSError:
    return None


# -- main --------------------------------------------------------------------

def main(argv=None):
  p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
  p.add_argument("--smoke", action="store_true",
                 help="tiny shapes, 4 pairs and one audit per entry "
                 "(measure=True, whose report has the calibrated estimate "
                 "too): the plumbing, not accuracy")
  p.add_argument("--pairs", type=int, default=None)
  p.add_argument("--rows", type=int, default=None)
  p.add_argument("--width", type=int, default=None)
  p.add_argument("--timing-budget", type=float, default=None,
                 help="the audit's timing_budget (seconds), where it has "
                 "one; --smoke: 1")
  p.add_argument("--load", type=int, default=0,
                 help="start N CPU-bound processes for the run")
  p.add_argument("--only", nargs="*", default=None)
  p.add_argument("--out", default=None)
  p.add_argument("--markdown", metavar="JSON", default=None,
                 help="print a run's tables in Markdown and exit")
  opts = p.parse_args(argv)
  if opts.smoke and opts.timing_budget is None:
    opts.timing_budget = 1.0
  if opts.markdown:
    with open(opts.markdown, encoding="utf-8") as fh:
      print(markdown(json.load(fh)))
    return None
  t_start = time.perf_counter()
  pairs = opts.pairs or (4 if opts.smoke else 40)
  rows = opts.rows or (16 if opts.smoke else 256)
  width = opts.width or (16 if opts.smoke else 256)
  load_before = loadavg()
  procs = start_load(opts.load, 3600.0) if opts.load else []
  mach, vers = _report.machine(), _report.versions()
  print(_report.header(mach, vers))
  print(f"load: {opts.load} busy processes started by this run; load "
        f"average before {load_before}; "
        f"XLA_FLAGS={os.environ.get('XLA_FLAGS')}")
  print(f"shapes: {LAYERS} layers, x ({rows}, {width}); {pairs} pairs per "
        "variant; truth = CPU time (process_time), wall beside it")
  doc = dict(schema="smartvjp/audit_truth/1", machine=mach, versions=vers,
             smoke=opts.smoke, pairs=pairs, rows=rows, width=width,
             layers=LAYERS, timing_budget=opts.timing_budget,
             load=dict(busy_processes=opts.load, loadavg_before=load_before),
             xla_flags=os.environ.get("XLA_FLAGS"),
             tolerance=dict(relative=RELATIVE, points=POINTS, worth=WORTH),
             entries=[])
  commit = (vers.get("commit") or "nogit").replace("+changes", "-dirty")
  out_path = opts.out or os.path.join(HERE, "results",
                                      f"audit_truth_{commit}.json")

  def save():
    doc["load"]["loadavg_after"] = loadavg()
    with open(out_path, "w", encoding="utf-8") as fh:
      json.dump(doc, fh, indent=1, default=str)

  goals = _report.Goals()
  try:
    for entry in entries():
      if opts.only and not any(o in entry.name for o in opts.only):
        continue
      try:
        e = run_entry(entry, rows, width, pairs,
                      ("measure",) if opts.smoke else ("calibrate", "measure"),
                      opts.timing_budget)
      except Exception as ex:   # noqa: BLE001  (recorded; the next one runs)
        e = dict(name=entry.name, what=entry.what, expect=entry.expect,
                 sites=[dataclasses.asdict(s) for s in entry.sites],
                 error=f"{type(ex).__name__}: {ex}",
                 trace=traceback.format_exc()[-3000:])
        print(f"\n== {entry.name}: ERROR {e['error'][:500]}", flush=True)
      else:
        print_entry(e)
        if "verdict" in e:
          goals.check(f"{entry.name} within the held-to checks",
                      e["verdict"]["met"])
      doc["entries"].append(e)
      save()
  finally:
    for proc in procs:
      if proc.poll() is None:
        proc.kill()
        proc.wait()
  ran = [e for e in doc["entries"] if "verdict" in e]
  n = len(ran)
  met = sum(bool(e["verdict"].get("met")) for e in ran)
  tol_miss = sum(not e["verdict"].get("tolerance") for e in ran)
  wrong_sign = sum(not e["verdict"].get("signs_right", False) for e in ran)
  wrong_advice = sum(not e["verdict"].get("advice_right", False) for e in ran)
  count_bad = sum(not e["verdict"].get("counts_equal", False) for e in ran)
  unresolved = [e["name"] for e in ran
                if not e["verdict"].get("truth_resolves", True)]
  held = (n > 0 and tol_miss <= n // 8 and not wrong_sign and not wrong_advice
          and not count_bad)
  doc["summary"] = dict(entries=n, met=met, tolerance_missed=tol_miss,
                        wrong_sign=wrong_sign, wrong_advice=wrong_advice,
                        counts_differ=count_bad, held_to=held,
                        truth_wider_than_tolerance=unresolved,
                        skipped=[e["name"] for e in doc["entries"]
                                 if "skipped" in e or "error" in e],
                        seconds=time.perf_counter() - t_start)
  save()
  print()
  print(goals.render())
  print(f"summary: {met} of {n} entries met; tolerance missed in {tol_miss} "
        f"(at most {n // 8} allowed), wrong sign in {wrong_sign}, wrong or "
        f"no advice in {wrong_advice}, counts differ in {count_bad}; held to: "
        f"{_report.verdict(held)}")
  if unresolved:
    print(f"the truth's interval is wider than the tolerance band in "
          f"{len(unresolved)} entries ({', '.join(unresolved)}): there a "
          "miss may be the measurement's noise")
  print(f"JSON: {out_path}")
  print(f"Finished in {time.perf_counter() - t_start:.1f} s.")
  return doc


if __name__ == "__main__":
  main()
