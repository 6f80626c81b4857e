"""The workloads whose allocation traces record.py records: GPT-2 training and generation,
ResNet-50 training and a mixture of experts (record.py's opening comment says what each does and
why these four). bench/pytorch_end_to_end.py runs the same classes, through record.BY_NAME.

No torch at import: each workload is given the torch module when it is made, so that the parent
process, which only starts children, never initialises CUDA (PyTorch's allocator settings are
read then, and each child needs its own).
"""


def say(*args):
    # Flushed at once: the parent's lines and its children's reach the console in the order they
    # were written.
    print(*args, flush=True)


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
