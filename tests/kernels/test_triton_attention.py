"""Triton kernels vs their torch references (TRITON_INTERPRET=1 on CPU, see conftest)."""

from __future__ import annotations

import pytest
import torch

triton = pytest.importorskip("triton")
from kernels import triton_attention as ta  # noqa: E402

DEV = "cuda" if torch.cuda.is_available() else "cpu"


def make_pool(bs, kv_heads, head_dim, seq_lens, pool=400, ctx=96, seed=0):
    g = torch.Generator().manual_seed(seed)
    k_buf = torch.randn(pool + 1, kv_heads, head_dim, generator=g).to(DEV)
    v_buf = torch.randn(pool + 1, kv_heads, head_dim, generator=g).to(DEV)
    req_to_token = torch.zeros(bs + 1, ctx, dtype=torch.int32)
    perm = torch.randperm(pool, generator=g) + 1
    used = 0
    for b in range(bs):
        req_to_token[b + 1, :seq_lens[b]] = perm[used:used + seq_lens[b]].int()
        used += seq_lens[b]
    rows = torch.arange(1, bs + 1)
    return k_buf, v_buf, req_to_token.to(DEV), rows.to(DEV)


@pytest.mark.parametrize("bs, kv_heads, group, head_dim", [(1, 1, 1, 8), (3, 2, 4, 32), (4, 4, 2, 16), (2, 1, 3, 24)])
def test_decode_attention(bs, kv_heads, group, head_dim):
    seq_lens = [1, 70, 33, 5][:bs]
    k_buf, v_buf, r2t, rows = make_pool(bs, kv_heads, head_dim, seq_lens, seed=bs)
    q = torch.randn(bs, kv_heads * group, head_dim).to(DEV)
    lens = torch.tensor(seq_lens).to(DEV)
    got = ta.decode_attention(q, k_buf, v_buf, r2t, rows, lens, head_dim ** -0.5)
    want = ta.decode_attention_ref(q, k_buf, v_buf, r2t, rows, lens, head_dim ** -0.5)
    torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-4)


@pytest.mark.parametrize("bs, kv_heads, group, head_dim", [(1, 1, 1, 8), (3, 2, 2, 32), (2, 2, 1, 16)])
@pytest.mark.parametrize("case", ["empty_prefix", "with_prefix", "prefix_only_one_new"])
def test_extend_attention(bs, kv_heads, group, head_dim, case):
    ext = {"empty_prefix": [20, 7, 1], "with_prefix": [5, 17, 3], "prefix_only_one_new": [1, 1, 1]}[case][:bs]
    prefix = {"empty_prefix": [0, 0, 0], "with_prefix": [30, 0, 12], "prefix_only_one_new": [40, 9, 1]}[case][:bs]
    seq = [p + e for p, e in zip(prefix, ext)]
    k_buf, v_buf, r2t, rows = make_pool(bs, kv_heads, head_dim, seq, seed=7)
    starts = torch.tensor([sum(ext[:i]) for i in range(bs)]).to(DEV)
    q = torch.randn(sum(ext), kv_heads * group, head_dim).to(DEV)
    args = (q, k_buf, v_buf, r2t, rows, torch.tensor(seq).to(DEV), torch.tensor(ext).to(DEV), starts, max(ext),
            head_dim ** -0.5)
    torch.testing.assert_close(ta.extend_attention(*args), ta.extend_attention_ref(*args), atol=1e-5, rtol=1e-4)


def test_store_kv():
    k_buf = torch.zeros(50, 2, 8).to(DEV)
    v_buf = torch.zeros(50, 2, 8).to(DEV)
    loc = torch.tensor([3, 17, 49, 1]).to(DEV)
    k, v = torch.randn(4, 2, 8).to(DEV), torch.randn(4, 2, 8).to(DEV)
    kr, vr = k_buf.clone(), v_buf.clone()
    ta.store_kv(k_buf, v_buf, loc, k, v)
    ta.store_kv_ref(kr, vr, loc, k, v)
    assert torch.equal(k_buf, kr) and torch.equal(v_buf, vr)


def test_engine_parity_with_triton_backend(model_dirs, hf):
    from engine import Engine, SamplingParams

    path = model_dirs["llama"]
    eng = Engine(model_path=path, attention_backend="triton", chunked_prefill_size=16)
    ids = [[1] + list(range(20, 20 + n)) for n in (5, 30, 12)]
    params = SamplingParams(max_new_tokens=6, temperature=0.0, ignore_eos=True)
    outs = eng.generate(input_ids=ids, sampling_params=params)
    second = eng.generate(input_ids=ids[1], sampling_params=params)  # a cached prefix this time
    assert second.cached_tokens > 0
    for p, o in zip(ids + [ids[1]], outs + [second]):
        assert o.token_ids == hf.greedy(path, p, 6)
    eng.check_memory()


def test_flash_attn_refused_with_a_reason():
    from engine import Engine
    from engine.errors import ConfigError

    with pytest.raises(ConfigError, match="flash_attn"):
        Engine(attention_backend="flash_attn", max_total_tokens=1000)
