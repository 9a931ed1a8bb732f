"""Every bad input is a TypeError/ValueError naming the argument, with shapes/dtypes and a hint."""

import pytest
import torch

import portattn


def qkv(b=2, sq=5, sk=7, hq=4, hkv=2, d=8, dtype=torch.float32):
    return (torch.randn(b, sq, hq, d, dtype=dtype), torch.randn(b, sk, hkv, d, dtype=dtype),
            torch.randn(b, sk, hkv, d, dtype=dtype))


def cu(*lengths):
    return torch.tensor([0, *torch.tensor(lengths).cumsum(0).tolist()], dtype=torch.int32)


def test_not_a_tensor():
    q, k, v = qkv()
    with pytest.raises(TypeError, match=r"k must be a torch.Tensor, got list"):
        portattn.attention(q, [1, 2], v)


def test_wrong_ndim_names_layout_and_shape():
    q, k, v = qkv()
    with pytest.raises(ValueError, match=r"q must be 4-D \(B, S, H, D\) for layout='bshd'; got Tensor\(shape=\(5, 4, 8\)"
                       r".*cu_seqlens"):
        portattn.attention(q[0], k, v)
    with pytest.raises(ValueError, match=r"v must be 4-D \(B, H, S, D\) for layout='bhsd'"):
        portattn.attention(q, k, v[0], layout="bhsd")


def test_dtype_mismatch():
    q, k, v = qkv()
    with pytest.raises(TypeError, match=r"q, k and v must share one dtype.*k=Tensor\(.*dtype=torch.float16.*\.to\(q.dtype\)"):
        portattn.attention(q, k.half(), v)


def test_unsupported_dtype():
    q, k, v = qkv()
    with pytest.raises(TypeError, match=r"q has dtype torch.int64; supported dtypes are float16, bfloat16"):
        portattn.attention(q.long(), k.long(), v.long())


def test_device_mismatch():
    q, k, v = qkv()
    with pytest.raises(ValueError, match=r"q, k and v must be on one device.*device=meta"):
        portattn.attention(q, k.to("meta"), v)


def test_heads_not_divisible():
    q, k, v = qkv(hq=6, hkv=4)
    with pytest.raises(ValueError, match=r"number of query heads \(6\) must be a multiple of .*key/value heads \(4\)"):
        portattn.attention(q, k, v)


def test_kv_heads_differ():
    q, k, v = qkv()
    with pytest.raises(ValueError, match=r"k and v must have the same number of heads"):
        portattn.attention(q, k, v[:, :, :1])


def test_batch_and_seqlen_mismatch():
    q, k, v = qkv()
    with pytest.raises(ValueError, match=r"same batch size"):
        portattn.attention(q[:1], k, v)
    with pytest.raises(ValueError, match=r"k and v must have the same sequence length"):
        portattn.attention(q, k, v[:, :3])


def test_head_dim_mismatch():
    q, k, v = qkv()
    with pytest.raises(ValueError, match=r"q and k must have the same head_dim"):
        portattn.attention(q, k[..., :4], v)


@pytest.mark.parametrize("scale", [0.0, -1.0, float("nan"), float("inf")])
def test_scale_out_of_range(scale):
    q, k, v = qkv()
    with pytest.raises(ValueError, match=r"scale=.* is out of range: it must be finite and > 0"):
        portattn.attention(q, k, v, scale=scale)


def test_softcap_out_of_range():
    q, k, v = qkv()
    with pytest.raises(ValueError, match=r"softcap=-1.0 is out of range"):
        portattn.attention(q, k, v, softcap=-1.0)
    with pytest.raises(TypeError, match=r"softcap must be a real number"):
        portattn.attention(q, k, v, softcap="big")


@pytest.mark.parametrize("window,match", [
    ((-2, 0), r"window\[0\] \(left\)=-2 is out of range"),
    ((0, -5), r"window\[1\] \(right\)=-5 is out of range"),
    ((1.5, 0), r"window\[0\] \(left\) must be an int"),
    (3, r"window must be a \(left, right\) pair"),
])
def test_window_out_of_range(window, match):
    q, k, v = qkv()
    with pytest.raises((ValueError, TypeError), match=match):
        portattn.attention(q, k, v, window=window)


def test_causal_with_right_window_is_ambiguous():
    q, k, v = qkv()
    with pytest.raises(ValueError, match=r"causal=True already means window right = 0"):
        portattn.attention(q, k, v, causal=True, window=(4, 2))


