"""tplab's one attention function on a GPU (and attend_with_lse's choice of kernel, at the end): a causal block of
queries (s_q <= s_k, lower-right aligned) gives bitwise what PyTorch's own lower-right causal bias gives -- the
kernel attend() calls directly is the one the bias dispatches to -- for bf16 and fp16, GQA, and head dims
FlashAttention takes; float32 (no FlashAttention) goes through the bias itself."""

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


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("causal", [True, False], ids=["causal", "full"])
@pytest.mark.parametrize("strided", [False, True], ids=["contiguous", "views"])
def test_attention_with_lse_runs_cudnns_kernel_where_it_may_and_flashattentions_when_told(dtype, causal, strided):
    """Square blocks (a ring's or streamed K/V's), as contiguous tensors or as the schemes' views -- heads
    split out of a (b, s, n, d) projection, a block cut out of the sequence: attend_with_lse gives bitwise
    what cuDNN's kernel gives (where this cuDNN is one it uses, 9.15 on), and under
    sdpa_kernel(FLASH_ATTENTION) what FlashAttention's does; both the same attention to bf16 rounding."""
    from torch.nn.attention import SDPBackend, sdpa_kernel

    from tplab.layers.attend import attend_with_lse

    g = torch.Generator(device="cuda").manual_seed(7)
    b, n, s, d = 2, 4, 256, 128
    if strided:   # (b, 2s, n, d) projections: heads transposed out, the second half of the sequence cut out
        q, k, v = (torch.randn(b, 2 * s, n, d, device="cuda", dtype=dtype, generator=g).transpose(1, 2)[:, :, s:]
                   for _ in range(3))
    else:
        q, k, v = (torch.randn(b, n, s, d, device="cuda", dtype=dtype, generator=g) for _ in range(3))
    scale = d ** -0.5
    out, lse = attend_with_lse(q, k, v, causal=causal)
    flash_out, flash_lse = torch.ops.aten._scaled_dot_product_flash_attention(q, k, v, 0.0, causal, False,
                                                                              scale=scale)[:2]
    if (torch.backends.cudnn.version() or 0) > 91500:
        want_out, want_lse = torch.ops.aten._scaled_dot_product_cudnn_attention(q, k, v, None, True, 0.0, causal,
                                                                                False, scale=scale)[:2]
        agree(torch.equal(out, want_out) and torch.equal(lse, want_lse.reshape(lse.shape)), "not cuDNN's kernel")
    with sdpa_kernel([SDPBackend.FLASH_ATTENTION]):
        told_out, told_lse = attend_with_lse(q, k, v, causal=causal)
    agree(torch.equal(told_out, flash_out) and torch.equal(told_lse, flash_lse), "not FlashAttention's kernel")
    agree(float((out.float() - flash_out.float()).abs().max()) < 2e-2 * float(flash_out.float().abs().max())
          and float((lse - flash_lse).abs().max()) < 1e-3, "cuDNN's and FlashAttention's attention differ")
