"""GPU benchmark: Pallas kernels in a checkpointed stack, four implementations.

Two workloads, each an ``L``-layer stack with ``jax.checkpoint`` per layer:

* ``gelu_matmul``: ``x <- gelu(x @ w_l)`` (``examples/pallas_gelu_matmul.py``),
  compute-bound; reported as achieved TFLOP/s of the useful work (forward
  ``2MKN`` + backward ``4MKN`` per layer, remat recomputation not counted);
* ``rmsnorm_gelu``: ``x <- gelu(rmsnorm(x) * gamma_l)``
  (``examples/pallas_rmsnorm_gelu.py``), memory-bound; reported as GB/s of
  the useful traffic (forward reads x, writes z; backward reads x, g, writes
  dx: 5 arrays of ``M x D`` per layer).

Implementations: ``jax.custom_vjp``, ``optimize_remat=True``, smartvjp, and
smartvjp with the fused ``fwd_bwd``. For each: median step time, throughput
against the chip's peak, and the compiled step's memory
(``compiled.memory_analysis()``: temporaries + arguments + outputs; the
process-wide ``device.memory_stats()`` peak is saved too where available).
Raw numbers go to a JSON file.

Run on a GPU:   python benchmarks/gpu_mlp.py --out gpu_mlp.json
Smoke test:     python benchmarks/gpu_mlp.py --smoke   (tiny shapes, CPU ok)
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time

import jax
import jax.numpy as jnp

sys.path.insert(0, os.path.join(os.path.dirname(__file__), os.pardir, "examples"))
import pallas_gelu_matmul as PG  # noqa: E402
import pallas_rmsnorm_gelu as RG  # noqa: E402

IMPLS = ("jax.custom_vjp", "optimize_remat", "smartvjp", "smartvjp+fused")
# H200 SXM: ~989 TFLOP/s dense bf16, 4.8 TB/s HBM3e (vendor figures)
PEAK = {"tflops": 989.0, "gbps": 4800.0}


def build(workload, impl, interpret, block):
  fused = impl == "smartvjp+fused"
  if workload == "gelu_matmul":
    op, rules = PG.make_gelu_matmul(block_m=block, block_n=block,
                                    interpret=interpret, fused=fused)
  else:
    op, rules = RG.make_rmsnorm_gelu(block_m=block, interpret=interpret,
                                     fused=fused)
  if impl.startswith("smartvjp"):
    return op
  F = jax.custom_vjp(rules["f"])
  F.defvjp(rules["fwd"], rules["bwd"], optimize_remat=impl == "optimize_remat")
  return F


def stack_grad(op, workload):
  layer = jax.checkpoint(op)

  def loss(params, x):
    def body(x, p):
      return layer(x, p), None
    x, _ = jax.lax.scan(body, x, params)
    return jnp.sum(x.astype(jnp.float32) ** 2)
  return jax.jit(jax.grad(loss))


def make_inputs(workload, layers, m, d, dtype):
  kx, kp = jax.random.split(jax.random.key(0))
  x = (jax.random.normal(kx, (m, d)) * 0.5).astype(dtype)
  if workload == "gelu_matmul":
    params = (jax.random.normal(kp, (layers, d, d)) / d ** 0.5).astype(dtype)
  else:
    params = (1.0 + 0.1 * jax.random.normal(kp, (layers, d))).astype(dtype)
  return params, x


def program_memory(compiled):
  """Bytes the compiled step needs: temporaries (activations, residuals) plus
  arguments and outputs, from XLA's ``memory_analysis()`` (deterministic,
  per program; on a GPU the process-wide ``memory_stats()`` peak is also
  recorded)."""
  analysis = compiled.memory_analysis()
  if analysis is None:
    return None
  return sum(getattr(analysis, a, 0) for a in (
      "temp_size_in_bytes", "argument_size_in_bytes", "output_size_in_bytes"))


def device_peak(device):
  stats = getattr(device, "memory_stats", lambda: None)()
  return (stats or {}).get("peak_bytes_in_use")


def fmt_bytes(n):
  if n is None:
    return "n/a"
  for unit, scale in (("GiB", 2**30), ("MiB", 2**20), ("KiB", 2**10)):
    if n >= scale:
      return f"{n / scale:.2f} {unit}"
  return f"{n} B"


def time_compiled(compiled, args, repeats):
  """Median wall time of ``compiled(*args)`` after one warm-up call."""
  jax.block_until_ready(compiled(*args))
  times = []
  for _ in range(repeats):
    t0 = time.perf_counter()
    jax.block_until_ready(compiled(*args))
    times.append(time.perf_counter() - t0)
  return statistics.median(times)


def run(workload, layers, m, d, dtype, repeats, interpret, block):
  params, x = make_inputs(workload, layers, m, d, dtype)
  device = jax.devices()[0]
  rows = []
  for impl in IMPLS:
    fn = stack_grad(build(workload, impl, interpret, block), workload)
    compiled = fn.lower(params, x).compile()
    t = time_compiled(compiled, (params, x), repeats)
    mem = program_memory(compiled)
    if workload == "gelu_matmul":
      work = 6 * m * d * d * layers
      rate = work / t / 1e12
      unit, peak = "TFLOP/s", PEAK["tflops"]
    else:
      work = 5 * m * d * jnp.dtype(dtype).itemsize * layers
      rate = work / t / 1e9
      unit, peak = "GB/s", PEAK["gbps"]
    rows.append(dict(workload=workload, impl=impl, step_s=t, rate=rate,
                     unit=unit, fraction_of_peak=rate / peak,
                     program_memory_bytes=mem,
                     device_peak_bytes=device_peak(device)))
  return rows


def main(argv=None):
  p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  p.add_argument("--smoke", action="store_true",
                 help="tiny shapes, Pallas interpret mode (runs on a CPU)")
  p.add_argument("--layers", type=int, default=8)
  p.add_argument("--batch", type=int, default=8192)
  p.add_argument("--width", type=int, default=4096)
  p.add_argument("--repeats", type=int, default=10)
  p.add_argument("--out", default=None, help="write raw results as JSON")
  args = p.parse_args(argv)
  on_gpu = jax.default_backend() == "gpu"
  if args.smoke:
    layers, m, d, repeats, block = 2, 64, 32, 2, 16
  else:
    if not on_gpu:
      print("gpu_mlp.py: no GPU here; use --smoke for a CPU run of tiny "
            "shapes. Exiting.")
      return []
    layers, m, d, repeats, block = (args.layers, args.batch, args.width,
                                    args.repeats, 128)
  interpret = not on_gpu
  dtype = jnp.bfloat16
  print(f"jax {jax.__version__} on {jax.devices()[0].device_kind}; "
        f"{layers} checkpointed layers, x {m}x{d} bf16; median of {repeats}"
        f"{' (smoke: interpret mode)' if interpret else ''}\n")
  results = []
  for workload in ("gelu_matmul", "rmsnorm_gelu"):
    rows = run(workload, layers, m, d, dtype, repeats, interpret, block)
    results += rows
    base = rows[0]["step_s"]
    print(f"{workload}:")
    for r in rows:
      print(f"  {r['impl']:16s} {r['step_s'] * 1e3:9.2f} ms  "
            f"{r['step_s'] / base:5.3f}x  {r['rate']:9.2f} {r['unit']:8s} "
            f"({100 * r['fraction_of_peak']:5.1f}% of peak)  program memory "
            f"{fmt_bytes(r['program_memory_bytes'])}")
  if args.out:
    with open(args.out, "w") as fh:
      json.dump(dict(jax=jax.__version__, device=jax.devices()[0].device_kind,
                     layers=layers, batch=m, width=d, results=results), fh,
                indent=1)
  return results


if __name__ == "__main__":
  main()
