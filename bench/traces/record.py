#!/usr/bin/env python3
"""Records the allocation traces of real PyTorch workloads for streamalloc's trace benches.

    python3 bench/traces/record.py [--out DIR] [--only NAME[,NAME...]] [--budget SECONDS]
                                   [--no-peaks] [--max-kb KB]
    python3 bench/traces/record.py --self-test     the converter on a made-up snapshot
    python3 bench/traces/record.py --cpu-check     each workload's code on the CPU, small

Run on a GPU machine (torch with CUDA; transformers and torchvision for the workloads that use
them; no network: every model is built from its config with random weights). For each workload
it starts a fresh Python process (PyTorch's allocator settings are read when CUDA initialises,
so each setting needs a process of its own) that

  1. builds the model and runs one warm-up step (CUDA, cuBLAS and cuDNN initialise, cuDNN's
     benchmark picks its algorithms, optimizer state is created), frees the cache
     (torch.cuda.empty_cache) so that what the recording starts from is only what is live;
  2. records the caching allocator's history (torch.cuda.memory._record_memory_history) over a
     few steps, takes torch.cuda.memory._snapshot() and converts it (convert_snapshot in
     snapshot_to_trace.py) to bench/traces/<name>.trace.gz, the format bench/trace_file.hpp
     reads (README.md);

then, in two more processes that do not record, runs the same warm-up and steps with
PYTORCH_CUDA_ALLOC_CONF unset (PyTorch's default) and with expandable_segments:True, and
writes PyTorch's own peaks for the same steps (torch.cuda.max_memory_reserved /
max_memory_allocated after the warm-up, the process's peak device memory from
torch.cuda.mem_get_info polled after each step, and the step time) to pytorch_peaks.json.
Traces are recorded first for every workload, peaks after, so that a run cut short keeps the
traces; each file is written whole (a temporary file renamed), and pytorch_peaks.json is updated
after each measurement, keeping the workloads not measured this time.

The workloads, each about 10-20 s a process on an H100:

  gpt2_train      GPT-2 small (transformers GPT2LMHeadModel, GPT2Config() defaults), bf16
                  autocast, AdamW, batch 8 x 1024 random tokens: 3 steps. Large activations of a
                  few fixed sizes, the fp32 logits (1.6 GB), the optimizer's foreach temporaries.
  gpt2_generate   the same model in bf16, eval, transformers' generate() (greedy, KV cache) on 4
                  requests of different shapes, batch x prompt -> new tokens: 1 x 32 -> 64,
                  16 x 512 -> 128, 4 x 128 -> 64, 8 x 256 -> 96 (a manual decode loop over a
                  DynamicCache if generate() fails). Many small allocations, a cache that grows
                  a token at a time, sizes that change with every request.
  resnet50_train  torchvision resnet50(weights=None), channels_last, bf16 autocast, SGD with
                  momentum, cuDNN benchmark on, batch 64 of 224 x 224 random images: 3 steps.
                  Convolution activations and cuDNN workspaces.
  moe_train       our choice of a fourth: a small mixture-of-experts transformer in plain
                  PyTorch (6 blocks, d_model 768, 8 experts of different widths 768..3456, top-2
                  routing, a shared expert on a second CUDA stream), bf16 autocast, AdamW, batch
                  8 x 1024 random tokens: 4 steps. Chosen over a diffusion U-Net (another
                  convolution net, close to resnet50_train in shape) because its sizes depend on
                  the data: how many tokens each expert gets changes every step and every layer,
                  so the same code asks for different sizes each step, the case that fragments a
                  size-keyed cache and that expandable segments were made for. Its shared expert
                  runs on a side stream (tensors crossing streams kept with record_stream), so the
                  trace has two streams and blocks whose free PyTorch defers across streams.

The trace format (gzip-compressed text, one operation a line):

  # streamalloc trace v1 <name> ops=<n> peak_live=<bytes>
  # ... provenance (model, batch, torch version), "# step k" before each step's operations
  a <id> <bytes> <stream>     an allocation of <bytes> (the size the program asked for)
  f <id> <stream>             its free

ids are 0, 1, 2, ... in order of allocation; streams are numbered 0..k-1 in order of first
appearance. Blocks live when the recording began (model weights, optimizer state, anything
freed during the steps whose allocation was not recorded) are allocated first, before
"# step 1", so the trace is consistent on its own.

A trace over --max-kb compressed (1500 by default) keeps fewer steps (whole steps, found from
the events' time stamps against marks taken between steps); the peaks processes then run the
same number of steps.

The code, in this folder: this file is the command line and the parent process, which starts
each child by running this file again (--child); record_children.py is what the children run
(and --cpu-check); workloads.py the four workloads; snapshot_to_trace.py the conversion to the
trace format, with its check (--self-test).
"""

