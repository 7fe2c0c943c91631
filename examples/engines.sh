# Shared by the recipes: start vllm serve engines with p2p_kv and stop them.
# Sourced, not run. Needs MODEL (the model) and LOGS (a directory).

# The connector config: $1 engine id, $2 its p2p_kv port, $3 the connector
# (OffloadingConnector, or P2PKVConnector whose prefill responses say where
# the KV waits).
kv_config() {
  local module=""
  [ "$3" = P2PKVConnector ] && module='"kv_connector_module_path": "p2p_kv.adapter.connector",'
  cat <<EOF_JSON
{"kv_connector": "$3", $module "kv_role": "kv_both", "engine_id": "$1",
 "kv_connector_extra_config": {
   "spec_name": "HostCopyTieringSpec", "spec_module_path": "p2p_kv.adapter.cpu_spec",
   "cpu_bytes_to_use": 67108864, "block_size": 32,
   "secondary_tiers": [{"type": "P2PKVTier", "module_path": "p2p_kv.adapter.tier",
                        "host": "127.0.0.1", "port": $2}]}}
EOF_JSON
}

# Start one engine in the background: $1 name, $2 HTTP port, $3 p2p_kv
# port, $4 connector. --block-size 32: the CPU backend's block is 128
# tokens unless told, and the tier's block_size must match it.
# --kv-cache-memory-bytes: the CPU backend's default asks for more memory
# than a small host has. Prints the engine's pid.
serve() {
  vllm serve "$MODEL" --host 127.0.0.1 --port "$2" \
    --block-size 32 --kv-cache-memory-bytes 67108864 --max-model-len 1024 \
    --enforce-eager --kv-transfer-config "$(kv_config "engine-$1" "$3" "$4")" \
    >"$LOGS/$1.log" 2>&1 &
  echo $!
}

# Wait for an engine's /health: $1 name, $2 HTTP port, $3 pid.
wait_ready() {
  for _ in $(seq 300); do
    curl -sf "http://127.0.0.1:$2/health" >/dev/null && return
    kill -0 "$3" 2>/dev/null || { echo "engine $1 exited" >&2; exit 1; }
    sleep 1
  done
  echo "engine $1 did not start in 300 s" >&2
  exit 1
}

# On any exit: stop every pid in PIDS cleanly, and return only once each
# has exited (its ports free, its files closed); on failure show the logs.
# The engines are not this shell's children (each started inside $(...)),
# so `wait` would return at once: poll each, up to 60 s, then kill it.
stop() {
  local status=$? pid
  kill -TERM $PIDS 2>/dev/null || true
  for pid in $PIDS; do
    for _ in $(seq 600); do
      kill -0 "$pid" 2>/dev/null || break
      sleep 0.1
    done
    kill -KILL "$pid" 2>/dev/null || true
  done
  [ "$status" = 0 ] || tail -n 30 "$LOGS"/*.log
  rm -rf "$LOGS"
}

# A completion's text as JSON: $1 HTTP port, $2 extra JSON fields. An
# error answer is shown and fails the script.
complete() {
  curl -s "http://127.0.0.1:$1/v1/completions" -H 'Content-Type: application/json' \
    -d "{\"model\": \"$MODEL\", \"prompt\": \"$PROMPT\", \"max_tokens\": 8,
         \"temperature\": 0 $2}" | python -c '
import json, sys
raw = sys.stdin.read()
try:
    print(json.dumps(json.loads(raw)["choices"][0]["text"]))
except (ValueError, KeyError, IndexError):
    sys.exit(f"no completion: {raw[:500]!r}")'
}

# Print $1's p2p_kv series for peer $2 once they show loads (stats reach
# the API server every few seconds); fail if none comes.
p2p_metrics() {
  local hits=""
  for _ in $(seq 30); do
    hits=$(curl -sf "http://127.0.0.1:$1/metrics" \
      | grep -E "^vllm:kv_offload_p2p_(lookup_hit_blocks|loaded_bytes)[a-z_]*\{.*peer=\"$2\"" || true)
    [ -n "$hits" ] && break
    sleep 1
  done
  echo "${hits:-none: nothing loaded from $2}"
  [ -n "$hits" ]
}

# About 400 tokens: a dozen 32-token blocks to share.
PROMPT=$(python -c 'print(" ".join(f"word{i % 97}" for i in range(150)))')
