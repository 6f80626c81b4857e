#!/usr/bin/env python3
"""Turns a streamalloc::logging_resource log (CSV or JSON lines), or the history in a pool's
snapshot, into an allocation trace in the format of bench/traces/README.md, so that what a real
program allocated can be replayed by bench_trace_replay (on a GPU, against cudaMallocAsync, CUB
and streamalloc's pools) and bench_trace_sim (on the CPU).

    python3 scripts/log_to_trace.py allocations.csv -o myprog.trace.gz [--name myprog]
    python3 scripts/log_to_trace.py pool.snapshot.json.gz -o myprog.trace.gz
    ./build/bench/bench_trace_replay myprog.trace.gz
    python3 scripts/log_to_trace.py --self-test

A snapshot (pool::snapshot, streamalloc_snapshot, streamalloc.snapshot() written with json.dump)
holds a history when the pool kept one (pool::keep_history, streamalloc.keep_history): its
allocations and frees become the trace, stream by stream, with the bytes the pool was asked
for. Kept from the pool's first allocation, it is a whole run: a PyTorch program's warm-up too,
where the optimizer's state is made among freed activations, which bench/traces/record.py's
traces (recorded after a warm-up and an emptied cache) leave out. A history whose ring dropped
its oldest events starts with blocks of unknown size: their frees are live at the start, as
below, and the header counts the events dropped.

What the conversion keeps and what it cannot:
- Each successful allocation is an `a <id> <bytes> <stream>` line with the bytes asked for; each
  free of a live pointer an `f <id> <stream>` line, in the log's order (the resource writes a free
  before the upstream frees and an allocation after it returns, so an address is always freed
  before it is allocated again down the file, whatever threads did it).
- Streams are numbered 0, 1, 2, ... in order of first appearance. Synchronous calls (`allocate`,
  `free`) have no stream: they get a stream number of their own, the same for all of them. A
  replay orders them on that stream, where the program had them ordered with every stream.
- A free of a pointer the log never saw allocated (allocated before the log began, or through
  another resource) is of a block live at the start: it is allocated at the start of the trace,
  on the stream of its free, with the free's byte count, as bench/traces/record.py does.
- A `resize_async` line (a stream_buffer grown or shrunk in place) is a free of the block and an
  allocation of the new size in its place, on the same stream: the format has no growth in
  place, and this keeps the bytes live right.
- Failed allocations, allocations of 0 bytes (no pointer) and frees of null are left out;
  alignments are not part of the format (a count of those above 256 is noted in the header).
- Lines from several processes, or several logs, cannot be merged by this script.
"""

import argparse
import csv
import gzip
import io
import json
import os
import sys
import tempfile

CSV_HEADER = ["time_ns", "thread", "operation", "pointer", "bytes", "alignment", "stream", "outcome", "exception",
              "message"]
ALLOCATIONS = ("allocate", "allocate_async")
FREES = ("free", "free_async")
RESIZES = ("resize_async",)
SYNC_STREAM = "synchronous"


class LogError(Exception):
    """A log that cannot be converted; the message names the file and line."""


def records(path, source=None):
    """Yields (line number, dict) for each operation of the log, CSV or JSON lines, or of a
    snapshot's history (event number, and the dict a JSON line would be). `source`, a dict if
    given, is told what was read: "kind" and, for a snapshot, "dropped"."""
    source = {} if source is None else source
    source["kind"] = "a streamalloc::logging_resource log"
    opener = gzip.open if path.endswith(".gz") else open
    with opener(path, "rt", encoding="utf-8", newline="") as f:
        first = f.readline()
        if not first:
            return
        if first.lstrip().startswith("{"):
            doc = _snapshot_of(first, f)
            if doc is not None:
                yield from _history_records(path, doc, source)
                return
            number = 0
            for number, text in enumerate(_chain([first], f), start=1):
                if not text.strip():
                    continue
                try:
                    yield number, json.loads(text)
                except json.JSONDecodeError as e:
                    raise LogError(f"{path}:{number}: not JSON: {e}") from None
            return
        header = next(csv.reader([first]))
        if header != CSV_HEADER:
            raise LogError(f"{path}:1: neither a JSON line nor the CSV header of a logging_resource log")
        for number, row in enumerate(csv.reader(f), start=2):
            if not row:
                continue
            if len(row) != len(CSV_HEADER):
                raise LogError(f"{path}:{number}: {len(row)} fields, expected {len(CSV_HEADER)}")
            rec = dict(zip(CSV_HEADER, row))
            for key in ("pointer", "stream"):
                if rec[key] == "":
                    rec[key] = None
            yield number, rec


