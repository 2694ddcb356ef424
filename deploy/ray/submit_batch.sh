#!/usr/bin/env bash
# Submit the offline batch job (batch_generate.py) to a Ray cluster with `ray job submit`.
#   RAY_DASHBOARD=http://head:8265 TP=2 ./deploy/ray/submit_batch.sh /shared/prompts.jsonl /shared/outputs.jsonl \
#       [more batch_generate.py flags, e.g. --max-tokens 128 --device cpu]
# RAY_DASHBOARD: the head's dashboard (job server) URL, default http://127.0.0.1:8265; it needs
# "ray[default]" on the head. TP: tensor-parallel size (default 2). MODEL: model folder on every node.
# The repository is uploaded as the job's working directory. Input and output paths are opened by the
# job's driver on the node that runs it: give absolute paths on shared storage.
# Waits for the job and exits non-zero if it fails. DRY_RUN=1 prints the command instead of running it.
set -euo pipefail
INPUT=${1:?prompts JSONL}
OUTPUT=${2:?outputs JSONL}
shift 2
ROOT=$(cd "$(dirname "${BASH_SOURCE[0]}")/../.." && pwd)
cmd=(ray job submit --address "${RAY_DASHBOARD:-http://127.0.0.1:8265}" --working-dir "$ROOT" --
    python deploy/ray/batch_generate.py --input "$INPUT" --output "$OUTPUT"
    --ray-address auto --tensor-parallel-size "${TP:-2}" ${MODEL:+--model "$MODEL"} "$@")
if [[ -n "${DRY_RUN:-}" ]]; then
    printf '%q ' "${cmd[@]}"
    echo
else
    exec "${cmd[@]}"
fi
