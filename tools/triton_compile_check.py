"""Compiles every kernel of ``examples/triton_gelu_matmul.py`` for an H200
(sm_90) ahead of time, without a GPU and without jax_triton.

For each kernel, dtype (f32, bf16) and tile configuration (the benchmark's
128x128x64 with 8 warps and 3 stages, and the tests' small 32x32x16 with 4
warps and 2 stages), on a shape that is a multiple of the tiles and a ragged
one (the sizes are constexprs, so each shape compiles separately), it runs ``triton.compile`` on an ``ASTSource`` with the
signature, constexprs and pointer alignment that jax-triton 0.3.1 gives the
kernel (pointers 16-byte aligned, every keyword a constexpr), then runs the
ptxas bundled with triton on the PTX to read registers and spills. It prints
one row per compilation and exits with status 1 when any fails, uses more
shared memory than an H200 gives one block (227 KiB), or needs a global
scratch buffer (jax-triton 0.3.1 passes none).

With ``--interpret`` it instead runs every kernel in Triton's CPU
interpreter (``TRITON_INTERPRET=1``, which needs torch CPU tensors) in f32 on
ragged and block-multiple shapes and compares each output with a float64
numpy reference, exiting with status 1 when an error is above tolerance.
Only f32: triton 3.6's interpreter returns garbage for ``tl.dot`` of bf16
blocks (a lone 16x16 bf16 dot is off by 1e10), so bf16 needs a GPU.

With ``--lower`` it exports ``jit(grad(loss))`` of the example's operation
for CUDA on this machine (``jax.export`` with ``platforms=["cuda"]``), through
the installed jax_triton, whose lowering compiles each kernel with triton to
PTX. jaxlib's GPU kernel-call library is absent on a CPU jaxlib, so the tool
puts a recorder in its place (``jax._src.lib.gpu_triton``: compute
capability 90, kernel calls serialized as their kernel name) before importing
jax_triton. It then counts the kernels in the exported module for each
schedule (jax.custom_vjp, smartvjp, smartvjp + fwd_bwd; with and without
``jax.checkpoint``) and exits with status 1 when a count differs from the
one the GPU test expects. This checks jax_triton's compile path against the
installed triton and JAX, and the rules' wiring, without a GPU; it says
nothing about what XLA later does with the custom calls.

Needs triton (3.6.0 is what the example targets) and jax (for the example's
module); no GPU, no jax_triton; ``--interpret`` also needs torch.

Usage:  PYTHONPATH=. python tools/triton_compile_check.py [--kernels NAME ...]
        PYTHONPATH=. python tools/triton_compile_check.py --interpret
        PYTHONPATH=. python tools/triton_compile_check.py --lower   # + jax_triton
"""

import argparse
import importlib.util
import os
import re
import subprocess
import sys
import tempfile
import traceback
import types

import jax.numpy as jnp

ROOT = os.path.abspath(os.path.join(os.path.dirname(__file__), os.pardir))
H200_SMEM_PER_BLOCK = 227 * 1024
CAPABILITY = 90
# (block_m, block_n, block_k, num_warps, num_stages), shapes (M, K, N): the
# sizes are constexprs, so each shape is its own compilation.
CONFIGS = [
    ((128, 128, 64, 8, 3), [(8192, 4096, 4096), (300, 200, 170)]),
    ((32, 32, 16, 4, 2), [(64, 32, 96), (50, 37, 45)]),
]
TRITON_TYPE = {"float32": "fp32", "bfloat16": "bf16"}


def load_example():
  path = os.path.join(ROOT, "examples", "triton_gelu_matmul.py")
  spec = importlib.util.spec_from_file_location("triton_gelu_matmul", path)
  module = importlib.util.module_from_spec(spec)
  spec.loader.exec_module(module)
  return module


def signature_of(fn, dtype, residual_dtype, constexprs):
  """jax-triton's view of the kernel: arrays as typed pointers, Python ints
  as i32, keywords as constexprs."""
  sig = {}
  for name in fn.arg_names:
    if name in constexprs:
      sig[name] = "constexpr"
    elif name.endswith("_ptr"):
      dt = residual_dtype if name == "y_ptr" else dtype
      sig[name] = "*" + TRITON_TYPE[jnp.dtype(dt).name]
    else:
      sig[name] = "i32"
  return sig


def pointer_attrs(backend, sig):
  """The specialization jax-triton asks for: each pointer divisible by 16,
  scalars unspecialized (as ``get_or_create_triton_kernel`` builds it)."""
  from triton._C import libtriton
  attrs = {}
  for i, ty in enumerate(sig.values()):
    if ty == "constexpr":
      continue
    aligned = ty.startswith("*")
    fake = types.SimpleNamespace(data_ptr=lambda a=aligned: 16 if a else 0,
                                 dtype=ty.removeprefix("*"))
    _, attr = libtriton.native_specialize_impl(backend, fake, False, True,
                                               aligned)
    attrs[(i,)] = backend.parse_attr(attr)
  return attrs


