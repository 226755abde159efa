#!/usr/bin/env bash
# End-to-end figures, each printed as a ratio against a baseline measured in the same run.
#   P4 layer:     the demo server (memory store; its default algorithm and GCRA) vs a bare axum
#                 hello-world and vs the same behind tower_governor keyed by peer IP, all with
#                 tokio's default runtime (a worker per core), loaded with wrk -t1 -c64 (server on
#                 core 0, wrk on core 1), on allowed and on denied traffic;
#   P1 Redis:     Limiter decisions per second from one process vs redis-benchmark -P 16 running
#                 EVALSHA of the same script, with the same keys (state and listing), on the same
#                 Redis (Redis's own ceiling; one hot key, where the limiter spreads over 1,000);
#   P2 hot key:   one key leased vs direct Redis.
# Each measurement runs ROUNDS times, interleaved with its baseline (these machines are shared and
# noisy; interleaving keeps drift out of the ratios), and the median is reported with min–max.
# Starts and stops its own servers (loopback only; killed by PID on exit). About 5 minutes.
# Two more rows give a scale: the bare server with a handler busy 1 and 2 µs per request.
# Usage: scripts/bench.sh [SECONDS_PER_RUN (default 4)] [ROUNDS (default 3)]
#        scripts/bench.sh fleet [PROCESSES (default 4)] [SECONDS (default 5)]   (see fleet below)
#        scripts/bench.sh instructions [REQUESTS (default 10000)]             (see instructions below)
set -euo pipefail
cd "$(dirname "$0")/.."
MODE=layer
if [ "${1:-}" = fleet ] || [ "${1:-}" = instructions ]; then MODE=$1; shift; fi
SECS=${1:-4}
ROUNDS=${2:-3}

need() { command -v "$1" >/dev/null 2>&1; }
# Each mode's tools (Debian packages in brackets), installed when missing and possible.
case "$MODE" in
  instructions) tools=(valgrind callgrind_control wrk); packages=(valgrind valgrind wrk) ;;
  fleet) tools=(redis-server redis-cli python3); packages=(redis-server python3) ;;
  *) tools=(wrk redis-server redis-cli redis-benchmark python3); packages=(wrk redis-server redis-tools python3) ;;
esac
missing=0
for tool in "${tools[@]}"; do need "$tool" || missing=1; done
if [ "$missing" = 1 ] && ! scripts/install.sh "${packages[@]}"; then
  echo "bench.sh $MODE needs ${tools[*]} (Debian: ${packages[*]})" >&2
  exit 1
fi