def _snapshot_of(first, rest):
    """The snapshot document whose text starts with line `first` (the rest read from `rest`), or
    None when the text is a log of JSON lines. A snapshot is one JSON object with "blocks"; a
    log's line is an operation."""
    try:
        one = json.loads(first)
    except json.JSONDecodeError:
        one = None  # a document over several lines, or not JSON: a log's line parses whole
    if isinstance(one, dict) and "operation" in one:
        return None
    doc = one if one is not None else json.loads(first + rest.read())
    return doc if isinstance(doc, dict) and "blocks" in doc else None


def _history_records(path, doc, source):
    history = doc.get("history")
    if not isinstance(history, dict) or not history.get("events"):
        raise LogError(f"{path}: a snapshot without a history (the pool kept none: pool::keep_history)")
    source["kind"] = "a pool snapshot's history"
    source["dropped"] = int(history.get("dropped", 0))
    for number, e in enumerate(history["events"], start=1):
        op = e.get("op")
        if op not in ("allocate", "free"):
            continue  # grow, release, remap: the pool's own doings
        yield number, {"operation": op + "_async", "pointer": hex(int(e["address"])), "bytes": e["bytes"],
                       "alignment": 256, "stream": str(e["stream"]), "outcome": "ok"}


def _chain(*iterables):
    for it in iterables:
        yield from it


def convert(path, name=None):
    """Returns the trace's text for the log at `path`."""
    name = name or os.path.basename(path).split(".")[0] or "log"
    # First pass, in the log's order: symbolic operations, and the blocks live before the log.
    live = {}            # pointer -> symbolic id
    ops = []             # ("a", sid, bytes, stream key) / ("f", sid, stream key)
    prelive = []         # (sid, bytes, stream key) in the order of their frees
    sizes = {}
    next_sid = 0
    failed = zero = null_frees = over_aligned = 0
    source = {}
    for number, rec in records(path, source):
        op = rec.get("operation")
        if op not in ALLOCATIONS and op not in FREES and op not in RESIZES:
            raise LogError(f"{path}:{number}: unknown operation {op!r}")
        stream = rec.get("stream") or SYNC_STREAM
        if op in ("allocate", "free"):
            stream = SYNC_STREAM
        try:
            nbytes = int(rec["bytes"])
            alignment = int(rec["alignment"])
        except (KeyError, ValueError, TypeError):
            raise LogError(f"{path}:{number}: bad bytes or alignment") from None
        pointer = rec.get("pointer")
        pointer = int(pointer, 16) if pointer else 0
        if op in RESIZES:
            if pointer == 0 or nbytes == 0:
                raise LogError(f"{path}:{number}: a resize without a pointer or bytes")
            sid = live.pop(pointer, None)
            if sid is None:  # allocated before the log began: live at the start, size unknown
                sid = next_sid
                next_sid += 1
                sizes[sid] = nbytes
                prelive.append((sid, nbytes, stream))
            ops.append(("f", sid, stream))
            live[pointer] = next_sid
            sizes[next_sid] = nbytes
            ops.append(("a", next_sid, nbytes, stream))
            next_sid += 1
        elif op in ALLOCATIONS:
            if rec.get("outcome") != "ok":
                failed += 1
                continue
            if pointer == 0 or nbytes == 0:
                zero += 1
                continue
            if pointer in live:
                raise LogError(f"{path}:{number}: {hex(pointer)} allocated while live (two logs or processes mixed?)")
            over_aligned += alignment > 256
            live[pointer] = next_sid
            sizes[next_sid] = nbytes
            ops.append(("a", next_sid, nbytes, stream))
            next_sid += 1
        else:
            if pointer == 0:
                null_frees += 1
                continue
            sid = live.pop(pointer, None)
            if sid is None:  # allocated before the log began
                sid = next_sid
                next_sid += 1
                sizes[sid] = nbytes
                prelive.append((sid, nbytes, stream))
            ops.append(("f", sid, stream))
    if not ops and not prelive:
        raise LogError(f"{path}: no operation to convert")

    # Second pass: ids in order of allocation (the blocks live at the start first), streams in
    # order of first appearance, and the most bytes live at once.
    ids, streams, lines = {}, {}, []
    live_bytes = peak = 0

    def stream_no(key):
        return streams.setdefault(key, len(streams))

    def allocate(sid, nbytes, key):
        nonlocal live_bytes, peak
        ids[sid] = len(ids)
        live_bytes += nbytes
        peak = max(peak, live_bytes)
        lines.append(f"a {ids[sid]} {nbytes} {stream_no(key)}")

    for sid, nbytes, key in prelive:
        allocate(sid, nbytes, key)
    if prelive:
        lines.append("# step 1")
    for o in ops:
        if o[0] == "a":
            allocate(o[1], o[2], o[3])
        else:
            live_bytes -= sizes[o[1]]
            lines.append(f"f {ids[o[1]]} {stream_no(o[2])}")
    count = sum(1 for text in lines if not text.startswith("#"))

    head = [f"# streamalloc trace v1 {name} ops={count} peak_live={peak}",
            f"# converted from {os.path.basename(path)} ({source['kind']}) by scripts/log_to_trace.py",
            f"# live at start: {len(prelive)} blocks, {sum(b for _, b, _ in prelive)} bytes (freed in the log, "
            f"allocated before it)",
            "# streams: " + ", ".join(f"{n} = {'synchronous calls' if k == SYNC_STREAM else k}"
                                      for k, n in streams.items())]
    left = []
    if failed:
        left.append(f"{failed} failed allocations")
    if zero:
        left.append(f"{zero} allocations of 0 bytes")
    if null_frees:
        left.append(f"{null_frees} frees of null")
    if left:
        head.append("# left out: " + ", ".join(left))
    if source.get("dropped"):
        head.append(f"# the history had dropped its {source['dropped']} oldest events")
    if over_aligned:
        head.append(f"# {over_aligned} allocations asked for an alignment above 256, which the format does not keep")
    return "\n".join(head + lines) + "\n"


