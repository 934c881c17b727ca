#!/usr/bin/env bash
# Loopback migrations of a synthetic guest, plain against --auth-key against
# TLS (user-space rustls where the kernel has no tls ULP), run by run
# interleaved, each run starting with the next mode (so that no mode always
# follows the same one); prints one JSON line per run (mode, total time, source and
# destination CPU seconds, bytes sent) for docs/benchmarks.md.
#   bench/transport_security.sh [TERN] [MEMORY] [RUNS]
set -euo pipefail
tern=${1:-target/release/tern}
memory=${2:-4GiB}
runs=${3:-3}
work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT

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
    "$tern" --progress none receive --listen "127.0.0.1:$port" "${opts[@]}" \
      --json --run-after 0 >"$work/receive.json" 2>"$work/receive.err" &
    receiver=$!
    "$tern" --progress none migrate --to "127.0.0.1:$port" "${opts[@]}" \
      --memory "$memory" --dirty-rate 0 --json >"$work/migrate.json" 2>"$work/migrate.err" ||
      { cat "$work/migrate.err" >&2; exit 1; }
    wait "$receiver"
    python3 - "$mode" "$run" "$work/migrate.json" <<'PY'
import json, sys
mode, run, path = sys.argv[1], int(sys.argv[2]), sys.argv[3]
report = json.load(open(path))
print(json.dumps({
    "mode": mode, "run": run,
    "total_ms": report["total-time"],
    "source_cpu_s": round(sum(report["cpu-seconds"].values()), 3),
    "destination_cpu_s": round(sum(report["destination"]["cpu-seconds"].values()), 3),
    "bytes": report["ram"]["transferred"],
}))
PY
  done
done