# `scripts/bench.sh fleet [PROCESSES (default 4)] [SECONDS (default 5)]`: N processes of
# examples/fleet_load, each with its own limiter on one redis-server, hammer 4 hot keys (a fixed
# window of LIMIT per second each, leased with the defaults); the aggregate decisions per second,
# the Redis calls per second, and per key and whole window the fleet's admitted total against
# the limit (worst window, lowest utilisation).
fleet() {
  local procs=${1:-4} secs=${2:-5} limit=${FLEET_LIMIT:-500000} keys=4
  cargo build --release --quiet --example fleet_load
  local rport; rport=$(python3 -c 'import socket; s=socket.socket(); s.bind(("127.0.0.1",0)); print(s.getsockname()[1])')
  redis-server --port "$rport" --bind 127.0.0.1 --save "" --appendonly no >/dev/null 2>&1 &
  PIDS+=($!)
  for _ in $(seq 1 100); do redis-cli -p "$rport" ping >/dev/null 2>&1 && break; sleep 0.05; done
  local calls_before; calls_before=$(redis-cli -p "$rport" info stats | awk -F: '/^total_commands_processed/ {print $2+0}')
  local dir; dir=$(mktemp -d); TMPS+=("$dir")
  local fleet_pids=()
  for i in $(seq 1 "$procs"); do
    target/release/examples/fleet_load --url "redis://127.0.0.1:$rport" --keys "$keys" \
      --limit "$limit" --seconds "$secs" >"$dir/$i.out" 2>"$dir/$i.err" &
    fleet_pids+=($!); PIDS+=($!)
  done
  local failed=0
  for p in "${fleet_pids[@]}"; do wait "$p" || failed=1; done
  # Reaped: their numbers may be another process's by the time the exit trap runs.
  PIDS=("${PIDS[@]:0:${#PIDS[@]}-$procs}")
  if [ "$failed" = 1 ]; then cat "$dir"/*.err >&2; echo "a fleet process failed" >&2; exit 1; fi
  local calls_after; calls_after=$(redis-cli -p "$rport" info stats | awk -F: '/^total_commands_processed/ {print $2+0}')
  python3 - "$dir" "$procs" "$limit" "$((calls_after - calls_before))" <<'PY'
import glob, sys
d, procs, limit, calls = sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), int(sys.argv[4])
decisions = admitted = lease_calls = 0; secs = 0.0; windows = {}; spans = []
for f in sorted(glob.glob(d + "/*.out")):
    mine = set()
    for line in open(f):
        w = line.split()
        if w[0] == "decisions":
            decisions += int(w[1]); admitted += int(w[3]); lease_calls += int(w[5]); secs = max(secs, float(w[7]))
        elif w[0] == "window":
            key, end, n = int(w[1]), int(w[2]), int(w[3])
            windows[(key, end)] = windows.get((key, end), 0) + n; mine.add(end)
    spans.append((min(mine), max(mine)))
# Whole windows only: those every process ran through from start to end.
first = max(lo for lo, _ in spans) + 1; last = min(hi for _, hi in spans) - 1
whole = {k: n for k, n in windows.items() if first <= k[1] <= last}
over = sum(1 for n in whole.values() if n > limit)
worst = max(whole.values(), default=0); least = min(whole.values(), default=0)
print(f"fleet: {procs} processes, {len(set(k for k, _ in windows))} hot keys, fixed window of {limit:,}/s each, leased (LeaseConfig::auto()), {secs:.1f} s")
print()
print("| measured | value | target |")
print("|---|---:|---|")
print(f"| decisions per second, all processes | {decisions / secs:,.0f} | ≥ 1,000,000 |")
print(f"| of which admitted, per second | {admitted / secs:,.0f} | (information) |")
print(f"| Redis commands per second | {calls / secs:,.0f} ({lease_calls:,} lease calls) | (information) |")
print(f"| whole windows over the limit | {over} of {len(whole)} | 0 |")
print(f"| worst window, admitted / limit | {worst:,} / {limit:,} ({worst / limit:.2%}) | ≤ 100% |")
print(f"| least-used window, admitted / limit | {least:,} / {limit:,} ({least / limit:.2%}) | ≥ 95% |")
PY
  rm -rf "$dir"
}


# `scripts/bench.sh instructions [REQUESTS (default 10000)]`: the instructions one request takes
# in process (examples/layer_instructions: a hello-world bare, behind tower_governor without and
# with its headers, behind the README's RateLimitLayer allowed and denied), counted by valgrind's callgrind over the
# measured requests only. Unlike req/s, the same binary gives the same count on a busy machine,
# so a change to the layer's cost shows even where wrk's noise would hide it. Then the same
# servers as the end-to-end run (and the demo server), each under callgrind, served over
# loopback by hyper and loaded by wrk: the user-space instructions per request of the whole
# server (hyper, axum, the layer, the allocator; not the kernel). About 3 minutes.
instructions() {
  local n=${1:-10000}
  cargo build --release --quiet --example layer_instructions
  local kind total bare=""
  echo "| request, in process | instructions | over bare axum |"
  echo "|---|---:|---:|"
  for kind in bare governor governor-headers fleetlimit fleetlimit-denied; do
    total=$(valgrind --tool=callgrind --callgrind-out-file=/dev/null \
      --toggle-collect='layer_instructions::measure' \
      target/release/examples/layer_instructions "$kind" "$n" 2>&1 | awk '/Collected/ {print $4}')
    [ -n "$total" ] || { echo "callgrind failed for $kind" >&2; exit 1; }
    local per=$((total / n))
    [ -n "$bare" ] || bare=$per
    echo "| $kind | $per | $((per - bare)) |"
  done
  cargo build --release --quiet --example baseline --example server
  echo
  echo "| request, served over loopback (user space) | instructions | over bare axum |"
  echo "|---|---:|---:|"
  local B=target/release/examples
  bare=""
  served "bare axum" "$B/baseline" --kind bare
  served "tower_governor" "$B/baseline" --kind governor
  served "tower_governor with its headers" "$B/baseline" --kind governor --headers
  served "quick-start RateLimitLayer, allowed" "$B/baseline" --kind fleetlimit
  served "quick-start RateLimitLayer, denied" "$B/baseline" --kind fleetlimit --denied
  served "demo server, allowed" "$B/server" --limit 1000000000 --period 1s
  served "demo server, denied" "$B/server" --limit 1 --period 1h
}

# served LABEL CMD...: one server under callgrind on a free port; wrk warms it for 2 s, the
# counters are zeroed, wrk loads it for 6 s, and the counters are dumped: instructions over the
# requests wrk completed in those 6 s (the server's own work for them, whatever the machine's
# load; what wrk left half-done at either end is a few requests in thousands).
served() {
  local label=$1; shift
  local dir; dir=$(mktemp -d); TMPS+=("$dir")
  valgrind --tool=callgrind --callgrind-out-file="$dir/cg.%p" "$@" --port 0 >"$dir/out" 2>&1 &
  local pid=$!; PIDS+=("$pid")
  local port=""
  for _ in $(seq 1 600); do
    port=$(sed -n 's/^listening on http:\/\/127.0.0.1:\([0-9]*\).*/\1/p' "$dir/out" | head -1)
    [ -n "$port" ] && break; sleep 0.1
  done
  [ -n "$port" ] || { echo "server did not start under callgrind: $*" >&2; cat "$dir/out" >&2; exit 1; }
  wrk -t1 -c16 -d2s "http://127.0.0.1:$port/" >/dev/null
  # callgrind_control exits 0 even when it reached nothing: its output says.
  control() {
    local said; said=$(callgrind_control "$@" 2>&1 || true)
    case "$said" in *rror*|*"not detected"*) echo "callgrind_control $* failed for $label: $said" >&2; exit 1 ;; esac
  }
  control --zero "$pid"
  local n; n=$(wrk -t1 -c16 -d6s "http://127.0.0.1:$port/" | awk '/requests in/ {print $1}')
  control --dump=measured "$pid"
  kill "$pid" 2>/dev/null || true; wait "$pid" 2>/dev/null || true; unset 'PIDS[-1]'
  local total; total=$( (grep -l '^desc: Trigger: .*measured' "$dir"/cg.* || true) | xargs -r awk '/^(summary|totals):/ {print $2; exit}')
  { [ -n "$total" ] && [ "${n:-0}" -gt 0 ]; } || { echo "no count for $label" >&2; exit 1; }
  local per=$((total / n))
  [ -n "$bare" ] || bare=$per
  echo "| $label | $per | $((per - bare)) |"
}