import argparse
import datetime
import json
import os
import signal
import subprocess
import sys
import tempfile
import time
import traceback

# The parts, in modules of their own beside this file; every name is also kept here, as
# record.<name>, for the code that imports this file (bench/pytorch_end_to_end.py uses BY_NAME,
# the workload classes, _import_torch and child_env).
from snapshot_to_trace import (  # noqa: F401  (re-exported)
    FORMAT_LINE, MAX_ENTRIES, ConversionError, _Block, _time_scale, compress, convert_snapshot,
    fit_trace, render_trace, self_test, write_atomic)
from workloads import (  # noqa: F401  (re-exported)
    BY_NAME, WORKLOADS, GPT2Generate, GPT2Train, MoETrain, ResNet50Train, Workload, _autocast,
    _gpt2_config, _moe_model, say)
from record_children import (  # noqa: F401  (re-exported)
    GIB, _between_steps, _import_torch, _marks_now, _settle, _start_history, _stop_history,
    _versions, child_peaks, child_record, cpu_check)

HERE = os.path.dirname(os.path.abspath(__file__))
DEFAULT_MAX_KB = 1500
CHILD_TIMEOUT_S = 240


# ---------------------------------------------------------------------------------------------
# The parent: one child per (workload, job), results gathered.
# ---------------------------------------------------------------------------------------------


def child_env(alloc_conf):
    env = dict(os.environ)
    for k in ("PYTORCH_CUDA_ALLOC_CONF", "PYTORCH_ALLOC_CONF", "PYTORCH_NO_CUDA_MEMORY_CACHING"):
        env.pop(k, None)
    if alloc_conf:
        env["PYTORCH_CUDA_ALLOC_CONF"] = alloc_conf
    env.update({"PYTHONUNBUFFERED": "1", "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1",
                "HF_DATASETS_OFFLINE": "1", "TOKENIZERS_PARALLELISM": "false",
                "TRANSFORMERS_VERBOSITY": "error", "TRANSFORMERS_NO_ADVISORY_WARNINGS": "1",
                "HF_HUB_DISABLE_TELEMETRY": "1"})
    return env


_running = None  # the child process now running, ended with the parent


def _end_child_and_exit(signum, _frame):
    # `timeout` and Ctrl-C signal this process only: the child, holding the GPU, goes too.
    if _running is not None and _running.poll() is None:
        _running.kill()
        _running.wait()
    say("record.py: stopped by signal %d" % signum)
    sys.exit(128 + signum)


def run_child(args, alloc_conf, timeout):
    global _running
    fd, result = tempfile.mkstemp(prefix="record-", suffix=".json")
    os.close(fd)
    os.unlink(result)
    # This file, whoever imported it: a child starts at main() below, like the command line.
    cmd = [sys.executable, os.path.abspath(__file__)] + args + ["--result", result]
    t = time.time()
    _running = subprocess.Popen(cmd, env=child_env(alloc_conf))
    try:
        rc = _running.wait(timeout=timeout)
    except subprocess.TimeoutExpired:
        _running.kill()
        _running.wait()
        rc = "killed: over its %.0f s" % timeout
    _running = None
    took = time.time() - t
    out = None
    if os.path.exists(result):
        try:
            with open(result) as f:
                out = json.load(f)
        except ValueError:
            out = None
        os.unlink(result)
    if rc != 0 or out is None:
        return None, "child %s failed (%s) after %.0f s" % (" ".join(args[:4]), rc, took)
    return out, None


