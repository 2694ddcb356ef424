#!/usr/bin/env bash
# Start the OpenAI-compatible server as a long-running Ray job; its shards are actors of this cluster.
#   RAY_DASHBOARD=http://head:8265 TP=2 ./deploy/ray/submit_server.sh [more `raypaged serve` flags]
# RAY_DASHBOARD: the head's dashboard URL (default http://127.0.0.1:8265). TP (default 2), PLACEMENT
# (default STRICT_PACK), HOST (default 0.0.0.0: reachable from outside the node), PORT (default 8000),
# MODEL (a model folder on every node). `raypaged` must be installed on the nodes.
# Stop it with: ray job stop --address "$RAY_DASHBOARD" <submission id>. DRY_RUN=1 prints the command.
set -euo pipefail
cmd=(ray job submit --address "${RAY_DASHBOARD:-http://127.0.0.1:8265}" --no-wait --
    raypaged serve --ray-address auto --tensor-parallel-size "${TP:-2}"
    --placement-strategy "${PLACEMENT:-STRICT_PACK}" --host "${HOST:-0.0.0.0}" --port "${PORT:-8000}"
    ${MODEL:+--model "$MODEL"} "$@")
if [[ -n "${DRY_RUN:-}" ]]; then
    printf '%q ' "${cmd[@]}"
    echo
else
    exec "${cmd[@]}"
fi
