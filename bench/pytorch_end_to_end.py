#!/usr/bin/env python3
"""End to end through PyTorch: the workloads whose traces bench/traces holds, run for real with
PyTorch's own allocator (its default, and expandable segments) and with streamalloc as PyTorch's
allocator, each run a process of its own, the allocators taken in rotation, several rounds.

    python3 bench/pytorch_end_to_end.py [--only NAME[,NAME...]] [--runs 3] [--steps 20]
                                        [--json FILE] [--snapshots DIR] [--pin CPU,CPU]
    python3 bench/pytorch_end_to_end.py --report FILE.json [FILE.json ...]

For every process it measures
  - the device memory the process held at its peak: cudaMemGetInfo's total minus free, polled
    after the model is built, after the warm-up step and after every step (the CUDA context
    and the libraries' workspaces are in it, the same for every allocator);
  - the allocator's own high-water mark of reserved memory (PyTorch's max_memory_reserved, or
    the pool's reserved_high);
  - the median time of a step (forward, backward and optimizer step, or for gpt2_generate one
    pass over its four requests), synchronized, after one warm-up step (for gpt2_generate, a
    small request and then one whole pass, whose first calls for each shape are slow);
  - within a step, the host's part (until every launch and allocation of the step is made) and
    the stream's span (events before the first and after the last kernel): when the host's
    part is close to the step, the step is bound by the host, where an allocator's own time
    shows, and the machine's speed from one process to the next decides more than on the GPU;
and prints each workload's table, with streamalloc's ratios to PyTorch's default allocator
taken within each round (the machine's speed varies between processes more than between
allocators; a round's processes run back to back).

`--allocators ...,streamalloc_timed` runs streamalloc through bench/timed_streamalloc.cpp (the
target bench_timed_streamalloc), which times each call: the report then says how long a step
spends inside streamalloc, in the process itself, and how many calls it makes.

`--allocators ...,pluggable_control` adds a control: bench/pluggable_control.cpp (the target
bench_pluggable_control), the least an allocator behind PyTorch's CUDAPluggableAllocator can do
per call (same-stream, same-size lists over cudaMalloc, one hash lookup under a mutex). Its
step time over PyTorch's default is what the pluggable interface itself costs; streamalloc's
over the control's is what streamalloc's own work adds.

With --snapshots, each streamalloc process keeps the pool's history and writes, after its last
step, DIR/<workload>.snapshot.json.gz (pool::snapshot: reservations, chunks, every block, and
the history of allocations, frees, growths and remaps), for scripts/plot_snapshot.py; keeping
the history costs about 200 ns an allocation, so its step times are not the table's.

The workloads are bench/traces/workloads.py's (those bench/traces/record.py records), built from configs with random weights: nothing is
downloaded. cuDNN's benchmark mode is off for every allocator here: PyTorch refuses it with any
pluggable allocator ("CUDAPluggableAllocator does not yet support cacheInfo"). Needs PyTorch with CUDA, transformers and torchvision, and libstreamalloc_c (found
as the streamalloc package finds it: $STREAMALLOC_LIBRARY, or the build folders of this tree);
exits 77 (skipped) without PyTorch or a GPU.
"""

import argparse
import json
import math
import os
import pathlib
import statistics
import subprocess
import sys
import tempfile
import time

SKIP = 77
HERE = pathlib.Path(__file__).resolve()
sys.path.insert(0, str(HERE.parent / "traces"))
sys.path.insert(0, str(HERE.parents[1] / "python"))
import record  # noqa: E402  (the workloads; torch is imported in the child processes only)

ALLOCATORS = {  # name: PYTORCH_CUDA_ALLOC_CONF, or None for an allocator plugged in
    "pytorch": "",
    "pytorch_expandable": "expandable_segments:True",
    "streamalloc": None,
    # Not an allocator to use: bench/pluggable_control.cpp, the least an allocator behind
    # CUDAPluggableAllocator can do per call; its step time is PyTorch's pluggable interface's.
    "pluggable_control": None,
    # streamalloc through bench/timed_streamalloc.cpp: a clock around each call, so that the
    # time a step spends inside streamalloc is measured in the process (adds some 50 ns a call).
    "streamalloc_timed": None,
}
DEFAULT_ALLOCATORS = ["pytorch", "pytorch_expandable", "streamalloc"]
MIB = float(1 << 20)


