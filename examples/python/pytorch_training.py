"""Trains a small GPT-style transformer with streamalloc as PyTorch's CUDA allocator, and again
with PyTorch's own allocator, and checks that the two runs compute the same losses.

Each run is a process of its own (PyTorch takes its allocator once, before the first CUDA
allocation): the same seed, deterministic algorithms, random weights and random-but-learnable
data (counting sequences: each token one more than the last, from a random start, modulo the
vocabulary), so nothing is downloaded. Prints the losses of
both, the step time, and the memory each held at its peak (the pool's reserved_high against
PyTorch's max_memory_reserved, and the device memory the process took as cudaMemGetInfo saw it).

    python3 examples/python/pytorch_training.py [--steps 300]

Needs PyTorch with CUDA and a GPU; exits 77 (skipped) without them. Finds libstreamalloc_c
as the streamalloc package does ($STREAMALLOC_LIBRARY, or the build folders of this tree).
"""

import argparse
import json
import os
import pathlib
import subprocess
import sys
import time

SKIP = 77
HERE = pathlib.Path(__file__).resolve()
sys.path.insert(0, str(HERE.parents[2] / "python"))


def run(allocator, steps):
    import torch
    if allocator == "streamalloc":
        import streamalloc
        streamalloc.use_in_pytorch()
    os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")
    torch.manual_seed(0)
    torch.use_deterministic_algorithms(True)
    # Attention by the math kernels: the fused ones' backward passes add in varying order.
    torch.backends.cuda.enable_flash_sdp(False)
    torch.backends.cuda.enable_mem_efficient_sdp(False)
    if hasattr(torch.backends.cuda, "enable_cudnn_sdp"):
        torch.backends.cuda.enable_cudnn_sdp(False)
    torch.backends.cuda.matmul.allow_tf32 = False
    torch.backends.cudnn.allow_tf32 = False
    free_at_start, _ = torch.cuda.mem_get_info()
    dev = torch.device("cuda")
    vocab, width, layers, heads, seq, batch = 512, 256, 4, 8, 128, 32
    model = Gpt(vocab, width, layers, heads, seq).to(dev)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    gen = torch.Generator(device="cpu").manual_seed(1)
    lowest_free = free_at_start
    losses, times = [], []
    for step in range(steps):
        start = torch.randint(0, vocab, (batch, 1), generator=gen)
        tokens = ((start + torch.arange(seq)) % vocab).to(dev)  # every token but the first predictable
        t = time.perf_counter()
        logits = model(tokens[:, :-1])
        loss = torch.nn.functional.cross_entropy(logits.reshape(-1, vocab), tokens[:, 1:].reshape(-1))
        opt.zero_grad(set_to_none=True)
        loss.backward()
        opt.step()
        losses.append(loss.item())  # synchronizes: the step's time is all of its work
        times.append(time.perf_counter() - t)
        lowest_free = min(lowest_free, torch.cuda.mem_get_info()[0])
    out = {"allocator": allocator, "losses": losses,
           "step_ms": 1e3 * sorted(times[10:])[len(times[10:]) // 2] if len(times) > 10 else None,
           "process_peak_bytes": free_at_start - lowest_free}
    if allocator == "streamalloc":
        import streamalloc
        stats = streamalloc.statistics()
        out["reserved_high"] = stats["reserved_high"]
        out["used_high"] = stats["used_high"]
    else:
        out["reserved_high"] = torch.cuda.max_memory_reserved()
        out["used_high"] = torch.cuda.max_memory_allocated()
    print(json.dumps(out))


def Gpt(vocab, width, layers, heads, seq):
    """A decoder-only transformer from PyTorch's own modules, with causal attention."""
    import torch

    class Model(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.embed = torch.nn.Embedding(vocab, width)
            self.position = torch.nn.Parameter(0.02 * torch.randn(seq, width))
            block = torch.nn.TransformerEncoderLayer(width, heads, 4 * width, dropout=0.0, batch_first=True,
                                                     norm_first=True)
            self.blocks = torch.nn.TransformerEncoder(block, layers, enable_nested_tensor=False)
            self.head = torch.nn.Linear(width, vocab)

        def forward(self, tokens):
            n = tokens.shape[1]
            mask = torch.nn.Transformer.generate_square_subsequent_mask(n, device=tokens.device)
            x = self.embed(tokens) + self.position[:n]
            return self.head(self.blocks(x, mask=mask, is_causal=True))

    return Model()


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--steps", type=int, default=300)
    parser.add_argument("--run", choices=["streamalloc", "pytorch"])
    args = parser.parse_args()
    try:
        import torch
    except ImportError:
        print("SKIPPED: PyTorch is not installed")
        return SKIP
    if not torch.cuda.is_available():
        print("SKIPPED: PyTorch sees no GPU")
        return SKIP
    if args.run:
        run(args.run, args.steps)
        return 0
    results = {}
    for allocator in ("streamalloc", "pytorch"):
        proc = subprocess.run([sys.executable, str(HERE), "--run", allocator, "--steps", str(args.steps)],
                              capture_output=True, text=True)
        if proc.returncode != 0:
            print(f"the {allocator} run failed ({proc.returncode}):\n{proc.stdout}{proc.stderr}")
            return 1
        results[allocator] = json.loads(proc.stdout.strip().splitlines()[-1])
    ours, theirs = results["streamalloc"], results["pytorch"]
    worst = max(abs(a - b) / max(abs(b), 1e-12) for a, b in zip(ours["losses"], theirs["losses"]))
    identical = ours["losses"] == theirs["losses"]
    mib = 1 << 20
    print(f"{args.steps} steps; loss {theirs['losses'][0]:.4f} -> {theirs['losses'][-1]:.4f} (PyTorch's allocator), "
          f"{ours['losses'][0]:.4f} -> {ours['losses'][-1]:.4f} (streamalloc)")
    print(f"losses {'identical' if identical else f'differ by at most {worst:.2e} (relative)'}")
    print(f"{'':22} {'step ms':>8} {'reserved high MiB':>18} {'used high MiB':>14} {'process peak MiB':>17}")
    for name, r in (("PyTorch's allocator", theirs), ("streamalloc", ours)):
        print(f"{name:22} {r['step_ms']:8.2f} {r['reserved_high'] / mib:18.1f} {r['used_high'] / mib:14.1f} "
              f"{r['process_peak_bytes'] / mib:17.1f}")
    learned = theirs["losses"][-1] < 0.5 * theirs["losses"][0]
    if not learned:
        print("the model did not learn: the check compares nothing useful")
    return 0 if worst <= 1e-4 and learned else 1


if __name__ == "__main__":
    sys.exit(main())
