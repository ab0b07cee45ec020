"""Custom C++ calls (XLA FFI) wrapped in ``smart_custom_vjp``.

Users of custom C++/CUDA kernels register them with ``jax.ffi`` and call them
with ``jax.ffi.ffi_call``; the pattern with smartvjp is the same as for Pallas:
one FFI target per rule (``f``, ``fwd``, ``bwd``, optionally a fused
``fwd_bwd``). This example compiles four tiny CPU handlers for ``sin`` with
the system C++ compiler and JAX's FFI headers (``jax.ffi.include_dir()``),
counts their calls in C++, and shows which run where. Where no compiler is
available it falls back to ``jax.pure_callback`` stand-ins with the same
interface.

Run:  python examples/ffi_kernel.py
"""

from __future__ import annotations

import collections
import ctypes
import hashlib
import os
import shutil
import subprocess
import tempfile
import time

import jax
import jax.numpy as jnp
import numpy as np

from smartvjp import smart_custom_vjp

SOURCE = r"""
#include <cmath>
#include <cstdint>
#include "xla/ffi/api/ffi.h"

namespace ffi = xla::ffi;
static int64_t counts[4] = {0, 0, 0, 0};
extern "C" int64_t smartvjp_example_count(int i) { return counts[i]; }
extern "C" void smartvjp_example_reset() { for (auto& c : counts) c = 0; }

static ffi::Error SinF(ffi::Buffer<ffi::F32> x, ffi::ResultBuffer<ffi::F32> y) {
  ++counts[0];
  for (size_t i = 0; i < x.element_count(); ++i)
    y->typed_data()[i] = std::sin(x.typed_data()[i]);
  return ffi::Error::Success();
}
static ffi::Error SinFwd(ffi::Buffer<ffi::F32> x, ffi::ResultBuffer<ffi::F32> y,
                         ffi::ResultBuffer<ffi::F32> c) {
  ++counts[1];
  for (size_t i = 0; i < x.element_count(); ++i) {
    y->typed_data()[i] = std::sin(x.typed_data()[i]);
    c->typed_data()[i] = std::cos(x.typed_data()[i]);
  }
  return ffi::Error::Success();
}
static ffi::Error SinBwd(ffi::Buffer<ffi::F32> c, ffi::Buffer<ffi::F32> g,
                         ffi::ResultBuffer<ffi::F32> dx) {
  ++counts[2];
  for (size_t i = 0; i < c.element_count(); ++i)
    dx->typed_data()[i] = c.typed_data()[i] * g.typed_data()[i];
  return ffi::Error::Success();
}
static ffi::Error SinFwdBwd(ffi::Buffer<ffi::F32> x, ffi::Buffer<ffi::F32> g,
                            ffi::ResultBuffer<ffi::F32> dx) {
  ++counts[3];
  for (size_t i = 0; i < x.element_count(); ++i)
    dx->typed_data()[i] = std::cos(x.typed_data()[i]) * g.typed_data()[i];
  return ffi::Error::Success();
}

#define B ffi::Buffer<ffi::F32>
XLA_FFI_DEFINE_HANDLER_SYMBOL(smartvjp_sin_f, SinF,
    ffi::Ffi::Bind().Arg<B>().Ret<B>());
XLA_FFI_DEFINE_HANDLER_SYMBOL(smartvjp_sin_fwd, SinFwd,
    ffi::Ffi::Bind().Arg<B>().Ret<B>().Ret<B>());
XLA_FFI_DEFINE_HANDLER_SYMBOL(smartvjp_sin_bwd, SinBwd,
    ffi::Ffi::Bind().Arg<B>().Arg<B>().Ret<B>());
XLA_FFI_DEFINE_HANDLER_SYMBOL(smartvjp_sin_fwd_bwd, SinFwdBwd,
    ffi::Ffi::Bind().Arg<B>().Arg<B>().Ret<B>());
"""

RULES = ("f", "fwd", "bwd", "fwd_bwd")
_STATE: dict = {}
_PY_COUNTS: collections.Counter = collections.Counter()