def bench_library(target, variable):
    """A bench target's shared library: $variable, or a build folder's."""
    if os.environ.get(variable):
        return os.environ[variable]
    for build in sorted(HERE.parents[1].glob("build*")):
        path = build / "bench" / ("lib%s.so" % target)
        if path.exists():
            return str(path)
    raise SystemExit("build the target %s (STREAMALLOC_BUILD_BENCH=ON) or set %s" % (target, variable))


def control_library():
    """bench/pluggable_control.cpp's library."""
    return bench_library("bench_pluggable_control", "STREAMALLOC_CONTROL_LIBRARY")


def timed_library():
    """bench/timed_streamalloc.cpp's library (it needs the C library of the same build)."""
    return bench_library("bench_timed_streamalloc", "STREAMALLOC_TIMED_LIBRARY")


def timed_totals(lib):
    """The timed library's calls and nanoseconds so far."""
    import ctypes
    calls, ns = ctypes.c_uint64(), ctypes.c_uint64()
    lib.timed_totals(ctypes.byref(calls), ctypes.byref(ns))
    return calls.value, ns.value


def timed_kinds(lib):
    """Allocations' and frees' calls, nanoseconds and power-of-two buckets of call times so far."""
    import ctypes
    kinds = []
    for kind in (0, 1):
        calls, ns = ctypes.c_uint64(), ctypes.c_uint64()
        buckets, bucket_ns = (ctypes.c_uint64 * 32)(), (ctypes.c_uint64 * 32)()
        lib.timed_kind(kind, ctypes.byref(calls), ctypes.byref(ns), buckets, bucket_ns)
        kinds.append({"calls": calls.value, "ns": ns.value, "buckets": list(buckets), "bucket_ns": list(bucket_ns)})
    return kinds


# What timed_probe times (bench/timed_streamalloc.cpp), and the bytes written over the CPU's
# caches before each call: none, more than a core's first level, about a second level's size
# (half of some hosts'), and a good part of a third level's.
PROBES = ["clock", "allocate", "free", "cuCtxGetCurrent", "cuStreamIsCapturing", "cuStreamGetId"]
EVICT_BYTES = [0, 64 << 10, 1 << 20, 8 << 20]


