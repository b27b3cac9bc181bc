"""Attention that also returns its log-sum-exp, on one GPU: FlashAttention's kernel against cuDNN's, for the
blocks ring attention and streamed K/V compute (tplab.layers.attend.attend_with_lse picks between the two).

    python scripts/gpu_attention_lse.py OUT_DIR [--batch 4 --heads 40 --head-dim 128]

For each block shape (1024 queries against 1024, 2048 and 4096 keys, full and square-causal; the whole
4096 x 4096 for scale), bf16: ``_scaled_dot_product_flash_attention`` and ``_scaled_dot_product_cudnn_attention``
(asked for its lse) called directly, and F.scaled_dot_product_attention (no lse; PyTorch's own pick) as the
yardstick. Per row: median ms of 30 calls after 5 (CUDA events), TFLOP/s, and the largest difference of the
lse and the output from the exact float32 computation (the first batch row). Writes
OUT_DIR/gpu_attention_lse_<card>.csv and prints it.
"""

import argparse
import re
import statistics
from pathlib import Path

import pandas as pd
import torch
from torch.nn import functional as F

from tplab.toolkit.timing import time_calls


def median_ms(fn, iters=30, warmup=5):
    return statistics.median(time_calls(fn, iters=iters, warmup=warmup, cuda=True)) * 1e3   # (CUDA events)


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("out_dir", type=Path)
    parser.add_argument("--batch", type=int, default=4)
    parser.add_argument("--heads", type=int, default=40)
    parser.add_argument("--head-dim", type=int, default=128)
    args = parser.parse_args()
    if not torch.cuda.is_available():
        raise SystemExit("gpu_attention_lse.py times CUDA kernels: it needs a GPU")
    b, n, d, scale = args.batch, args.heads, args.head_dim, args.head_dim ** -0.5
    generator = torch.Generator(device="cuda").manual_seed(0)
    rows = []
    for s_q, s_k, causal in [(1024, 1024, False), (1024, 2048, False), (1024, 4096, False), (1024, 1024, True),
                             (4096, 4096, False), (4096, 4096, True)]:
        q = torch.randn(b, n, s_q, d, device="cuda", generator=generator).bfloat16()
        k, v = (torch.randn(b, n, s_k, d, device="cuda", generator=generator).bfloat16() for _ in range(2))
        kernels = {
            "flash": lambda: torch.ops.aten._scaled_dot_product_flash_attention(q, k, v, 0.0, causal, False,
                                                                                scale=scale)[:2],
            "cudnn": lambda: torch.ops.aten._scaled_dot_product_cudnn_attention(q, k, v, None, True, 0.0, causal,
                                                                                False, scale=scale)[:2],
            "sdpa (no lse)": lambda: (F.scaled_dot_product_attention(q, k, v, is_causal=causal), None)}
        scores = (q[:1].float() @ k[:1].float().transpose(-2, -1)) * scale        # (1, n, s_q, s_k), exact
        if causal:
            scores = scores.masked_fill(~torch.ones(s_q, s_k, dtype=torch.bool, device="cuda").tril(), float("-inf"))
        exact_lse, exact_out = torch.logsumexp(scores, -1), torch.softmax(scores, -1) @ v[:1].float()
        flops = 4 * b * n * s_q * s_k * d / (2 if causal else 1)
        for name, call in kernels.items():
            out, lse = call()
            ms = median_ms(call)
            rows.append(dict(kernel=name, batch=b, heads=n, head_dim=d, s_q=s_q, s_k=s_k, causal=causal, ms=ms,
                             tflops=flops / ms / 1e9,
                             lse_max_diff=None if lse is None else
                             float((lse.reshape(lse.shape[:3])[:1] - exact_lse).abs().max()),
                             out_max_diff=float((out[:1].float() - exact_out).abs().max()),
                             card=torch.cuda.get_device_name(), software=f"torch {torch.__version__}, cuDNN "
                             f"{torch.backends.cudnn.version()}"))
    table = pd.DataFrame(rows)
    args.out_dir.mkdir(parents=True, exist_ok=True)
    slug = re.sub(r"[^a-z0-9]+", "-", torch.cuda.get_device_name().lower()).strip("-")
    table.to_csv(args.out_dir / f"gpu_attention_lse_{slug}.csv", index=False)
    print(table.drop(columns=["card", "software"]).round(4).to_string(index=False))


if __name__ == "__main__":
    main()
