#!/usr/bin/env bash
# One lent-GPU session's checks, in priority order, each bounded so that one failure leaves time for the rest;
# one log and the files made go to $OUT (8 files at most come back). The configs and tokenizers come in .gpu/
# (carried; no weights can be sent whole: a call carries 64 MiB), so most models are random-weight copies of
# configs, which time the same as the real ones. smollm2-135m's real GGUF (98 MB) comes in two carried halves,
# .gpuw1/part1 with the first call and .gpuw2/part2 with the second, sent back to back while the machine is warm
# (bench/gpu_carry.sh assembles all four carried folders from the local model cache).
# The package is installed into /tmp/site first (pip, offline, no dependencies: the image has torch and transformers),
# so that `specplan.` resolves as a wheel installs it.
#   device run: bash bench/gpu_session.sh profiles   (carry .gpu .whl .gpuw1: test_cuda, then held-out profiles)
#          or: bash bench/gpu_session.sh tests      (carry .whl .gpuw1: test_cuda alone)
#   device run: bash bench/gpu_session.sh triforce   (carry .gpuw2; the same machine, within its 30 s warm time)
#          or: bash bench/gpu_session.sh diagnose   (carry .gpu .whl: grouped matmuls against SDPA for many heads;
#                                                   where a one- and a two-row forward's time goes, fp32 and bf16)
#          or: bash bench/gpu_session.sh offload    (no carry: the offloaded decoding tests of test_cuda, then the
#                                                   host link's rate and a 13B-shaped model streamed, measured
#                                                   against its modeled t(n); issue 52)
#          or: bash bench/gpu_session.sh batched    (carry .gpu .whl: t(B, n) of llama-3.2-1b bf16 and smollm2-135m fp32)
#          or: bash bench/gpu_session.sh next       (carry .whl .gpuw1: the open issues' GPU items in order, within
#                                                   540 s: a Sequoia plan's step on a 13B shape streamed, with
#                                                   the link and t(n) (issue 52), then test_cuda)
set -u
export PYTHONPATH=/tmp/site PYTHONSAFEPATH=1 PYTHONUNBUFFERED=1 TOKENIZERS_PARALLELISM=false SPECPLAN_CACHE=/tmp/specplan-cache
OUT=${OUT:-/tmp/gpu-out}
LOG="$OUT/session-$1.log"
mkdir -p "$OUT" /tmp/models /tmp/halves "$SPECPLAN_CACHE/gguf"
python3 -m pip install -q --no-index --no-deps --no-build-isolation --no-compile --target /tmp/site . 2>&1 | tail -1
plan="python3 -m specplan.cli"
{
  nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader
  python3 -c "import torch, transformers; print('torch', torch.__version__, 'transformers', transformers.__version__)"
  lscpu | grep 'Model name'
} 2>&1 | tee "$LOG"

# at most $1 seconds, and no more than what is left of the session's NEXT_BUDGET
bounded() {
  local limit=$1; shift
  local left=$(( ${NEXT_BUDGET:-100000} - SECONDS ))
  (( left < limit )) && limit=$left
  (( limit > 10 )) && timeout "$limit" "$@"
}

