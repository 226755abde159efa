#!/usr/bin/env bash
# Runs every cargo-fuzz target for SECONDS each (default 60) with the nightly toolchain, and
# prints executions and crashes per target. Needs `cargo install cargo-fuzz` and a nightly
# toolchain (`rustup toolchain install nightly`). CI runs the proptest equivalents in
# tests/hostile_input.rs instead.
set -euo pipefail
cd "$(dirname "$0")/../fuzz"
seconds="${1:-60}"
status=0
for target in forwarded key_extraction headers quota redis_key; do
  log="$(mktemp)"
  found() { find "artifacts/$target" -type f 2>/dev/null | wc -l; }
  before=$(found)
  if cargo +nightly fuzz run "$target" -- -max_total_time="$seconds" >"$log" 2>&1; then
    result="no crash"
  elif [ "$(found)" -gt "$before" ]; then
    result="CRASH (see fuzz/artifacts/$target)"
    status=1
  else
    # Not a crash: cargo-fuzz or nightly missing, or a build error. Its words say which.
    result="FAILED TO RUN:"$'\n'"$(tail -20 "$log")"
    status=1
  fi
  runs="$(grep -o 'Done [0-9]* runs' "$log" | tail -1 || true)"
  echo "$target: ${runs:-?} in ${seconds}s: $result"
  rm -f "$log"
done
exit "$status"
