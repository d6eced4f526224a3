#!/usr/bin/env bash
# On a bare GPU machine (the device tool's image: Python 3.12, jax with CUDA, torch, transformers): install the
# carried wheels (benchmarks/gpu_wheels.sh) into /tmp/site and run the GPU benchmark. Results go to $OUT when set
# (the device tool brings that folder back), else benchmarks/results. Extra arguments go to gpu_train_step.py
# (its cases: llama, moe, attention, gmm, and the family cases from its FAMILIES table: qwen3moe, gpt_oss,
# gemma3, qwen3_5, v4 = a DeepSeek-V4 training step; e.g. `--cases gpt_oss gemma3`).
# The case `dsa` (`--cases dsa`, alone or with others) runs benchmarks/dsa_layer.py --platform gpu instead: one
# DeepSeek-V3.2 DSA layer against the dense MLA layer (cuDNN), bf16, contexts 4k-64k; DSA_ARGS adds arguments to
# it (e.g. DSA_ARGS="--contexts 4096 8192 --rounds 3"); with --smoke it runs its --quick shapes.
set -euo pipefail
cd "$(dirname "$0")/.."
if [ -d .whl ]; then
  python3 -m pip install -q --no-index --no-deps --target /tmp/site .whl/*.whl
  export PYTHONPATH=/tmp/site${PYTHONPATH:+:$PYTHONPATH}
fi
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader || true
python3 -c "import jax, flax, torch, transformers; print('jax', jax.__version__, 'flax', flax.__version__, \
'torch', torch.__version__, 'transformers', transformers.__version__, jax.devices())"
if ! python3 -c "import tokamax; print('tokamax', getattr(tokamax, '__version__', '?'))"; then
  # A carried tokamax that does not import would make every kernel fall back: stop before spending device time.
  if compgen -G ".whl/tokamax-*.whl" > /dev/null && [ "${ALLOW_NO_TOKAMAX:-0}" != 1 ]; then
    echo "gpu_run.sh: tokamax was carried in .whl but does not import (the error is above), so every kernel would" \
         "fall back: add what it lacks to benchmarks/gpu_wheels.sh, or set ALLOW_NO_TOKAMAX=1 to run anyway" >&2
    exit 3
  fi
  echo "tokamax: not importable"
fi

# Take `dsa` out of `--cases ...`; the rest goes to gpu_train_step.py (which runs every case when --cases is absent).
args=() dsa=0 in_cases=0 other_cases=0 had_cases=0 smoke=""
for a in "$@"; do
  if [ "$a" = "--smoke" ]; then smoke="--quick"; fi  # the DSA benchmark's smoke run
  if [ "$a" = "--cases" ]; then in_cases=1 had_cases=1; args+=("$a"); continue; fi
  case "$a" in --*) in_cases=0 ;; esac
  if [ "$in_cases" = 1 ] && [ "$a" = "dsa" ]; then dsa=1; continue; fi
  if [ "$in_cases" = 1 ]; then other_cases=1; fi
  args+=("$a")
done
if [ "$dsa" = 1 ]; then
  # shellcheck disable=SC2086  # DSA_ARGS is a list of words
  python3 benchmarks/dsa_layer.py --platform gpu --out-dir "${OUT:-benchmarks/results}" $smoke ${DSA_ARGS:-}
fi
if [ "$had_cases" = 0 ] || [ "$other_cases" = 1 ]; then
  python3 benchmarks/gpu_train_step.py --out "${OUT:-benchmarks/results}" "${args[@]}"
fi