def ptxas_usage(ptx, arch):
  """``(registers, spill store bytes, spill load bytes)`` from ptxas -v."""
  from triton.backends.nvidia.compiler import get_ptxas
  with tempfile.TemporaryDirectory() as d:
    src = os.path.join(d, "k.ptx")
    with open(src, "w") as f:
      f.write(ptx)
    out = subprocess.run([get_ptxas(CAPABILITY).path, "-v", f"--gpu-name={arch}", src,
                          "-o", os.path.join(d, "k.cubin")],
                         capture_output=True, text=True, check=True)
  log = out.stderr + out.stdout
  regs = re.search(r"Used (\d+) registers", log)
  spills = re.search(r"(\d+) bytes spill stores, (\d+) bytes spill loads", log)
  return (int(regs.group(1)) if regs else None,
          int(spills.group(1)) if spills else None,
          int(spills.group(2)) if spills else None)


def compile_one(tg, name, dtype, config, shape, residual_dtype=None):
  import triton
  from triton.backends.compiler import GPUTarget
  from triton.backends.nvidia.compiler import CUDABackend
  bm, bn, bk, warps, stages = config
  _, consts = tg.launch_params(name, shape, dtype, bm, bn, bk)
  fn = tg.KERNELS[name]
  target = GPUTarget("cuda", CAPABILITY, 32)
  sig = signature_of(fn, dtype, residual_dtype or dtype, consts)
  src = triton.compiler.ASTSource(
      fn, signature=sig, constexprs=consts,
      attrs=pointer_attrs(CUDABackend(target), sig))
  compiled = triton.compile(src, target=target, options=dict(
      num_warps=warps, num_stages=stages, num_ctas=1, enable_fp_fusion=True))
  md = compiled.metadata
  arch = re.search(r"\.target\s+(\S+)", compiled.asm["ptx"]).group(1)
  regs, spill_st, spill_ld = ptxas_usage(compiled.asm["ptx"], arch)
  scratch = (getattr(md, "global_scratch_size", 0) or 0,
             getattr(md, "profile_scratch_size", 0) or 0)
  return dict(entry=md.name, shared=md.shared, regs=regs, spill_st=spill_st,
              spill_ld=spill_ld, scratch=scratch, arch=arch)


# -- numerics in the interpreter ------------------------------------------------

def reference(x, w, g):
  """float64 numpy: z, y, dy, dx, dw of gelu(x @ w) with cotangent g."""
  import numpy as np
  x, w, g = (np.asarray(a, np.float64) for a in (x, w, g))
  y = x @ w
  t = np.tanh(np.sqrt(2 / np.pi) * (y + 0.044715 * y ** 3))
  z = 0.5 * y * (1 + t)
  dgelu = 0.5 * (1 + t) + 0.5 * y * (1 - t * t) * np.sqrt(2 / np.pi) * (
      1 + 3 * 0.044715 * y * y)
  dy = g * dgelu
  return dict(z=z, y=y, dy=dy, dx=dy @ w.T, dw=x.T @ dy)


# kernel: (inputs, outputs) by the names of ``reference``'s values
INTERPRET_IO = {
    "tgm_f_kernel": (("x", "w"), ("z",)),
    "tgm_fwd_kernel": (("x", "w"), ("z", "y")),
    "tgm_dy_kernel": (("x", "w", "g"), ("dy",)),
    "tgm_dx_kernel": (("g", "y", "w"), ("dx",)),
    "tgm_dw_kernel": (("x", "g", "y"), ("dw",)),
    "tgm_dx_from_dy_kernel": (("dy", "w"), ("dx",)),
    "tgm_dw_from_dy_kernel": (("x", "dy"), ("dw",)),
}