PIDS=(); TMPS=()
cleanup() {
  for p in "${PIDS[@]}"; do kill "$p" 2>/dev/null || true; wait "$p" 2>/dev/null || true; done
  rm -rf "${TMPS[@]}"
}
trap cleanup EXIT

if [ "$MODE" = fleet ]; then
  fleet "${1:-4}" "${2:-5}"
  exit 0
fi
if [ "$MODE" = instructions ]; then
  instructions "${1:-10000}"
  exit 0
fi

cargo build --release --quiet --example server --example baseline --example redis_load --example bench_chart
BIN=target/release/examples

# Servers on core 0, load generators on core 1, when there are two cores to separate.
SERVER_CPU=(); LOAD_CPU=()
if need taskset && [ "$(nproc)" -ge 2 ]; then SERVER_CPU=(taskset -c 0); LOAD_CPU=(taskset -c 1); fi

LAST_PORT=
start() { # start CMD...: run a server that prints "listening on http://127.0.0.1:PORT"
  local out; out=$(mktemp); TMPS+=("$out")
  "${SERVER_CPU[@]}" "$@" >"$out" 2>&1 &
  PIDS+=($!)
  for _ in $(seq 1 200); do
    if grep -q '^listening on' "$out"; then LAST_PORT=$(sed -n 's/^listening on http:\/\/127.0.0.1:\([0-9]*\).*/\1/p' "$out" | head -1); rm -f "$out"; return; fi
    sleep 0.05
  done
  echo "server did not start: $*" >&2; cat "$out" >&2; exit 1
}
stop_last() { local p=${PIDS[-1]}; kill "$p" 2>/dev/null || true; wait "$p" 2>/dev/null || true; unset 'PIDS[-1]'; }
wrk_rps() { "${LOAD_CPU[@]}" wrk -t1 -c64 -d"${SECS}s" "http://127.0.0.1:$1/" | awk '/Requests\/sec/ {print $2}'; }
ratio() { awk -v a="$1" -v b="$2" 'BEGIN { if (b > 0) printf "%.2f", a / b; else print "n/a" }'; }
median() { tr ' ' '\n' | grep -v '^$' | sort -g | awk '{v[NR]=$1} END {print v[int((NR+1)/2)]}'; }
minmax() { tr ' ' '\n' | grep -v '^$' | sort -g | awk 'NR==1 {lo=$1} {hi=$1} END {printf "%s–%s", lo, hi}'; }

