#!/usr/bin/env bash
# One lent-GPU session's checks, in priority order, each bounded so that one failure leaves time for the rest;
# logs and profiles go to $OUT. The configs and tokenizers come in .gpu/ (carried: no weights can be sent, so
# the models are random-weight copies of the presets' configs, which time the same as the real ones).
#   device run: bash bench/gpu_session.sh   (carry .gpu)
set -u
export PYTHONPATH=. PYTHONUNBUFFERED=1 TOKENIZERS_PARALLELISM=false
OUT=${OUT:-/tmp/gpu-out}
mkdir -p "$OUT" /tmp/models
{
  nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader
  python3 -c "import torch, transformers; print('torch', torch.__version__, 'transformers', transformers.__version__)"
  lscpu | grep 'Model name'
} 2>&1 | tee "$OUT/machine.txt"

# Issue 33 item 5: the compiled forward inside the CUDA graphs against today's graphs and transformers.
timeout 170 python3 bench/gpu_forward.py --config .gpu/smollm2-135m --dtypes fp32 --contexts 256,4096 \
  --sizes 1,16 2>&1 | grep -v Warning | tee "$OUT/gpu_forward.txt"
timeout 80 python3 bench/gpu_forward.py --config .gpu/smollm2-135m --dtypes bf16 --contexts 256 \
  --sizes 1 2>&1 | grep -v Warning | tee -a "$OUT/gpu_forward.txt"

# Issue 35 item 5: the qwen pair's measured H100 profiles (held-out data for the modeled profiles).
cp .gpu/qwen2.5-coder-1.5b/tokenizer.json .gpu/qwen2.5-coder-0.5b/
for m in qwen2.5-coder-0.5b qwen2.5-coder-1.5b; do
  timeout 40 python3 bench/random_weights.py .gpu/$m /tmp/models/$m 2>&1 | tail -1
done
for dtype in fp32 bf16; do
  timeout 95 python3 -m specplan.cli profile --model /tmp/models/qwen2.5-coder-1.5b \
    --draft /tmp/models/qwen2.5-coder-0.5b --gpu h100 --dtype $dtype --contexts 256,1024,4096 \
    --sizes 1,2,4,8,16,32,64,128 --repeats 7 --budgets 256,1024 \
    -o "$OUT/qwen2.5-coder-1.5b.h100.$dtype.yaml" 2>&1 | tail -30 | tee -a "$OUT/profiles.txt"
done

# The GPU path's own tests.
timeout 120 python3 -m pytest -q tests/test_cuda.py -p no:cacheprovider 2>&1 | tail -15 | tee "$OUT/test_cuda.txt"
