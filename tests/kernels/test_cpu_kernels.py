"""The CPU kernels (kernels/cpu_kernels.py) against plain-torch references: paged decode attention,
with RoPE and the KV store fused in, the fused residual-add + RMSNorm, greedy argmax, the GEMM."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from engine.models.layers import RoPE, apply_rope
from kernels import cpu_kernels
from kernels.cpu_linear import onednn_linear_works

pytestmark = pytest.mark.skipif(cpu_kernels.load() is None,
                                reason="CPU kernels disabled (RADIXRAY_CPU_KERNELS=0) or not buildable here")
ops = torch.ops.radixray


def reference(q, k_buf, v_buf, req_to_token, rows, seq_lens, scale):
    out = []
    for b in range(q.shape[0]):
        slots = req_to_token[rows[b], :seq_lens[b]].long()
        k = k_buf[slots].transpose(0, 1)
        v = v_buf[slots].transpose(0, 1)
        out.append(F.scaled_dot_product_attention(q[b].unsqueeze(1), k, v, scale=scale, enable_gqa=True).squeeze(1))
    return torch.stack(out)


def paged_state(bs: int, kv_heads: int, head_dim: int, g: torch.Generator, dtype=torch.float32, pool: int = 600,
                ctx: int = 128):
    k_buf = torch.randn(pool + 1, kv_heads, head_dim, generator=g).to(dtype)
    v_buf = torch.randn(pool + 1, kv_heads, head_dim, generator=g).to(dtype)
    req_to_token = torch.zeros(bs + 2, ctx, dtype=torch.int32)
    seq_lens = torch.randint(1, ctx, (bs,), generator=g)
    seq_lens[0] = 1
    rows = torch.randperm(bs + 1, generator=g)[:bs] + 1
    slots = torch.randperm(pool, generator=g) + 1  # distinct: no request reads another's new slot
    used = 0
    for b in range(bs):
        n = int(seq_lens[b])
        req_to_token[rows[b], :n] = slots[used:used + n].int()
        used += n
    return k_buf, v_buf, req_to_token, rows, seq_lens


@pytest.mark.parametrize("bs, kv_heads, group, head_dim", [(1, 1, 1, 8), (3, 2, 4, 32), (9, 4, 2, 64),
                                                           (40, 8, 1, 64), (2, 2, 2, 128), (5, 1, 3, 24)])
def test_decode_attention_matches_reference(bs, kv_heads, group, head_dim):
    g = torch.Generator().manual_seed(bs * 100 + head_dim)
    k_buf, v_buf, req_to_token, rows, seq_lens = paged_state(bs, kv_heads, head_dim, g, pool=bs * 128)
    q = torch.randn(bs, kv_heads * group, head_dim, generator=g)
    scale = head_dim ** -0.5
    got = cpu_kernels.decode_attention(q, k_buf, v_buf, req_to_token, rows, seq_lens, scale)
    want = reference(q, k_buf, v_buf, req_to_token, rows, seq_lens, scale)
    torch.testing.assert_close(got, want, atol=2e-6, rtol=1e-5)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("bs, kv_heads, group, head_dim", [(1, 1, 1, 8), (3, 2, 4, 32), (40, 2, 3, 64),
                                                           (2, 1, 2, 128)])
def test_decode_attention_rope_is_rope_then_store_then_attention(dtype, bs, kv_heads, group, head_dim):
    """The fused op = the model's RoPE (bit for bit), k/v written at out_loc, then attention."""
    g = torch.Generator().manual_seed(bs + head_dim)
    k_buf, v_buf, req_to_token, rows, seq_lens = paged_state(bs, kv_heads, head_dim, g, dtype, pool=bs * 128)
    heads = kv_heads * group
    rope = RoPE(head_dim, 10000.0, None, 256, dtype, torch.device("cpu"))
    positions = seq_lens - 1
    out_loc = torch.stack([req_to_token[r, p].long() for r, p in zip(rows, positions)])
    wide = torch.randn(bs, heads + 2 * kv_heads + 3, head_dim, generator=g).to(dtype)
    qkv = wide[:, :heads + 2 * kv_heads]  # strided rows, as a view of a wider projection
    scale = head_dim ** -0.5
    k_ref, v_ref = k_buf.clone(), v_buf.clone()
    got = ops.decode_attention_rope(qkv, rope.cos, rope.sin_signed, positions, k_buf, v_buf, out_loc,
                                    req_to_token, rows, seq_lens, heads, scale)
    cos, sin = rope(positions)
    roped = apply_rope(qkv[:, :heads + kv_heads], cos, sin)
    k_ref[out_loc] = roped[:, heads:]
    v_ref[out_loc] = qkv[:, heads + kv_heads:]
    assert torch.equal(k_buf, k_ref) and torch.equal(v_buf, v_ref)
    want = reference(roped[:, :heads].float(), k_ref.float(), v_ref.float(), req_to_token, rows, seq_lens, scale)
    tol = dict(atol=2e-6, rtol=1e-5) if dtype == torch.float32 else dict(atol=1e-2, rtol=1e-2)
    torch.testing.assert_close(got.float(), want, **tol)


