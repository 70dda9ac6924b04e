"""Triton attention over the token-level KV pool (backend "triton").

Three kernels, each with a plain-torch reference beside it (the tests compare them, on the CPU
under TRITON_INTERPRET=1 and on a GPU):
  store_kv          k/v of the new tokens -> k_buf/v_buf at out_cache_loc
  decode_attention  one query per request over req_to_token[row, :seq_len]
  extend_attention  the new tokens of each request over its cached prefix and themselves
                    (causal), all read from the pool: store_kv runs first.
Query heads of one GQA group read the same kv head. Scores use tl.dot when the head dim allows
(>= 16), else a broadcast product (tiny test models)."""

from __future__ import annotations

import torch
import triton
import triton.language as tl


@triton.jit
def _store_kv_kernel(k_buf, v_buf, loc, k, v, row_elems, BLOCK: tl.constexpr):
    t = tl.program_id(0)
    slot = tl.load(loc + t).to(tl.int64)
    for start in range(0, row_elems, BLOCK):
        offs = start + tl.arange(0, BLOCK)
        m = offs < row_elems
        tl.store(k_buf + slot * row_elems + offs, tl.load(k + t * row_elems + offs, mask=m), mask=m)
        tl.store(v_buf + slot * row_elems + offs, tl.load(v + t * row_elems + offs, mask=m), mask=m)


