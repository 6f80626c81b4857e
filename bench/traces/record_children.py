"""What runs in record.py's child processes, one per workload and job: recording a workload's
allocation history into a trace (child_record) and measuring PyTorch's own peaks over the same
steps (child_peaks); and --cpu-check, the same workload code on the CPU, in this process.

torch is imported here, in the child, and never in the parent: PyTorch reads its allocator
settings (PYTORCH_CUDA_ALLOC_CONF) when CUDA initialises, so each setting needs a fresh process.
"""

import datetime
import gc
import json
import os
import platform
import statistics
import sys
import time
import traceback

from snapshot_to_trace import MAX_ENTRIES, convert_snapshot, fit_trace, self_test, write_atomic
from workloads import BY_NAME, say

GIB = float(1 << 30)


def _import_torch():
    import torch

    if not torch.cuda.is_available():
        raise RuntimeError("torch.cuda.is_available() is False: no GPU for this workload")
    torch.cuda.init()
    return torch


def _versions(torch):
    v = {"python": platform.python_version(), "torch": torch.__version__,
         "cuda": getattr(torch.version, "cuda", None), "gpu": torch.cuda.get_device_name(0)}
    for mod in ("transformers", "torchvision"):
        try:
            v[mod] = __import__(mod).__version__
        except Exception:
            pass
    return v


def _start_history(torch):
    mem = torch.cuda.memory
    # Only 'alloc' and 'free_requested' are used (and 'oom' is kept to be told of): skipping the
    # rest, where this torch can, leaves room for twice as many allocations in the ring.
    skip = ["free_completed", "segment_alloc", "segment_free", "snapshot"]
    tries = [
        lambda: mem._record_memory_history(enabled="all", context=None, stacks="python",
                                           max_entries=MAX_ENTRIES, skip_actions=skip),
        lambda: mem._record_memory_history(enabled="all", context=None, stacks="python",
                                           max_entries=MAX_ENTRIES),
        lambda: mem._record_memory_history(max_entries=MAX_ENTRIES),
        lambda: mem._record_memory_history(True, trace_alloc_max_entries=MAX_ENTRIES,
                                           trace_alloc_record_context=False),
    ]
    errors = []
    for t in tries:
        try:
            t()
            return
        except Exception as e:  # API differences between torch versions
            errors.append("%s: %s" % (type(e).__name__, e))
    raise RuntimeError("cannot start torch.cuda.memory._record_memory_history: " + " | ".join(errors))


def _stop_history(torch):
    for t in (lambda: torch.cuda.memory._record_memory_history(enabled=None),
              lambda: torch.cuda.memory._record_memory_history(False)):
        try:
            t()
            return
        except Exception:
            pass


def _marks_now():
    return time.time_ns() // 1000, time.monotonic_ns() // 1000


def _between_steps(torch, marks):
    # A quiet gap around each mark, so that the events' approximate clock cannot put an event on
    # the wrong side of it.
    torch.cuda.synchronize()
    time.sleep(0.01)
    wall, mono = _marks_now()
    marks["wall"].append(wall)
    marks["monotonic"].append(mono)
    time.sleep(0.01)


def _settle(torch):
    torch.cuda.synchronize()
    gc.collect()
    torch.cuda.empty_cache()
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()


