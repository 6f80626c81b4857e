"""The snapshot converter behind record.py: a torch.cuda.memory._snapshot() dict turned into the
replay format that bench/trace_file.hpp reads, cut to a size limit and compressed.

Pure Python, no torch, so that it can be checked without a GPU (self_test below, run by
`record.py --self-test`; bench/traces/README.md says how it was checked on made-up snapshots).
The format itself is described in record.py's opening comment and in README.md.
"""

import gzip
import os
import tempfile

FORMAT_LINE = "streamalloc trace v1"
# The allocator's history ring: 2 or 3 entries an allocation. The recording child asks for a
# ring this size; the converter warns when a history fills it (the earliest events were lost).
MAX_ENTRIES = 1_000_000


class ConversionError(Exception):
    pass


class _Block:
    """One allocation of the program: what it asked for and on which stream."""

    __slots__ = ("size", "stream", "addr")

    def __init__(self, size, stream, addr):
        self.size = int(size)
        self.stream = int(stream)
        self.addr = addr


def _time_scale(events, marks):
    """How the events' time stamps relate to our marks: (clock name, factor to microseconds),
    or None when they cannot be matched (then steps are not told apart).

    PyTorch stamps each history entry ('time_us') from an approximate clock converted to wall
    time; our marks are taken from the wall clock and from the monotonic clock, in microseconds.
    The factor and clock are whichever put the stamps inside the recorded window."""
    stamps = [e.get("time_us") for e in events if e.get("action") in ("alloc", "free_requested")]
    stamps = [t for t in stamps if isinstance(t, (int, float))]
    if not stamps or not marks:
        return None
    first, last = stamps[0], stamps[-1]
    best = None
    for clock, ms in marks.items():
        lo, hi = ms[0], ms[-1]
        for factor in (1.0, 1e-3, 1e3):
            a, b = first * factor, last * factor
            slack = 2e6  # 2 s either side
            if a >= lo - slack and b <= hi + slack:
                err = abs(a - lo) + abs(hi - b)
                if best is None or err < best[0]:
                    best = (err, clock, factor)
    return None if best is None else (best[1], best[2])