def build():
  """Compiles and registers the FFI targets once; returns True on success.

  The shared library goes to ``<temp dir>/smartvjp-ffi-<hash>/`` (the hash
  covers the C++ source and the JAX version), is built there at first use,
  with a message saying so, and is reused by later runs. What happened is
  recorded in ``_STATE["how"]``."""
  if "ok" in _STATE:
    return _STATE["ok"]
  cxx = shutil.which(os.environ.get("CXX", "g++")) or shutil.which("c++")
  ok = False
  if cxx is None:
    _STATE["how"] = "no C++ compiler found (set CXX to use one)"
  else:
    digest = hashlib.sha1((SOURCE + jax.__version__).encode()).hexdigest()[:12]
    folder = os.path.join(tempfile.gettempdir(), f"smartvjp-ffi-{digest}")
    os.makedirs(folder, exist_ok=True)
    lib_path = os.path.join(folder, "libsmartvjp_sin.so")
    _STATE["how"] = f"reused {lib_path}, built by an earlier run"
    if not os.path.exists(lib_path):
      src = os.path.join(folder, "sin.cc")
      with open(src, "w") as fh:
        fh.write(SOURCE)
      cmd = [cxx, "-O2", "-shared", "-fPIC", "-std=c++17",
             f"-I{jax.ffi.include_dir()}", src, "-o", lib_path + ".tmp"]
      print(f"Compiling the C++ handlers (first use): {cxx} -> {lib_path} ...",
            flush=True)
      t0 = time.perf_counter()
      done = subprocess.run(cmd, capture_output=True, text=True)
      if done.returncode == 0:
        os.replace(lib_path + ".tmp", lib_path)
        _STATE["how"] = (f"compiled now into {lib_path} in "
                         f"{time.perf_counter() - t0:.1f} s; later runs reuse it")
      else:
        last = (done.stderr.strip().splitlines() or ["no message"])[-1]
        _STATE["how"] = f"compiling failed ({last[:120]})"
    if os.path.exists(lib_path):
      lib = ctypes.cdll.LoadLibrary(lib_path)
      for rule in RULES:
        jax.ffi.register_ffi_target(
            f"smartvjp_sin_{rule}",
            jax.ffi.pycapsule(getattr(lib, f"smartvjp_sin_{rule}")),
            platform="cpu")
      lib.smartvjp_example_count.restype = ctypes.c_int64
      _STATE["lib"] = lib
      ok = True
  _STATE["ok"] = ok
  return ok


def counts() -> dict:
  if _STATE.get("lib") is not None:
    lib = _STATE["lib"]
    got = {r: lib.smartvjp_example_count(i) for i, r in enumerate(RULES)}
  else:
    got = dict(_PY_COUNTS)
  return {k: v for k, v in got.items() if v}


def reset():
  if _STATE.get("lib") is not None:
    _STATE["lib"].smartvjp_example_reset()
  _PY_COUNTS.clear()


def _call(rule, outs, *args):
  """``jax.ffi.ffi_call`` of a registered target, or a callback stand-in."""
  shapes = [jax.ShapeDtypeStruct(o.shape, o.dtype) for o in outs]
  if build():
    return jax.ffi.ffi_call(f"smartvjp_sin_{rule}", shapes)(*args)
  host = {"f": lambda x: [np.sin(x)], "fwd": lambda x: [np.sin(x), np.cos(x)],
          "bwd": lambda c, g: [c * g], "fwd_bwd": lambda x, g: [np.cos(x) * g]}

  def run(*a):
    _PY_COUNTS[rule] += 1
    return [np.asarray(o, np.float32) for o in host[rule](*a)]
  return jax.pure_callback(run, shapes, *args)


def make(fused=False):
  """``sin`` as a ``smart_custom_vjp`` whose rules are FFI calls (f32 only)."""
  def f(x):
    return _call("f", [x], x)[0]

  def fwd(x):
    y, c = _call("fwd", [x, x], x)
    return y, c

  def bwd(c, g):
    return (_call("bwd", [g], c, g)[0],)

  def fwd_bwd(x, g):
    return (_call("fwd_bwd", [g], x, g)[0],)

  F = smart_custom_vjp(f)
  F.defvjp(fwd, bwd, fwd_bwd=fwd_bwd if fused else None)
  return F


def main():
  t0 = time.perf_counter()
  if build():
    print(f"Rules as XLA FFI handlers in C++: {_STATE['how']}.")
  else:
    print(f"Rules as jax.pure_callback stand-ins: {_STATE['how']}.")
  print("Per jitted gradient step of sum(sin(x)**2), x of 16 floats; each rule "
        "is one call of its handler, counted\nin the handler. Gradient error: "
        "max |ours - 2 sin(x) cos(x)|, absolute.\n")
  x = jnp.linspace(-1.0, 2.0, 16, dtype=jnp.float32)
  want = 2 * jnp.sin(x) * jnp.cos(x)
  print(f"  {'program':28s} {'rule calls':24s} gradient error")
  rows = {}
  for name, fused, remat in (("grad", False, False),
                             ("grad(checkpoint)", False, True),
                             ("grad(checkpoint), fwd_bwd", True, True)):
    F = make(fused)
    G = jax.checkpoint(F) if remat else F
    reset()
    g = jax.block_until_ready(jax.jit(jax.grad(lambda x: jnp.sum(G(x) ** 2)))(x))
    err = float(jnp.max(jnp.abs(g - want)))
    c = ", ".join(f"{k} {v}" for k, v in counts().items())
    rows[name] = (c, err)
    print(f"  {name:28s} {c:24s} {err:.1e}"
          f"{'' if err < 1e-5 else '  WRONG'}")
  worst = max(err for _, err in rows.values())
  print(f"\nWhat to conclude: rules written as compiled handlers (here "
        f"{'C++ through XLA FFI' if _STATE.get('ok') else 'callback stand-ins'}) "
        "work with smartvjp as JAX-coded ones do:\n"
        f"under jax.checkpoint each runs once ({rows['grad(checkpoint)'][0]}; "
        f"fused: {rows['grad(checkpoint), fwd_bwd'][0]}), and the gradient "
        f"error is {worst:.1e}.")
  print(f"\nFinished in {time.perf_counter() - t0:.1f} s.")


if __name__ == "__main__":
  main()
