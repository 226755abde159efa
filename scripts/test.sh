#!/usr/bin/env bash
# Runs the whole test suite. Integration tests start their own redis-server processes on free
# loopback ports, so redis-server and redis-cli must be installed; this script installs Debian's
# redis-server package when they are missing and it can.
set -euo pipefail
cd "$(dirname "$0")/.."

if ! command -v redis-server >/dev/null 2>&1 || ! command -v redis-cli >/dev/null 2>&1; then
  if ! scripts/install.sh redis-server; then
    echo "test.sh: redis-server and redis-cli are needed: install Debian's redis-server package" >&2
    echo "         (sudo apt-get install redis-server) or your system's equivalent." >&2
    exit 1
  fi
fi

# The demo server's contract is tested by running its binary, which `cargo test` alone does not
# build (it builds the example as a test harness).
cargo build --all-features --examples
cargo test --all-features "$@"
