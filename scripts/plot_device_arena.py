#!/usr/bin/env python3
"""Draws bench_device_arena's results (its --json output) as one PNG: allocations per second
from a kernel, on a log scale, for each case the bench measures, side by side for in-kernel
malloc + free, an atomicAdd per thread (as nvcc compiles it when it can merge the lanes' adds,
and when it cannot), the arena's warp path and its per-block sub-arenas.

    plot_device_arena.py RESULTS.json [--out device_arena_rates.png]

Needs matplotlib. docs/device-arena.md shows the picture.
"""

import argparse
import json

SERIES = [  # (field, label, colour)
    ("malloc_free_per_s", "malloc + free in the kernel", "#c0392b"),
    ("atomicAdd_unmerged_per_s", "atomicAdd per thread, not merged", "#f28e2b"),
    ("atomicAdd_per_thread_per_s", "atomicAdd per thread, as nvcc merges it", "#f1c40f"),
    ("arena_warp_per_s", "device_arena (warp)", "#3b6fb6"),
    ("arena_block_per_s", "device_arena (block sub-arenas)", "#2e8b57"),
]


def case_label(row):
    if row["lanes"] == "mixed":
        return "all lanes\n16..256 B by lane"
    lanes = {"all": "all lanes", "half": "every other lane"}.get(row["lanes"], row["lanes"])
    size = f"{row['bytes']} B" if row["bytes"] < 1024 else f"{row['bytes'] // 1024} KiB"
    return f"{lanes}\n{size}"


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("results", help="bench_device_arena --json output")
    ap.add_argument("--out", default="device_arena_rates.png")
    args = ap.parse_args()
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    with open(args.results, encoding="utf-8") as f:
        doc = json.load(f)
    rows = doc["rows"]
    fig, ax = plt.subplots(figsize=(12, 5.2), dpi=110)
    width = 0.8 / len(SERIES)
    for i, (field, label, colour) in enumerate(SERIES):
        xs = [r + (i - (len(SERIES) - 1) / 2) * width for r in range(len(rows))]
        ys = [row[field] / 1e6 for row in rows]
        ax.bar(xs, ys, width, label=label, color=colour)
    ax.set_yscale("log")
    ax.set_ylabel("million allocations per second")
    ax.set_xticks(range(len(rows)))
    ax.set_xticklabels([case_label(r) for r in rows], fontsize=8)
    ax.grid(axis="y", which="major", alpha=0.3)
    ax.set_title(f"Allocation from a kernel, {doc['threads']:,} threads: {doc['gpu']}")
    ax.legend(fontsize=8, loc="upper center", bbox_to_anchor=(0.5, -0.13), ncol=len(SERIES), frameon=False)
    fig.tight_layout()
    fig.savefig(args.out)
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