def hf_rms_norm(x: torch.Tensor, w: torch.Tensor, eps: float) -> torch.Tensor:
    """transformers' LlamaRMSNorm."""
    h = x.float()
    h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + eps)
    return w * h.to(x.dtype)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("rows", [0, 1, 7, 40])
def test_rms_norms_match_transformers(dtype, rows):
    g = torch.Generator().manual_seed(rows)
    x = torch.randn(rows, 96, generator=g).to(dtype)
    residual = torch.randn(rows, 96, generator=g).to(dtype)
    w = (1 + 0.1 * torch.randn(96, generator=g)).to(dtype)
    tol = dict(atol=1e-5, rtol=1e-5) if dtype == torch.float32 else dict(atol=2e-2, rtol=2e-2)
    torch.testing.assert_close(ops.rms_norm(x, w, 1e-6), hf_rms_norm(x, w, 1e-6), **tol)
    want_residual = residual + x
    got = ops.add_rms_norm(x, residual, w, 1e-6)
    assert torch.equal(residual, want_residual)  # updated in place, rounded like torch's add
    torch.testing.assert_close(got, hf_rms_norm(want_residual, w, 1e-6), **tol)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_argmax_rows_flags_non_finite_rows(dtype):
    logits = torch.randn(6, 300).to(dtype)
    logits[1, 7] = logits[1, 9] = 50.0  # a tie: the first index, as torch.argmax
    logits[2, 5] = float("nan")
    logits[3, 11] = float("inf")
    logits[4] = float("-inf")
    logits[5, 1] = float("-inf")  # masked tokens beside finite ones are fine
    ids, void = torch.full((8,), -5, dtype=torch.int64), torch.full((8,), -5, dtype=torch.int64)
    ops.argmax_rows(logits, ids, void)
    want = torch.argmax(logits.float(), dim=-1)
    for r in (0, 1, 5):
        assert ids[r] == want[r] and void[r] == want[r]
    assert ids[1] == 7
    assert void[2:5].tolist() == [-1, -1, -1] and 0 <= int(ids[2]) < 300
    assert ids[6:].tolist() == [-5, -5]  # only the batch's rows are written


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_masked_argmax_rows_is_argmax_over_allowed_tokens(dtype):
    """Against torch.argmax of the masked logits; a mask word past the vocabulary is ignored."""
    g = torch.Generator().manual_seed(0)
    rows, vocab = 7, 300  # 10 words: the last covers 288..319, past the vocabulary
    logits = torch.randn(rows, vocab, generator=g).to(dtype)
    allowed = torch.rand(rows, 320, generator=g) < 0.1
    allowed[1] = True  # everything
    allowed[2] = False  # nothing: void
    allowed[3] = False
    allowed[3, [40, 299]] = True
    logits[3, 299] = logits[3, 40] = 30.0  # a tie: the first index
    allowed[4, 5] = True
    logits[4, 5] = float("nan")  # an allowed NaN: void
    allowed[5, 6], allowed[5, 7] = False, True
    logits[5, 6] = float("nan")  # a forbidden NaN does not matter
    bits = allowed.view(rows, 10, 32).long() << torch.arange(32)
    bitmask = bits.sum(-1).to(torch.int64).to(torch.uint32).view(torch.int32).contiguous()
    ids, void = torch.full((8,), -5, dtype=torch.int64), torch.full((8,), -5, dtype=torch.int64)
    cpu_kernels.masked_argmax_rows(logits, bitmask, ids, void)
    masked = logits.float().masked_fill(~allowed[:, :vocab], float("-inf"))
    want = torch.argmax(masked, dim=-1)
    for r in (0, 1, 5, 6):
        assert ids[r] == want[r] and void[r] == want[r] and allowed[r, want[r]]
    assert ids[3] == 40 and void[3] == 40
    assert void[2] == -1 and void[4] == -1
    assert ids[7:].tolist() == [-5]


