"""tern vs QEMU 10: side-by-side live-migration benchmark on the same guest.

    python3 -m bench.compare            # full default run (from the repository root)
    python3 -m bench.compare --smoke    # the smallest run: one case, one repetition
    python3 bench/compare --help        # the same, from anywhere

Both programs run the same test guest (tern-vmm's guest code, exported as a
multiboot image for QEMU's -kernel) over the same memory image, with the
same downtime limit, on the same link, interleaved A/B. Results go to
bench/results/ (results.json, results.md, *.png). See bench/README.md.

Modules: contenders (cases, contenders, run records), config (the options),
system (what must be installed; --install), image (the memory image),
procfs (CPU time from /proc), netem (the 1 Gbit/s link), qemu (QMP),
tern (the tern CLI and its JSON events), stats (medians), report (tables,
charts), cli (the run).
"""
