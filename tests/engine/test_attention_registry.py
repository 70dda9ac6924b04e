"""The attention-backend registry and contract (CPU): creation by name, graph safety, metadata
returned per forward instead of kept on the backend, and the kernels/ -> engine/ layering rule."""

from __future__ import annotations

import ast
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

from engine import config as engine_config
from engine.attention import (
    ATTENTION_BACKENDS,
    AttentionBackend,
    FlashAttnBackend,
    TorchAttnBackend,
    TritonAttnBackend,
    create_attention_backend,
    register_backend,
)
from engine.cuda_graph import PaddedDecode, pad_decode
from engine.errors import ConfigError
from engine.forward_batch import ForwardBatch, ForwardMode
from engine.memory import KVCache, ReqToTokenPool

ROOT = Path(__file__).resolve().parents[2]
CPU = torch.device("cpu")
KV_HEADS, HEADS, HEAD_DIM, LAYERS = 2, 4, 8, 2
SCALE = HEAD_DIM ** -0.5


def make_state(dtype: torch.dtype, rows: int = 6, ctx: int = 32, slots: int = 120, seed: int = 0):
    """A pool whose rows 1..rows hold 16 distinct slots each, and K/V filled with noise."""
    g = torch.Generator().manual_seed(seed)
    pool = ReqToTokenPool(rows, ctx, CPU)
    kv = KVCache(slots, LAYERS, KV_HEADS, HEAD_DIM, dtype, CPU)
    for buf in kv.k + kv.v:
        buf.copy_(torch.randn(buf.shape, generator=g, dtype=torch.float64).to(dtype))
    perm = torch.randperm(slots, generator=g) + 1
    for r in range(1, rows + 1):
        pool.write(r, 0, perm[(r - 1) * 16:r * 16])
    return pool, kv


def decode_fb(pool: ReqToTokenPool, rows: list[int], seq: list[int]) -> ForwardBatch:
    loc = torch.stack([pool.req_to_token[r, s - 1] for r, s in zip(rows, seq)]).long()
    return ForwardBatch(forward_mode=ForwardMode.DECODE, batch_size=len(rows),
                        input_ids=torch.zeros(len(rows), dtype=torch.int64), seq_lens=torch.tensor(seq),
                        out_cache_loc=loc, req_pool_indices=torch.tensor(rows), positions=torch.tensor(seq) - 1,
                        seq_lens_cpu=list(seq))


def extend_fb(pool: ReqToTokenPool, rows: list[int], prefix: list[int], ext: list[int]) -> ForwardBatch:
    seq = [p + e for p, e in zip(prefix, ext)]
    starts = [sum(ext[:i]) for i in range(len(ext))]
    loc = torch.cat([pool.req_to_token[r, p:s] for r, p, s in zip(rows, prefix, seq)]).long()
    return ForwardBatch(forward_mode=ForwardMode.EXTEND, batch_size=len(rows),
                        input_ids=torch.zeros(sum(ext), dtype=torch.int64), seq_lens=torch.tensor(seq),
                        out_cache_loc=loc, req_pool_indices=torch.tensor(rows),
                        positions=torch.cat([torch.arange(p, s) for p, s in zip(prefix, seq)]),
                        extend_seq_lens=torch.tensor(ext), extend_start_loc=torch.tensor(starts),
                        seq_lens_cpu=seq, extend_seq_lens_cpu=list(ext))


def batches(pool: ReqToTokenPool) -> dict[str, ForwardBatch]:
    # Disjoint request rows, so the K/V one batch writes is never read by another.
    return {"decode_a": decode_fb(pool, [1, 2], [5, 9]), "decode_b": decode_fb(pool, [3], [12]),
            "extend": extend_fb(pool, [4, 5], [3, 0], [4, 2])}


def qkv(fb: ForwardBatch, dtype: torch.dtype, seed: int) -> tuple[torch.Tensor, ...]:
    g = torch.Generator().manual_seed(seed)
    t = fb.num_tokens
    return tuple(torch.randn(t, h, HEAD_DIM, generator=g, dtype=torch.float64).to(dtype)
                 for h in (HEADS, KV_HEADS, KV_HEADS))


