#!/usr/bin/env python3
"""Medians of an A/B of the round trip (bench/ab_roundtrip.sh's ab.txt): per build, gpuq's hot
p50 and its throughput at 1 and 4 clients, and the new build's change against the base."""

import re
import statistics
import sys


def main(path: str) -> None:
    runs: dict = {"base": [], "new": []}
    for block in open(path).read().split("=== round ")[1:]:
        name = block.split("\n", 1)[0].split()[-1]
        hot = re.search(
            r"Round trip, 1 in flight, hot.*?\n  gpuq\s+([\d.]+)", block, re.S
        )
        tp = re.search(r"Throughput.*?\n  gpuq\s+(\d+)\s+(\d+)", block, re.S)
        if hot and tp and name in runs:
            runs[name].append((float(hot.group(1)), int(tp.group(1)), int(tp.group(2))))
    med = {}
    for name, rows in runs.items():
        if not rows:
            sys.exit(f"{path}: no complete round of {name}")
        med[name] = [statistics.median(r[i] for r in rows) for i in range(3)]
        print(
            f"{name}: {len(rows)} rounds, medians: hot p50 {med[name][0]:.2f} us, "
            f"1 client {med[name][1] / 1e6:.2f} M jobs/s, 4 clients {med[name][2] / 1e6:.2f} M"
        )
    change = [100.0 * (med["new"][i] / med["base"][i] - 1) for i in range(3)]
    print(
        f"new against base: hot p50 {change[0]:+.1f} %, 1 client {change[1]:+.1f} %, "
        f"4 clients {change[2]:+.1f} %"
    )


if __name__ == "__main__":
    main(sys.argv[1] if len(sys.argv) > 1 else "build-ab/ab.txt")
