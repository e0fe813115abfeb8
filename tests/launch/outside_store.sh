# Sourced by the launch tests: start_outside_store <bin dir> <log> starts
# bulkhead-store on a free port of 127.0.0.1, sets `store` to its pid and
# exports BULKHEAD_STORE_ADDR; the caller's fail() reports a store that does
# not start.
start_outside_store() {
  "$1/bulkhead-store" --host 127.0.0.1 --port 0 >"$2" 2>&1 &
  store=$!
  for _ in $(seq 100); do grep -q "^bulkhead-store listening on" "$2" && break; sleep 0.1; done
  BULKHEAD_STORE_ADDR=$(sed -n 's/^bulkhead-store listening on //p' "$2")
  [ -n "$BULKHEAD_STORE_ADDR" ] || fail "bulkhead-store did not start"
  export BULKHEAD_STORE_ADDR
}
