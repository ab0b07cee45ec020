"""tesseract-jax and smartvjp.tesseract side by side on one real Tesseract.

The Tesseract is examples/tesseracts/heat (seed 003's workload:
pasteurlabs/tesseract-jax#27), which takes part in smartvjp's residual
contract. Each program runs through ``tesseract_jax.apply_tesseract`` (the
real package) and ``smartvjp.tesseract.apply_tesseract``, in-process
(``Tesseract.from_tesseract_api``) and served over HTTP on 127.0.0.1 by
``tesseract-runtime serve`` (started and stopped here). For each row: the
endpoint calls per step (counted inside the Tesseract) and the step time,
median [min-max] over interleaved rounds, with the round-by-round ratio to
tesseract-jax.

Rows: ``jit(value_and_grad(loss))`` with no checkpoint, with
``jax.checkpoint`` around the call and around the loss, and under ``vmap``
(3 examples, sequential), then forward mode: ``jax.jvp``, the linear map of
``jax.linearize`` and ``jax.jacfwd`` (the Tesseract's ``jacobian``
endpoint).

Goals, each with a verdict: never more endpoint calls than tesseract-jax in
any row; the residual contract (no checkpoint, in-process and served) at
most 0.85x tesseract-jax's step; forward mode works; values and gradients
equal to tesseract-jax's to 1e-12 (float64), and the gradient equal to that
of the same solver written in JAX (``jax.lax.linalg.tridiagonal_solve``) to
1e-9.

Run:  python benchmarks/tesseract.py [--rounds 7] [--nx 64] [--nt 400] [--smoke]
"""

import argparse
import collections
import os
import sys
import tempfile
import time

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
sys.path.insert(1, os.path.join(HERE, os.pardir))
sys.path.insert(2, os.path.join(HERE, os.pardir, "examples", "tesseracts"))

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402

import _report as R  # noqa: E402
import tesseract_jax  # noqa: E402
import tesseract_server  # noqa: E402
from tesseract_core import Tesseract  # noqa: E402

from smartvjp import tesseract as st  # noqa: E402

API = os.path.join(HERE, os.pardir, "examples", "tesseracts", "heat",
                   "tesseract_api.py")
IMPLS = {"tesseract-jax": tesseract_jax.apply_tesseract,
         "smartvjp": st.apply_tesseract}


def programs(apply, t, nx, nt):
  """name -> (jitted function, arguments)."""
  T0 = jnp.asarray(2.0 + np.tanh(5.0 * np.linspace(-1, 1, nx)))
  batch = jnp.stack([T0, 1.05 * T0, 0.95 * T0])
  kw = {"vmap_method": "sequential"} if apply is tesseract_jax.apply_tesseract \
      else {}

  def call(T0):
    return apply(t, {"T0": T0, "nt": nt, "stride": 20}, **kw)["T"]

  def loss_of(c):
    return lambda T0: jnp.sum(c(T0) ** 2)

  return {
      "no checkpoint": (jax.value_and_grad(loss_of(call)), T0),
      "checkpoint(call)": (jax.value_and_grad(loss_of(jax.checkpoint(call))),
                           T0),
      "checkpoint(loss)": (jax.value_and_grad(jax.checkpoint(loss_of(call))),
                           T0),
      "vmap(value_and_grad)": (jax.vmap(jax.value_and_grad(loss_of(call))),
                               batch),
      "jvp": (lambda T0: jax.jvp(call, (T0,), (jnp.ones_like(T0),)), T0),
      "linearize": (lambda T0: jax.linearize(call, T0)[1](jnp.ones_like(T0)),
                    T0),
      "jacfwd": (jax.jacfwd(call), T0),
  }


def jax_heat(T0, nt, t1=1e-3, conductivity=1.0):
  """The heat Tesseract's solver in JAX: the same implicit steps, each a
  tridiagonal solve (``jax.lax.linalg.tridiagonal_solve``)."""
  nx = T0.shape[0]
  coeff = t1 / nt / 3.5 / (2.0 / nx) ** 2 * conductivity

  def step(T, _):
    k = coeff * T ** 2.5
    d = (1.0 + 2.0 * k).at[0].add(-k[0]).at[-1].add(-k[-1])
    zero = jnp.zeros((1,), T.dtype)
    dl = jnp.concatenate([zero, -k[:-1]])
    du = jnp.concatenate([-k[1:], zero])
    return jax.lax.linalg.tridiagonal_solve(dl, d, du, T[:, None])[:, 0], None
  return jax.lax.scan(step, T0, None, length=nt)[0]


class Log:
  def __init__(self, path):
    self.path = path

  def take(self):
    text = open(self.path).read() if os.path.exists(self.path) else ""
    open(self.path, "w").close()
    return dict(collections.Counter(text.split()))


def measure(t, log, nx, nt, rounds):
  """row -> impl -> dict(calls, times, value, error)."""
  fns = {}
  for impl, apply in IMPLS.items():
    for row, (fn, arg) in programs(apply, t, nx, nt).items():
      fns[row, impl] = (jax.jit(fn), arg)
  results = {k: {"times": []} for k in fns}
  for key, (fn, arg) in fns.items():
    log.take()
    try:
      out = jax.block_until_ready(fn(arg))      # compile + one step
      results[key].update(value=out, calls=None)
      log.take()
      jax.block_until_ready(fn(arg))
      results[key]["calls"] = log.take()
    except Exception as e:  # noqa: BLE001 - a row that raises is reported
      results[key]["error"] = f"{type(e).__name__}: {str(e).splitlines()[0]}"
  keys = [k for k in fns if "error" not in results[k]]
  for r in range(rounds):
    for k in keys[r % len(keys):] + keys[:r % len(keys)]:
      fn, arg = fns[k]
      t0 = time.perf_counter()
      jax.block_until_ready(fn(arg))
      results[k]["times"].append(time.perf_counter() - t0)
  return results


