#!/usr/bin/env bash
# Peak GPU memory and seconds per step of train_min.py's default settings, capped at 24 GB.
# Run on a CUDA machine with hub access (or models in the HF cache):  bash experiments/benchmarks/gpu_budget.sh
# Each run: 3 steps of the default configuration (16 questions x 4 rollouts, micro-batch 4),
# no validation; the per-step line prints s/step and peak memory; metrics.jsonl keeps them.
set -euo pipefail
cd "$(dirname "$0")/../.."
for model in Qwen/Qwen2.5-1.5B-Instruct Qwen/Qwen3-4B; do
  for variant in mpo mpo_token_is mpo_beta0; do
    out=runs/gpu-budget/$(basename "$model")-$variant
    python train_min.py --model "$model" --variant "$variant" --steps 3 --eval_every 1000 \
      --save_every 1000 --memory_cap_gb 24 --out_dir "$out"
    python - "$out" <<'PY'
import json, sys
rows = [json.loads(l) for l in open(sys.argv[1] + "/metrics.jsonl")]
print(sys.argv[1], "peak GB", max(r["mem/peak_gb"] for r in rows),
      "s/step (steps 2-3)", sum(r["time/step_s"] for r in rows[1:]) / max(len(rows) - 1, 1))
PY
  done
done