def test_bad_alignment_and_layout():
    q, k, v = qkv()
    with pytest.raises(ValueError, match=r"causal_alignment='bottom' is not supported"):
        portattn.attention(q, k, v, causal=True, causal_alignment="bottom")
    with pytest.raises(ValueError, match=r"layout='sbhd' is not supported"):
        portattn.attention(q, k, v, layout="sbhd")


def test_bias_not_broadcastable():
    q, k, v = qkv()
    with pytest.raises(ValueError, match=r"attn_bias with shape \(2, 4, 5, 6\) is not broadcastable to "
                                         r"\(B, Hq, Sq, Sk\)=\(2, 4, 5, 7\)"):
        portattn.attention(q, k, v, attn_bias=torch.zeros(2, 4, 5, 6))


def test_bias_wrong_dtype_or_device():
    q, k, v = qkv()
    with pytest.raises(TypeError, match=r"attn_bias must be a float tensor \(additive\) or bool"):
        portattn.attention(q, k, v, attn_bias=torch.zeros(7, dtype=torch.int32))
    with pytest.raises(ValueError, match=r"attn_bias is on meta but q is on cpu"):
        portattn.attention(q, k, v, attn_bias=torch.zeros(7, device="meta"))


def test_alibi_bad_shape():
    q, k, v = qkv()
    with pytest.raises(ValueError, match=r"alibi_slopes must have shape \(Hq,\)=\(4,\) or \(B, Hq\)=\(2, 4\)"):
        portattn.attention(q, k, v, alibi_slopes=torch.ones(3))


def test_cu_seqlens_wrong_dtype():
    q = torch.randn(5, 2, 8)
    with pytest.raises(ValueError, match=r"cu_seqlens_q must be a 1-D int32 tensor.*dtype=torch.int64"):
        portattn.attention(q, q, q, cu_seqlens_q=cu(5).long(), cu_seqlens_k=cu(5))


def test_cu_seqlens_not_monotonic_or_wrong_total():
    q = torch.randn(5, 2, 8)
    bad = torch.tensor([0, 4, 2, 5], dtype=torch.int32)
    with pytest.raises(ValueError, match=r"cu_seqlens_q must start at 0, never decrease and end at the packed length 5"):
        portattn.attention(q, q, q, cu_seqlens_q=bad, cu_seqlens_k=cu(1, 1, 3))
    with pytest.raises(ValueError, match=r"cu_seqlens_k must start at 0.*end at the packed length 5"):
        portattn.attention(q, q, q, cu_seqlens_q=cu(5), cu_seqlens_k=cu(4))


def test_cu_seqlens_only_one_or_length_mismatch():
    q = torch.randn(5, 2, 8)
    with pytest.raises(ValueError, match=r"varlen needs both cu_seqlens_q and cu_seqlens_k"):
        portattn.attention(q, q, q, cu_seqlens_q=cu(5))
    with pytest.raises(ValueError, match=r"cu_seqlens_q and cu_seqlens_k must have the same length B \+ 1"):
        portattn.attention(q, q, q, cu_seqlens_q=cu(5), cu_seqlens_k=cu(2, 3))


def test_max_seqlen_too_small():
    q = torch.randn(5, 2, 8)
    with pytest.raises(ValueError, match=r"max_seqlen_q=2 is smaller than the longest sequence in cu_seqlens_q \(3\)"):
        portattn.attention(q, q, q, cu_seqlens_q=cu(2, 3), cu_seqlens_k=cu(2, 3), max_seqlen_q=2)


def test_varlen_needs_3d_and_bshd():
    q, k, v = qkv()
    with pytest.raises(ValueError, match=r"with cu_seqlens, q must be 3-D \(total, heads, head_dim\)"):
        portattn.attention(q, k, v, cu_seqlens_q=cu(5), cu_seqlens_k=cu(7))
    q3 = torch.randn(5, 2, 8)
    with pytest.raises(ValueError, match=r"varlen inputs are packed"):
        portattn.attention(q3, q3, q3, cu_seqlens_q=cu(5), cu_seqlens_k=cu(5), layout="bhsd")


def test_max_seqlen_without_cu_seqlens():
    q, k, v = qkv()
    with pytest.raises(ValueError, match=r"max_seqlen_q/max_seqlen_k are only meaningful with cu_seqlens"):
        portattn.attention(q, k, v, max_seqlen_q=5)
