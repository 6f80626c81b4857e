#!/usr/bin/env python3
"""Draws a streamalloc pool snapshot (pool::snapshot's JSON) as two PNG pictures.

    plot_snapshot.py SNAPSHOT.json [--out PREFIX]

PREFIX_timeline.png: used and reserved memory over time, from the snapshot's history (kept
with pool::keep_history). The values at the end are the snapshot's statistics; earlier ones
are worked back from the events, so a history that dropped its oldest events still starts
right.

PREFIX_map.png: the pool's mapped memory, chunk after chunk with the gaps between them left
out, in rows of equal size: each block coloured by its state (live, free, pending on a
stream, graph memory, ...). Fragmentation shows as free and pending slivers between live
blocks.

Needs matplotlib. docs/observability.md shows what the pictures look like.
"""

import argparse
import json
import sys

COLOURS = {
    "live": "#3b6fb6",
    "free": "#d9d9d9",
    "pending": "#f28e2b",
    "cached": "#f1c40f",
    "graph": "#8e6bbf",
    "imported": "#c0392b",
}

GIB = float(1 << 30)
MIB = float(1 << 20)


def timeline(doc):
    """(seconds, used GiB, reserved GiB) after each event of the history."""
    history = doc.get("history")
    if not history or not history["events"]:
        return None
    events = history["events"]
    stats = doc["statistics"]
    d_used = sum(e["bytes"] if e["op"] == "allocate" else -e["bytes"] if e["op"] == "free" else 0 for e in events)
    d_reserved = sum(e["bytes"] if e["op"] == "grow" else -e["bytes"] if e["op"] == "release" else 0 for e in events)
    used = stats["used_current"] - d_used
    reserved = stats["reserved_current"] - d_reserved
    t, u, r = [], [], []
    for e in events:
        op = e["op"]
        if op == "allocate":
            used += e["bytes"]
        elif op == "free":
            used -= e["bytes"]
        elif op == "grow":
            reserved += e["bytes"]
        elif op == "release":
            reserved -= e["bytes"]
        t.append(e["t_ns"] / 1e9)
        u.append(used / GIB)
        r.append(reserved / GIB)
    return t, u, r


def plot_timeline(doc, path, plt):
    series = timeline(doc)
    if series is None:
        print("no history in the snapshot (pool::keep_history): no timeline drawn", file=sys.stderr)
        return False
    t, u, r = series
    fig, ax = plt.subplots(figsize=(10, 4.5))
    ax.step(t, r, where="post", color="#c0392b", label="reserved (physical memory the pool holds)")
    ax.step(t, u, where="post", color="#3b6fb6", label="used (live allocations)")
    ax.fill_between(t, u, r, step="post", color="#f5b7b1", alpha=0.5, label="held but not used")
    ax.set_xlabel("seconds since the history began")
    ax.set_ylabel("GiB")
    h = doc["history"]
    ax.set_title("%s: %d events%s" % (doc.get("location", "pool"), len(h["events"]),
                                      ", %d older ones dropped" % h["dropped"] if h["dropped"] else ""))
    ax.legend(loc="lower right")
    ax.grid(alpha=0.3)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return True


def plot_map(doc, path, plt, row_bytes=None):
    chunks = sorted(doc["chunks"], key=lambda c: c["address"])
    blocks = sorted(doc["blocks"], key=lambda b: b["address"])
    mapped = sum(c["bytes"] for c in chunks)
    if mapped == 0:
        print("the pool maps nothing: no map drawn", file=sys.stderr)
        return False
    # Offsets with the gaps between chunks left out.
    offset_of, at = [], 0
    for c in chunks:
        offset_of.append((c["address"], c["address"] + c["bytes"], at))
        at += c["bytes"]
    if row_bytes is None:
        row_bytes = max(2 * MIB, 2 ** round(__import__("math").log2(max(mapped / 64.0, 1))))
    rows = int((mapped + row_bytes - 1) // row_bytes)
    bars = {state: [[] for _ in range(rows)] for state in COLOURS}
    k = 0
    for b in blocks:
        while k < len(offset_of) and offset_of[k][1] <= b["address"]:
            k += 1
        if k == len(offset_of) or b["address"] < offset_of[k][0]:
            continue  # not inside a chunk of the list (should not happen)
        start = offset_of[k][2] + (b["address"] - offset_of[k][0])
        left, state = b["bytes"], b["state"]
        while left > 0:
            row, col = int(start // row_bytes), start % row_bytes
            n = min(left, row_bytes - col)
            bars.setdefault(state, [[] for _ in range(rows)])[row].append((col / MIB, n / MIB))
            start += n
            left -= n
    fig, ax = plt.subplots(figsize=(10, max(3.0, 0.12 * rows + 1.5)))
    for state, per_row in bars.items():
        colour = COLOURS.get(state, "#000000")
        for row, spans in enumerate(per_row):
            if spans:
                ax.broken_barh(spans, (row - 0.45, 0.9), facecolors=colour, linewidth=0)
    ax.set_xlim(0, row_bytes / MIB)
    ax.set_ylim(rows - 0.5, -0.5)
    ax.set_xlabel("MiB within the row (rows of %g MiB, chunks placed end to end)" % (row_bytes / MIB))
    ax.set_ylabel("row")
    s = doc["statistics"]
    ax.set_title("%s: %.2f GiB mapped in %d chunks, %.2f GiB live in %d blocks, largest free %.1f MiB" % (
        doc.get("location", "pool"), mapped / GIB, len(chunks), s["used_current"] / GIB, s["live_allocations"],
        s["largest_free_block"] / MIB))
    from matplotlib.patches import Patch
    present = [st for st, per_row in bars.items() if any(per_row)]
    ax.legend(handles=[Patch(color=COLOURS.get(st, "#000000"), label=st) for st in present],
              loc="upper center", bbox_to_anchor=(0.5, -0.12 if rows < 20 else -0.04), ncol=len(present))
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return True


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("snapshot")
    ap.add_argument("--out", help="prefix of the PNG files (default: the snapshot's name)")
    ap.add_argument("--row-mib", type=float, help="MiB per row of the map (default: about 64 rows)")
    args = ap.parse_args()
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        sys.exit("plot_snapshot.py needs matplotlib (pip install matplotlib)")
    with open(args.snapshot) as f:
        doc = json.load(f)
    prefix = args.out or (args.snapshot[:-5] if args.snapshot.endswith(".json") else args.snapshot)
    drew = []
    if plot_timeline(doc, prefix + "_timeline.png", plt):
        drew.append(prefix + "_timeline.png")
    if plot_map(doc, prefix + "_map.png", plt, args.row_mib * MIB if args.row_mib else None):
        drew.append(prefix + "_map.png")
    for p in drew:
        print(p)
    return 0 if drew else 1


if __name__ == "__main__":
    sys.exit(main())
