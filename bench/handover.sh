#!/usr/bin/env bash
# Same-host migration of a synthetic guest over a Unix socket: memory
# handed over as file descriptors (--local) against the usual copy, with
# the guest's writer running; medians of RUNS runs of each, alternated.
# Prints one table row per mode: downtime and total time (milliseconds, as
# the source measures them), bytes sent, and the load average around the runs.
# Usage: bench/handover.sh [MEMORY] [RUNS]   (default 1GiB, 5)
set -euo pipefail
memory=${1:-1GiB}
runs=${2:-5}
tern=${TERN:-target/release/tern}
dir=$(mktemp -d)
trap 'rm -rf "$dir"' EXIT

one() { # mode index
    local flag=() sock="$dir/main-$1-$2.sock"
    [ "$1" = handover ] && flag=(--local)
    "$tern" receive --listen "unix:$sock" "${flag[@]}" --run-after 0 --json \
        >"$dir/receive-$1-$2.json" &
    local receiver=$!
    for _ in $(seq 100); do [ -S "$sock" ] && break; sleep 0.1; done
    "$tern" migrate --to "unix:$sock" "${flag[@]}" --memory "$memory" \
        --dirty-rate 64MiB --json >"$dir/migrate-$1-$2.json"
    wait "$receiver"
}

load_before=$(cut -d' ' -f1 /proc/loadavg)
for i in $(seq "$runs"); do
    one copy "$i"
    one handover "$i"
done
load_after=$(cut -d' ' -f1 /proc/loadavg)

python3 - "$dir" "$runs" "$memory" "$load_before" "$load_after" <<'PY'
import json, statistics, sys
d, runs, memory, before, after = sys.argv[1], int(sys.argv[2]), sys.argv[3], sys.argv[4], sys.argv[5]
print(f"| {memory} guest, 64 MiB/s writer, {runs} runs each | downtime (ms), median | total time (ms), median | downtime runs | total runs | bytes sent (median) |")
print("|---|---|---|---|---|---|")
for mode in ("copy", "handover"):
    stats = [json.load(open(f"{d}/migrate-{mode}-{i}.json")) for i in range(1, runs + 1)]
    down = [s["downtime"] for s in stats]
    total = [s["total-time"] for s in stats]
    sent = [s["ram"]["transferred"] for s in stats]
    print(f"| {mode} | {statistics.median(down)} | {statistics.median(total)} | {down} | {total} | {int(statistics.median(sent))} |")
print(f"\nload average (1 min) before: {before}, after: {after}; {__import__('os').cpu_count()} cores")
PY
