"""The CPU paged decode-attention kernel against a plain-torch reference."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from kernels import cpu_kernels as cpu_attention

pytestmark = pytest.mark.skipif(cpu_attention.load() is None,
                                reason="CPU kernel disabled (RADIXRAY_CPU_KERNELS=0) or not buildable here")


def reference(q, k_buf, v_buf, req_to_token, rows, seq_lens, scale):
    out = []
    for b in range(q.shape[0]):
        slots = req_to_token[rows[b], :seq_lens[b]].long()
        k = k_buf[slots].transpose(0, 1)
        v = v_buf[slots].transpose(0, 1)
        out.append(F.scaled_dot_product_attention(q[b].unsqueeze(1), k, v, scale=scale, enable_gqa=True).squeeze(1))
    return torch.stack(out)


@pytest.mark.parametrize("bs, kv_heads, group, head_dim", [(1, 1, 1, 8), (3, 2, 4, 32), (9, 4, 2, 64),
                                                           (40, 8, 1, 64), (2, 2, 2, 128), (5, 1, 3, 24)])
def test_decode_attention_matches_reference(bs, kv_heads, group, head_dim):
    g = torch.Generator().manual_seed(bs * 100 + head_dim)
    pool, ctx = 600, 128
    k_buf = torch.randn(pool + 1, kv_heads, head_dim, generator=g)
    v_buf = torch.randn(pool + 1, kv_heads, head_dim, generator=g)
    req_to_token = torch.zeros(bs + 2, ctx, dtype=torch.int32)
    seq_lens = torch.randint(1, ctx, (bs,), generator=g)
    seq_lens[0] = 1
    rows = torch.randperm(bs + 1, generator=g)[:bs] + 1
    for b in range(bs):
        req_to_token[rows[b], :seq_lens[b]] = torch.randint(1, pool + 1, (int(seq_lens[b]),), generator=g).int()
    q = torch.randn(bs, kv_heads * group, head_dim, generator=g)
    scale = head_dim ** -0.5
    got = cpu_attention.decode_attention(q, k_buf, v_buf, req_to_token, rows, seq_lens, scale)
    want = reference(q, k_buf, v_buf, req_to_token, rows, seq_lens, scale)
    torch.testing.assert_close(got, want, atol=2e-6, rtol=1e-5)


def test_build_is_keyed_by_the_cpu(monkeypatch):
    """-march=native code from one CPU can SIGILL on another: another CPU means another build."""
    here = cpu_attention.build_digest()
    assert cpu_attention.cpu_signature().split()[0]  # the machine at least
    monkeypatch.setattr(cpu_attention, "cpu_signature", lambda: "x86_64 other-cpu sse2")
    assert cpu_attention.build_digest() != here