def child_record(name, out_dir, steps, max_bytes, result_path):
    t0 = time.time()
    torch = _import_torch()
    versions = _versions(torch)
    say("  [%s] torch %s, %s; building the model" % (name, versions["torch"], versions["gpu"]))
    w = BY_NAME[name](torch)
    w.setup()
    steps = w.clamp_steps(steps)
    w.warmup()
    _settle(torch)
    say("  [%s] warm-up done (%.1f s); recording %d steps" % (name, time.time() - t0, steps))
    dev = torch.cuda.current_device()
    _start_history(torch)
    marks = {"wall": [], "monotonic": []}
    for i in range(steps):
        _between_steps(torch, marks)
        w.step(i)
    _between_steps(torch, marks)
    snap = torch.cuda.memory._snapshot()
    _stop_history(torch)
    traces = snap.get("device_traces") or []
    say("  [%s] recorded (%.1f s); converting %d history entries"
        % (name, time.time() - t0, len(traces[dev] or []) if dev < len(traces) else 0))
    conv = convert_snapshot(snap, device=dev, marks=marks)
    del snap
    for wmsg in conv["warnings"]:
        say("  [%s] warning: %s" % (name, wmsg))
    notes = list(w.notes())
    notes.append("recorded: %s, torch %s (CUDA %s)%s%s, Python %s, %s" % (
        datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d"), versions["torch"],
        versions["cuda"],
        ", transformers %s" % versions["transformers"] if "transformers" in versions else "",
        ", torchvision %s" % versions["torchvision"] if "torchvision" in versions else "",
        versions["python"], versions["gpu"]))
    notes.append("by: python3 bench/traces/record.py (%d steps after 1 warm-up step and "
                 "torch.cuda.empty_cache; PYTORCH_CUDA_ALLOC_CONF unset)" % steps)
    notes.append("from: torch.cuda.memory._snapshot() device_traces[%d]: 'alloc' -> a (the size "
                 "asked for), 'free_requested' -> f; live blocks from its segments" % dev)
    for wmsg in conv["warnings"]:
        notes.append("warning: " + wmsg)
    gz, facts = fit_trace(name, conv, max_bytes, notes)
    path = os.path.join(out_dir, name + ".trace.gz")
    write_atomic(path, gz)
    facts.update({"name": name, "path": path, "bytes": len(gz), "entries": conv["entries"],
                  "steps_recorded": steps, "warnings": conv["warnings"], "versions": versions,
                  "seconds": time.time() - t0})
    if facts["steps"] is None:
        facts["steps"] = steps
    say("  [%s] wrote %s: %d operations, %d streams, peak live %.3f GiB, %d live at start, "
        "%.0f KB (%d of %d steps kept)" % (name, path, facts["ops"], facts["streams"],
                                          facts["peak_live"] / GIB, facts["pre_live_blocks"],
                                          len(gz) / 1000.0, facts["steps"], steps))
    with open(result_path, "w") as f:
        json.dump(facts, f)


def child_peaks(name, conf, steps, result_path):
    t0 = time.time()
    torch = _import_torch()
    versions = _versions(torch)
    w = BY_NAME[name](torch)
    w.setup()
    steps = w.clamp_steps(steps)
    _, total = torch.cuda.mem_get_info()
    device_peak = 0

    def poll():
        nonlocal device_peak
        free, _ = torch.cuda.mem_get_info()
        device_peak = max(device_peak, total - free)

    poll()
    w.warmup()
    torch.cuda.synchronize()
    poll()
    warm_reserved = torch.cuda.max_memory_reserved()
    warm_allocated = torch.cuda.max_memory_allocated()
    _settle(torch)
    times = []
    for i in range(steps):
        t = time.perf_counter()
        w.step(i)
        torch.cuda.synchronize()
        times.append(time.perf_counter() - t)
        poll()
    res = {
        "alloc_conf": conf or "",
        "steps": steps,
        "max_reserved": torch.cuda.max_memory_reserved(),
        "max_allocated": torch.cuda.max_memory_allocated(),
        "step_time_s": statistics.median(times),
        "step_times_s": times,
        "device_used_peak": device_peak,
        "warmup_max_reserved": warm_reserved,
        "warmup_max_allocated": warm_allocated,
        "torch": versions["torch"],
        "gpu": versions["gpu"],
    }
    try:
        snap = torch.cuda.memory._snapshot()
        settings = snap.get("allocator_settings") or {}
        exp = settings.get("expandable_segments")
        if exp is None:
            exp = any(s.get("is_expandable") for s in snap.get("segments") or [])
        res["expandable_in_use"] = bool(exp)
    except Exception as e:
        res["expandable_in_use"] = None
        say("  [%s] could not tell whether expandable segments are in use: %s" % (name, e))
    say("  [%s, %s] max_memory_reserved %.3f GiB, max_memory_allocated %.3f GiB, device peak "
        "%.3f GiB, step %.1f ms (%.1f s)" % (name, conf or "default", res["max_reserved"] / GIB,
                                             res["max_allocated"] / GIB, device_peak / GIB,
                                             res["step_time_s"] * 1e3, time.time() - t0))
    with open(result_path, "w") as f:
        json.dump(res, f)


# ---------------------------------------------------------------------------------------------
# The check without a GPU (record.py --cpu-check): each workload's code on the CPU at a small
# size, nothing recorded.
# ---------------------------------------------------------------------------------------------


def cpu_check(names):
    """Each workload's setup, warm-up and steps on the CPU at a small size."""
    self_test()
    import torch

    failed = 0
    for n in names:
        t = time.time()
        try:
            w = BY_NAME[n](torch, device="cpu", small=True)
            w.setup()
            w.warmup()
            steps = w.clamp_steps(0)
            for i in range(steps):
                w.step(i)
            say("cpu-check %s: %d steps ran (%.1f s); %s" % (n, steps, time.time() - t, w.notes()[-1]))
        except Exception:
            failed += 1
            say("cpu-check %s: FAILED" % n)
            traceback.print_exc()
            sys.stdout.flush()
    return 1 if failed else 0

