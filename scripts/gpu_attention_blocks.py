"""Causal attention cut into blocks of query rows, as async TP cuts it, against one whole call; one GPU.

    python scripts/gpu_attention_blocks.py OUT_DIR [--batch 4 --seq 4096 --heads 40 --head-dim 128]

For each rank count p (2 and 4; a rank holds heads/p heads), bf16, q/k/v laid out as async TP makes them
(views of one (s, b, 3·n·d) tensor): the whole causal attention (F.scaled_dot_product_attention), the p
blocks through ``tplab.layers.attend`` (block j: queries j·s/p .. (j+1)·s/p against keys up to its end, a
lower-right causal mask), and three ways to give the blocks cuDNN's kernel, which takes no lower-right mask:
a block split into its past (no mask) and its diagonal square (causal), merged by their log-sum-exps in
float32 or in bf16, and the block's queries padded back to the sequence's start (a square, wasted work).
Per row: median ms of 20 calls (CUDA events), the largest difference from ``attend``'s blocks and from the
whole call's rows, and the kernels it ran. Writes OUT_DIR/gpu_attention_blocks_<card>.csv.
"""

import argparse
import statistics
from pathlib import Path

import pandas as pd
import torch
import torch.nn.functional as F

from tplab.layers.attend import attend
from tplab.toolkit.timing import time_calls


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("out_dir", type=Path)
    parser.add_argument("--batch", type=int, default=4)
    parser.add_argument("--seq", type=int, default=4096)
    parser.add_argument("--heads", type=int, default=40)
    parser.add_argument("--head-dim", type=int, default=128)
    args = parser.parse_args()
    torch.manual_seed(0)
    b, s, d, card = args.batch, args.seq, args.head_dim, torch.cuda.get_device_name()
    rows_out = []
    for p in (2, 4):
        n, rows = args.heads // p, s // p
        qkv = torch.randn(s, b, 3 * n * d, device="cuda", dtype=torch.bfloat16)
        q, k, v = (t.view(s, b, n, d).permute(1, 2, 0, 3) for t in qkv.split([n * d] * 3, dim=-1))   # (b, n, s, d)
        ways = {"whole, F.sdpa": lambda: [F.scaled_dot_product_attention(q, k, v, is_causal=True)],
                "blocks, attend": lambda: [attend(*block(q, k, v, j, rows), causal=True) for j in range(p)],
                "blocks, cuDNN past + diagonal, float32 merge": lambda: split(q, k, v, p, rows, torch.float32),
                "blocks, cuDNN past + diagonal, bf16 merge": lambda: split(q, k, v, p, rows, torch.bfloat16),
                "blocks, cuDNN padded to a square": lambda: [
                    F.scaled_dot_product_attention(*block(q, k, v, j, rows, padded=True), is_causal=True)[:, :, j * rows:]
                    for j in range(p)]}
        reference = torch.cat(ways["blocks, attend"](), dim=2)
        whole = ways["whole, F.sdpa"]()[0]
        for way, run in ways.items():
            got = torch.cat(run(), dim=2)
            rows_out.append(dict(p=p, heads_per_rank=n, query_rows_per_block=rows, way=way, ms=round(median_ms(run), 3),
                                 max_diff_vs_attend_blocks=float((got.float() - reference.float()).abs().max()),
                                 max_diff_vs_whole=float((got.float() - whole.float()).abs().max()),
                                 kernels="; ".join(kernel_names(run)), card=card, batch=b, seq=s, head_dim=d))
            print(f"p = {p}: {way:<46} {rows_out[-1]['ms']:7.3f} ms   diff vs attend {rows_out[-1]['max_diff_vs_attend_blocks']:.1e}",
                  flush=True)
    args.out_dir.mkdir(parents=True, exist_ok=True)
    path = args.out_dir / f"gpu_attention_blocks_{card.lower().replace('nvidia ', '').split()[0]}.csv"
    pd.DataFrame(rows_out).to_csv(path, index=False)
    print(f"wrote {path}")


def block(q, k, v, j, rows, padded=False):
    """Block j's queries and the keys it sees (up to its end); ``padded``: its queries from the start."""
    end = (j + 1) * rows
    return q[:, :, 0 if padded else j * rows:end], k[:, :, :end], v[:, :, :end]


def cudnn_with_lse(q, k, v, causal):
    out, lse = torch.ops.aten._scaled_dot_product_cudnn_attention(q, k, v, None, True, 0.0, causal, False,
                                                                   scale=q.shape[-1] ** -0.5)[:2]
    return out, lse.view(*q.shape[:3])                                   # (b, n, s_q, d), (b, n, s_q) float32


def split(q, k, v, p, rows, merge_dtype):
    """Each block as its diagonal square (causal) and, beyond block 0, its past (no mask), merged: the softmax
    over both key sets is out = w·out_past + (1 - w)·out_diagonal with w = sigmoid(lse_past - lse_diagonal)."""
    outs = []
    for j in range(p):
        mine = slice(j * rows, (j + 1) * rows)
        diagonal, lse_diagonal = cudnn_with_lse(q[:, :, mine], k[:, :, mine], v[:, :, mine], True)
        if j == 0:
            outs.append(diagonal)
            continue
        past, lse_past = cudnn_with_lse(q[:, :, mine], k[:, :, :j * rows], v[:, :, :j * rows], False)
        w = torch.sigmoid(lse_past - lse_diagonal).unsqueeze(-1).to(merge_dtype)
        outs.append(torch.lerp(diagonal.to(merge_dtype), past.to(merge_dtype), w).to(q.dtype))
    return outs


def median_ms(run, reps=20):
    return statistics.median(time_calls(run, iters=reps, warmup=3, cuda=True)) * 1e3   # (CUDA events)


def kernel_names(run):
    from torch.profiler import ProfilerActivity, profile

    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        run()
        torch.cuda.synchronize()
    return sorted({e.name.split("<")[0][:48] for e in prof.events()
                   if e.device_type.name == "CUDA" and not e.name.startswith("Memset")})


if __name__ == "__main__":
    main()