def write(text, out):
    if out == "-":
        sys.stdout.write(text)
    elif out.endswith(".gz"):
        with gzip.open(out, "wt", encoding="utf-8") as f:
            f.write(text)
    else:
        with open(out, "w", encoding="utf-8") as f:
            f.write(text)


def self_test():
    """Converts a made-up log in each format and checks the trace line by line."""
    csv_log = (
        "time_ns,thread,operation,pointer,bytes,alignment,stream,outcome,exception,message\n"
        "10,1,allocate_async,0x7f0000000000,4096,256,0x55aa00,ok,,\n"
        "20,1,free_async,0x7f0000100000,1000,256,0x55aa00,ok,,\n"          # allocated before the log
        "30,2,allocate,0x7f0000200000,512,4096,,ok,,\n"
        "40,1,allocate_async,,1099511627776,256,0x55bb00,failed,streamalloc::out_of_memory,\"too big, \"\"sorry\"\"\"\n"
        "50,2,allocate_async,0x0,0,256,0x55bb00,ok,,\n"
        "60,1,free_async,0x7f0000000000,4096,256,0x55bb00,ok,,\n"
        "70,2,allocate_async,0x7f0000000000,8192,256,0x55bb00,ok,,\n"       # the same address, again
        "75,2,resize_async,0x7f0000000000,16384,256,0x55bb00,ok,,\n"        # grown in place
        "80,2,free,0x7f0000200000,512,4096,,ok,,\n"
    )
    want_ops = ["a 0 1000 0", "# step 1", "a 1 4096 0", "f 0 0", "a 2 512 1", "f 1 2", "a 3 8192 2", "f 3 2", "a 4 16384 2", "f 2 1"]
    json_log = "".join(json.dumps(r, separators=(",", ":")) + "\n" for r in _as_json(csv_log))
    with tempfile.TemporaryDirectory() as d:
        for fmt, text in (("csv", csv_log), ("json", json_log)):
            path = os.path.join(d, f"t.{fmt}")
            with open(path, "w", encoding="utf-8") as f:
                f.write(text)
            trace = convert(path, "selftest").splitlines()
            assert trace[0] == "# streamalloc trace v1 selftest ops=9 peak_live=16896", trace[0]
            ops = [t for t in trace[1:] if not t.startswith("# ") or t == "# step 1"]
            assert ops == want_ops, (fmt, ops)
            assert "# live at start: 1 blocks, 1000 bytes" in "\n".join(trace)
            assert "# left out: 1 failed allocations, 1 allocations of 0 bytes" in trace, trace
            assert "# streams: 0 = 0x55aa00, 1 = synchronous calls, 2 = 0x55bb00" in trace, trace
            assert "# 1 allocations asked for an alignment above 256, which the format does not keep" in trace
            out = os.path.join(d, f"t.{fmt}.trace.gz")
            write(convert(path, "selftest"), out)
            with gzip.open(out, "rt") as f:
                assert f.read().splitlines() == trace
        # A snapshot's history: the pool's own events left out, streams by id, a free of a block
        # allocated before the history's first event live at the start.
        events = [{"t_ns": 1, "op": "grow", "stream": 7, "address": 4096, "bytes": 1 << 26},
                  {"t_ns": 2, "op": "allocate", "stream": 7, "address": 4096, "bytes": 1000},
                  {"t_ns": 3, "op": "free", "stream": 9, "address": 8192, "bytes": 300},
                  {"t_ns": 4, "op": "allocate", "stream": 9, "address": 8192, "bytes": 500},
                  {"t_ns": 5, "op": "free", "stream": 7, "address": 4096, "bytes": 1000},
                  {"t_ns": 6, "op": "remap", "stream": 7, "address": 4096, "bytes": 1 << 21}]
        snap = {"version": 100, "blocks": [], "history": {"capacity": 8, "dropped": 2, "events": events}}
        path = os.path.join(d, "pool.snapshot.json.gz")
        with gzip.open(path, "wt") as f:
            json.dump(snap, f)
        trace = convert(path, "snap").splitlines()
        assert trace[0] == "# streamalloc trace v1 snap ops=5 peak_live=1500", trace[0]
        ops = [t for t in trace[1:] if not t.startswith("# ") or t == "# step 1"]
        assert ops == ["a 0 300 0", "# step 1", "a 1 1000 1", "f 0 0", "a 2 500 0", "f 1 1"], ops
        assert "(a pool snapshot's history)" in trace[1], trace[1]
        assert "# streams: 0 = 9, 1 = 7" in trace, trace
        assert "# the history had dropped its 2 oldest events" in trace, trace
        del snap["history"]
        with gzip.open(path, "wt") as f:
            json.dump(snap, f)
        try:
            convert(path)
            raise AssertionError("a snapshot without a history was accepted")
        except LogError as e:
            assert "without a history" in str(e), e
        bad = os.path.join(d, "bad.csv")
        with open(bad, "w") as f:
            f.write(csv_log.splitlines()[0] + "\n1,1,allocate,0x10,1,256,,ok,,\n2,1,allocate,0x10,1,256,,ok,,\n")
        try:
            convert(bad)
            raise AssertionError("a pointer allocated twice was accepted")
        except LogError as e:
            assert "bad.csv:3: 0x10 allocated while live" in str(e), e
    print("log_to_trace self-test: ok")


