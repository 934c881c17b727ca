#!/usr/bin/env bash
# Re-measures the threat table of docs/security.md ("Measured"): runs the
# attack tests one file (module) at a time, single-threaded so that no attack
# shares the machine with another, with --nocapture, and prints the
# figure line each test prints (attack, result, time, receiver peak RSS),
# with the machine's load before each file. Each test is also a pass/fail
# check of its defence: a failing one shows as FAILED in the output.
#   bench/threat_table.sh [RUNS]
# Runs from the repository root; builds the release test binaries first.
set -euo pipefail
runs=${1:-1}
# Figures are printed by eprintln! in the tests; these lines are theirs.
figures='receiver peak|rejected in|refused in|closed after|hostage attack|cut off|read .* ms after|TLS connections|connections,|128 MiB guest|took|slowloris|state-section flood|trickled|through the proxy|downtime'
files=(
  "tern attacks_trust"
  "tern attacks_accept"
  "tern-engine attacks_invariants"
  "tern-engine switch_over_commit"
  "tern-engine secure"
)
for run in $(seq "$runs"); do
  for entry in "${files[@]}"; do
    read -r crate file <<<"$entry"
    echo "== run $run: $crate $file:: (load $(cut -d' ' -f1-3 /proc/loadavg))"
    # One test binary per crate (docs/testing.md): the file is a module.
    cargo test --release -q -p "$crate" --test integration -- "$file::" --test-threads 1 --nocapture 2>&1 \
      | grep --line-buffered -E "$figures|test result|FAILED|panicked" || true
  done
done
