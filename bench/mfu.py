"""One device's training step: megazero against a torchtitan-style model in plain PyTorch, tokens/s and MFU.

The contenders train the same Llama-3-shaped model (RMSNorm, RoPE, grouped-query attention through SDPA,
SwiGLU, an untied head) on the same random token microbatches, with the same loss (per-token cross entropy
summed and divided by the step's tokens), AdamW (lr 3e-4, betas (0.9, 0.95), weight decay 0.1, fused), gradient
clipping at 1.0 and gradient accumulation over ``--microbatches``:

  megazero eager   megazero.engine.build + megazero.engine.step.train_step, one process (ZeRO-0, torch kernels)
                   and, on a GPU, the same with kernels.norm=triton (the fused RMSNorm)
  peer eager       the model below, written as torchtitan writes its Llama: ``nn.Module`` blocks,
                   ``F.scaled_dot_product_attention(enable_gqa=True)``, ``torch.optim.AdamW(fused=True)``,
                   ``clip_grad_norm_(foreach=True)``, bf16 parameters on a GPU (fp32 on the CPU)
  peer compiled    the same with ``torch.compile`` per block (torchtitan's default), with ``--compile``

With ``--compile``: the peer compiled per block, megazero with train.compile and, on a GPU, with train.compile
and train.fp8=rowwise (the blocks between the first and the last in FP8). A second table times one
document-masked attention call (seq 8192 on a GPU, mean document 1,024 tokens): the path kernels.attention=auto
takes against SDPA with the dense mask. Contenders alternate step by step
(the order rotates) so all see the same machine noise; ``--repeats`` rounds of ``--steps`` timed steps after
``--warmup`` each; the table gives the median of each round and the median of the rounds' medians, the ratio
of each contender's step time to the eager peer's, tokens/s, MFU (6·N·tokens plus the attention's FLOPs,
megazero.costs, over ``--peak-tflops``) and the device's peak memory.

    python bench/mfu.py                 # GPU: hidden 2048, 16 layers, 32/8 heads, SwiGLU 8192, vocab 128256, seq 4096
    python bench/mfu.py --cpu           # the host-overhead size: 4 layers, hidden 384, seq 128, fp32, on the CPU
    python bench/mfu.py --toy           # a seconds-long run of everything at toy sizes (the suite's)

Not a test: nothing here asserts. The first step's losses are printed: same weights' shapes and data, but each
contender initialises its own weights, so they agree only to the init's spread.
"""
from __future__ import annotations

import os
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if ROOT not in sys.path:
    sys.path.insert(0, ROOT)

import argparse  # noqa: E402
import statistics  # noqa: E402
import time  # noqa: E402
from typing import Callable  # noqa: E402

import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402
from torch import Tensor, nn  # noqa: E402

from bench.document_attention import document_table  # noqa: E402
from megazero.config.load import load_config  # noqa: E402
from megazero.config.resolve import resolve  # noqa: E402
from megazero.costs import model_flops_per_token  # noqa: E402
from megazero.engine.build import build_engine  # noqa: E402
from megazero.engine.step import train_step  # noqa: E402
from megazero.parallel.dims import ParallelDims  # noqa: E402
from megazero.parallel.topology import Grid  # noqa: E402

# layers, hidden, heads, kv_heads, ffn, vocab, seq, micro_batch
SIZES = {"gpu": (16, 2048, 32, 8, 8192, 128256, 4096, 1), "cpu": (4, 384, 6, 2, 1024, 4096, 128, 4),
         "toy": (2, 64, 4, 2, 128, 512, 32, 2)}
LR, BETAS, WD, CLIP, ROPE_THETA, EPS = 3e-4, (0.9, 0.95), 0.1, 1.0, 500000.0, 1e-5


class Block(nn.Module):
    """A Llama block as torchtitan writes it: pre-norm attention and SwiGLU, each added to the residual."""

    def __init__(self, hidden: int, heads: int, kv_heads: int, ffn: int):
        super().__init__()
        self.heads, self.kv_heads, self.head_dim = heads, kv_heads, hidden // heads
        self.attention_norm, self.ffn_norm = nn.RMSNorm(hidden, eps=EPS), nn.RMSNorm(hidden, eps=EPS)
        self.wq = nn.Linear(hidden, hidden, bias=False)
        self.wk = nn.Linear(hidden, kv_heads * self.head_dim, bias=False)
        self.wv = nn.Linear(hidden, kv_heads * self.head_dim, bias=False)
        self.wo = nn.Linear(hidden, hidden, bias=False)
        self.w1, self.w3 = nn.Linear(hidden, ffn, bias=False), nn.Linear(hidden, ffn, bias=False)
        self.w2 = nn.Linear(ffn, hidden, bias=False)

    def forward(self, x: Tensor, cos: Tensor, sin: Tensor) -> Tensor:
        b, s, _ = x.shape
        h = self.attention_norm(x)
        q = self.wq(h).view(b, s, self.heads, self.head_dim)
        k = self.wk(h).view(b, s, self.kv_heads, self.head_dim)
        v = self.wv(h).view(b, s, self.kv_heads, self.head_dim)
        q, k = _rotate(q, cos, sin), _rotate(k, cos, sin)
        o = F.scaled_dot_product_attention(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), is_causal=True,
                                           enable_gqa=True)
        x = x + self.wo(o.transpose(1, 2).reshape(b, s, -1))
        h = self.ffn_norm(x)
        return x + self.w2(F.silu(self.w1(h)) * self.w3(h))


