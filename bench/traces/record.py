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
     few steps, takes torch.cuda.memory._snapshot() and converts it (convert_snapshot below) to
     bench/traces/<name>.trace.gz, the format bench/trace_file.hpp reads (README.md);

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
"""

import argparse
import datetime
import gc
import gzip
import json
import os
import platform
import signal
import statistics
import subprocess
import sys
import tempfile
import time
import traceback

HERE = os.path.dirname(os.path.abspath(__file__))
FORMAT_LINE = "streamalloc trace v1"
MAX_ENTRIES = 1_000_000  # the allocator's history ring: 2 or 3 entries an allocation
DEFAULT_MAX_KB = 1500
CHILD_TIMEOUT_S = 240
GIB = float(1 << 30)


def say(*args):
    print(*args, flush=True)


# ---------------------------------------------------------------------------------------------
# Conversion: a torch.cuda.memory._snapshot() dict to the replay format. Pure Python, no torch:
# bench/traces/README.md says how it was checked on made-up snapshots.
# ---------------------------------------------------------------------------------------------


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
# Workloads. Each runs in a child process; torch and friends are imported there only.
# ---------------------------------------------------------------------------------------------


class Workload:
    """A workload's model and steps. `device` is "cuda" for recording; "cpu" with small=True is
    --cpu-check's dry run of the same code at a small size."""

    name = ""
    steps = 3
    summary = ""

    def __init__(self, torch, device="cuda", small=False):
        self.torch = torch
        self.device = device
        self.small = small

    def setup(self):
        raise NotImplementedError

    def clamp_steps(self, steps):
        return steps if steps and steps > 0 else self.steps

    def warmup(self):
        self.step(-1)

    def step(self, i):
        raise NotImplementedError

    def notes(self):
        return [self.summary]


def _autocast(torch, device):
    return torch.autocast(device_type=device, dtype=torch.bfloat16)


def _gpt2_config(small):
    from transformers import GPT2Config

    return GPT2Config(n_layer=2, n_embd=128, n_head=4) if small else GPT2Config()


class GPT2Train(Workload):
    name = "gpt2_train"
    steps = 3
    batch, seq = 8, 1024
    summary = ("workload: GPT-2 small (transformers GPT2LMHeadModel, GPT2Config() defaults, random "
               "weights), train mode, bf16 autocast, AdamW; batch 8 x 1024 random tokens; "
               "a step = forward + backward + optimizer step + zero_grad(set_to_none)")

    def setup(self):
        torch = self.torch
        from transformers import GPT2LMHeadModel

        if self.small:
            self.batch, self.seq = 2, 64
        torch.manual_seed(0)
        cfg = _gpt2_config(self.small)
        self.vocab = cfg.vocab_size
        self.model = GPT2LMHeadModel(cfg).to(self.device).train()
        self.opt = torch.optim.AdamW(self.model.parameters(), lr=1e-4)

    def step(self, i):
        torch = self.torch
        torch.manual_seed(1000 + i)
        x = torch.randint(0, self.vocab, (self.batch, self.seq), device=self.device)
        with _autocast(torch, self.device):
            try:
                out = self.model(input_ids=x, labels=x, use_cache=False)
            except TypeError:
                out = self.model(input_ids=x, labels=x)
        loss = out.loss if hasattr(out, "loss") else out[0]
        loss.backward()
        self.opt.step()
        self.opt.zero_grad(set_to_none=True)


