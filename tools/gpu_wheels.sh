#!/usr/bin/env bash
# Downloads the wheels that tools/gpu_session.py installs on the GPU machine,
# which has Python 3.12, jax 0.11.2 and triton 3.6.0 but no jax-triton and no
# package registry. jax-triton 0.3.1 is the newest release that accepts
# triton 3.6 (0.4.x asks for triton>=3.7, a wheel too large to carry: the
# device tool carries 64 MiB). Its own needs (absl-py) are installed there.
# Run here, in the repository's root; then carry ".whl" in the device call.
set -euo pipefail
cd "$(dirname "$0")/.."
grep -qx '/.whl/' .git/info/exclude 2>/dev/null || echo '/.whl/' >> .git/info/exclude
mkdir -p .whl
python3 -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 \
  --implementation cp --platform manylinux_2_28_x86_64 \
  --platform manylinux2014_x86_64 --platform any -d .whl "jax-triton==0.3.1"
ls -la .whl
