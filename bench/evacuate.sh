#!/usr/bin/env bash
# Evacuates a host through its agent (docs/fleet.md, "Evacuating a host"):
# one `tern migrate --agent` per guest, all started at once; the agent's
# slots and budget decide who goes when. Prints the queue and the shares
# every two seconds, then one line per guest; exits 1 if any guest did not
# arrive verified, 2 on usage errors.
#
#   bench/evacuate.sh AGENT_SOCKET DESTINATION NAME...
#
# DESTINATION is one `tern receive --keep-listening` address, or, with
# DESTINATIONS="addr1 addr2 ..." set, one address per guest in order.
# The guests are tern's synthetic ones (MEMORY, default 1GiB; DIRTY_RATE,
# default 0); a real VMM would run `tern vm migrate` or its own migration
# with `tern_fleet::join` instead. POLICY passes --migration-policy.
set -euo pipefail

if [ $# -lt 3 ]; then
    sed -n '2,15p' "$0" >&2
    exit 2
fi
agent=$1 destination=$2
shift 2
tern=${TERN:-tern}
memory=${MEMORY:-1GiB}
dirty_rate=${DIRTY_RATE:-0}
read -r -a destinations <<<"${DESTINATIONS:-}"
work=$(mktemp -d)
pids=()
cleanup() {
    for pid in "${pids[@]}"; do kill "$pid" 2>/dev/null || true; done
    rm -rf "$work"
}
trap cleanup EXIT

"$tern" ctl "$agent" query-version >/dev/null || { echo "evacuate: no agent at $agent" >&2; exit 2; }
index=0
for name in "$@"; do
    to=${destinations[$index]:-$destination}
    policy=()
    if [ -n "${POLICY:-}" ]; then policy=(--migration-policy "$POLICY"); fi
    "$tern" migrate --to "$to" --memory "$memory" --dirty-rate "$dirty_rate" --json \
        --progress none --agent "$agent" --agent-name "$name" "${policy[@]}" \
        >"$work/$name.json" 2>"$work/$name.err" &
    pids+=($!)
    index=$((index + 1))
done

started=$(date +%s.%N)
while true; do
    running=0
    for pid in "${pids[@]}"; do
        if kill -0 "$pid" 2>/dev/null; then running=$((running + 1)); fi
    done
    [ "$running" -eq 0 ] && break
    "$tern" ctl "$agent" query-fleet | python3 -c '
import json, sys
view = json.load(sys.stdin)
def row(m):
    where = "#%d" % m["position"] if m.get("position") else "@%dMiB/s" % (m["share"] >> 20)
    return m["name"] + ":" + m["state"] + where
rows = [row(m) for m in view["migrations"] if m["direction"] == "outbound"]
print("evacuate:", " ".join(rows) or "(none listed)")' || true
    sleep 2
done

failed=0
for name in "$@"; do
    python3 - "$work/$name.json" "$name" <<'PY' || failed=1
import json, sys
path, name = sys.argv[1], sys.argv[2]
try:
    report = json.load(open(path))
except ValueError:
    print(f"{name}: no report (see its error above)")
    sys.exit(1)
ok = report["status"] == "completed" and report["digest-verified"]
print(f"{name}: {report['status']}, verified {report['digest-verified']}, "
      f"{report['total-time'] / 1000:.1f} s, downtime {report['downtime']} ms, "
      f"throttle {report['cpu-throttle-percentage']}%")
sys.exit(0 if ok else 1)
PY
    if [ -s "$work/$name.err" ]; then grep -v "warning" "$work/$name.err" >&2 || true; fi
done
echo "evacuate: $(python3 -c "import time; print(f'{time.time() - $started:.1f}')") s"
exit "$failed"