def store_kv(k_buf: torch.Tensor, v_buf: torch.Tensor, loc: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> None:
    n = k.shape[0]
    if n == 0:
        return
    row = k.shape[1] * k.shape[2]
    _store_kv_kernel[(n,)](k_buf, v_buf, loc, k.contiguous(), v.contiguous(), row, BLOCK=min(1024, triton.next_power_of_2(row)))


def store_kv_ref(k_buf, v_buf, loc, k, v) -> None:
    k_buf[loc] = k
    v_buf[loc] = v


@triton.jit
def _decode_kernel(q, k_buf, v_buf, out, req_to_token, rows, seq_lens, scale, r2t_stride, num_heads, kv_heads,
                   head_dim, BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr):
    b = tl.program_id(0)
    h = tl.program_id(1)
    kvh = h // (num_heads // kv_heads)
    row = tl.load(rows + b).to(tl.int64)
    seq_len = tl.load(seq_lens + b)
    d = tl.arange(0, BLOCK_D)
    dm = d < head_dim
    qv = tl.load(q + (b * num_heads + h) * head_dim + d, mask=dm, other=0.0).to(tl.float32)
    m_i = -float("inf")
    l_i = 0.0
    acc = tl.zeros([BLOCK_D], dtype=tl.float32)
    for start in range(0, seq_len, BLOCK_N):
        n = start + tl.arange(0, BLOCK_N)
        nm = n < seq_len
        slots = tl.load(req_to_token + row * r2t_stride + n, mask=nm, other=0).to(tl.int64)
        kv_off = (slots[:, None] * kv_heads + kvh) * head_dim + d[None, :]
        kt = tl.load(k_buf + kv_off, mask=nm[:, None] & dm[None, :], other=0.0).to(tl.float32)
        s = tl.sum(qv[None, :] * kt, axis=1) * scale
        s = tl.where(nm, s, -float("inf"))
        m_new = tl.maximum(m_i, tl.max(s, axis=0))
        p = tl.exp(s - m_new)
        alpha = tl.exp(m_i - m_new)
        vt = tl.load(v_buf + kv_off, mask=nm[:, None] & dm[None, :], other=0.0).to(tl.float32)
        acc = acc * alpha + tl.sum(p[:, None] * vt, axis=0)
        l_i = l_i * alpha + tl.sum(p, axis=0)
        m_i = m_new
    tl.store(out + (b * num_heads + h) * head_dim + d, (acc / l_i).to(out.dtype.element_ty), mask=dm)


def decode_attention(q: torch.Tensor, k_buf: torch.Tensor, v_buf: torch.Tensor, req_to_token: torch.Tensor,
                     rows: torch.Tensor, seq_lens: torch.Tensor, scale: float) -> torch.Tensor:
    """q [B, H, D] -> [B, H, D]."""
    bs, heads, dim = q.shape
    out = torch.empty_like(q)
    if bs == 0:
        return out
    _decode_kernel[(bs, heads)](q.contiguous(), k_buf, v_buf, out, req_to_token, rows, seq_lens, scale,
                                req_to_token.stride(0), heads, k_buf.shape[1], dim,
                                BLOCK_N=64, BLOCK_D=triton.next_power_of_2(dim))
    return out


def decode_attention_ref(q, k_buf, v_buf, req_to_token, rows, seq_lens, scale) -> torch.Tensor:
    out = []
    for b in range(q.shape[0]):
        slots = req_to_token[rows[b], :seq_lens[b]].long()
        k, v = k_buf[slots].transpose(0, 1), v_buf[slots].transpose(0, 1)
        out.append(torch.nn.functional.scaled_dot_product_attention(
            q[b].unsqueeze(1), k, v, scale=scale, enable_gqa=True).squeeze(1))
    return torch.stack(out) if out else torch.empty_like(q)


@triton.jit
def _extend_kernel(q, k_buf, v_buf, out, req_to_token, rows, seq_lens, ext_lens, ext_starts, scale, r2t_stride,
                   num_heads, kv_heads, head_dim, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                   BLOCK_D: tl.constexpr, USE_DOT: tl.constexpr):
    b = tl.program_id(0)
    h = tl.program_id(1)
    mblk = tl.program_id(2)
    kvh = h // (num_heads // kv_heads)
    ext = tl.load(ext_lens + b)
    if mblk * BLOCK_M < ext:
        row = tl.load(rows + b).to(tl.int64)
        seq_len = tl.load(seq_lens + b)
        prefix = seq_len - ext
        q_start = tl.load(ext_starts + b)
        m = mblk * BLOCK_M + tl.arange(0, BLOCK_M)
        mm = m < ext
        d = tl.arange(0, BLOCK_D)
        dm = d < head_dim
        q_off = ((q_start + m[:, None]) * num_heads + h) * head_dim + d[None, :]
        qt = tl.load(q + q_off, mask=mm[:, None] & dm[None, :], other=0.0).to(tl.float32)
        m_i = tl.full([BLOCK_M], -float("inf"), tl.float32)
        l_i = tl.zeros([BLOCK_M], dtype=tl.float32)
        acc = tl.zeros([BLOCK_M, BLOCK_D], dtype=tl.float32)
        # Keys up to the last query of this block: the prefix, then the new tokens causally.
        end = tl.minimum(seq_len, prefix + (mblk + 1) * BLOCK_M)
        for start in range(0, end, BLOCK_N):
            n = start + tl.arange(0, BLOCK_N)
            nm = n < end
            slots = tl.load(req_to_token + row * r2t_stride + n, mask=nm, other=0).to(tl.int64)
            kv_off = (slots[:, None] * kv_heads + kvh) * head_dim + d[None, :]
            kt = tl.load(k_buf + kv_off, mask=nm[:, None] & dm[None, :], other=0.0).to(tl.float32)
            if USE_DOT:
                s = tl.dot(qt, tl.trans(kt))
            else:
                s = tl.sum(qt[:, None, :] * kt[None, :, :], axis=2)
            s = s * scale
            allowed = (n[None, :] <= prefix + m[:, None]) & nm[None, :] & mm[:, None]
            s = tl.where(allowed, s, -float("inf"))
            m_new = tl.maximum(m_i, tl.max(s, axis=1))
            m_safe = tl.where(m_new == -float("inf"), 0.0, m_new)
            p = tl.exp(s - m_safe[:, None])
            alpha = tl.exp(m_i - m_safe)
            vt = tl.load(v_buf + kv_off, mask=nm[:, None] & dm[None, :], other=0.0).to(tl.float32)
            if USE_DOT:
                pv = tl.dot(p, vt)
            else:
                pv = tl.sum(p[:, :, None] * vt[None, :, :], axis=1)
            acc = acc * alpha[:, None] + pv
            l_i = l_i * alpha + tl.sum(p, axis=1)
            m_i = m_new
        l_i = tl.where(l_i == 0.0, 1.0, l_i)
        tl.store(out + q_off, (acc / l_i[:, None]).to(out.dtype.element_ty), mask=mm[:, None] & dm[None, :])


def extend_attention(q: torch.Tensor, k_buf: torch.Tensor, v_buf: torch.Tensor, req_to_token: torch.Tensor,
                     rows: torch.Tensor, seq_lens: torch.Tensor, ext_lens: torch.Tensor, ext_starts: torch.Tensor,
                     max_ext: int, scale: float) -> torch.Tensor:
    """q [T, H, D] of the new tokens (their K/V already stored) -> [T, H, D]."""
    tokens, heads, dim = q.shape
    out = torch.empty_like(q)
    if tokens == 0:
        return out
    block_m, block_d = 16, triton.next_power_of_2(dim)
    grid = (rows.shape[0], heads, triton.cdiv(max_ext, block_m))
    _extend_kernel[grid](q.contiguous(), k_buf, v_buf, out, req_to_token, rows, seq_lens, ext_lens, ext_starts, scale,
                         req_to_token.stride(0), heads, k_buf.shape[1], dim, BLOCK_M=block_m, BLOCK_N=32,
                         BLOCK_D=block_d, USE_DOT=dim >= 16)
    return out


def extend_attention_ref(q, k_buf, v_buf, req_to_token, rows, seq_lens, ext_lens, ext_starts, max_ext, scale):
    out = torch.empty_like(q)
    for b in range(rows.shape[0]):
        n, seq, s0 = int(ext_lens[b]), int(seq_lens[b]), int(ext_starts[b])
        slots = req_to_token[rows[b], :seq].long()
        k, v = k_buf[slots].transpose(0, 1), v_buf[slots].transpose(0, 1)
        mask = torch.ones(n, seq, dtype=torch.bool, device=q.device).tril(diagonal=seq - n)
        o = torch.nn.functional.scaled_dot_product_attention(q[s0:s0 + n].transpose(0, 1), k, v, attn_mask=mask,
                                                             scale=scale, enable_gqa=True)
        out[s0:s0 + n] = o.transpose(0, 1)
    return out