def run(backend: AttentionBackend, fb: ForwardBatch, inputs: tuple[torch.Tensor, ...]) -> list[torch.Tensor]:
    return [backend.forward(*inputs, layer, fb) for layer in range(LAYERS)]


def test_registry_holds_the_builtin_backends():
    assert {"torch", "triton", "flash_attn"} <= set(ATTENTION_BACKENDS)
    assert set(engine_config.ATTENTION_BACKENDS) <= set(ATTENTION_BACKENDS)  # every configurable name exists
    assert ATTENTION_BACKENDS["torch"] is TorchAttnBackend
    assert ATTENTION_BACKENDS["triton"] is TritonAttnBackend
    assert ATTENTION_BACKENDS["flash_attn"] is FlashAttnBackend
    for name, cls in ATTENTION_BACKENDS.items():
        assert issubclass(cls, AttentionBackend) and cls.name == name


def test_graph_safe_values():
    assert TorchAttnBackend.graph_safe is False
    pool, kv = make_state(torch.float32)  # with the CPU kernel: safe for the CPU decode graphs
    from kernels import cpu_kernels

    assert create_attention_backend("torch", pool, kv, SCALE, CPU).cpu_graph_safe == (cpu_kernels.load() is not None)
    assert TritonAttnBackend.graph_safe is True
    assert FlashAttnBackend.graph_safe is False


def test_unknown_name_lists_the_registered_ones():
    pool, kv = make_state(torch.float32)
    with pytest.raises(ConfigError) as e:
        create_attention_backend("nope", pool, kv, SCALE, CPU)
    assert "'nope'" in str(e.value)
    for name in ATTENTION_BACKENDS:
        assert name in str(e.value)


def test_importing_the_package_imports_no_optional_kernel_package():
    code = ("import sys, engine.attention, engine.model_runner; "
            "print(sorted(m for m in ('triton', 'vllm_flash_attn', 'flash_attn', 'kernels.triton_attention',"
            " 'kernels.triton_moe') "
            "if m in sys.modules))")
    out = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "[]"


def test_non_graph_safe_backend_refuses_graph_hooks():
    pool, kv = make_state(torch.float64)  # no CPU kernel for float64: not graph-safe anywhere
    backend = create_attention_backend("torch", pool, kv, SCALE, CPU)
    fb = batches(pool)["decode_a"]
    for call in (lambda: backend.init_cuda_graph_state(8), lambda: backend.capture_metadata(fb),
                 lambda: backend.replay_metadata(fb)):
        with pytest.raises(ConfigError, match="'torch' is not graph-safe.*triton"):
            call()


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])  # float32 decode: the C++ CPU kernel
def test_torch_backend_returns_metadata_and_keeps_no_per_forward_state(dtype):
    pool, kv = make_state(dtype)
    fbs = batches(pool)
    inputs = {name: qkv(fb, dtype, seed=i) for i, (name, fb) in enumerate(fbs.items())}
    fresh = {}
    for name, fb in fbs.items():
        backend = create_attention_backend("torch", pool, kv, SCALE, CPU)
        fb.attn_metadata = backend.init_forward_metadata(fb)
        fresh[name] = run(backend, fb, inputs[name])
        fb.attn_metadata = None

    backend = create_attention_backend("torch", pool, kv, SCALE, CPU)
    before = dict(vars(backend))
    for fb in fbs.values():  # every batch's metadata first, then the forwards interleaved
        fb.attn_metadata = backend.init_forward_metadata(fb)
        assert fb.attn_metadata is not None
    assert vars(backend).keys() == before.keys()
    assert all(vars(backend)[k] is v for k, v in before.items())
    for name in ("decode_a", "extend", "decode_b", "extend", "decode_a", "decode_b"):
        for got, want in zip(run(backend, fbs[name], inputs[name]), fresh[name]):
            torch.testing.assert_close(got, want, rtol=0, atol=0)