def convert_snapshot(snapshot, device=0, marks=None):
    """Turns a snapshot into operations.

    snapshot: the dict torch.cuda.memory._snapshot() returns: 'device_traces' (a list per device
    of history entries: action, addr, size, stream, time_us, ...) and 'segments' (the caching
    allocator's segments at snapshot time, each with its 'blocks': address, size,
    requested_size, state).
    marks: {clock name: [microseconds]} taken before each step and after the last, or None.

    Returns a dict: 'pre' (blocks live before the recording, in the order they are allocated at
    the start), 'body' (operations in recorded order: ('a', block) or ('f', block, stream)),
    'step_starts' (index into body where each step begins, one per mark; None when the steps
    cannot be told apart), 'warnings', 'entries'.

    An allocation is taken at 'alloc' (its size is the size the program asked for), its free at
    'free_requested': the moment the program let go of the memory, which is where a
    stream-ordered allocator is called (cudaFreeAsync, pool.deallocate(p, stream)); keeping the
    memory from reuse until the GPU work using it is done is then that allocator's job, in
    stream order. 'free_completed' is when PyTorch's caching allocator itself lets the block be
    reused: later than 'free_requested' only for blocks used on other streams (record_stream),
    where it waits for CUDA events on the host. That is its mechanism, not the program's, and
    replaying it would hand PyTorch's delays to every allocator replayed. Segment events, OOMs and
    snapshot marks are the caching allocator's own and are skipped."""
    traces = snapshot.get("device_traces")
    if not isinstance(traces, list) or device >= len(traces):
        raise ConversionError("the snapshot has no 'device_traces' entry for device %d" % device)
    events = traces[device] or []
    warnings = []
    if len(events) >= MAX_ENTRIES - 1:
        warnings.append("the history ring was full (%d entries): the earliest events were lost, "
                        "their blocks count as live before the recording" % len(events))

    scale = _time_scale(events, marks) if marks else None
    mark_list = [m / 1.0 for m in marks[scale[0]]] if scale else None
    if marks and not scale:
        warnings.append("event time stamps do not match the step marks: steps not told apart")

    live = {}  # address -> block allocated there during the recording, not yet freed
    pre_freed = []  # blocks freed with no allocation seen: live before the recording
    body = []
    step_starts = [] if mark_list else None
    next_mark = 0
    for e in events:
        action = e.get("action")
        if action not in ("alloc", "free_requested"):
            continue
        if mark_list is not None:
            t = e.get("time_us")
            if isinstance(t, (int, float)):
                t = t * scale[1]
                while next_mark < len(mark_list) and t >= mark_list[next_mark]:
                    step_starts.append(len(body))
                    next_mark += 1
        addr = e.get("addr")
        size = e.get("size", 0)
        stream = e.get("stream", 0) or 0
        if addr is None:
            continue
        if action == "alloc":
            if size <= 0:
                continue  # PyTorch does not record empty allocations; be safe anyway
            old = live.pop(addr, None)
            if old is not None:
                warnings.append("allocation at 0x%x, which was never freed: freed there" % addr)
                body.append(("f", old, old.stream))
            b = _Block(size, stream, addr)
            live[addr] = b
            body.append(("a", b))
        else:
            b = live.pop(addr, None)
            if b is None:
                b = _Block(size if size > 0 else 1, stream, addr)
                pre_freed.append(b)
            body.append(("f", b, stream))
    if step_starts is not None:
        while len(step_starts) < len(mark_list):
            step_starts.append(len(body))
        if step_starts:
            step_starts[0] = 0  # anything before the first mark belongs to the first step

    # Blocks live at the snapshot that no recorded allocation made: live all along.
    long_lived = []
    seen_live = set()
    for seg in snapshot.get("segments") or []:
        if seg.get("device", device) != device:
            continue
        at = seg.get("address", 0)
        for blk in seg.get("blocks") or []:
            baddr = blk.get("address", at)
            at = baddr + blk.get("size", 0)
            if blk.get("state") != "active_allocated":
                continue
            if baddr in live:
                seen_live.add(baddr)
                continue
            size = blk.get("requested_size") or blk.get("size") or 0
            if size > 0:
                long_lived.append(_Block(size, seg.get("stream", 0) or 0, baddr))
    if snapshot.get("segments") is not None:
        missing = [a for a in live if a not in seen_live]
        if missing:
            warnings.append("%d blocks allocated during the recording and never freed are not "
                            "live in the snapshot's segments" % len(missing))
    long_lived.sort(key=lambda b: b.addr)
    pre_freed.sort(key=lambda b: b.addr)
    return {
        "pre": long_lived + pre_freed,
        "body": body,
        "step_starts": step_starts,
        "warnings": warnings,
        "entries": len(events),
    }