def report(where, results, goals):
  rows = sorted({row for row, _ in results}, key=list(programs(
      st.apply_tesseract, None, 4, 1)).index)
  print(f"\n{where}")
  print(f"{'row':24s} {'impl':14s} {'calls per step':55s} "
        f"{'step ms':24s} ratio to tesseract-jax")
  for row in rows:
    base = results[row, "tesseract-jax"]
    for impl in IMPLS:
      res = results[row, impl]
      if "error" in res:
        print(f"{row:24s} {impl:14s} raises {res['error'][:90]}")
        continue
      calls = ", ".join(f"{k} {v}" for k, v in sorted(res["calls"].items()))
      ratio = (R.spread(R.paired_ratios(res["times"], base["times"]),
                        digits=3, unit="x")
               if impl != "tesseract-jax" and base["times"] else "")
      print(f"{row:24s} {impl:14s} {calls:55s} "
            f"{R.spread(res['times'], 1e3, 1):24s} {ratio}")
    smart = results[row, "smartvjp"]
    if "error" not in base and "error" not in smart:
      goals.check(f"{where}, {row}: endpoint calls <= tesseract-jax's",
                  sum(smart["calls"].values()) <= sum(base["calls"].values()))
      ok = all(np.allclose(a, b, rtol=1e-12, atol=0) for a, b in zip(
          jax.tree.leaves(smart["value"]), jax.tree.leaves(base["value"])))
      goals.check(f"{where}, {row}: values and gradients equal to "
                  "tesseract-jax's to 1e-12", ok)
  nock_s, nock_b = results["no checkpoint", "smartvjp"], results[
      "no checkpoint", "tesseract-jax"]
  ratio = R.Spread(R.paired_ratios(nock_s["times"], nock_b["times"]))
  goals.check(f"{where}, residual contract (no checkpoint) <= 0.85x "
              f"tesseract-jax's step (median {ratio.median:.3f}x)",
              ratio.median <= 0.85)
  goals.check(f"{where}, forward mode (jvp, linearize, jacfwd) works "
              "through smartvjp",
              all("error" not in results[row, "smartvjp"]
                  for row in ("jvp", "linearize", "jacfwd")))


def check_against_jax(results, nx, nt, goals):
  """The gradient and Jacobian against the solver written in JAX."""
  T0 = jnp.asarray(2.0 + np.tanh(5.0 * np.linspace(-1, 1, nx)))
  grad = jax.jit(jax.value_and_grad(lambda T0: jnp.sum(jax_heat(T0, nt) ** 2)))
  jac = jax.jit(jax.jacfwd(lambda T0: jax_heat(T0, nt)))(T0)
  value, g = grad(T0)
  for where, res in results.items():
    v_s, g_s = res["no checkpoint", "smartvjp"]["value"]
    err = float(jnp.max(jnp.abs(g_s - g)) / jnp.max(jnp.abs(g)))
    goals.check(f"{where}: gradient equal to the pure-JAX solver's to 1e-9 "
                f"(max relative {err:.1e})",
                err <= 1e-9 and bool(np.isclose(v_s, value, rtol=1e-9)))
    if "error" not in res["jacfwd", "smartvjp"]:
      j_s = res["jacfwd", "smartvjp"]["value"]
      err = float(jnp.max(jnp.abs(j_s - jac)) / jnp.max(jnp.abs(jac)))
      goals.check(f"{where}: jacfwd equal to the pure-JAX solver's to 1e-9 "
                  f"(max relative {err:.1e})", err <= 1e-9)


def main(argv=None):
  p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  p.add_argument("--rounds", type=int, default=7)
  p.add_argument("--nx", type=int, default=64)
  p.add_argument("--nt", type=int, default=400)
  p.add_argument("--smoke", action="store_true",
                 help="a tiny problem and 2 rounds (tests)")
  a = p.parse_args(argv)
  start = time.perf_counter()
  if a.smoke:
    a.rounds, a.nx, a.nt = 2, 16, 40
  print(R.header())
  print(f"tesseract-jax {tesseract_jax.__version__}; heat Tesseract nx={a.nx}, "
        f"nt={a.nt}, {a.rounds} rounds")
  goals = R.Goals()
  # the Tesseract's arrays are float64
  with jax.enable_x64(True), tempfile.TemporaryDirectory() as tmp:
    log = Log(os.path.join(tmp, "calls.txt"))
    os.environ["HEAT_TESSERACT_CALLS"] = log.path    # read by the Tesseract
    try:
      local = Tesseract.from_tesseract_api(API, output_path=tmp)
      out = {"in-process": measure(local, log, a.nx, a.nt, a.rounds)}
      with tesseract_server.Server(API, runs=tmp) as server:
        served = Tesseract.from_url(server.url, timeout=120)
        out["served over HTTP"] = measure(served, log, a.nx, a.nt, a.rounds)
    finally:
      del os.environ["HEAT_TESSERACT_CALLS"]
    for where, results in out.items():
      report(where, results, goals)
    check_against_jax(out, a.nx, a.nt, goals)
  print()
  print(goals.render())
  print(f"Finished in {time.perf_counter() - start:.1f} s.")
  return out, goals


if __name__ == "__main__":
  main()
