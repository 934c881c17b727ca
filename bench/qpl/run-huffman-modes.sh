#!/usr/bin/env bash
# Builds and runs bench/qpl/job_layout.c and huffman_modes.c against the QPL
# that bench/install-qpl.sh installed (PREFIX, /opt/qpl by default), on
# tern's corpus pages (mixed, text, binary; 64 training + 1024 measured).
# Needs libdeflate's headers (apt-get install libdeflate-dev).
set -euo pipefail
PREFIX=${1:-/opt/qpl}
here=$(cd "$(dirname "$0")" && pwd)
root=$(cd "$here/../.." && pwd)
out=$(mktemp -d)
trap 'rm -rf "$out"' EXIT
[[ -f /usr/include/libdeflate.h ]] || apt-get install -y -qq libdeflate-dev
cc_qpl() { gcc -O2 -Wall -Wextra -I"$PREFIX/include" "$@" -L"$PREFIX/lib" -lqpl -Wl,-rpath,"$PREFIX/lib"; }
cc_qpl "$here/job_layout.c" -o "$out/job_layout"
cc_qpl "$here/huffman_modes.c" -ldeflate -o "$out/huffman_modes"
"$out/job_layout"
(cd "$root" && cargo build -q --release -p tern-page --example dump_corpus)
for kind in mixed text binary; do
    echo "== $kind"
    "$root/target/release/examples/dump_corpus" "$kind" 1088 >"$out/$kind.bin"
    "$out/huffman_modes" "$out/$kind.bin"
done
