#!/usr/bin/env bash
# bench/scale.py on one CUDA GPU, in under ~8 minutes: real shapes at full depth, hf_rlhf against TRL, and
# decoding against the memory-bandwidth roofline with each engine (`static`: static KV cache, decoding forward
# compiled with mode "reduce-overhead", i.e. CUDA graphs). Writes JSON (and the sweep's PNG) under $OUT when set,
# else bench/results/gpu/. Skips cleanly (exit 0) without CUDA. Each stage has its own time limit; a stage cut
# short keeps the runs it finished in <output>.runs.jsonl.
#
#     bash bench/gpu_scale.sh            # on the GPU machine, from the repository root
set -u
cd "$(dirname "$0")/.."
if ! python -c "import torch, sys; sys.exit(0 if torch.cuda.is_available() else 1)" 2>/dev/null; then
  echo "gpu_scale: no CUDA device, skipped"; exit 0
fi
DEST="${OUT:-bench/results/gpu}"
mkdir -p "$DEST"
export HF_RLHF_BENCH_CACHE="${HF_RLHF_BENCH_CACHE:-/tmp/hf_rlhf_bench}"
export TOKENIZERS_PARALLELISM=false
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv > "$DEST/gpu.txt" 2>&1
python -m hf_rlhf.cli env > "$DEST/env.txt" 2>&1
SHAPE=qwen2.5-0.5b
LAYERS=24   # full depth: a 0.5B model is small for one GPU
start=$(date +%s)
stage() {  # stage NAME LIMIT_S ARGS...: one bench/scale.py invocation, its log next to its JSON
  local name=$1 limit=$2; shift 2
  echo "== $name (limit ${limit}s, $(( $(date +%s) - start ))s elapsed)"
  timeout "$limit" python bench/scale.py --device cuda --threads 4 --shapes "$SHAPE" --layers "$LAYERS" \
    --output "$DEST/$name.json" "$@" > "$DEST/$name.log" 2>&1
  echo "   exit $? ($(( $(date +%s) - start ))s elapsed)"; tail -n 25 "$DEST/$name.log" | grep '^|' || true
}
# 1. decoding vs the roofline, batch 1 and 8: generate, lean, static (CUDA graphs; its compile is reported apart)
stage roofline 110 --workloads roofline --decode_tokens 128 --roofline_prompt 128
# 2. SFT at 4k (padded, packed), DPO 512 + 512, GRPO G = 8 x 1,024 (TRL, hf_rlhf generate, hf_rlhf static)
stage train 230 --workloads sft_padded,sft_packed,dpo_padded,dpo_padding_free,grpo,grpo_static --sft_len 4096 \
  --grpo_prompt 128 --grpo_completion 1024
# 3. the GRPO pair over completion lengths 256 and 1,024 (plot: $DEST/sweep.png); what the limit leaves out is
#    in sweep.json.runs.jsonl
stage sweep 110 --sweep grpo --lengths 256,1024 --grpo_prompt 128 --plot "$DEST/sweep.png"
echo "gpu_scale: done in $(( $(date +%s) - start ))s; results in $DEST"
ls -la "$DEST"
