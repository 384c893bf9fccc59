"""use_fused_attention on CPU: forward + backward time of hand-written attention and of nn.MultiheadAttention
(need_weights=True, its default) against the same modules routed to F.scaled_dot_product_attention; with
transformers installed, also a one-layer Hugging Face Llama built with ``attn_implementation="eager"`` against its
eager attention rewritten (``library_switch=False``) and against the library's own switch to ``"sdpa"``.

Variants alternate A B A B ... (``--rounds`` rounds of ``--iters`` timed iterations each, after warm-up); the table
shows the median time per iteration and the ratio fused ÷ original. The backend that actually ran is read with
SDPABackendRecorder and printed.

Run: ``flock /tmp/la-bench.lock python benchmarks/bench_attention.py [--seq 512 --dim 256 --heads 4 --batch 8]``;
on a GPU: ``python benchmarks/bench_attention.py --device cuda --dtype bfloat16 --seq 2048``.
"""

from __future__ import annotations

import argparse
import copy
import math
import statistics
import time
import warnings

import torch
import torch.nn.functional as F
from torch import nn

from lightning_accel import SDPABackendRecorder, use_fused_attention


class CausalSelfAttention(nn.Module):
    """nanoGPT's attention without flash: softmax((q @ k^T) / sqrt(d)) masked causally, then @ v."""

    def __init__(self, dim: int, heads: int, seq: int) -> None:
        super().__init__()
        self.qkv, self.proj, self.heads = nn.Linear(dim, 3 * dim), nn.Linear(dim, dim), heads
        self.register_buffer("causal", torch.triu(torch.ones(seq, seq, dtype=torch.bool), 1))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, d = x.shape
        q, k, v = (z.view(b, t, self.heads, d // self.heads).transpose(1, 2) for z in self.qkv(x).split(d, dim=-1))
        att = (q @ k.transpose(-2, -1)) * (1.0 / math.sqrt(k.size(-1)))
        att = F.softmax(att.masked_fill(self.causal[:t, :t], float("-inf")), dim=-1)
        return self.proj((att @ v).transpose(1, 2).reshape(b, t, d))


class MHABlock(nn.Module):
    def __init__(self, dim: int, heads: int) -> None:
        super().__init__()
        self.attn = nn.MultiheadAttention(dim, heads, batch_first=True)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out, _ = self.attn(x, x, x)  # need_weights=True by default; the weights are dropped
        return out


class HFLlamaLayer(nn.Module):
    """A one-layer Hugging Face ``LlamaModel`` (eager attention, causal mask) fed embeddings directly."""

    def __init__(self, dim: int, heads: int, seq: int) -> None:
        super().__init__()
        from transformers import LlamaConfig, LlamaModel

        self.model = LlamaModel(
            LlamaConfig(
                hidden_size=dim,
                intermediate_size=2 * dim,
                num_hidden_layers=1,
                num_attention_heads=heads,
                num_key_value_heads=heads,
                vocab_size=32,
                max_position_embeddings=seq,
                attn_implementation="eager",
                use_cache=False,
            )
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.model(inputs_embeds=x).last_hidden_state


def time_iters(model: nn.Module, x: torch.Tensor, iters: int) -> list[float]:
    times = []
    for _ in range(iters):
        start = time.perf_counter()
        model(x).float().square().mean().backward()
        if x.is_cuda:
            torch.cuda.synchronize()  # a benchmark: wait for the kernels to finish before reading the clock
        times.append(time.perf_counter() - start)
    return times


def backend(model: nn.Module, x: torch.Tensor) -> str:
    with torch.no_grad(), SDPABackendRecorder() as rec:
        model(x)
    return ", ".join(f"{name} {n}" for name, n in rec.counts.items() if n) or "no SDPA call"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--rounds", type=int, default=4)
    parser.add_argument("--iters", type=int, default=5)
    parser.add_argument("--seq", type=int, default=512)
    parser.add_argument("--dim", type=int, default=256)
    parser.add_argument("--heads", type=int, default=4)
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--device", default="cpu", help="cpu or cuda")
    parser.add_argument("--dtype", default="float32", choices=["float32", "bfloat16", "float16"])
    args = parser.parse_args()
    warnings.filterwarnings("ignore")
    torch.manual_seed(0)
    dtype = getattr(torch, args.dtype)
    x = torch.randn(args.batch, args.seq, args.dim, device=args.device, dtype=dtype)
    pairs = {}
    hand = CausalSelfAttention(args.dim, args.heads, args.seq).to(args.device, dtype)
    hand_fused = copy.deepcopy(hand)
    use_fused_attention(hand_fused, blocks=[""])
    pairs["hand-written causal"] = (hand, hand_fused)
    mha = MHABlock(args.dim, args.heads).to(args.device, dtype)
    mha_fused = copy.deepcopy(mha)
    use_fused_attention(mha_fused, example_inputs=x[:1])
    pairs["nn.MultiheadAttention"] = (mha, mha_fused)
    try:
        llama = HFLlamaLayer(args.dim, args.heads, args.seq).to(args.device, dtype)
    except ImportError:
        llama = None
    if llama is not None:
        rewritten, switched = copy.deepcopy(llama), copy.deepcopy(llama)
        use_fused_attention(rewritten, blocks=["model.layers.0.self_attn"], library_switch=False)
        use_fused_attention(switched)  # set_attn_implementation("sdpa")
        pairs["HF Llama eager: rewrite"] = (llama, rewritten)
        pairs["HF Llama eager: sdpa"] = (llama, switched)

    where = torch.cuda.get_device_name() if x.is_cuda else f"CPU, {torch.get_num_threads()} threads"
    print(
        f"{where}, torch {torch.__version__}, {args.dtype}; batch {args.batch}, seq {args.seq}, "
        f"dim {args.dim}, heads {args.heads}; forward + backward; {args.rounds} rounds x {args.iters} iters"
    )
    print(f"{'module':26s} {'original':>10s} {'fused':>10s} {'ratio':>7s}  backends (original | fused)")
    for name, (original, fused) in pairs.items():
        for model in (original, fused):  # warm-up
            time_iters(model, x, 1)
        samples: dict[str, list[float]] = {"original": [], "fused": []}
        for _ in range(args.rounds):
            samples["original"] += time_iters(original, x, args.iters)
            samples["fused"] += time_iters(fused, x, args.iters)
        a, b = statistics.median(samples["original"]), statistics.median(samples["fused"])
        print(
            f"{name:26s} {1e3 * a:8.1f}ms {1e3 * b:8.1f}ms {b / a:7.3f}  {backend(original, x)} | {backend(fused, x)}"
        )


if __name__ == "__main__":
    main()
