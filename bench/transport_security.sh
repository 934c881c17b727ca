#!/usr/bin/env bash
# Migrations of a synthetic guest, plain against --auth-key against TLS
# (user-space rustls where the kernel has no tls ULP), run by run
# interleaved, each run starting with the next mode (so that no mode always
# follows the same one); prints one JSON line per run (mode, total time, source and
# destination CPU seconds, bytes sent, the TLS records' place) for docs/benchmarks.md.
#   bench/transport_security.sh [TERN] [MEMORY] [RUNS] [LINK]
# LINK is loopback (default) or 1gbit: both processes then run in a network
# namespace whose loopback is shaped by a token bucket (tc tbf 1gbit, burst
# 256kb, latency 50ms, as bench/compare/netem.py; needs root), named by
# TERNBENCH_NETNS (default ternbench-security).
set -euo pipefail
tern=$(realpath "${1:-target/release/tern}")
memory=${2:-4GiB}
runs=${3:-3}
link=${4:-loopback}
work=$(mktemp -d)
netns=${TERNBENCH_NETNS:-ternbench-security}
in_link=()
case $link in
  loopback) trap 'rm -rf "$work"' EXIT ;;
  1gbit)
    ip netns del "$netns" 2>/dev/null || true
    ip netns add "$netns"
    ip -n "$netns" link set lo up
    ip netns exec "$netns" tc qdisc add dev lo root tbf rate 1gbit burst 256kb latency 50ms
    trap 'rm -rf "$work"; ip netns del "$netns"' EXIT
    in_link=(ip netns exec "$netns")
    ;;
  *) echo "LINK is loopback or 1gbit, not $link" >&2; exit 2 ;;
esac

# A CA and one certificate for both ends (127.0.0.1 in its SANs), made as
# docs/security.md shows.
mkdir -p "$work/tls"
openssl req -x509 -newkey ec -pkeyopt ec_paramgen_curve:P-256 -nodes \
  -keyout "$work/ca.key" -out "$work/tls/ca.pem" -days 2 \
  -subj "/CN=tern bench CA" 2>/dev/null
openssl req -newkey ec -pkeyopt ec_paramgen_curve:P-256 -nodes \
  -keyout "$work/tls/key.pem" -out "$work/host.csr" -subj "/CN=bench" 2>/dev/null
openssl x509 -req -in "$work/host.csr" -CA "$work/tls/ca.pem" -CAkey "$work/ca.key" \
  -CAcreateserial -days 2 -out "$work/tls/cert.pem" \
  -extfile <(printf "subjectAltName=IP:127.0.0.1\nbasicConstraints=CA:FALSE") 2>/dev/null
openssl rand -hex 32 > "$work/key"
chmod 600 "$work/key"

port=47400
modes=(plain auth-key tls)
for run in $(seq "$runs"); do
  for step in 0 1 2; do
    mode=${modes[$(((run + step) % 3))]}
    case $mode in
      plain) opts=() ;;
      auth-key) opts=(--auth-key "$work/key") ;;
      tls) opts=(--tls-dir "$work/tls") ;;
    esac
    port=$((port + 1))
    "${in_link[@]}" "$tern" --progress none receive --listen "127.0.0.1:$port" "${opts[@]}" \
      --json --run-after 0 >"$work/receive.json" 2>"$work/receive.err" &
    receiver=$!
    # Wait for the receiver's listening event before the source dials.
    for _ in $(seq 500); do [ -s "$work/receive.json" ] && break; sleep 0.02; done
    "${in_link[@]}" "$tern" --progress none migrate --to "127.0.0.1:$port" "${opts[@]}" \
      --memory "$memory" --dirty-rate 0 --json >"$work/migrate.json" 2>"$work/migrate.err" ||
      { cat "$work/migrate.err" >&2; exit 1; }
    wait "$receiver"
    python3 - "$mode" "$run" "$link" "$work/migrate.json" "$work/receive.json" <<'PY'
import json, sys
mode, run, link, path, received = sys.argv[1], int(sys.argv[2]), sys.argv[3], sys.argv[4], sys.argv[5]
report = json.load(open(path))
# The receiver prints its listening event, then its report.
text = open(received).read()
destination = json.loads(text[text.index("\n") + 1:])
tls = destination.get("tls")
print(json.dumps({
    "mode": mode, "run": run, "link": link,
    "total_ms": report["total-time"],
    "source_cpu_s": round(sum(report["cpu-seconds"].values()), 3),
    "destination_cpu_s": round(sum(report["destination"]["cpu-seconds"].values()), 3),
    "bytes": report["ram"]["transferred"],
    "authenticated": destination["authenticated"],
    "tls": tls and ("kernel" if tls["kernel-offload"] else "user space") + " " + tls["cipher"],
}))
PY
  done
done