def _rotate(x: Tensor, cos: Tensor, sin: Tensor) -> Tensor:
    """RoPE on (b, s, heads, d) in the rotate-half form (Hugging Face's and megazero's)."""
    a, b = x.chunk(2, dim=-1)
    return x * cos + torch.cat([-b, a], dim=-1) * sin


class Peer(nn.Module):
    def __init__(self, layers: int, hidden: int, heads: int, kv_heads: int, ffn: int, vocab: int, seq: int):
        super().__init__()
        self.tok_embeddings = nn.Embedding(vocab, hidden)
        self.layers = nn.ModuleList(Block(hidden, heads, kv_heads, ffn) for _ in range(layers))
        self.norm, self.output = nn.RMSNorm(hidden, eps=EPS), nn.Linear(hidden, vocab, bias=False)
        d = hidden // heads
        freqs = 1.0 / ROPE_THETA ** (torch.arange(0, d, 2).float() / d)
        angles = torch.outer(torch.arange(seq).float(), freqs).repeat(1, 2)  # (s, d)
        self.register_buffer("cos", angles.cos()[None, :, None, :], persistent=False)
        self.register_buffer("sin", angles.sin()[None, :, None, :], persistent=False)

    def forward(self, ids: Tensor) -> Tensor:
        x = self.tok_embeddings(ids)
        cos, sin = self.cos.to(x.dtype), self.sin.to(x.dtype)
        for layer in self.layers:
            x = layer(x, cos, sin)
        return self.output(self.norm(x))


def peer_step(layers: int, hidden: int, heads: int, kv_heads: int, ffn: int, vocab: int, seq: int,
              device: torch.device, dtype: torch.dtype, compiled: bool) -> Callable[[list[Tensor]], float]:
    """A step of the plain model over microbatches of (b, seq + 1) ids: returns the step's mean loss."""
    torch.manual_seed(0)
    model = Peer(layers, hidden, heads, kv_heads, ffn, vocab, seq).to(device=device, dtype=dtype)
    if compiled:
        for i, layer in enumerate(model.layers):
            model.layers[i] = torch.compile(layer)
    decay = [p for p in model.parameters() if p.dim() >= 2]
    rest = [p for p in model.parameters() if p.dim() < 2]
    opt = torch.optim.AdamW([{"params": decay, "weight_decay": WD}, {"params": rest, "weight_decay": 0.0}], lr=LR,
                            betas=BETAS, fused=True)

    def step(microbatches: list[Tensor]) -> float:
        tokens = sum(mb[:, 1:].numel() for mb in microbatches)
        total = torch.zeros((), device=device)
        for mb in microbatches:
            logits = model(mb[:, :-1])
            loss = F.cross_entropy(logits.float().flatten(0, 1), mb[:, 1:].flatten(), reduction="sum") / tokens
            loss.backward()
            total += loss.detach()
        torch.nn.utils.clip_grad_norm_(model.parameters(), CLIP, foreach=True)
        opt.step()
        opt.zero_grad(set_to_none=True)
        return total.item()  # the host waits for the step, as megazero's step does for its norm
    return step