def update_peaks(path, name, conf_key, res):
    data = {}
    if os.path.exists(path):
        try:
            with open(path) as f:
                data = json.load(f)
        except ValueError:
            say("  %s was not valid JSON: starting it afresh" % path)
            data = {}
    data.setdefault("about", "PyTorch's own peaks for the steps of each trace (bench/traces/record.py): "
                    "max_reserved / max_allocated = torch.cuda.max_memory_reserved / "
                    "max_memory_allocated over the steps after a warm-up step and empty_cache; "
                    "device_used_peak = total - free from torch.cuda.mem_get_info, polled after "
                    "each step (the whole process: CUDA context, cuBLAS/cuDNN workspaces); "
                    "step_time_s = median step time")
    data.setdefault("workloads", {})
    data["updated"] = datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%dT%H:%M:%SZ")
    data["torch"] = res.get("torch")
    data["gpu"] = res.get("gpu")
    entry = data["workloads"].setdefault(name, {})
    entry[conf_key] = {k: res[k] for k in ("max_reserved", "max_allocated", "step_time_s",
                                           "device_used_peak", "steps", "step_times_s",
                                           "warmup_max_reserved", "warmup_max_allocated",
                                           "alloc_conf", "expandable_in_use") if k in res}
    write_atomic(path, (json.dumps(data, indent=2, sort_keys=True) + "\n").encode())