def interpret(names):
  import numpy as np
  import torch
  tg = load_example()
  cases = [((32, 32, 16), (50, 37, 45)), ((32, 32, 16), (64, 32, 96)),
           ((32, 64, 16), (70, 90, 33)), ((128, 128, 64), (300, 200, 170))]
  tols = {"float32": 1e-5}
  tdt = {"float32": torch.float32}
  print("Triton interpreter (TRITON_INTERPRET=1) against float64 numpy; error: "
        "max |ours - reference| / max |reference|")
  print(f"{'kernel':22s} {'dtype':9s} {'tiles':11s} {'M x K x N':12s} "
        f"{'error':>8s}  tolerance")
  bad = 0
  for dtype in tols:   # f32 only: the interpreter's bf16 tl.dot is wrong
    for blocks, (m, k, n) in cases:
      rng = np.random.default_rng(0)
      x = torch.tensor(rng.standard_normal((m, k)), dtype=tdt[dtype])
      w = torch.tensor(rng.standard_normal((k, n)) / np.sqrt(k), dtype=tdt[dtype])
      g = torch.tensor(rng.standard_normal((m, n)), dtype=tdt[dtype])
      ref = reference(x.float(), w.float(), g.float())
      # The backward kernels read y and dy: give them the reference's, rounded
      # to the dtype, so each kernel is checked alone.
      vals = dict(x=x, w=w, g=g, y=torch.tensor(ref["y"], dtype=tdt[dtype]),
                  dy=torch.tensor(ref["dy"], dtype=tdt[dtype]))
      for name in names:
        ins, outs = INTERPRET_IO[name]
        grid, consts = tg.launch_params(name, (m, k, n), dtype, *blocks)
        out = [torch.zeros(ref[o].shape, dtype=tdt[dtype]) for o in outs]
        tg.KERNELS[name][grid](*[vals[i] for i in ins], *out, **consts)
        err = max(float(np.max(np.abs(o.float().numpy() - ref[r]))
                        / np.max(np.abs(ref[r]))) for o, r in zip(out, outs))
        ok = err < tols[dtype]
        bad += not ok
        print(f"{name:22s} {dtype:9s} {'x'.join(map(str, blocks)):11s} "
              f"{'x'.join(map(str, (m, k, n))):12s} {err:8.1e}  "
              f"{tols[dtype]:.0e} {'ok' if ok else 'TOO LARGE'}")
  print("all within tolerance" if not bad else f"{bad} above tolerance")
  return 1 if bad else 0


# -- lowering through jax_triton without a GPU ---------------------------------

# (implementation, remat, fused): kernel launches per gradient step
EXPECTED_LAUNCHES = {
    ("jax.custom_vjp", True, False): {"tgm_fwd_kernel": 2, "tgm_dx_kernel": 1,
                                      "tgm_dw_kernel": 1},
    ("smartvjp", True, False): {"tgm_f_kernel": 1, "tgm_fwd_kernel": 1,
                                "tgm_dx_kernel": 1, "tgm_dw_kernel": 1},
    ("smartvjp", True, True): {"tgm_f_kernel": 1, "tgm_dy_kernel": 1,
                               "tgm_dx_from_dy_kernel": 1,
                               "tgm_dw_from_dy_kernel": 1},
    ("jax.custom_vjp", False, False): {"tgm_fwd_kernel": 1, "tgm_dx_kernel": 1,
                                       "tgm_dw_kernel": 1},
    ("smartvjp", False, False): {"tgm_fwd_kernel": 1, "tgm_dx_kernel": 1,
                                 "tgm_dw_kernel": 1},
    ("smartvjp", False, True): {"tgm_fwd_kernel": 1, "tgm_dx_kernel": 1,
                                "tgm_dw_kernel": 1},
}


def _install_recorder():
  """Stands in for jaxlib's CUDA kernel-call library: each kernel call
  serializes to ``name|grid|warps|shared bytes|number of parameters``."""
  from jax._src.lib import gpu_triton as lib

  class Kernel:
    def __init__(self, name, num_warps, num_ctas, shared, binary, ttir, cc):
      self.desc = f"{name}|warps={num_warps}|smem={shared}|cc={cc}"

  class KernelCall:
    def __init__(self, kernel, g0, g1, g2, params):
      self.kernel, self.grid, self.params = kernel, (g0, g1, g2), params

    def to_proto(self, name, metadata):
      return (f"{self.kernel.desc}|grid={self.grid}|params={len(self.params)}"
              .encode())

  lib.get_compute_capability = lambda device: CAPABILITY
  lib.get_serialized_metadata = lambda *a: b""
  lib.TritonKernel = Kernel
  lib.TritonKernelCall = KernelCall
  lib.create_array_parameter = lambda zeroed, divisibility: ("array",)
  lib.create_scalar_parameter = lambda value, dtype: ("scalar",)


def _mlir_string(text):
  """The bytes of an MLIR string literal's body (``\\XX`` escapes)."""
  return re.sub(rb"\\(\\|[0-9A-Fa-f]{2})",
                lambda m: b"\\" if m.group(1) == b"\\" else bytes(
                    [int(m.group(1), 16)]), text.encode("latin1"))


