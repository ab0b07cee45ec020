"""The audit's HTML page as the docs show it: ``smartvjp.audit`` of
``benchmarks/tpu_lm.py``'s smoke-sized train step (its ``smartvjp+fused``
column: the two example kernels with fused rules, attention in jnp) with
``measure=True``, written as HTML and photographed by headless Chromium.

  python tools/audit_screenshot.py [--html audit.html] [--png docs/audit_report.png]

Needs matplotlib and Chromium (Debian: ``apt-get install chromium``).
"""

from __future__ import annotations

import argparse
import os
import shutil
import subprocess
import sys
import tempfile

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(ROOT, "benchmarks"))
sys.path.insert(0, ROOT)

import jax            # noqa: E402
import jax.numpy as jnp  # noqa: E402
import tpu_lm         # noqa: E402
import smartvjp       # noqa: E402


def main(argv=None) -> int:
  p = argparse.ArgumentParser()
  p.add_argument("--html", default=None)
  p.add_argument("--png", default=os.path.join(ROOT, "docs", "audit_report.png"))
  p.add_argument("--chromium", default=shutil.which("chromium"))
  p.add_argument("--width", type=int, default=1200)
  p.add_argument("--height", type=int, default=1500)
  opts = p.parse_args(argv)
  cfg = tpu_lm.SMOKE_CONFIG
  step = tpu_lm.make_train_step(
      cfg, "smartvjp+fused", tpu_lm.POLICIES["nothing_saveable"], True)
  tokens = jax.ShapeDtypeStruct((cfg.batch, cfg.seq + 1), jnp.int32)
  report = smartvjp.audit(step, tpu_lm.state_shapes(cfg), tokens, measure=True)
  print(report.table())
  html = opts.html or os.path.join(tempfile.mkdtemp(), "audit.html")
  report.to_html(html)
  if not opts.chromium:
    print("no chromium on PATH: the page is at", html)
    return 1
  subprocess.run([opts.chromium, "--headless", "--no-sandbox", "--disable-gpu",
                  "--hide-scrollbars", f"--window-size={opts.width},{opts.height}",
                  f"--screenshot={os.path.abspath(opts.png)}",
                  "file://" + os.path.abspath(html)],
                 check=True, timeout=120, capture_output=True)
  print("wrote", opts.png, "from", html)
  return 0


if __name__ == "__main__":
  sys.exit(main())