def test_forward_without_metadata_says_what_is_missing():
    pool, kv = make_state(torch.float64)
    backend = create_attention_backend("torch", pool, kv, SCALE, CPU)
    fb = batches(pool)["extend"]
    with pytest.raises(RuntimeError, match="attn_metadata"):
        run(backend, fb, qkv(fb, torch.float64, seed=0))


@pytest.fixture
def echo_backend():
    try:
        @register_backend("test_echo")
        class EchoBackend(AttentionBackend):
            """Attention that returns q: just enough to check creation by name."""

            def init_forward_metadata(self, fb: ForwardBatch) -> int:
                return fb.batch_size

            def forward(self, q, k, v, layer, fb):
                return q

        yield EchoBackend
    finally:
        ATTENTION_BACKENDS.pop("test_echo", None)


def test_a_registered_backend_is_created_by_name(echo_backend):
    pool, kv = make_state(torch.float32)
    backend = create_attention_backend("test_echo", pool, kv, SCALE, CPU)
    assert type(backend) is echo_backend and backend.name == "test_echo"
    assert backend.req_to_token is pool.req_to_token and backend.kv is kv and backend.scale == SCALE
    fb = batches(pool)["decode_b"]
    fb.attn_metadata = backend.init_forward_metadata(fb)
    q = torch.randn(1, HEADS, HEAD_DIM)
    assert fb.attn_metadata == 1 and backend.forward(q, q, q, 0, fb) is q
    with pytest.raises(ValueError, match="already registered"):
        register_backend("test_echo")(type("Other", (echo_backend,), {}))
    with pytest.raises(TypeError):
        register_backend("test_not_a_backend")(int)
    assert "test_not_a_backend" not in ATTENTION_BACKENDS


def test_graph_safe_backend_must_implement_the_hooks(echo_backend):
    class Unfinished(echo_backend):
        graph_safe = True

    pool, kv = make_state(torch.float32)
    with pytest.raises(NotImplementedError, match="capture_metadata"):
        Unfinished(pool, kv, SCALE, CPU).capture_metadata(batches(pool)["decode_a"])


def varlen_ref(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, softmax_scale, causal):
    """flash_attn_varlen_func's semantics in torch: causal aligned to the end of each sequence."""
    assert causal
    out = torch.empty_like(q)
    cq, ck = cu_seqlens_q.tolist(), cu_seqlens_k.tolist()
    assert max_seqlen_q == max(b - a for a, b in zip(cq, cq[1:]))
    assert max_seqlen_k == max(b - a for a, b in zip(ck, ck[1:]))
    for i in range(len(cq) - 1):
        qs, ks, vs = q[cq[i]:cq[i + 1]], k[ck[i]:ck[i + 1]], v[ck[i]:ck[i + 1]]
        n, m = qs.shape[0], ks.shape[0]
        mask = torch.ones(n, m, dtype=torch.bool).tril(diagonal=m - n)
        o = F.scaled_dot_product_attention(qs.transpose(0, 1), ks.transpose(0, 1), vs.transpose(0, 1),
                                           attn_mask=mask, scale=softmax_scale, enable_gqa=True)
        out[cq[i]:cq[i + 1]] = o.transpose(0, 1)
    return out


def test_flash_attn_packing_matches_torch_backend():
    """CPU twin of the flash_attn backend: its metadata (packed KV slots, cu_seqlens) and forward,
    with the CUDA kernel replaced by a torch reference of the same call."""
    pool, kv = make_state(torch.float64)
    torch_backend = create_attention_backend("torch", pool, kv, SCALE, CPU)
    fa = FlashAttnBackend.__new__(FlashAttnBackend)  # skip the CUDA / package checks
    AttentionBackend.__init__(fa, pool, kv, SCALE, CPU)
    fa.varlen = varlen_ref
    for i, fb in enumerate(batches(pool).values()):
        inputs = qkv(fb, torch.float64, seed=i)
        fb.attn_metadata = torch_backend.init_forward_metadata(fb)
        want = run(torch_backend, fb, inputs)
        fb.attn_metadata = fa.init_forward_metadata(fb)
        for got, w in zip(run(fa, fb, inputs), want):
            torch.testing.assert_close(got, w)


