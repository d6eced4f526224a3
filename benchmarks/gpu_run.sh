#!/usr/bin/env bash
# On a bare GPU machine (the device tool's image: Python 3.12, jax with CUDA, torch, transformers): install the
# carried wheels (benchmarks/gpu_wheels.sh) into /tmp/site and run the GPU benchmark. Results go to $OUT when set
# (the device tool brings that folder back), else benchmarks/results. Extra arguments go to gpu_train_step.py.
set -euo pipefail
cd "$(dirname "$0")/.."
if [ -d .whl ]; then
  python3 -m pip install -q --no-index --no-deps --target /tmp/site .whl/*.whl
  export PYTHONPATH=/tmp/site${PYTHONPATH:+:$PYTHONPATH}
fi
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader || true
python3 -c "import jax, flax, torch, transformers; print('jax', jax.__version__, 'flax', flax.__version__, \
'torch', torch.__version__, 'transformers', transformers.__version__, jax.devices())"
python3 -c "import tokamax; print('tokamax', getattr(tokamax, '__version__', '?'))" || echo "tokamax: not importable"
python3 benchmarks/gpu_train_step.py --out "${OUT:-benchmarks/results}" "$@"