def _as_json(csv_text):
    rows = list(csv.reader(io.StringIO(csv_text)))
    for row in rows[1:]:
        r = dict(zip(rows[0], row))
        out = {"time_ns": int(r["time_ns"]), "thread": int(r["thread"]), "operation": r["operation"],
               "pointer": r["pointer"] or None, "bytes": int(r["bytes"]), "alignment": int(r["alignment"]),
               "stream": r["stream"] or None, "outcome": r["outcome"]}
        if r["outcome"] != "ok":
            out["exception"], out["message"] = r["exception"], r["message"]
        yield out


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("log", nargs="?",
                    help="a logging_resource log, CSV or JSON lines, or a pool snapshot with its history (.gz read too)")
    ap.add_argument("-o", "--output", default="-", help="the trace to write (.gz: compressed; default: stdout)")
    ap.add_argument("--name", help="the trace's name in its header (default: the log's file name)")
    ap.add_argument("--self-test", action="store_true", help="check the conversion on made-up logs and exit")
    args = ap.parse_args()
    if args.self_test:
        self_test()
        return 0
    if not args.log:
        ap.error("give a log (or --self-test)")
    try:
        write(convert(args.log, args.name), args.output)
    except (LogError, OSError) as e:
        print(f"log_to_trace: {e}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