def parent(opts):
    t_start = time.time()
    signal.signal(signal.SIGTERM, _end_child_and_exit)
    signal.signal(signal.SIGINT, _end_child_and_exit)
    out_dir = os.path.abspath(opts.out)
    os.makedirs(out_dir, exist_ok=True)
    names = [w.name for w in WORKLOADS]
    if opts.only:
        wanted = [n.strip() for n in opts.only.split(",") if n.strip()]
        unknown = [n for n in wanted if n not in BY_NAME]
        if unknown:
            say("unknown workload(s): %s (known: %s)" % (", ".join(unknown), ", ".join(names)))
            return 2
        names = wanted
    max_bytes = int(opts.max_kb * 1000)
    say("record.py: workloads %s -> %s (budget %.0f s, trace limit %d KB)"
        % (", ".join(names), out_dir, opts.budget, opts.max_kb))

    def left():
        return opts.budget - (time.time() - t_start)

    failures = []
    recorded = {}
    for n in names:
        if left() < 30:
            failures.append("%s: not recorded, time budget spent" % n)
            continue
        say("[%s] recording (%.0f s used)" % (n, time.time() - t_start))
        try:
            res, err = run_child(["--child", "record", "--workload", n, "--out", out_dir,
                                  "--max-bytes", str(max_bytes)], None, min(CHILD_TIMEOUT_S, left()))
        except Exception as e:  # reported, and the next workload goes on
            res, err = None, "%s: %s" % (type(e).__name__, e)
        if err:
            failures.append("%s: %s" % (n, err))
            say("[%s] FAILED: %s" % (n, err))
            continue
        recorded[n] = res
    peaks_path = os.path.join(out_dir, "pytorch_peaks.json")
    peaks = {}
    if not opts.no_peaks:
        for n in names:
            if n not in recorded:
                say("[%s] PyTorch peaks skipped: no trace recorded" % n)
                continue
            steps = recorded[n]["steps"]
            for key, conf in (("default", None), ("expandable", "expandable_segments:True")):
                if left() < 30:
                    failures.append("%s: PyTorch peaks (%s) not measured, time budget spent" % (n, key))
                    continue
                say("[%s] PyTorch peaks, %s (%d steps, %.0f s used)"
                    % (n, conf or "PYTORCH_CUDA_ALLOC_CONF unset", steps, time.time() - t_start))
                try:
                    res, err = run_child(["--child", "peaks", "--workload", n, "--steps", str(steps)],
                                         conf, min(CHILD_TIMEOUT_S, left()))
                    if not err:
                        update_peaks(peaks_path, n, key, res)
                except Exception as e:  # reported, and the next measurement goes on
                    res, err = None, "%s: %s" % (type(e).__name__, e)
                if err:
                    failures.append("%s (%s peaks): %s" % (n, key, err))
                    say("[%s] FAILED: %s" % (n, err))
                    continue
                if key == "expandable" and res.get("expandable_in_use") is False:
                    say("[%s] warning: expandable segments were asked for but not in use" % n)
                peaks.setdefault(n, {})[key] = res

    say("\nsummary (%.0f s):" % (time.time() - t_start))
    say("%-16s %10s %8s %8s %12s %14s %14s" % ("workload", "ops", "streams", "KB", "peak live",
                                              "torch default", "expandable"))
    for n in names:
        r = recorded.get(n)
        p = peaks.get(n, {})

        def res_gib(k):
            return "%.3f GiB" % (p[k]["max_reserved"] / GIB) if k in p else "-"

        if r:
            say("%-16s %10d %8d %8.0f %8.3f GiB %14s %14s" % (n, r["ops"], r["streams"], r["bytes"] / 1000.0,
                                                              r["peak_live"] / GIB, res_gib("default"),
                                                              res_gib("expandable")))
        else:
            say("%-16s %10s %8s %8s %12s %14s %14s" % (n, "-", "-", "-", "-", res_gib("default"),
                                                       res_gib("expandable")))
    for f in failures:
        say("FAILED: " + f)
    say("traces in %s; PyTorch's peaks in %s" % (out_dir, peaks_path))
    return 1 if failures else 0


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", default=HERE, help="where traces and pytorch_peaks.json go (default: "
                                                 "this script's folder, bench/traces)")
    ap.add_argument("--only", help="comma-separated workloads: " + ", ".join(BY_NAME))
    ap.add_argument("--budget", type=float, default=470.0,
                    help="seconds for the whole run; work that would start later is skipped")
    ap.add_argument("--no-peaks", action="store_true", help="record traces only")
    ap.add_argument("--max-kb", type=float, default=DEFAULT_MAX_KB,
                    help="largest compressed trace in KB; fewer steps are kept above it")
    ap.add_argument("--self-test", action="store_true",
                    help="check the snapshot converter on a made-up snapshot (no torch needed)")
    ap.add_argument("--cpu-check", action="store_true",
                    help="run each workload's code on the CPU at a small size, recording nothing "
                         "(checks the script without a GPU)")
    # for the child processes
    ap.add_argument("--child", choices=("record", "peaks"), help=argparse.SUPPRESS)
    ap.add_argument("--workload", help=argparse.SUPPRESS)
    ap.add_argument("--steps", type=int, default=0, help=argparse.SUPPRESS)
    ap.add_argument("--max-bytes", type=int, default=DEFAULT_MAX_KB * 1000, help=argparse.SUPPRESS)
    ap.add_argument("--result", help=argparse.SUPPRESS)
    opts = ap.parse_args(argv)
    if opts.child:
        try:
            if opts.child == "record":
                child_record(opts.workload, opts.out, opts.steps, opts.max_bytes, opts.result)
            else:
                child_peaks(opts.workload, os.environ.get("PYTORCH_CUDA_ALLOC_CONF"), opts.steps,
                            opts.result)
            return 0
        except Exception:
            say("  [%s] %s failed:" % (opts.workload, opts.child))
            traceback.print_exc()
            sys.stdout.flush()
            return 1
    if opts.self_test:
        self_test()
        return 0
    if opts.cpu_check:
        names = [n.strip() for n in opts.only.split(",")] if opts.only else list(BY_NAME)
        return cpu_check(names)
    return parent(opts)


if __name__ == "__main__":
    sys.exit(main())