case "$1" in
next)
  NEXT_BUDGET=540
  cp .gpuw1/part1 /tmp/halves/ 2>/dev/null
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --target /tmp/site .whl/*.whl 2>&1 | tail -1
  pytest="python3 -m pytest -q -p no:cacheprovider -o addopts= tests/test_cuda.py"
  # issue 52: a Sequoia plan's step on the 13B shape streamed (the plan solved on the modeled H200 profile of every
  # layer streamed, its 7B-shaped draft on the device), beside t(1) and t(1024) and the link's rate
  bounded 240 python3 bench/gpu_offload.py --sizes 1,1024 \
    --sequoia plans/llama-2-13b.sequoia.h200-all.fp16.modeled.yaml 2>&1 | tail -10 | tee -a "$LOG"
  # the GPU path's tests
  bounded 300 $pytest 2>&1 | tail -15 | tee -a "$LOG"
  ;;
batched)
  # t(B, n) of two more shapes and dtypes on the batched CUDA graphs: held-out data for the cost model's batched step
  # (bench/modeled_vs_measured.py prints each against it)
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --target /tmp/site .whl/*.whl 2>&1 | tail -1
  gpu=$(nvidia-smi --query-gpu=name --format=csv,noheader | head -1)
  cp .gpu/smollm2-135m/tokenizer*.json .gpu/llama-3.2-1b/
  for spec in "llama-3.2-1b bf16" "smollm2-135m fp32"; do
    read -r m dtype <<< "$spec"
    timeout 40 python3 bench/random_weights.py .gpu/$m /tmp/models/$m --dtype $dtype 2>&1 | tail -1 | tee -a "$LOG"
    timeout 90 $plan profile --target /tmp/models/$m --gpu "$gpu" --dtype $dtype --contexts 512,4096 \
      --sizes 1,2,4,8,16 --batches 1,2,4,8,16,32,64 --budgets "" --repeats 3 -o "$OUT/$m.batched.$dtype.yaml" 2>&1 \
      | tail -3 | tee -a "$LOG"
  done
  ;;
offload)
  timeout 120 python3 -m pytest -q tests/test_cuda.py -k offloaded -p no:cacheprovider -o addopts= 2>&1 | tail -5 \
    | tee -a "$LOG"
  timeout 240 python3 bench/gpu_offload.py --resident 0 2>&1 | tail -8 | tee -a "$LOG"
  timeout 120 python3 bench/gpu_offload.py --resident 20 --sizes 1,512 2>&1 | tail -4 | tee -a "$LOG"
  ;;
profiles|tests)
  cp .gpuw1/part1 /tmp/halves/
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --target /tmp/site .whl/*.whl 2>&1 | tail -1
  # The GPU path's own tests first.
  timeout 300 python3 -m pytest -q tests/test_cuda.py -p no:cacheprovider -o addopts= 2>&1 | tail -15 | tee -a "$LOG"
  [ "$1" = tests ] && exit 0
  # Measured t(n) of random-weight copies of configs (held-out data for the modeled profiles).
  cp .gpu/qwen2.5-coder-1.5b/tokenizer.json .gpu/qwen2.5-coder-0.5b/
  cp .gpu/qwen2.5-coder-1.5b/tokenizer*.json .gpu/qwen3-0.6b/
  cp .gpu/smollm2-135m/tokenizer*.json .gpu/llama-3.2-1b/
  for m in qwen2.5-coder-0.5b llama-3.2-1b qwen3-0.6b; do
    timeout 40 python3 bench/random_weights.py .gpu/$m /tmp/models/$m 2>&1 | tail -1 | tee -a "$LOG"
    for dtype in fp32 bf16; do
      timeout 60 $plan profile --target /tmp/models/$m --gpu h100 --dtype $dtype --contexts 256,1024,4096 \
        --sizes 1,2,4,8,16,32,64,128 --repeats 7 -o "$OUT/$m.h100.$dtype.yaml" 2>&1 | tail -14 | tee -a "$LOG"
    done
  done
  ;;
diagnose)
  # Where grouped matmuls stop paying against masked SDPA in bf16 from 4,096 keys (decoder/model.py:
  # cuda_grouped_attention): 32 heads of 64 (Llama 3.2 1B) and 16 of 128 (Qwen3 0.6B), 8 to 64 rows.
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --target /tmp/site .whl/*.whl 2>&1 | tail -1
  cp .gpu/qwen2.5-coder-1.5b/tokenizer*.json .gpu/qwen3-0.6b/
  cp .gpu/smollm2-135m/tokenizer*.json .gpu/llama-3.2-1b/
  for m in llama-3.2-1b qwen3-0.6b; do
    timeout 40 python3 bench/random_weights.py .gpu/$m /tmp/models/$m 2>&1 | tail -1 | tee -a "$LOG"
    timeout 120 python3 bench/gpu_attention.py --model /tmp/models/$m --dtype bf16 --contexts 4096,8192 \
      --sizes 8,16,24,32,48,64 --repeats 20 2>&1 | tail -14 | tee -a "$LOG"
  done
  timeout 90 python3 bench/gpu_attention.py --model /tmp/models/llama-3.2-1b --dtype fp32 --contexts 4096 \
    --sizes 8,16,32,64 --repeats 20 2>&1 | tail -6 | tee -a "$LOG"
  # The cost model's fp32/bf16 split of t(1) (docs/benchmark-log.md): each weight's GEMV, its bandwidth, per dtype.
  for m in llama-3.2-1b qwen2.5-coder-1.5b smollm2-135m; do
    timeout 90 python3 bench/gpu_kernels.py --config .gpu/$m --dtypes fp32,bf16 --context 256 --sizes 1,2 2>&1 \
      | grep -v USDT | tee -a "$LOG"
  done
  ;;
triforce)
  # A TriForce plan solved on a measured H100 profile and run there with real weights.
  gguf="$SPECPLAN_CACHE/gguf/SmolLM2-135M-Instruct.Q4_1.gguf"
  cat /tmp/halves/part1 .gpuw2/part2 > "$gguf" && sha256sum "$gguf" | tee -a "$LOG"
  profile="$OUT/smollm2-135m.h100.fp32-7680.yaml"
  plan_file="$OUT/smollm2-135m.triforce-7680.h100.fp32.yaml"
  timeout 200 $plan profile --target smollm2-135m --gpu h100 --dtype fp32 --contexts 256,1024,4096,7680,7936 \
    --sizes 1,2,3,4,5,6,8,12,16,24,32 --budgets 256,512,1024,2048 --repeats 7 -o "$profile" | tail -25 | tee -a "$LOG"
  timeout 60 $plan solve triforce --acceptance acceptance/smollm2-135m.triforce.haystack.cpu-2c-avx2.fp32.decoded-7680.yaml \
    --profile "$profile" --context 7680 -o "$plan_file" | head -20 | tee -a "$LOG"
  timeout 240 $plan bench --plan "$plan_file" --dataset haystack --context 7680 --prompts 4 --max-new-tokens 256 \
    --baselines ours-ar,two-level,streaming --reprice -o "$OUT/smollm2-135m.triforce-7680.h100.fp32.json" | tail -30 | tee -a "$LOG"
  # The committed H100 Lookahead plan against our one-token decoding alone: what the decoder's changes since did.
  timeout 150 $plan bench --plan plans/smollm2-135m.lookahead.h100.fp32.yaml --dataset specbench:summarization,rag,coding \
    --prompts 12 --max-new-tokens 256 --baselines ours-ar -o "$OUT/lookahead.h100.fp32.json" | tail -12 | tee -a "$LOG"
  ;;
esac