def lower(shape=(300, 200, 170)):
  import collections
  import zlib
  import jax
  _install_recorder()
  import jax_triton
  tg = load_example()
  print(f"jax {jax.__version__}, jax_triton {jax_triton.__version__}; "
        f"exported for cuda with a recorder in place of jaxlib's kernel calls")
  m, k, n = shape
  x = jnp.ones((m, k), jnp.bfloat16)
  w = jnp.ones((k, n), jnp.bfloat16)
  call = re.compile(r'stablehlo.custom_call @triton_kernel_call\(.*?'
                    r'backend_config = "((?:[^"\\]|\\.)*)"')
  bad = 0
  for (impl, remat, fused), want in EXPECTED_LAUNCHES.items():
    gm, rules = tg.make_gelu_matmul(fused=fused)
    F = tg.custom_vjp_version(rules) if impl == "jax.custom_vjp" else gm
    G = jax.checkpoint(F) if remat else F
    loss = lambda x, w: jnp.sum(G(x, w).astype(jnp.float32) ** 2)  # noqa: E731
    exported = jax.export.export(
        jax.jit(jax.grad(loss, (0, 1))), platforms=["cuda"],
        disabled_checks=[jax.export.DisabledSafetyCheck.custom_call(
            "triton_kernel_call")])(x, w)
    text = exported.mlir_module()
    calls = [zlib.decompress(_mlir_string(c)).decode()
             for c in call.findall(text)]
    got = dict(collections.Counter(c.split("|")[0] for c in calls))
    ok = got == want and "func.call" not in text
    bad += not ok
    label = (f"{impl}{' + fwd_bwd' if fused else ''}, "
             f"{'checkpoint' if remat else 'no checkpoint'}")
    print(f"{label:40s} {'ok' if ok else 'WRONG'}  "
          + ", ".join(f"{name} {c}" for name, c in got.items()))
    for c in calls:
      print(f"    {c}")
    if not ok:
      print(f"    expected {want}")
  print("all counts as expected" if not bad else f"{bad} count(s) differ")
  return 1 if bad else 0


def main(argv=None):
  ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  ap.add_argument("--kernels", nargs="*", help="kernel names (default: all)")
  ap.add_argument("--interpret", action="store_true",
                  help="run the kernels in Triton's CPU interpreter instead")
  ap.add_argument("--lower", action="store_true",
                  help="export the gradient for CUDA through jax_triton and "
                       "count its kernels instead")
  args = ap.parse_args(argv)
  if args.lower:
    return lower()
  if args.interpret:
    os.environ["TRITON_INTERPRET"] = "1"   # read when the kernels are defined
    return interpret(args.kernels or list(INTERPRET_IO))
  import triton
  tg = load_example()
  names = args.kernels or tg.KERNEL_NAMES
  print(f"triton {triton.__version__}, target cuda sm_{CAPABILITY} (H200); "
        f"shared-memory limit {H200_SMEM_PER_BLOCK} bytes per block")
  print(f"{'kernel':22s} {'dtype':14s} {'tiles':20s} {'M x K x N':15s} {'result':6s} "
        f"{'shared':>7s} {'regs':>5s} {'spill st/ld':>12s}  entry")
  bad = 0
  # (dtype, residual dtype): bf16 with an f32 residual y for the kernels
  # that read or write y, at the benchmark tiles
  variants = [(jnp.float32, None, CONFIGS), (jnp.bfloat16, None, CONFIGS),
              (jnp.bfloat16, jnp.float32, CONFIGS[:1])]
  for name in names:
    for dtype, rdtype, configs in variants:
      if rdtype is not None and "y_ptr" not in tg.KERNELS[name].arg_names:
        continue
      for config, shape in [(c, s) for c, shapes in configs for s in shapes]:
        bm, bn, bk, warps, stages = config
        tiles = f"{bm}x{bn}x{bk} w{warps} s{stages}"
        dname = jnp.dtype(dtype).name + ("/y f32" if rdtype is not None else "")
        label = (f"{name:22s} {dname:14s} {tiles:20s} "
                 f"{'x'.join(map(str, shape)):15s}")
        try:
          r = compile_one(tg, name, dtype, config, shape, rdtype)
        except Exception as e:   # report and go on with the others
          bad += 1
          print(f"{label} FAILED  {type(e).__name__}: {str(e).splitlines()[:1]}")
          traceback.print_exc(limit=3, file=sys.stdout)
          continue
        problems = []
        if r["shared"] > H200_SMEM_PER_BLOCK:
          problems.append("shared memory over the limit")
        if any(r["scratch"]):
          problems.append(f"needs scratch {r['scratch']}")
        if r["entry"] != name:
          problems.append(f"entry name {r['entry']!r} differs from the kernel's")
        bad += bool(problems)
        spills = (f"{r['spill_st']}/{r['spill_ld']}"
                  if r["spill_st"] is not None else "?")
        print(f"{label} {'ok' if not problems else 'BAD':6s} {r['shared']:7d} "
              f"{r['regs'] if r['regs'] is not None else '?':>5} {spills:>12s}  "
              f"{r['entry']} ({r['arch']}){'; ' + '; '.join(problems) if problems else ''}")
  print(f"{'all compiled within limits' if not bad else f'{bad} problem(s)'}")
  return 1 if bad else 0


if __name__ == "__main__":
  sys.exit(main())
