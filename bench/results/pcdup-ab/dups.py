"""Per-run duplicate figures of tern's postcopy runs in a results.json
(argv[1]): the source's pushed and answered pages against the stale ones,
and the destination's first placements by the push."""
import json
import statistics
import sys

runs = json.load(open(sys.argv[1]))["runs"]
print("| run | total s | switch → all s | after switch MiB | stale | pushed | requested (answered) | requests | sent twice | destination: urgent placed first | fault p50/p99 µs | blocktime ms | load |")
print("| --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: |")
by = {}
for r in runs:
    if r.get("error"):
        continue
    s = (r["raw"].get("source") or {}).get("postcopy")
    d = (r["raw"].get("destination") or {}).get("postcopy")
    if not s:
        continue
    m = r["metrics"]
    twice = s["requested-pages"] + s["pushed-pages"] - s["stale-pages"]
    first_urgent = d["stale-pages"] - d["pushed-pages"] if d else None
    by.setdefault(r["contender"], []).append((m["total_s"], twice, m["postcopy_mib"],
                                              m["delivered_after_switch_s"], m["blocktime_ms"]))
    print(f"| {r['contender']} {r['rep']} | {m['total_s']:.2f} | {m['delivered_after_switch_s']:.2f} | "
          f"{m['postcopy_mib']:.0f} | {s['stale-pages']} | {s['pushed-pages']} | {s['requested-pages']} | "
          f"{s['postcopy-requests']} | {twice} ({twice * 4096 / 2**20:.1f} MiB) | {first_urgent} | "
          f"{m['fault_p50_us']:.0f}/{m['fault_p99_us']:.0f} | {m['blocktime_ms']:.0f} | {m['loadavg']:.1f} |")
print()
for name, rows in by.items():
    med = [statistics.median(x[i] for x in rows) for i in range(5)]
    print(f"* {name}: {len(rows)} postcopy runs, median total {med[0]:.2f} s, sent twice {med[1]:.0f} "
          f"pages, {med[2]:.0f} MiB after the switch, switch → all memory {med[3]:.2f} s, "
          f"blocktime {med[4]:.0f} ms")
