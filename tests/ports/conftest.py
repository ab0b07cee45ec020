"""Runs a port program twice, with ``jax.custom_vjp`` and with
``smartvjp.smart_custom_vjp`` swapped in before the library is imported
(each in its own process, since a module is imported once per process),
and compares every recorded array bit for bit."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)

import _harness  # noqa: E402

TIMEOUT_S = 300


def run_side(script: str, smart: bool, out_dir, case: str = "") -> dict:
  """Runs ``script`` with ``--smart 0|1`` and loads what it recorded."""
  out = os.path.join(str(out_dir), f"{script}.{case}.smart{int(smart)}.npz")
  env = dict(os.environ, JAX_PLATFORMS="cpu")
  proc = subprocess.run(
      [sys.executable, os.path.join(HERE, script), "--smart", str(int(smart)),
       "--out", out, "--case", case], env=env, capture_output=True, text=True,
      timeout=TIMEOUT_S)
  if proc.returncode != 0:
    side = "smart_custom_vjp" if smart else "jax.custom_vjp"
    pytest.fail(f"{script} with {side} failed (exit {proc.returncode}):\n"
                f"{proc.stderr[-6000:]}", pytrace=False)
  return _harness.load(out)


def differences(ref: dict, got: dict) -> list[str]:
  """Names, dtypes, shapes and bytes that differ, described."""
  problems = []
  if list(ref) != list(got):
    problems.append(f"recorded names differ: only with jax.custom_vjp "
                    f"{sorted(set(ref) - set(got))}, only with smartvjp "
                    f"{sorted(set(got) - set(ref))}")
  for name in ref:
    if name not in got:
      continue
    (rd, rs, rb), (gd, gs, gb) = ref[name], got[name]
    if (rd, rs) != (gd, gs):
      problems.append(f"{name}: jax.custom_vjp gives {rd}{list(rs)}, "
                      f"smartvjp {gd}{list(gs)}")
    elif rb != gb:
      r, g = _harness.decode(ref[name]), _harness.decode(got[name])
      problems.append(f"{name} ({rd}{list(rs)}) differs:\n"
                      f"  jax.custom_vjp: {_short(r)}\n  smartvjp:       "
                      f"{_short(g)}")
  return problems


def _short(a) -> str:
  import numpy as np
  with np.printoptions(precision=6, threshold=12, edgeitems=3):
    return " ".join(str(a).split())


@pytest.fixture
def compare_port(tmp_path):
  """``compare_port(script, case="")``: runs both sides and fails on any difference;
  returns the reference's arrays (name -> numpy array) for sanity checks."""

  def compare(script: str, case: str = "") -> dict:
    ref = run_side(script, False, tmp_path, case)
    got = run_side(script, True, tmp_path, case)
    problems = differences(ref, got)
    if problems:
      pytest.fail(f"{script}: smart_custom_vjp differs from jax.custom_vjp "
                  f"in {len(problems)} recorded arrays (the first 12):\n" +
                  "\n".join(problems[:12]), pytrace=False)
    return {n: _harness.decode(e) for n, e in ref.items()}

  return compare