def test_flash_attn_refused_on_cpu():
    pool, kv = make_state(torch.float32)
    with pytest.raises(ConfigError, match="flash_attn"):
        create_attention_backend("flash_attn", pool, kv, SCALE, CPU)


def test_triton_backend_matches_torch_and_its_graph_hooks():
    """Under TRITON_INTERPRET=1 (conftest): eager forwards against the torch backend, and the
    CUDA-graph protocol (static inputs, padded batch, capture/replay metadata) without a graph."""
    pytest.importorskip("triton")
    pool, kv = make_state(torch.float32)
    torch_backend = create_attention_backend("torch", pool, kv, SCALE, CPU)
    tb = create_attention_backend("triton", pool, kv, SCALE, CPU)
    fbs = batches(pool)
    inputs = {name: qkv(fb, torch.float32, seed=i) for i, (name, fb) in enumerate(fbs.items())}
    want = {}
    for name, fb in fbs.items():
        fb.attn_metadata = torch_backend.init_forward_metadata(fb)
        want[name] = run(torch_backend, fb, inputs[name])
        fb.attn_metadata = tb.init_forward_metadata(fb)
        for got, w in zip(run(tb, fb, inputs[name]), want[name]):
            torch.testing.assert_close(got, w, atol=1e-5, rtol=1e-4)

    size = 4
    tb.init_cuda_graph_state(size)
    # The graph runner's static inputs, all padding to start with: row 0, seq_len 1, slot 0.
    static = PaddedDecode(*(torch.zeros(size, dtype=torch.int64) for _ in range(5)))
    static.seq_lens.fill_(1)
    captured = ForwardBatch(forward_mode=ForwardMode.DECODE, batch_size=size, input_ids=static.input_ids,
                            seq_lens=static.seq_lens, out_cache_loc=static.out_cache_loc,
                            req_pool_indices=static.req_pool_indices, positions=static.positions,
                            seq_lens_cpu=[1] * size)
    captured.attn_metadata = tb.capture_metadata(captured)
    for name in ("decode_a", "decode_b"):
        fb = fbs[name]
        padded = pad_decode(fb, size)
        for field in ("input_ids", "req_pool_indices", "seq_lens", "out_cache_loc", "positions"):
            getattr(static, field).copy_(getattr(padded, field))
        captured.seq_lens_cpu = fb.seq_lens_cpu + [1] * (size - fb.batch_size)
        tb.replay_metadata(captured)
        pad = size - fb.batch_size
        padded_inputs = [torch.cat([t, t.new_zeros(pad, *t.shape[1:])]) for t in inputs[name]]
        for got, w in zip(run(tb, captured, padded_inputs), want[name]):
            torch.testing.assert_close(got[:fb.batch_size], w, atol=1e-5, rtol=1e-4)
    with pytest.raises(ValueError, match="DECODE"):
        tb.capture_metadata(fbs["extend"])


def _engine_imports(path: Path) -> list[str]:
    found = []
    for node in ast.walk(ast.parse(path.read_text(), filename=str(path))):
        if isinstance(node, ast.Import):
            names = [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            names = [node.module]
        elif (isinstance(node, ast.Call) and node.args and isinstance(node.args[0], ast.Constant)
              and isinstance(node.args[0].value, str)
              and getattr(node.func, "attr", getattr(node.func, "id", None)) in ("import_module", "__import__")):
            names = [node.args[0].value]
        else:
            continue
        found += [f"{path.relative_to(ROOT)}:{node.lineno}: {n}" for n in names
                  if n == "engine" or n.startswith("engine.")]
    return found


def test_kernels_import_nothing_from_engine():
    files = sorted((ROOT / "kernels").rglob("*.py"))
    assert files
    assert [hit for f in files for hit in _engine_imports(f)] == []
