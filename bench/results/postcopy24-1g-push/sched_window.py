"""Per-thread CPU and run-queue wait of the tern processes during each
postcopy push window (while a source has tern-push-* threads), from the
log sched_sample.py writes (/proc/PID/task/TID/schedstat every 50 ms:
run ns, run-queue wait ns, timeslices). Usage: sched_window.py LOG"""
import collections
import sys

rows = [line.split() for line in open(sys.argv[1] if len(sys.argv) > 1 else '/tmp/p24sched.log')]
series = collections.defaultdict(list)
push = collections.defaultdict(list)
for r in rows:
    t = float(r[0])
    role, pid, tid, comm = r[1], r[2], r[3], r[4]
    series[(role, pid, tid, comm)].append((t, int(r[5]), int(r[6]), int(r[7])))
    if comm.startswith('tern-push'):
        push[pid].append(t)
for source, times in push.items():
    a, b = min(times), max(times)
    print(f"source pid {source}: push window {b - a:.2f} s")
    for (role, pid, tid, comm), samples in sorted(series.items()):
        w = [x for x in samples if a <= x[0] <= b]
        if len(w) < 2:
            continue
        run, wait, slices = (w[-1][i] - w[0][i] for i in (1, 2, 3))
        if run == 0 and slices == 0:
            continue
        print(f"  {role:8} pid {pid:>6} tid {tid:>6} {comm:16} cpu {run / 1e7 / (b - a):4.0f} %"
              f"  run-queue wait {wait / 1e6:7.1f} ms  wakeups {slices:6}"
              f"  wait per wakeup {wait / max(slices, 1) / 1e3:6.0f} µs")
