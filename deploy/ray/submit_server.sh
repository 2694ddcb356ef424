#!/usr/bin/env bash
# Start the OpenAI-compatible server as a long-running Ray job; its shards are actors of this cluster.
#   RAY_DASHBOARD=http://head:8265 TP=2 ./deploy/ray/submit_server.sh
# Stop it with: ray job stop --address "$RAY_DASHBOARD" <submission id>
set -euo pipefail
ray job submit --address "${RAY_DASHBOARD:-http://127.0.0.1:8265}" --no-wait -- \
    raypaged serve --ray-address auto --tensor-parallel-size "${TP:-2}" \
    --placement-strategy "${PLACEMENT:-STRICT_PACK}" --port "${PORT:-8000}" ${MODEL:+--model "$MODEL"}