def timed_probes(lib, torch):
    """Median ns of each probe, per stream (the steps' own, and a stream made for it) and per
    amount written over the caches before each call: {stream: {probe: {bytes: ns}}}."""
    import ctypes
    lib.timed_probe.restype = ctypes.c_double
    lib.timed_probe.argtypes = [ctypes.c_int, ctypes.c_int, ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
    device = torch.cuda.current_device()
    made = torch.cuda.Stream()
    streams = {"the steps' stream": torch.cuda.current_stream().cuda_stream, "a stream made for it": made.cuda_stream}
    out = {}
    for label, handle in streams.items():
        out[label] = {p: {str(b): lib.timed_probe(i, device, handle, b, 2001 if b < (1 << 20) else 401)
                          for b in EVICT_BYTES} for i, p in enumerate(PROBES)}
    torch.cuda.synchronize()
    return out


def child(name, allocator, steps, result_path, snapshot_dir=None, pin=None):
    """One process: build, warm up, run `steps` steps, write what it measured."""
    if pin:  # every process of a run on the same cores: the host's speed as alike as it gets
        os.sched_setaffinity(0, {int(c) for c in pin.split(",")})
    timed = None
    if allocator == "streamalloc_timed":
        import ctypes
        # The streamalloc package must load the C library the timed one links (the same
        # build's), or its statistics would be of another copy's pool.
        os.environ["STREAMALLOC_LIBRARY"] = str(pathlib.Path(timed_library()).parents[1] / "libstreamalloc_c.so")
        import torch
        torch.cuda.memory.change_current_allocator(torch.cuda.memory.CUDAPluggableAllocator(
            timed_library(), "timed_torch_malloc", "timed_torch_free"))
        timed = ctypes.CDLL(timed_library())  # the handle PyTorch opened: the same counters
        import streamalloc  # for its statistics and snapshots, below
    elif allocator.startswith("streamalloc"):
        import streamalloc
        streamalloc.use_in_pytorch()  # before CUDA initialises
    if allocator == "pluggable_control":  # as use_in_pytorch: before CUDA initialises
        import torch
        torch.cuda.memory.change_current_allocator(torch.cuda.memory.CUDAPluggableAllocator(
            control_library(), "control_torch_malloc", "control_torch_free"))
    torch = record._import_torch()
    _, total = torch.cuda.mem_get_info()
    if snapshot_dir and allocator.startswith("streamalloc"):
        streamalloc.keep_history(1 << 18)
    peak = 0

    def poll():
        nonlocal peak
        free, _ = torch.cuda.mem_get_info()
        peak = max(peak, total - free)

    w = record.BY_NAME[name](torch)
    w.setup()
    # cuDNN's benchmark mode asks the allocator for its largest free block, which PyTorch's
    # CUDAPluggableAllocator refuses ("does not yet support cacheInfo"), whichever allocator it
    # wraps: off for every allocator here, so all run the same kernels.
    torch.backends.cudnn.benchmark = False
    first_pass = None
    if name == "gpt2_generate":  # a step is one pass over its requests, of different shapes
        requests = w.clamp_steps(0)
        steps = max(4, steps // 3)

        def step(_):
            for j in range(requests):
                w.step(j)
    else:
        step = w.step
    poll()
    w.warmup()
    if name == "gpt2_generate":
        # The first pass over the requests' shapes costs about 25 s on an H100 with every
        # allocator (the libraries' first calls for each shape), eight times a later pass: a
        # warm-up of its own, or a median of a few passes is that outlier's neighbour.
        torch.cuda.synchronize()
        t = time.perf_counter()
        step(0)
        torch.cuda.synchronize()
        first_pass = time.perf_counter() - t
    torch.cuda.synchronize()
    poll()
    counts_before = pool_counts(allocator)
    times, enqueue, gpu, inside, calls = [], [], [], [], []
    kinds_before = timed_kinds(timed) if timed else None
    for i in range(steps):
        begin, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        before = timed_totals(timed) if timed else None
        t = time.perf_counter()
        begin.record()
        step(i)
        end.record()
        queued = time.perf_counter()  # the host's part: every launch (and allocation) made
        torch.cuda.synchronize()
        done = time.perf_counter()
        times.append(done - t)
        enqueue.append(queued - t)
        if timed:
            after = timed_totals(timed)
            calls.append(after[0] - before[0])
            inside.append((after[1] - before[1]) / 1e9)
        gpu.append(begin.elapsed_time(end) / 1e3)
        poll()
    if timed:  # the steps' calls by kind, then the probes (after the steps: they allocate too)
        kinds = [{"calls": a["calls"] - b["calls"], "ns": a["ns"] - b["ns"],
                  "buckets": [x - y for x, y in zip(a["buckets"], b["buckets"])],
                  "bucket_ns": [x - y for x, y in zip(a["bucket_ns"], b["bucket_ns"])]}
                 for a, b in zip(timed_kinds(timed), kinds_before)]
        probes = timed_probes(timed, torch)
    counts = pool_counts(allocator)
    if counts:  # growths and remaps over the whole run, and over the timed steps alone
        counts.update({k + "_in_steps": counts[k] - counts_before[k] for k in counts_before})
    if allocator.startswith("streamalloc"):
        import streamalloc
        reserved_high = streamalloc.statistics()["reserved_high"]
        if snapshot_dir:
            import gzip
            os.makedirs(snapshot_dir, exist_ok=True)
            with gzip.open(os.path.join(snapshot_dir, name + ".snapshot.json.gz"), "wt") as f:
                json.dump(streamalloc.snapshot(), f)
    elif allocator == "pluggable_control":
        import ctypes
        lib = ctypes.CDLL(control_library())  # the handle PyTorch opened: the same counters
        lib.control_reserved_high.restype = ctypes.c_uint64
        reserved_high = lib.control_reserved_high()
    else:
        reserved_high = torch.cuda.max_memory_reserved()
    out = {"workload": name, "allocator": allocator, "steps": steps, "process_peak_bytes": peak,
           "reserved_high_bytes": reserved_high, "step_s_median": statistics.median(times),
           "step_s": times,
           "enqueue_s_median": statistics.median(enqueue), "gpu_s_median": statistics.median(gpu),
           "cpu": sorted(os.sched_getaffinity(0)), "first_pass_s": first_pass, "pool_counts": counts, "torch": torch.__version__, "gpu": torch.cuda.get_device_name(0)}
    if timed:  # per step: the allocator's calls, and the seconds spent inside them
        out.update({"allocator_calls": calls, "inside_allocator_s": inside,
                    "allocate_calls": kinds[0], "free_calls": kinds[1], "probes_ns": probes})
    with open(result_path, "w") as f:
        json.dump(out, f)


def pool_counts(allocator):
    """streamalloc's growths and chunks remapped so far; None for PyTorch's allocator."""
    if not allocator.startswith("streamalloc"):
        return None
    import streamalloc
    st = streamalloc.statistics()
    return {"grows": st["grows"], "remapped_chunks": st["remapped_chunks"]}


def run_child(name, allocator, steps, timeout, snapshot_dir=None, pin=None):
    fd, result = tempfile.mkstemp(prefix="e2e-", suffix=".json")
    os.close(fd)
    env = record.child_env(ALLOCATORS[allocator])
    cmd = [sys.executable, str(HERE), "--child", name, allocator, "--steps", str(steps), "--result", result]
    if snapshot_dir:
        cmd += ["--snapshots", snapshot_dir]
    if pin:
        cmd += ["--pin", pin]
    try:
        proc = subprocess.run(cmd, env=env, timeout=timeout, capture_output=True, text=True)
        with open(result) as f:
            text = f.read()
        if proc.returncode != 0 or not text:
            tail = (proc.stdout + proc.stderr).strip().splitlines()[-5:]
            return None, "exit %d: %s" % (proc.returncode, " | ".join(tail))
        return json.loads(text), None
    except subprocess.TimeoutExpired:
        return None, "over its %d s" % timeout
    finally:
        os.unlink(result)


def spread(values, fmt):
    values = sorted(values)
    if len(values) == 1:
        return fmt % values[0]
    return (fmt + " (" + fmt + ".." + fmt + ")") % (statistics.median(values), values[0], values[-1])


def tenth(values):
    """The 10th percentile, by nearest rank (the fastest tenth's upper end)."""
    values = sorted(values)
    return values[max(0, math.ceil(len(values) / 10) - 1)]


def finished(*results):
    return all(r and "failed" not in r for r in results)


def pooled(runs):
    """Every timed step of the given processes: (median, 10th percentile)."""
    steps = [s for r in runs for s in r["step_s"]]
    return statistics.median(steps), tenth(steps)


def compare_steps(label, mine, theirs):
    """One allocator's step time over another's, round by round and with every step of those
    rounds pooled (median and 10th percentile); rounds where either did not finish left out."""
    pairs = [(m, t) for m, t in zip(mine, theirs) if finished(m, t)]
    if not pairs:
        return
    a, a10 = pooled(m for m, _ in pairs)
    b, b10 = pooled(t for _, t in pairs)
    print("  %s, round by round: step time %s; every step pooled: median %.3f, 10th percentile %.3f" % (
        label, spread([m["step_s_median"] / t["step_s_median"] for m, t in pairs], "%.3f"), a / b, a10 / b10))


def bucket_median(buckets):
    """The power-of-two range low..high ns (both included) that holds the median call."""
    half, seen = sum(buckets) / 2, 0
    for b, n in enumerate(buckets):
        seen += n
        if n and seen >= half:
            return (1 << (b - 1) if b else 0), (1 << b) - 1
    return 0, 0


def report_calls(timed_runs):
    """streamalloc_timed's calls by kind (all rounds added up) and its probes (median of the
    rounds): where the time inside streamalloc goes, in the process itself."""
    for kind, label in (("allocate_calls", "allocations"), ("free_calls", "frees")):
        got = [r[kind] for r in timed_runs if kind in r]
        if not got:
            return  # a results file from before the calls were kept by kind
        calls, ns = sum(g["calls"] for g in got), sum(g["ns"] for g in got)
        buckets = [sum(col) for col in zip(*(g["buckets"] for g in got))]
        low, high = bucket_median(buckets)
        slow_calls = sum(buckets[13:])  # 4,096 ns and more
        if all("bucket_ns" in g for g in got):
            slow_ns = sum(sum(g["bucket_ns"][13:]) for g in got)
            share = "%.0f%% of the time" % (100.0 * slow_ns / max(1, ns))
        else:  # files from before the buckets' time was kept: at least their count times 4,096 ns
            share = "at least %.0f%% of the time" % (100.0 * slow_calls * 4096 / max(1, ns))
        print("    %-12s %5.0f ns a call on average, the median call %d..%d ns; %.2f%% of calls took "
              "4 us or more (%s)" % (label, ns / max(1, calls), low, high, 100.0 * slow_calls / max(1, calls), share))
    probes = [r["probes_ns"] for r in timed_runs if "probes_ns" in r]
    if not probes:
        return
    print("    one call timed alone in the same process, median ns (of the rounds' medians), "
          "after writing over this many bytes:")
    sizes = list(probes[0][next(iter(probes[0]))]["clock"])
    for stream in probes[0]:
        print("      on %s" % stream)
        print("        %-22s" % "" + "".join("%10s" % ("%d KiB" % (int(b) >> 10) if int(b) else "none") for b in sizes))
        for name in probes[0][stream]:
            cells = []
            for b in sizes:
                got = [p[stream][name][b] for p in probes if p[stream][name][b] >= 0]  # -1: failed
                cells.append("%10.0f" % statistics.median(got) if got else "%10s" % "-")
            print("        %-22s" % name + "".join(cells))


def report(name, rows):
    """rows: allocator -> list of results, one per round (None where that process failed)."""
    print("\n%s" % name)
    print("  %-20s %28s %28s %26s" % ("", "process peak MiB", "allocator reserved MiB", "step ms"))
    for a in ALLOCATORS:
        if not rows.get(a):
            continue  # not run
        got = [r for r in rows.get(a, []) if finished(r)]
        if not got:
            print("  %-20s (no run finished)" % a)
            continue
        print("  %-20s %28s %28s %26s" % (
            a, spread([r["process_peak_bytes"] / MIB for r in got], "%.0f"),
            spread([r["reserved_high_bytes"] / MIB for r in got], "%.0f"),
            spread([r["step_s_median"] * 1e3 for r in got], "%.1f")))
    theirs = rows.get("pytorch", [])
    ours = rows.get("streamalloc", [])
    control = rows.get("pluggable_control", [])
    pairs = [(o, t) for o, t in zip(ours, theirs) if finished(o, t)]
    if pairs:
        peak = [o["process_peak_bytes"] / t["process_peak_bytes"] for o, t in pairs]
        step = [o["step_s_median"] / t["step_s_median"] for o, t in pairs]
        print("  streamalloc / PyTorch's default, round by round: process peak %s, step time %s"
              % (spread(peak, "%.3f"), spread(step, "%.3f")))
        # Every timed step of every round pooled, per allocator: what the rounds' own spread
        # (the machine's speed from one process to the next) leaves of the allocators' difference.
        # Steps within one process spread by half too (the host is shared with whatever else
        # runs): the fastest tenth is the least disturbed, a second estimate beside the median.
        mine, mine10 = pooled(o for o, _ in pairs)
        other, other10 = pooled(t for _, t in pairs)
        print("  every step of those rounds pooled: median %.2f ms against %.2f (%.3f), 10th percentile "
              "%.2f ms against %.2f (%.3f)" % (mine * 1e3, other * 1e3, mine / other,
                                               mine10 * 1e3, other10 * 1e3, mine10 / other10))
        if all("enqueue_s_median" in o and "enqueue_s_median" in t for o, t in pairs):
            q = [o["enqueue_s_median"] / t["enqueue_s_median"] for o, t in pairs]
            g = [o["gpu_s_median"] / t["gpu_s_median"] for o, t in pairs]
            print("  the host's part of a step (launches and allocations until the step is queued) %s, "
                  "the stream's span from its first to its last kernel %s" % (spread(q, "%.3f"), spread(g, "%.3f")))
    # The control's own work per call is a hash lookup under a mutex: its step time over
    # PyTorch's bounds what the pluggable interface costs, and streamalloc's over the control's
    # is what streamalloc's own work adds behind that interface. Each over its own rounds.
    compare_steps("the pluggable control / PyTorch's default", control, theirs)
    timed_runs = [r for r in rows.get("streamalloc_timed", []) if finished(r) and "inside_allocator_s" in r]
    if timed_runs:
        inside = [s for r in timed_runs for s in r["inside_allocator_s"]]
        steps = [s for r in timed_runs for s in r["step_s"]]
        ncalls = [n for r in timed_runs for n in r["allocator_calls"]]
        print("  inside streamalloc (streamalloc_timed), every step pooled: median %.3f ms a step (%.1f%% of the "
              "median step), %d calls a step, %.0f ns a call" % (
                  statistics.median(inside) * 1e3, 100 * statistics.median(inside) / statistics.median(steps),
                  statistics.median(ncalls), 1e9 * sum(inside) / max(1, sum(ncalls))))
        report_calls(timed_runs)
    compare_steps("streamalloc / the pluggable control", ours, control)

def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--only", help="comma-separated workloads: " + ", ".join(record.BY_NAME))
    ap.add_argument("--allocators", help="comma-separated, of: " + ", ".join(ALLOCATORS) +
                    " (default: " + ",".join(DEFAULT_ALLOCATORS) + ")")
    ap.add_argument("--runs", type=int, default=3, help="rounds: each allocator once per workload")
    ap.add_argument("--steps", type=int, default=20)
    ap.add_argument("--json", help="write every process's results here")
    ap.add_argument("--snapshots", metavar="DIR",
                    help="streamalloc's processes write the pool's snapshot with its history here")
    ap.add_argument("--report", nargs="+", metavar="JSON",
                    help="print the tables of earlier runs' --json files together (their rounds added up)")
    ap.add_argument("--pin", metavar="CPUS",
                    help="comma-separated CPU cores every process runs on (less spread between processes; "
                         "give two: the backward pass runs on a thread of its own)")
    ap.add_argument("--first", type=int, default=0, help=argparse.SUPPRESS)  # rotation of a later call
    ap.add_argument("--child", nargs=2, metavar=("WORKLOAD", "ALLOCATOR"), help=argparse.SUPPRESS)
    ap.add_argument("--result", help=argparse.SUPPRESS)
    opts = ap.parse_args()
    if opts.child:
        child(opts.child[0], opts.child[1], opts.steps, opts.result, opts.snapshots, opts.pin)
        return 0
    if opts.report:
        docs = []
        for path in opts.report:
            with open(path) as f:
                docs.append(json.load(f)["results"])
        # Rounds are compared by position: a file that did not run an allocator another file
        # ran gets None rounds for it, so that every file's rounds stay side by side.
        merged = {}
        for doc in docs:
            for n, rows in doc.items():
                merged.setdefault(n, {})
                for a, runs in rows.items():
                    if runs:
                        merged[n].setdefault(a, [])
        for n, alloc_rows in merged.items():
            for doc in docs:
                rows = doc.get(n, {})
                rounds = max((len(r) for r in rows.values()), default=0)
                for a in alloc_rows:
                    got = rows.get(a, [])
                    alloc_rows[a].extend(got + [None] * (rounds - len(got)))
        for n, rows in merged.items():
            report(n, rows)
        return 0
    try:
        import torch
    except ImportError:
        print("SKIPPED: PyTorch is not installed")
        return SKIP
    if not torch.cuda.is_available():
        print("SKIPPED: PyTorch sees no GPU")
        return SKIP
    names = [n.strip() for n in opts.only.split(",")] if opts.only else list(record.BY_NAME)
    unknown = [n for n in names if n not in record.BY_NAME]
    if unknown:
        print("unknown workload(s): %s (known: %s)" % (", ".join(unknown), ", ".join(record.BY_NAME)))
        return 2
    results = {n: {a: [] for a in ALLOCATORS} for n in names}
    failures = 0
    order = [a.strip() for a in opts.allocators.split(",")] if opts.allocators else list(DEFAULT_ALLOCATORS)
    if any(a not in ALLOCATORS for a in order):
        print("unknown allocator in %s (known: %s)" % (opts.allocators, ", ".join(ALLOCATORS)))
        return 2
    for r in range(opts.runs):
        for n in names:
            k = (r + opts.first) % len(order)
            for a in order[k:] + order[:k]:  # a different first each round
                res, err = run_child(n, a, opts.steps, 600, opts.snapshots, opts.pin)
                if err:
                    failures += 1
                    print("round %d, %s on %s failed: %s" % (r + 1, n, a, err), flush=True)
                    res = {"workload": n, "allocator": a, "failed": err}
                else:
                    c = res.get("pool_counts")
                    more = "" if not c else ", grows %d (%d in the steps), chunks remapped %d (%d in the steps)" % (
                        c["grows"], c["grows_in_steps"], c["remapped_chunks"], c["remapped_chunks_in_steps"])
                    print("round %d, %s on %-18s peak %6.0f MiB, step %7.1f ms (host queues it in %.1f, stream span %.1f)%s" % (
                        r + 1, n, a, res["process_peak_bytes"] / MIB, res["step_s_median"] * 1e3,
                        res["enqueue_s_median"] * 1e3, res["gpu_s_median"] * 1e3, more), flush=True)
                results[n][a].append(res)
    for n in names:
        report(n, results[n])
    if opts.json:
        with open(opts.json, "w") as f:
            json.dump({"runs": opts.runs, "steps": opts.steps, "results": results}, f, indent=1)
        print("\nwrote %s" % opts.json)
    return 0 if failures == 0 else 1


if __name__ == "__main__":
    sys.exit(main())
