#!/usr/bin/env bash
# Submit the offline batch job to a Ray cluster (needs the dashboard: pip install "ray[default]" on the head).
#   RAY_DASHBOARD=http://head:8265 ./deploy/ray/submit_batch.sh prompts.jsonl /shared/outputs.jsonl
# The output path is written by the job's driver on the node that runs it: use shared storage.
set -euo pipefail
INPUT=${1:?prompts JSONL}
OUTPUT=${2:?outputs JSONL}
ray job submit --address "${RAY_DASHBOARD:-http://127.0.0.1:8265}" --working-dir . -- \
    python deploy/ray/batch_generate.py --input "$INPUT" --output "$OUTPUT" \
    --ray-address auto --tensor-parallel-size "${TP:-2}" ${MODEL:+--model "$MODEL"}
