"""A real Tesseract from JAX through smartvjp.tesseract (seed 003).

The heat Tesseract (examples/tesseracts/heat: nonlinear diffusion,
conductivity ~ T**2.5, a tridiagonal scipy solve per step) runs in-process
and then served over HTTP by ``tesseract-runtime serve`` on 127.0.0.1,
started and stopped here. For each program the Tesseract's own endpoint
counts are printed, for smartvjp and, side by side, for tesseract-jax's
``apply_tesseract`` on the same Tesseract: with its residual contract a
gradient runs apply-with-residuals and the VJP from them (no forward
re-run); under ``jax.checkpoint`` the plain apply and VJP; forward mode the
JVP endpoint; ``jax.jacfwd`` one ``jacobian`` call.

Needs the ``tesseract`` extra, from the clone: pip install -e ".[tesseract]"
(Python 3.12 or newer: tesseract-jax 0.5 needs it; without the extra, the
example says so in one line and stops).
Run:  python examples/tesseract_heat.py
"""

import collections
import importlib.util
import os
import sys
import tempfile
import time

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.join(HERE, "tesseracts"))
API = os.path.join(HERE, "tesseracts", "heat", "tesseract_api.py")

MISSING = [m for m in ("tesseract_core", "tesseract_jax", "scipy")
           if importlib.util.find_spec(m) is None]


def programs(apply, t):
  import jax
  import jax.numpy as jnp
  import numpy as np

  def T_final(T0):
    return apply(t, {"T0": T0, "nt": 60, "stride": 10})["T"]

  def loss(T0):
    return jnp.sum(T_final(T0) ** 2)

  T0 = jnp.asarray(2.0 + np.tanh(5.0 * np.linspace(-1, 1, 16)))
  return {
      "jit(grad(loss))": lambda: jax.jit(jax.grad(loss))(T0),
      "jit(grad(loss)), checkpoint(call)": lambda: jax.jit(jax.grad(
          lambda x: jnp.sum(jax.checkpoint(T_final)(x) ** 2)))(T0),
      "jax.jvp": lambda: jax.jvp(T_final, (T0,), (jnp.ones_like(T0),)),
      "jit(jacfwd)": lambda: jax.jit(jax.jacfwd(T_final))(T0),
  }


def run(t, calls):
  """program -> {"smartvjp" | "tesseract-jax": (result, endpoint calls)}."""
  import jax
  import tesseract_jax
  from smartvjp.tesseract import apply_tesseract

  out = collections.defaultdict(dict)
  for who, apply in (("smartvjp", apply_tesseract),
                     ("tesseract-jax", tesseract_jax.apply_tesseract)):
    for name, fn in programs(apply, t).items():
      calls()
      try:
        result = jax.block_until_ready(fn())
      except Exception as e:  # noqa: BLE001 - reported as the row's result
        result = f"{type(e).__name__}"
      out[name][who] = (result, calls())
  for name, row in out.items():
    cells = [", ".join(f"{k} {v}" for k, v in sorted(row[w][1].items()))
             if not isinstance(row[w][0], str) else f"raises {row[w][0]}"
             for w in ("smartvjp", "tesseract-jax")]
    print(f"  {name:36s} {cells[0]:54s} {cells[1]}")
  return out


def main():
  start = time.perf_counter()
  print("Tesseract example (seed 003): the heat Tesseract's endpoint calls "
        "per program, smartvjp.tesseract beside tesseract-jax.")
  if MISSING:
    print(f"It needs {', '.join(MISSING)} "
          '(pip install -e ".[tesseract]" in the clone, on Python 3.12 '
          'or newer); not run.')
    print("\nWhat to conclude: nothing was measured here; python "
          "examples/blackbox_heat.py runs the same heat simulator behind "
          "apply / vector_jacobian_product callbacks, with the same "
          "schedule, without the extra.")
    print(f"\nFinished in {time.perf_counter() - start:.1f} s.")
    return None
  import jax
  import numpy as np
  from tesseract_core import Tesseract
  import tesseract_server

  header = f"  {'program':36s} {'smartvjp endpoint calls':54s} tesseract-jax's"
  with jax.enable_x64(True), tempfile.TemporaryDirectory() as tmp:
    log = os.path.join(tmp, "calls.txt")
    os.environ["HEAT_TESSERACT_CALLS"] = log   # the Tesseract appends to it

    def calls():
      text = open(log).read() if os.path.exists(log) else ""
      open(log, "w").close()
      return dict(collections.Counter(text.split()))

    try:
      print("in-process (Tesseract.from_tesseract_api):")
      print(header)
      local = run(Tesseract.from_tesseract_api(API, output_path=tmp), calls)
      with tesseract_server.Server(API, runs=tmp) as server:
        print(f"served over HTTP ({server.url}):")
        print(header)
        served = run(Tesseract.from_url(server.url, timeout=120), calls)
    finally:
      del os.environ["HEAT_TESSERACT_CALLS"]
  worst = 0.0
  for place in (local, served):
    for name, row in place.items():
      ours, theirs = row["smartvjp"][0], row["tesseract-jax"][0]
      if isinstance(ours, str) or isinstance(theirs, str):
        continue
      for a, b in zip(jax.tree.leaves(ours), jax.tree.leaves(theirs)):
        a, b = np.asarray(a), np.asarray(b)
        worst = max(worst, float(np.max(np.abs(a - b))
                                 / max(np.max(np.abs(b)), 1e-300)))
  for name in local:
    for a, b in zip(jax.tree.leaves(local[name]["smartvjp"][0]),
                    jax.tree.leaves(served[name]["smartvjp"][0])):
      np.testing.assert_array_equal(a, b)
  print(f"max |smartvjp - tesseract-jax| / max |tesseract-jax| over every "
        f"row: {worst:.1e}; in-process and served results identical.")
  print("\nWhat to conclude: with the Tesseract's residual contract a gradient "
        "costs one apply and one VJP that does not re-run the forward solve, "
        "where tesseract-jax's VJP endpoint re-runs it; under jax.checkpoint "
        "both make the same calls; forward mode goes through the JVP and "
        "jacobian endpoints as tesseract-jax does; values agree to float64 "
        "rounding.")
  print(f"\nFinished in {time.perf_counter() - start:.1f} s.")
  return local, served


if __name__ == "__main__":
  main()