ROWS=()
# row LABEL "VALUES" BASELINE "BASELINE_VALUES" TARGET: medians, their ratio, and the ratios' range
# over the interleaved rounds.
row() {
  local v b ratios="" i
  v=$(median <<<"$2"); b=$(median <<<"$4")
  read -r -a va <<<"$2"; read -r -a ba <<<"$4"
  for i in "${!va[@]}"; do ratios+=" $(ratio "${va[$i]}" "${ba[$i]:-${ba[0]}}")"; done
  ROWS+=("| $1 | $v | $3 | $b | $(ratio "$v" "$b") ($(minmax <<<"$ratios")) | $5 |")
}

echo "measuring the layer (wrk, ${SECS}s per run, ${ROUNDS} rounds)..." >&2
# The demo server as a user runs it (memory store, its defaults) and with GCRA; a limit no run
# reaches for allowed traffic, one spent by the first request for denied traffic. GCRA spaces
# requests at least a microsecond apart, so its "no run reaches it" is a million a second.
bare=""; gov=""; gov_denied=""; demo=""; demo_denied=""; gcra=""; gcra_denied=""; busy1=""; busy2=""; quick=""; gov_headers=""
for _ in $(seq 1 "$ROUNDS"); do
  start "$BIN/baseline" --kind bare --port 0;                 bare+=" $(wrk_rps "$LAST_PORT")"; stop_last
  # A scale: what 1 and 2 µs of handler work cost in the same run.
  start "$BIN/baseline" --kind busy --busy-us 1 --port 0;     busy1+=" $(wrk_rps "$LAST_PORT")"; stop_last
  start "$BIN/baseline" --kind busy --busy-us 2 --port 0;     busy2+=" $(wrk_rps "$LAST_PORT")"; stop_last
  start "$BIN/server" --port 0 --limit 1000000000 --period 1s; demo+=" $(wrk_rps "$LAST_PORT")"; stop_last
  # The README's quick-start layer on the bare hello-world: the layer without the demo's routes.
  start "$BIN/baseline" --kind fleetlimit --port 0;           quick+=" $(wrk_rps "$LAST_PORT")"; stop_last
  start "$BIN/baseline" --kind governor --port 0;             gov+=" $(wrk_rps "$LAST_PORT")"; stop_last
  # tower_governor with its headers on every response, as fleetlimit writes them by default.
  start "$BIN/baseline" --kind governor --headers --port 0;   gov_headers+=" $(wrk_rps "$LAST_PORT")"; stop_last
  start "$BIN/server" --port 0 --algorithm gcra --limit 1000000 --period 1s
  gcra+=" $(wrk_rps "$LAST_PORT")"; stop_last
  start "$BIN/baseline" --kind governor --denied --port 0;    gov_denied+=" $(wrk_rps "$LAST_PORT")"; stop_last
  start "$BIN/server" --port 0 --limit 1 --period 1h;          demo_denied+=" $(wrk_rps "$LAST_PORT")"; stop_last
  start "$BIN/server" --port 0 --algorithm gcra --limit 1 --period 1h
  gcra_denied+=" $(wrk_rps "$LAST_PORT")"; stop_last
