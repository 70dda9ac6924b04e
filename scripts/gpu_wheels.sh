#!/usr/bin/env bash
# Run here (not on the GPU machine) before a device check: the GPU machine has CUDA torch,
# triton, transformers, safetensors, tokenizers and jinja2 but no msgspec or pytest, and reaches
# no registry. This fetches their wheels for its Python 3.12 into .whl/ (ignored by git);
# scripts/gpu_check.sh installs whatever is there first. Pass `.whl` in the device run's carry.
#   bash scripts/gpu_wheels.sh
set -euo pipefail
cd "$(dirname "$0")/.."
grep -qx '/.whl/' .git/info/exclude 2>/dev/null || echo /.whl/ >> .git/info/exclude
python3 -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
    --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 \
    --platform any -d .whl \
    msgspec==0.23.0 pytest==9.0.3 pluggy==1.6.0 iniconfig==2.3.0 packaging==26.4 pygments==2.20.0
ls .whl
