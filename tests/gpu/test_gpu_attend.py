"""tplab's one attention function on a GPU: a causal block of queries (s_q <= s_k, lower-right aligned)
gives bitwise what PyTorch's own lower-right causal bias gives -- the kernel attend() calls directly is the
one the bias dispatches to -- for bf16 and fp16, GQA, and head dims FlashAttention takes; float32 (no
FlashAttention) goes through the bias itself."""

from gputest import require_gpu

require_gpu()

import cupy  # noqa: E402
import pytest  # noqa: E402
import torch  # noqa: E402
from mpitest import agree  # noqa: E402
from torch.nn import functional as F  # noqa: E402
from torch.nn.attention.bias import causal_lower_right  # noqa: E402

from tplab.layers.attend import attend  # noqa: E402

torch.cuda.set_device(cupy.cuda.Device().id)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
@pytest.mark.parametrize("s_q, s_k", [(1, 1), (5, 5), (1, 9), (7, 64), (64, 200)])
@pytest.mark.parametrize("heads, kv_heads, d", [(4, 4, 64), (8, 2, 128), (2, 1, 80)])
def test_a_causal_block_of_queries_equals_the_lower_right_bias(dtype, s_q, s_k, heads, kv_heads, d):
    g = torch.Generator(device="cuda").manual_seed(s_q * 1000 + s_k + d)
    q = torch.randn(2, heads, s_q, d, device="cuda", dtype=dtype, generator=g)
    k, v = (torch.randn(2, kv_heads, s_k, d, device="cuda", dtype=dtype, generator=g) for _ in range(2))
    got = attend(q, k, v, causal=True)
    group = heads // kv_heads
    k, v = k.repeat_interleave(group, dim=1), v.repeat_interleave(group, dim=1)
    want = F.scaled_dot_product_attention(q, k, v, attn_mask=causal_lower_right(s_q, s_k))
    agree(got.shape == want.shape and torch.equal(got, want),
          f"{dtype} s_q {s_q} s_k {s_k}: max diff {(got.float() - want.float()).abs().max().item():.3g}")
