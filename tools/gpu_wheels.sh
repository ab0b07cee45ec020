#!/usr/bin/env bash
# Downloads the wheels that tools/gpu_session.py installs on the GPU machine,
# which has Python 3.12, jax 0.11.2 and triton 3.6.0 but no jax-triton and no
# package registry. Run here, in the repository's root; then carry ".whl" in
# the device call (tools/gpu_session.py installs it --no-deps --target
# /tmp/site, leaving the machine's jax and CUDA plugin alone).
#
# jax-triton is pinned to 0.3.1: it works with jax 0.11.2 and triton 3.6.0
# (the Triton example exports for CUDA with the expected kernel counts, and
# the plugin's TritonKernel signature matches). 0.4.x does not: on triton
# 3.6 its NVIDIA backend imports TMA_TF32, which triton 3.6 lacks; the import
# fails, the backend becomes a stub, and every lowering raises "TypeError:
# object.__new__() takes exactly one argument". Its one need there, absl-py,
# comes with the machine's optax and flax.
set -euo pipefail
cd "$(dirname "$0")/.."
exclude="$(git rev-parse --git-path info/exclude)"
mkdir -p "$(dirname "$exclude")"
grep -qx '/.whl/' "$exclude" 2>/dev/null || echo '/.whl/' >> "$exclude"
mkdir -p .whl
python3 -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 \
  --implementation cp --platform manylinux_2_28_x86_64 \
  --platform manylinux2014_x86_64 --platform any -d .whl "jax-triton==0.3.1"
ls -la .whl