class GPT2Generate(Workload):
    name = "gpt2_generate"
    # (batch, prompt tokens, new tokens), largest early: a trace over the size limit loses the
    # last requests first.
    requests = [(1, 32, 64), (16, 512, 128), (4, 128, 64), (8, 256, 96)]
    steps = len(requests)
    summary = ("workload: GPT-2 small (GPT2LMHeadModel, GPT2Config() defaults, random weights) in "
               "bf16, eval, greedy generation with KV cache; a step = one request, "
               "batch x prompt -> new tokens: 1x32->64, 16x512->128, 4x128->64, 8x256->96")

    def setup(self):
        torch = self.torch
        from transformers import GPT2LMHeadModel

        if self.small:
            self.requests = [(1, 8, 4), (3, 16, 6)]
        torch.manual_seed(0)
        cfg = _gpt2_config(self.small)
        self.vocab = cfg.vocab_size
        self.eos = cfg.eos_token_id if cfg.eos_token_id is not None else 50256
        self.model = GPT2LMHeadModel(cfg).to(device=self.device, dtype=torch.bfloat16).eval()
        self.mode = None  # 'generate' or 'manual', decided by the warm-up

    def _manual(self, ids, mask, new):
        torch = self.torch
        import inspect

        try:
            from transformers import DynamicCache

            cache = DynamicCache()
        except Exception:
            cache = None
        # transformers 5 renames past_key_values to cache (the old name goes in 5.40).
        params = inspect.signature(self.model.forward).parameters
        key = "cache" if "cache" in params else "past_key_values"

        def forward(tokens, mask, cache):
            kwargs = {"use_cache": True}
            if cache is not None:
                kwargs[key] = cache
            out = self.model(input_ids=tokens, attention_mask=mask, **kwargs)
            if cache is None:
                cache = getattr(out, "cache", None) or getattr(out, "past_key_values", None)
            return out.logits[:, -1:].argmax(-1), cache

        nxt, cache = forward(ids, mask, cache)
        made = 1
        while made < new:
            mask = torch.cat([mask, torch.ones_like(nxt)], dim=1)
            nxt, cache = forward(nxt, mask, cache)
            made += 1
        return made

    def _run(self, batch, prompt, new):
        torch = self.torch
        ids = torch.randint(0, self.vocab, (batch, prompt), device=self.device)
        mask = torch.ones_like(ids)
        with torch.inference_mode():
            if self.mode in (None, "generate"):
                try:
                    out = self.model.generate(input_ids=ids, attention_mask=mask, max_new_tokens=new,
                                              min_new_tokens=new, do_sample=False,
                                              pad_token_id=self.eos)
                    self.mode = "generate"
                    return int(out.shape[1]) - prompt
                except Exception as e:
                    if self.mode == "generate":
                        raise
                    say("    generate() failed (%s: %s); using a manual decode loop"
                        % (type(e).__name__, str(e).splitlines()[0][:200] if str(e) else ""))
                    self.mode = "manual"
            return self._manual(ids, mask, new)

    def clamp_steps(self, steps):
        n = len(self.requests)
        return min(steps, n) if steps and steps > 0 else n

    def warmup(self):
        self.torch.manual_seed(999)
        self._run(2, 16, 8)

    def step(self, i):
        self.torch.manual_seed(1000 + i)
        b, p, n = self.requests[i]
        got = self._run(b, p, n)
        if got != n:
            say("    request %d: %d new tokens instead of %d" % (i + 1, got, n))

    def notes(self):
        how = {"generate": "transformers generate() (greedy, DynamicCache)",
               "manual": "a manual decode loop over DynamicCache (generate() failed)"}
        return [self.summary, "decoding: " + how.get(self.mode, "?")]


class ResNet50Train(Workload):
    name = "resnet50_train"
    steps = 3
    batch, image = 64, 224
    summary = ("workload: torchvision resnet50(weights=None), channels_last, bf16 autocast, SGD "
               "(momentum 0.9, weight decay 1e-4), cudnn.benchmark on; batch 64 x 3 x 224 x 224 "
               "random images; a step = forward + backward + optimizer step + zero_grad")

    def setup(self):
        torch = self.torch
        import torchvision

        if self.small:
            self.batch, self.image = 2, 64
        torch.backends.cudnn.benchmark = True
        torch.manual_seed(0)
        try:
            m = torchvision.models.resnet50(weights=None)
        except TypeError:
            m = torchvision.models.resnet50(pretrained=False)
        self.model = m.to(self.device).to(memory_format=torch.channels_last).train()
        self.opt = torch.optim.SGD(self.model.parameters(), lr=0.1, momentum=0.9, weight_decay=1e-4)

    def step(self, i):
        torch = self.torch
        torch.manual_seed(1000 + i)
        x = torch.randn(self.batch, 3, self.image, self.image, device=self.device)
        x = x.contiguous(memory_format=torch.channels_last)
        y = torch.randint(0, 1000, (self.batch,), device=self.device)
        with _autocast(torch, self.device):
            loss = torch.nn.functional.cross_entropy(self.model(x), y)
        loss.backward()
        self.opt.step()
        self.opt.zero_grad(set_to_none=True)