done
row "demo server, default algorithm, allowed (req/s)" "$demo" "bare axum" "$bare" "≥ 0.90"
row "demo server, default algorithm, allowed (req/s)" "$demo" "tower_governor" "$gov" "≥ 0.95"
row "demo server, GCRA, allowed (req/s)" "$gcra" "bare axum" "$bare" "≥ 0.90"
row "demo server, GCRA, allowed (req/s)" "$gcra" "tower_governor" "$gov" "≥ 0.95"
row "demo server, default algorithm, denied (req/s)" "$demo_denied" "bare axum" "$bare" "≥ 0.90"
row "demo server, default algorithm, denied (req/s)" "$demo_denied" "tower_governor denied" "$gov_denied" "≥ 0.95"
row "demo server, GCRA, denied (req/s)" "$gcra_denied" "bare axum" "$bare" "≥ 0.90"
row "demo server, GCRA, denied (req/s)" "$gcra_denied" "tower_governor denied" "$gov_denied" "≥ 0.95"
row "quick-start RateLimitLayer on the bare hello-world, allowed (req/s)" "$quick" "bare axum" "$bare" "(information)"
row "demo server, default algorithm, allowed (req/s)" "$demo" "tower_governor with its headers" "$gov_headers" "(information)"
row "tower_governor with its headers, allowed (req/s)" "$gov_headers" "bare axum" "$bare" "(information)"
row "bare axum, handler busy 1 µs (req/s)" "$busy1" "bare axum" "$bare" "(scale)"
row "bare axum, handler busy 2 µs (req/s)" "$busy2" "bare axum" "$bare" "(scale)"

echo "measuring Redis..." >&2
RPORT=$(python3 -c 'import socket; s=socket.socket(); s.bind(("127.0.0.1",0)); print(s.getsockname()[1])')
"${SERVER_CPU[@]}" redis-server --port "$RPORT" --bind 127.0.0.1 --save "" --appendonly no >/dev/null 2>&1 &
PIDS+=($!)
for _ in $(seq 1 100); do redis-cli -p "$RPORT" ping >/dev/null 2>&1 && break; sleep 0.05; done
SHA=$(redis-cli -p "$RPORT" SCRIPT LOAD "$("$BIN/baseline" --print-script)")
read -r -a ARGS <<<"$("$BIN/baseline" --print-args | sed 's/""/__EMPTY__/g')"
for i in "${!ARGS[@]}"; do [ "${ARGS[$i]}" = "__EMPTY__" ] && ARGS[$i]=""; done
ceiling=""; limiter=""; direct=""; leased=""; lease_calls=0
for _ in $(seq 1 "$ROUNDS"); do
  ceiling+=" $("${LOAD_CPU[@]}" redis-benchmark -p "$RPORT" -n 300000 -c 50 -P 16 -q EVALSHA "$SHA" "${ARGS[@]}" \
    | tr '\r' '\n' | awk '/requests per second/ {for (i=1;i<=NF;i++) if ($i ~ /^[0-9.]+$/) v=$i} END {print v}')"
  limiter+=" $("${LOAD_CPU[@]}" "$BIN/redis_load" --url "redis://127.0.0.1:$RPORT" --concurrency 256 --seconds "$SECS" | awk '{print $2}')"
  direct+=" $("${LOAD_CPU[@]}" "$BIN/redis_load" --url "redis://127.0.0.1:$RPORT" --concurrency 64 --keys 1 --seconds "$SECS" | awk '{print $2}')"
  out=$("${LOAD_CPU[@]}" "$BIN/redis_load" --url "redis://127.0.0.1:$RPORT" --concurrency 64 --keys 1 --lease 1000 --seconds "$SECS")
  leased+=" $(awk '{print $2}' <<<"$out")"; lease_calls=$(awk '{print $4}' <<<"$out")
done
row "Limiter decisions from one process (/s)" "$limiter" "redis-benchmark -P 16 EVALSHA" "$ceiling" "≥ 1.00"
row "one hot key, leased, 1,000-permit blocks (/s; last run $lease_calls lease calls)" "$leased" "same key, direct Redis" "$direct" "≥ 20"
start "$BIN/server" --port 0 --store "redis://127.0.0.1:$RPORT" --on-store-error open --limit 1000000000 --period 1s
demo_redis=$(wrk_rps "$LAST_PORT"); stop_last
row "demo server on Redis, allowed (req/s)" "$demo_redis" "demo server, memory store" "$(median <<<"$demo")" "(information)"

echo
echo "machine: $(nproc) cores, $(awk -F: '/model name/ {print $2; exit}' /proc/cpuinfo | sed 's/^ *//'); servers pinned to core 0, load to core 1: ${SERVER_CPU[*]:-no}"
echo
echo "| measured (median of $ROUNDS) | value | baseline | baseline value | ratio (range) | target |"
echo "|---|---:|---|---:|---:|---|"
printf '%s\n' "${ROWS[@]}"
# The same table as a picture (CHART=path to write it elsewhere).
printf '%s\n' "${ROWS[@]}" | "$BIN/bench_chart" "${CHART:-docs/bench.svg}"