def render_trace(name, conv, steps_kept=None, header_notes=(), cut_ops=None):
    """The trace text for `conv` (from convert_snapshot), keeping the first `steps_kept` steps
    (all when None), or, where steps are not known, the first `cut_ops` recorded operations.
    Returns (text, facts)."""
    pre, body, starts = conv["pre"], conv["body"], conv["step_starts"]
    end = len(body)
    if starts is not None and steps_kept is not None and steps_kept < len(starts) - 1:
        end = starts[steps_kept]
    if cut_ops is not None:
        end = min(end, cut_ops)
    ids = {}
    streams = {}
    lines = []
    live = peak = 0
    n_ops = 0

    def stream_no(raw):
        s = streams.get(raw)
        if s is None:
            s = streams[raw] = len(streams)
        return s

    def alloc(b):
        nonlocal live, peak, n_ops
        i = ids[id(b)] = len(ids)
        lines.append("a %d %d %d" % (i, b.size, stream_no(b.stream)))
        live += b.size
        peak = max(peak, live)
        n_ops += 1

    def free(b, stream):
        nonlocal live, n_ops
        lines.append("f %d %d" % (ids[id(b)], stream_no(stream)))
        live -= b.size
        n_ops += 1

    if pre:
        lines.append("# live at start: %d blocks, %d bytes (allocated before the recording)"
                     % (len(pre), sum(b.size for b in pre)))
    for b in pre:
        alloc(b)
    step_at = {}
    if starts is not None:
        for k, s in enumerate(starts[:-1]):
            step_at.setdefault(s, []).append(k + 1)
    for i in range(end):
        for k in step_at.get(i, ()):
            lines.append("# step %d" % k)
        op = body[i]
        if op[0] == "a":
            alloc(op[1])
        else:
            free(op[1], op[2])
    n_steps = None
    if starts is not None:
        n_steps = len(starts) - 1 if steps_kept is None else min(steps_kept, len(starts) - 1)
    head = ["# %s %s ops=%d peak_live=%d" % (FORMAT_LINE, name, n_ops, peak)]
    head += ["# " + n for n in header_notes]
    head.append("# streams: %d; live at start: %d blocks; steps: %s"
                % (len(streams), len(pre), "unknown" if n_steps is None else n_steps))
    text = "\n".join(head + lines) + "\n"
    return text, {"ops": n_ops, "peak_live": peak, "streams": len(streams),
                  "pre_live_blocks": len(pre), "pre_live_bytes": sum(b.size for b in pre),
                  "steps": n_steps, "body_ops_kept": end, "body_ops": len(body)}


def compress(text):
    return gzip.compress(text.encode("ascii"), compresslevel=9, mtime=0)


def fit_trace(name, conv, max_bytes, header_notes):
    """Renders the trace, dropping whole steps (and, if one step is still too large or the steps
    are not known, trailing operations) until it compresses to at most max_bytes. Returns
    (gz bytes, facts)."""
    text, facts = render_trace(name, conv, None, header_notes)
    gz = compress(text)
    starts = conv["step_starts"]
    recorded = None if starts is None else len(starts) - 1
    keep = None
    notes = list(header_notes)
    if len(gz) > max_bytes and recorded is not None and recorded > 1:
        keep = recorded
        while keep > 1 and len(gz) > max_bytes:
            keep -= 1
            notes = list(header_notes) + ["kept %d of %d recorded steps (size limit %d bytes)"
                                          % (keep, recorded, max_bytes)]
            text, facts = render_trace(name, conv, keep, notes)
            gz = compress(text)
    cut = facts["body_ops_kept"]
    while len(gz) > max_bytes and cut > 1000:
        cut = int(cut * max_bytes / len(gz) * 0.95)
        cut_notes = notes + ["cut after %d of %d recorded operations, inside a step (size limit "
                             "%d bytes)" % (cut, len(conv["body"]), max_bytes)]
        text, facts = render_trace(name, conv, keep, cut_notes, cut_ops=cut)
        gz = compress(text)
        facts["cut_inside_step"] = True
    return gz, facts


def write_atomic(path, data):
    d = os.path.dirname(os.path.abspath(path))
    fd, tmp = tempfile.mkstemp(prefix=".tmp-", dir=d)
    try:
        with os.fdopen(fd, "wb") as f:
            f.write(data)
        os.replace(tmp, path)
    except BaseException:
        try:
            os.unlink(tmp)
        except OSError:
            pass
        raise


# ---------------------------------------------------------------------------------------------
# The check without a GPU (record.py --self-test): the converter on a made-up snapshot.
# ---------------------------------------------------------------------------------------------