def megazero_step(size: tuple, device: torch.device, precision: str, microbatches: int,
                  norm: str = "torch", extra: tuple = ()) -> tuple[Callable[[list[Tensor]], float], object]:
    """megazero's step over the same microbatches (its mean loss), and the resolved config; ``extra``: more
    --set overrides (train.compile, train.fp8)."""
    layers, hidden, heads, kv_heads, ffn, vocab, seq, mb = size
    sets = ["model.arch=llama", f"model.layers={layers}", f"model.hidden={hidden}", f"model.heads={heads}",
            f"model.kv_heads={kv_heads}", f"model.ffn_hidden={ffn}", f"model.vocab_size={vocab}",
            "model.vocab_pad_multiple=1", f"model.seq_len={seq}", "model.tie_embeddings=false", "model.dropout=0.0",
            f"model.rope_theta={ROPE_THETA}", f"model.norm_eps={EPS}", f"train.micro_batch={mb}",
            f"train.global_batch={mb * microbatches}", f"train.precision={precision}", f"train.lr={LR}",
            f"train.weight_decay={WD}", f"train.grad_clip={CLIP}", "parallel.tp=1", "parallel.pp=1",
            "parallel.dp=1", "parallel.sequence_parallel=false", "zero.stage=0", "kernels.attention=torch",
            f"kernels.norm={norm}",
            f"kernels.adam={'fused' if device.type == 'cpu' else 'auto'}", *extra]
    cfg = load_config(os.path.join(ROOT, "configs", "tiny-llama.yaml"), sets)
    resolve(cfg, 1, device.type)
    engine = build_engine(cfg, Grid.build(ParallelDims(tp=1, pp=1, dp=1), device.type), device)

    def step(microbatches: list[Tensor]) -> float:
        result = train_step(engine.zero, engine.executor, engine.schedule, microbatches, LR, CLIP, engine.scaler)
        return result.loss_sum.item() / engine.tokens_per_step
    return step, cfg


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize()


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--cpu", action="store_true", help="the host-overhead size on the CPU (fp32)")
    ap.add_argument("--toy", action="store_true", help="toy sizes on the CPU: checks the script in seconds")
    ap.add_argument("--compile", action="store_true", help="add the peer compiled per block")
    ap.add_argument("--microbatches", type=int, default=2)
    ap.add_argument("--steps", type=int, default=20)
    ap.add_argument("--warmup", type=int, default=3)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--peak-tflops", type=float, default=989.0, help="dense bf16 of the device (H100/H200: 989)")
    args = ap.parse_args()
    if args.toy:
        args.steps, args.warmup, args.repeats = 2, 1, 1
    if args.cpu or args.toy:
        device, precision, size = torch.device("cpu"), "fp32", SIZES["toy" if args.toy else "cpu"]
    elif torch.cuda.is_available():
        device, precision, size = torch.device("cuda"), "bf16", SIZES["gpu"]
    else:
        print("bench/mfu.py needs a CUDA GPU (--cpu or --toy run on the CPU)", file=sys.stderr)
        return 2
    layers, hidden, heads, kv_heads, ffn, vocab, seq, mb = size
    dtype = torch.bfloat16 if precision == "bf16" else torch.float32
    ours, cfg = megazero_step(size, device, precision, args.microbatches)
    contenders = {"megazero eager": ours,
                  "peer eager": peer_step(layers, hidden, heads, kv_heads, ffn, vocab, seq, device, dtype, False)}
    if device.type == "cuda":  # the fused norm's measurement, which kernels.norm=auto waits for
        contenders["megazero eager, Triton RMSNorm"] = megazero_step(size, device, precision, args.microbatches,
                                                                     "triton")[0]
    if args.compile:
        contenders["peer compiled"] = peer_step(layers, hidden, heads, kv_heads, ffn, vocab, seq, device, dtype, True)
        contenders["megazero compiled"] = megazero_step(size, device, precision, args.microbatches,
                                                        extra=("train.compile=true",))[0]
        if device.type == "cuda":  # FP8 GEMMs need sm_89+; the CPU runs them far slower than its fp32
            contenders["megazero compiled + FP8 rowwise"] = megazero_step(
                size, device, precision, args.microbatches, extra=("train.compile=true", "train.fp8=rowwise"))[0]
    gen = torch.Generator().manual_seed(1234)

    def batch() -> list[Tensor]:
        return [torch.randint(0, vocab, (mb, seq + 1), generator=gen).to(device) for _ in range(args.microbatches)]

    first = {name: step(batch()) for name, step in contenders.items()}  # and warm-up
    for _ in range(args.warmup - 1):
        data = batch()
        for step in contenders.values():
            step(data)
    rounds: dict[str, list[float]] = {name: [] for name in contenders}
    names = list(contenders)
    for _ in range(args.repeats):
        times: dict[str, list[float]] = {name: [] for name in contenders}
        for i in range(args.steps):
            data = batch()
            for name in names[i % len(names):] + names[:i % len(names)]:
                _sync(device)
                t0 = time.perf_counter()
                contenders[name](data)
                _sync(device)
                times[name].append(time.perf_counter() - t0)
        for name in names:
            rounds[name].append(statistics.median(times[name]))
    tokens = mb * seq * args.microbatches
    flops = model_flops_per_token(cfg.model) * tokens
    where = torch.cuda.get_device_name() if device.type == "cuda" else "CPU"
    print(f"## One training step on {where}: Llama-shaped, {layers} layers, hidden {hidden}, {heads}/{kv_heads} heads, "
          f"SwiGLU {ffn}, vocab {vocab}, seq {seq}, {args.microbatches} microbatches of {mb}, {precision}\n")
    print("| contender | median s | rounds' medians | / peer eager | tokens/s | MFU | first loss |")
    print("|---|---|---|---|---|---|---|")
    peer = statistics.median(rounds["peer eager"])
    for name in names:
        t = statistics.median(rounds[name])
        print(f"| {name} | {t:.4f} | {' '.join(f'{r:.4f}' for r in rounds[name])} | {t / peer:.3f} | "
              f"{tokens / t:,.0f} | {flops / t / (args.peak_tflops * 1e12):.2%} | {first[name]:.4f} |")
    if device.type == "cuda":
        print(f"\npeak memory (all contenders, one process): {torch.cuda.max_memory_allocated() / 2**30:.1f} GiB")
    print(f"\n{args.repeats} rounds of {args.steps} timed steps after {args.warmup} warm-up, contenders alternating")
    document_table(device, dtype, heads, kv_heads, hidden // heads, 8192 if device.type == "cuda" else seq,
                   args.steps, args.repeats)
    return 0


if __name__ == "__main__":
    sys.exit(main())