needs_gemm = pytest.mark.skipif(not cpu_kernels.load().gemm_available(), reason="no AVX-512 on this CPU")


@needs_gemm
@pytest.mark.parametrize("rows", [0, 1, 5, 8, 12, 13, 97, 300])
@pytest.mark.parametrize("n, k", [(48, 40), (33, 70), (640, 384), (300, 64), (50, 800)])
def test_gemm_matches_f_linear_and_ignores_the_batch(rows, n, k):
    g = torch.Generator().manual_seed(rows * 7 + n)
    w, b = torch.randn(n, k, generator=g), torch.randn(n, generator=g)
    x = torch.randn(rows, k, generator=g)
    packed = cpu_kernels.load().gemm_pack(w)
    got = ops.gemm(x, packed, b, n)
    torch.testing.assert_close(got, F.linear(x, w, b), atol=1e-4, rtol=1e-4)
    for r in range(min(rows, 3)):  # each row alone gives the same bits: padding a batch changes nothing
        assert torch.equal(ops.gemm(x[r:r + 1].clone(), packed, b, n)[0], got[r])
    wide = torch.randn(rows, 2 * k, generator=g)  # rows with a stride, and a non-unit inner stride
    torch.testing.assert_close(ops.gemm(wide[:, :k], packed, None, n), F.linear(wide[:, :k], w),
                               atol=1e-4, rtol=1e-4)
    torch.testing.assert_close(ops.gemm(wide[:, ::2], packed, None, n), F.linear(wide[:, ::2], w),
                               atol=1e-4, rtol=1e-4)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("with_bias", [True, False])
def test_onednn_linear_operator_is_onednns_linear(dtype, with_bias):
    """torch.ops.radixray.onednn_linear (how compiled graphs call a oneDNN linear) gives exactly
    what mkldnn's own packed linear gives, for a strided input too; a wrong width is refused."""
    if not onednn_linear_works(dtype):
        pytest.skip(f"oneDNN's packed {dtype} linear does not run on this CPU or torch build")
    gen = torch.Generator().manual_seed(3)
    w = torch.randn(48, 40, generator=gen).to(dtype)
    b = torch.randn(48, generator=gen).to(dtype) if with_bias else None
    x = torch.randn(7, 80, generator=gen).to(dtype)[:, ::2]  # every other column: strided
    packed = torch.ops.mkldnn._reorder_linear_weight(w, None)
    got = torch.ops.radixray.onednn_linear(x, packed, b, 48)
    want = torch.ops.mkldnn._linear_pointwise(x, packed, b, "none", [], "")
    assert torch.equal(got, want)
    with pytest.raises(RuntimeError, match="outputs"):
        torch.ops.radixray.onednn_linear(x, packed, b, 47)


def test_stream_read_bandwidth_reads_the_buffer():
    assert cpu_kernels.load().stream_sum(torch.ones(1000)) == 1000.0
    assert cpu_kernels.stream_read_bandwidth(1 << 20, repeats=2) > 0


def test_build_is_keyed_by_the_cpu(monkeypatch):
    """-march=native code from one CPU can SIGILL on another: another CPU means another build."""
    here = cpu_kernels.build_digest()
    assert cpu_kernels.cpu_signature().split()[0]  # the machine at least
    monkeypatch.setattr(cpu_kernels, "cpu_signature", lambda: "x86_64 other-cpu sse2")
    assert cpu_kernels.build_digest() != here