def self_test():
    """The converter on a snapshot made up in the shape torch.cuda.memory._snapshot() has."""
    s1, s2, t0 = 0x7F00AA, 0x7F00BB, 1_700_000_000_000_000

    def ev(action, addr, size, stream, t):
        return {"action": action, "addr": addr, "size": size, "stream": stream, "time_us": t, "frames": []}

    events = [
        ev("segment_alloc", 0x5000, 2 << 20, s1, t0 + 5),
        ev("alloc", 0x5000, 100, s1, t0 + 10),
        ev("alloc", 0x6000, 2000, s2, t0 + 11),
        ev("free_requested", 0x5000, 100, s1, t0 + 12),
        ev("free_completed", 0x5000, 100, s1, t0 + 13),
        ev("alloc", 0x5000, 50, s1, t0 + 14),  # the same address again
        ev("free_requested", 0x3000, 1000, s1, t0 + 15),  # allocated before the recording
        ev("free_completed", 0x3000, 1000, s1, t0 + 15),
        ev("free_requested", 0x6000, 2000, s2, t0 + 16),  # its free_completed comes later
        ev("alloc", 0x7000, 300, s1, t0 + 1010),  # step 2; still live at the snapshot
        ev("free_requested", 0x5000, 50, s1, t0 + 1011),
        ev("free_completed", 0x6000, 2000, s2, t0 + 1012),
        ev("free_completed", 0x5000, 50, s1, t0 + 1013),
        {"action": "oom", "device_free": 5, "size": 5, "stream": s1, "time_us": t0 + 1014},
    ]
    segments = [
        {"device": 0, "address": 0x1000, "total_size": 0x2000, "stream": s2, "segment_type": "small",
         "blocks": [{"address": 0x1000, "size": 4096, "requested_size": 4000, "state": "active_allocated"},
                    {"address": 0x2000, "size": 4096, "requested_size": 0, "state": "inactive"}]},
        # blocks without 'address' (older torch): found by adding up sizes
        {"device": 0, "address": 0x5000, "total_size": 0x3000, "stream": s1, "segment_type": "small",
         "blocks": [{"size": 0x1000, "requested_size": 50, "state": "inactive"},
                    {"size": 0x1000, "requested_size": 2000, "state": "active_pending_free"},
                    {"size": 0x1000, "requested_size": 300, "state": "active_allocated"}]},
    ]
    marks = {"wall": [t0, t0 + 1000, t0 + 2000], "monotonic": [5_000_000, 5_001_000, 5_002_000]}
    conv = convert_snapshot({"segments": segments, "device_traces": [events]}, 0, marks)
    assert not conv["warnings"], conv["warnings"]
    text, facts = render_trace("made_up", conv, None, ["workload: made up"])
    lines = text.splitlines()
    ops = [l for l in lines if not l.startswith("#")]
    want = ["a 0 4000 0", "a 1 1000 1", "a 2 100 1", "a 3 2000 0", "f 2 1", "a 4 50 1", "f 1 1", "f 3 0",
            "a 5 300 1", "f 4 1"]
    assert ops == want, ops
    assert lines[0] == "# %s made_up ops=10 peak_live=7100" % FORMAT_LINE, lines[0]
    assert lines.index("# step 1") == lines.index("a 2 100 1") - 1
    assert lines.index("# step 2") == lines.index("a 5 300 1") - 1
    one, f1 = render_trace("made_up", conv, 1, [])
    assert "# step 2" not in one and f1["ops"] == 8 and f1["steps"] == 1
    # time stamps in nanoseconds, matched against the monotonic marks
    ns = [dict(e, time_us=(e["time_us"] - t0 + 5_000_000) * 1000) for e in events]
    assert convert_snapshot({"segments": segments, "device_traces": [ns]}, 0, marks)["step_starts"] == conv["step_starts"]
    # stamps that match no mark: same operations, steps unknown, a warning
    off = [dict(e, time_us=e["time_us"] - 10 ** 9) for e in events]
    c3 = convert_snapshot({"segments": segments, "device_traces": [off]}, 0, marks)
    assert c3["step_starts"] is None and c3["warnings"]
    assert [l for l in render_trace("x", c3, None, [])[0].splitlines() if not l.startswith("#")] == want
    gz, _ = fit_trace("made_up", conv, 1 << 20, [])
    assert gzip.decompress(gz).decode() == text.replace("# workload: made up\n", "")
    # flushed, as workloads.say does: a parent's lines and its children's stay in order
    print("self-test: the converter gives the expected operations", flush=True)