def _moe_model(torch):
    nn = torch.nn
    F = torch.nn.functional

    class Block(nn.Module):
        def __init__(self, d, heads, widths, shared_width, top_k):
            super().__init__()
            self.heads, self.top_k = heads, top_k
            self.ln1 = nn.LayerNorm(d)
            self.qkv = nn.Linear(d, 3 * d)
            self.proj = nn.Linear(d, d)
            self.ln2 = nn.LayerNorm(d)
            self.router = nn.Linear(d, len(widths), bias=False)
            nn.init.normal_(self.router.weight, std=0.05)  # uneven routing, as trained routers have
            self.experts = nn.ModuleList(
                nn.Sequential(nn.Linear(d, w), nn.GELU(), nn.Linear(w, d)) for w in widths)
            self.shared = nn.Sequential(nn.Linear(d, shared_width), nn.GELU(), nn.Linear(shared_width, d))

        def forward(self, x, side):
            B, T, D = x.shape
            qkv = self.qkv(self.ln1(x)).view(B, T, 3, self.heads, D // self.heads).permute(2, 0, 3, 1, 4)
            a = F.scaled_dot_product_attention(qkv[0], qkv[1], qkv[2], is_causal=True)
            x = x + self.proj(a.transpose(1, 2).reshape(B, T, D))
            h = self.ln2(x).reshape(B * T, D)
            # The shared expert runs on the side stream while the routed experts run here.
            if side is not None:
                main = torch.cuda.current_stream()
                side.wait_stream(main)
                with torch.cuda.stream(side):
                    shared = self.shared(h)
                h.record_stream(side)
            else:  # --cpu-check
                shared = self.shared(h)
            probs = self.router(h).float().softmax(-1)
            weight, expert = probs.topk(self.top_k, dim=-1)
            flat = expert.reshape(-1)
            order = flat.argsort()
            counts = torch.bincount(flat, minlength=len(self.experts)).tolist()
            w_flat = weight.reshape(-1)
            out = torch.zeros_like(h)
            start = 0
            for e, n in enumerate(counts):
                if n == 0:
                    continue
                idx = order[start:start + n]
                start += n
                tok = idx // self.top_k
                y = self.experts[e](h.index_select(0, tok))
                y = y * w_flat.index_select(0, idx).unsqueeze(1).to(y.dtype)
                out.index_add_(0, tok, y.to(out.dtype))
            if side is not None:
                main.wait_stream(side)
                shared.record_stream(main)
            return x + (out + shared).view(B, T, D)

    class Model(nn.Module):
        def __init__(self, vocab=32000, d=768, layers=6, heads=12,
                     widths=(768, 1152, 1536, 1920, 2304, 2688, 3072, 3456), shared_width=1536, top_k=2):
            super().__init__()
            self.emb = nn.Embedding(vocab, d)
            self.blocks = nn.ModuleList(Block(d, heads, widths, shared_width, top_k) for _ in range(layers))
            self.ln = nn.LayerNorm(d)
            self.head = nn.Linear(d, vocab, bias=False)

        def forward(self, tokens, side):
            x = self.emb(tokens)
            for b in self.blocks:
                x = b(x, side)
            return self.head(self.ln(x))

    return Model


class MoETrain(Workload):
    name = "moe_train"
    steps = 4
    batch, seq, vocab = 8, 1024, 32000
    summary = ("workload: a mixture-of-experts transformer in plain PyTorch (6 blocks, d_model 768, "
               "12 heads, 8 experts of widths 768..3456, top-2 routing, shared expert of width 1536 "
               "on a second stream), random weights, bf16 autocast, AdamW; batch 8 x 1024 random "
               "tokens; a step = forward + backward + optimizer step + zero_grad")

    def setup(self):
        torch = self.torch
        torch.manual_seed(0)
        model = _moe_model(torch)
        if self.small:
            self.batch, self.seq, self.vocab = 2, 64, 512
            model = model(vocab=self.vocab, d=64, layers=2, heads=4, widths=(32, 64, 96, 128), shared_width=64)
        else:
            model = model(vocab=self.vocab)
        self.model = model.to(self.device).train()
        self.opt = torch.optim.AdamW(self.model.parameters(), lr=1e-4)
        self.side = torch.cuda.Stream() if self.device == "cuda" else None

    def step(self, i):
        torch = self.torch
        torch.manual_seed(1000 + i)
        x = torch.randint(0, self.vocab, (self.batch, self.seq), device=self.device)
        with _autocast(torch, self.device):
            logits = self.model(x, self.side)
            loss = torch.nn.functional.cross_entropy(logits.view(-1, self.vocab).float(),
                                                     x.view(-1))
        loss.backward()
        self.opt.step()
        self.opt.zero_grad(set_to_none=True)


WORKLOADS = [GPT2Train, GPT2Generate, ResNet50Train, MoETrain]
BY_NAME = {w.name: w for w in WORKLOADS}


# ---------------------------------------------------------------------------------------------
# Child processes
# ---------------------------------------------------------------------------------------------


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
# Checks without a GPU: --self-test (the converter on a made-up snapshot, no torch needed) and
# --cpu-check (each workload's code on the CPU at a small size, nothing recorded).
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
    say("self-test: the converter gives the expected operations")


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
