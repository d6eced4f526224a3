#!/usr/bin/env bash
# Download, on a machine that reaches PyPI, the wheels the GPU image lacks (Python 3.12, jax 0.11 there; no grain,
# no tokamax) into .whl/ at the repository root, kept out of git. Then on the GPU machine, with .whl carried along:
#     bash benchmarks/gpu_run.sh
set -euo pipefail
cd "$(dirname "$0")/.."
grep -qxF "/.whl/" .git/info/exclude 2>/dev/null || echo "/.whl/" >> .git/info/exclude
rm -rf .whl && mkdir .whl
# The project venv's pip when there is one (README: python3 -m venv .venv), else the system's.
if [ -x .venv/bin/python ]; then PIP=${PIP:-.venv/bin/python -m pip}; else PIP=${PIP:-python3 -m pip}; fi
# grain and what it needs beyond the image; tokamax (kernels) and what it needs beyond the image (since 0.0.13 it
# imports xprof's kernel-stats tool at import time, which needs fire: without them `import tokamax` fails and every
# kernel falls back).
for pkg in grain==0.2.18 array_record==0.8.6 portpicker \
           tokamax einshape jaxtyping wadler_lindig pydantic pydantic_core annotated_types typing_inspection qwix \
           immutabledict tensorboardx absl-py tqdm xprof fire termcolor six; do
  $PIP download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
    --platform manylinux_2_28_x86_64 --platform manylinux_2_27_x86_64 --platform manylinux_2_24_x86_64 \
    --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 --platform any -d .whl "$pkg"
done
du -sh .whl
