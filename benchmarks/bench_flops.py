"""FLOP accuracy: ``count_flops`` (FlopCounterMode on a real step) vs ``transformer_flops_per_token`` (6N + 12LdT).

Run: ``python benchmarks/bench_flops.py``. Small configs run on CPU for real; GPT-2-sized ones run on the meta
device (shapes only, no arithmetic), which FlopCounterMode counts the same way. Target: within 5 %.
"""

from __future__ import annotations

import argparse

import torch

from lightning_accel.core.flops import count_flops, transformer_flops_per_token
from lightning_accel.demo.model import GPT, GPTConfig

CONFIGS = {
    "demo (4L, d128, T64)": (GPTConfig(), "cpu"),
    "tiny (2L, d64, T256)": (GPTConfig(n_layer=2, n_head=2, d_model=64, seq_len=256), "cpu"),
    "gpt2-small (12L, d768, T1024, V50257)": (
        GPTConfig(vocab_size=50257, seq_len=1024, n_layer=12, n_head=12, d_model=768),
        "meta",
    ),
    "gpt2-medium (24L, d1024, T1024, V50257)": (
        GPTConfig(vocab_size=50257, seq_len=1024, n_layer=24, n_head=16, d_model=1024),
        "meta",
    ),
}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--batch", type=int, default=2)
    args = parser.parse_args()
    print(f"{'config':42s} {'params':>10s} {'counted/token':>15s} {'6N+12LdT':>15s} {'ratio':>7s}")
    worst = 0.0
    for name, (cfg, device) in CONFIGS.items():
        with torch.device(device):
            model = GPT(cfg)
            batch = torch.randint(0, cfg.vocab_size, (args.batch, cfg.seq_len))
        counted = count_flops(model, batch, loss_fn=lambda logits: logits.float().logsumexp(-1).mean())
        per_token = counted / batch.numel()
        formula = transformer_flops_per_token(model.num_params(), cfg.n_layer, cfg.d_model, cfg.seq_len)
        ratio = per_token / formula
        worst = max(worst, abs(ratio - 1))
        print(f"{name:42s} {model.num_params() / 1e6:9.2f}M {per_token:15.4e} {formula:15.4e} {ratio:7.4f}")
    print(f"largest deviation: {100 * worst:.2f} % (target: within 5 %)")


if __name__ == "__main__":
    main()
