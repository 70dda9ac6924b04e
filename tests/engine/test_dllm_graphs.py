"""Graphs for DLLM_EXTEND (block diffusion). On the CPU a DLLM_EXTEND batch runs as decode rows
(`ForwardBatch.as_decode_rows`: each token a row over its request's keys up to its block's
end), graphs or not, so the CPU decode graphs replay it where its rows fit the ladder: the
outputs with graphs on are the eager ones, token for token. On CUDA the graph runner captures
DLLM_EXTEND batches of one block per request (width B) with block-causal metadata refreshed in
place before each replay; the padding, the metadata refresh and the runner's bookkeeping (with a
stand-in for torch.cuda graphs) are tested here on the CPU, the replay itself on a GPU."""

from __future__ import annotations

import contextlib
import types

import pytest
import torch

from engine import Engine, SamplingParams
from engine.attention import create_attention_backend
from engine.builtin_model import (
    DLLM_MASK_TOKEN,
    byte_level_tokenizer,
    dllm_config,
    random_llama_weights,
    write_checkpoint,
)
from engine.cpu_graph import CpuGraphRunner
from engine.cuda_graph import CudaGraphRunner, capture_ladder, fits_width, pad_verify, token_ladder
from engine.forward_batch import ForwardBatch, ForwardMode
from engine.memory import KVCache, ReqToTokenPool
from kernels import cpu_kernels

CPU = torch.device("cpu")
MODEL = "builtin-dllm"
needs_kernels = pytest.mark.skipif(
    cpu_kernels.load() is None, reason="decode rows need the CPU kernels"
)


# Small tensors: one intra-op thread is faster than two on a shared, busy machine.
pytestmark = pytest.mark.usefixtures("one_torch_thread")


def dllm_batch(prefix: list[int], ext: list[int], rows: list[int]) -> ForwardBatch:
    seq = [p + e for p, e in zip(prefix, ext)]
    n = sum(ext)
    fb = ForwardBatch(
        forward_mode=ForwardMode.DLLM_EXTEND,
        batch_size=len(ext),
        input_ids=torch.arange(10, 10 + n),
        seq_lens=torch.tensor(seq),
        out_cache_loc=torch.arange(100, 100 + n),
        req_pool_indices=torch.tensor(rows),
        positions=torch.empty(0, dtype=torch.int64),
        seq_lens_cpu=seq,
    )
    fb.set_extend_layout(prefix, ext)
    return fb


# ---- the pieces, on the CPU ---------------------------------------------------------------------
def test_dllm_batch_as_decode_rows_is_block_causal():
    """A new request (prompt of 5 after no prefix, its block 4..7), one right after a commit (the
    committed block 8..11 and the next, 12..15) and one mid-block (16..19), B = 4: a row per
    token, each over its request's keys up to its block's end."""
    fb = dllm_batch([0, 8, 16], [8, 8, 4], [3, 1, 2])
    rows = fb.as_decode_rows(4)
    assert rows.forward_mode == ForwardMode.DECODE and rows.rows_of == ForwardMode.DLLM_EXTEND
    assert rows.batch_size == rows.num_tokens == 20
    assert rows.req_pool_indices.tolist() == [3] * 8 + [1] * 8 + [2] * 4
    assert rows.seq_lens.tolist() == [4] * 4 + [8] * 4 + [12] * 4 + [16] * 4 + [20] * 4
    assert rows.seq_lens_cpu == rows.seq_lens.tolist()
    assert torch.equal(rows.positions, fb.positions) and torch.equal(
        rows.out_cache_loc, fb.out_cache_loc
    )
    assert rows.last_token_indices.tolist() == list(range(20))
    clipped = dllm_batch([4], [2], [1])  # a block clipped by the context at 6: no key past it
    assert clipped.as_decode_rows(4).seq_lens.tolist() == [6, 6]


def test_dllm_graph_fit_ladder_and_padding():
    """Graphs take batches of exactly one block (B) per request, up to as many tokens as the
    largest decode graph; padded requests are inert rows: row 0, positions 0..B-1, seq_len B, slot 0."""
    assert token_ladder(capture_ladder(64), 4) == [1, 2, 4, 8, 16]
    assert token_ladder(capture_ladder(2), 4) == [1]
    mid = dllm_batch([8, 16], [4, 4], [2, 1])
    assert fits_width(mid, 4)
    assert not fits_width(dllm_batch([8, 16], [8, 4], [2, 1]), 4)  # a commit's recomputed block
    assert not fits_width(dllm_batch([0], [4], [1]), 3)
    p = pad_verify(mid, 4, 4)
    assert p.req_pool_indices.tolist() == [2, 1, 0, 0]
    assert p.seq_lens.tolist() == [12, 20, 4, 4]
    assert p.positions.tolist() == list(range(8, 12)) + list(range(16, 20)) + [0, 1, 2, 3] * 2
    assert p.out_cache_loc.tolist() == list(range(100, 108)) + [0] * 8
    assert p.input_ids.tolist()[8:] == [0] * 8


def test_triton_dllm_graph_metadata_is_refreshed_in_place(monkeypatch):
    """The metadata a DLLM_EXTEND graph reads (each token's request row and key count) is built at
    capture from the static tensors and recomputed into the same tensors before each replay."""
    pytest.importorskip("triton")
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    pool = ReqToTokenPool(4, 64, CPU)
    kv = KVCache(64, 1, 2, 16, torch.float32, CPU)
    attn = create_attention_backend("triton", pool, kv, 0.25, CPU)
    static = pad_verify(
        ForwardBatch(
            ForwardMode.DLLM_EXTEND, 0, *(torch.empty(0, dtype=torch.int64) for _ in range(5))
        ),
        2,
        4,
    )
    fb = ForwardBatch(
        forward_mode=ForwardMode.DLLM_EXTEND,
        batch_size=2,
        input_ids=static.input_ids,
        seq_lens=static.seq_lens,
        out_cache_loc=static.out_cache_loc,
        req_pool_indices=static.req_pool_indices,
        positions=static.positions,
        seq_lens_cpu=[4, 4],
        extend_seq_lens_cpu=[4, 4],
        extend_seq_lens=torch.tensor([4, 4]),
        extend_start_loc=torch.tensor([0, 4]),
        last_token_indices=torch.arange(8),
    )
    md = attn.capture_metadata(fb, block_size=4)
    fb.attn_metadata = md
    rows, lens = md.token_rows, md.token_kv_lens
    assert rows.tolist() == [0] * 8 and lens.tolist() == [4] * 8
    real = pad_verify(dllm_batch([8], [4], [3]), 2, 4)  # one request mid-block, one padded
    for name in ("input_ids", "req_pool_indices", "seq_lens", "out_cache_loc", "positions"):
        getattr(fb, name).copy_(getattr(real, name))
    attn.replay_metadata(fb)
    assert fb.attn_metadata.token_rows is rows and rows.tolist() == [3] * 4 + [0] * 4
    assert lens.tolist() == [12] * 4 + [4] * 4
    with pytest.raises(ValueError, match="DLLM_EXTEND"):
        attn.capture_metadata(fb)  # no block size: not a graph the runner captures


# ---- through the Engine, CPU graphs on and off ------------------------------------------------------
LADDER_MAX = 16
# Offsets 3, 2 and 1 in blocks of 4.
PROMPTS = [[5 + (7 * i + 3 * n) % 250 for i in range(n)] for n in (3, 6, 9)]


def make_engine(path: str, graphs: bool, **kw) -> Engine:
    eng = Engine(
        model_path=path,
        max_total_tokens=512,
        max_running_requests=4,
        cpu_graph="on" if graphs else "off",
        cpu_graph_max_bs=LADDER_MAX,
        enable_lazy_cpu_graph=True,
        **kw,
    )
    assert isinstance(eng.model_runner.graph_runner, CpuGraphRunner) == graphs
    return eng


def run_both(path: str, threshold: float, prompts: list[list[int]], max_new: int) -> Engine:
    params = SamplingParams(max_new_tokens=max_new, temperature=0.0, ignore_eos=True)
    eager = make_engine(path, False, dllm_threshold=threshold).generate(
        input_ids=prompts, sampling_params=params
    )
    eng = make_engine(path, True, dllm_threshold=threshold)
    outs = eng.generate(input_ids=prompts, sampling_params=params)
    assert [o.token_ids for o in outs] == [o.token_ids for o in eager]
    assert all(len(o.token_ids) == max_new for o in outs)
    eng.check_memory()
    return eng


@needs_kernels
@pytest.mark.parametrize("threshold", [0.95, 0.5, 0.0])
def test_builtin_dllm_cpu_graphs_match_eager(threshold):
    """Three requests at different offsets in their blocks: graphed DLLM_EXTEND batches (each
    step's rows padded to the ladder: 12 rows mid-block, 24 at a commit, past the ladder: eager)
    give the eager tokens, and the graphs did run them."""
    eng = run_both(MODEL, threshold, PROMPTS, 10)
    runner = eng.model_runner.graph_runner
    assert runner.replays_by_mode[ForwardMode.DLLM_EXTEND] > 0 and not runner.failed
    # A block-diffusion model decodes nothing: every replay was a DLLM_EXTEND batch's rows.
    assert runner.replays_by_mode[ForwardMode.DECODE] == 0


@needs_kernels
def test_random_sdar_checkpoint_cpu_graphs_match_eager(tmp_path):
    """Another SDAR checkpoint, blocks of 3 and two KV heads, prompts at every offset of their
    blocks; thresholds where steps unmask several positions and where they unmask one."""
    cfg = dllm_config(
        block_size=3, num_key_value_heads=2, hidden_size=64, num_attention_heads=4, head_dim=16
    )
    path = write_checkpoint(
        str(tmp_path / "sdar"),
        cfg,
        random_llama_weights(cfg, seed=7, lm_head_std=0.6),
        byte_level_tokenizer((DLLM_MASK_TOKEN,)),
    )
    for threshold in (0.9, 0.0):
        eng = run_both(path, threshold, [p[:n] for p, n in zip(PROMPTS, (2, 4, 6))], 8)
        assert eng.model_runner.graph_runner.replays_by_mode[ForwardMode.DLLM_EXTEND] > 0


@needs_kernels
def test_decode_rows_match_the_extend_attention():
    """The decode-row forward of a DLLM_EXTEND batch gives the logits of the block-causal extend
    attention (SDPA under a mask), up to float32 rounding."""
    eng = make_engine(MODEL, False)
    mr = eng.model_runner
    assert mr.dllm_as_decode
    req_rows = [mr.req_to_token_pool.alloc() for _ in range(2)]
    slots = mr.allocator.alloc(20)
    mr.req_to_token_pool.write(req_rows[0], 0, slots[:12])
    mr.req_to_token_pool.write(req_rows[1], 0, slots[12:20])
    # A prompt and two blocks; a block over a prefix of 4.
    fb = dllm_batch([0, 4], [12, 4], req_rows)
    fb.input_ids = torch.tensor(PROMPTS[2] + [7, 8, 9] + [9, 8, 7, 6])
    fb.out_cache_loc = torch.cat([slots[:12], slots[16:20]]).to(torch.int64)
    fb.last_token_indices = torch.arange(16)
    # the second request's prefix KV first (an extend of its first block)
    first = dllm_batch([0], [4], [req_rows[1]])
    first.input_ids, first.out_cache_loc = (
        torch.tensor(PROMPTS[1][:4]),
        slots[12:16].to(torch.int64),
    )
    first.last_token_indices = torch.arange(4)
    mr.forward(first)
    rows_logits = mr.forward(fb)
    mr.dllm_as_decode = False
    try:
        extend_logits = mr.forward(fb)
    finally:
        mr.dllm_as_decode = True
    torch.testing.assert_close(rows_logits, extend_logits, atol=2e-4, rtol=1e-4)
    mr.allocator.free(slots)
    for row in req_rows:
        mr.req_to_token_pool.free(row)


# ---- CUDA ---------------------------------------------------------------------------------------
class StandInGraph:
    """torch.cuda.CUDAGraph's part the runner uses; `replay` reruns the captured batch's forward
    into the captured output (set up by `stand_in_cuda_graphs`)."""

    def __init__(self) -> None:
        self.fn = None

    def pool(self) -> None:
        return None

    def replay(self) -> None:
        self.fn()


class StandInCudaDevice(str):
    """A CPU device the runner's CUDA check accepts."""

    type = "cuda"


def use_reference_kernels(mr) -> None:
    """The triton backend's kernels replaced by their torch references (fast on the CPU)."""
    from kernels import triton_attention as ta

    mr.attn_backend.ops = types.SimpleNamespace(
        store_kv=ta.store_kv_ref,
        decode_attention=ta.decode_attention_ref,
        extend_attention=ta.extend_attention_ref,
    )


def stand_in_cuda_graphs(monkeypatch, mr, max_bs: int) -> CudaGraphRunner:
    """CudaGraphRunner on the CPU for a triton-backend ModelRunner: its static buffers, capture
    ladder, padding, metadata refresh and logits selection, with a rerun of the forward standing
    in for each graph's replay."""
    stream = types.SimpleNamespace(wait_stream=lambda s: None)
    nothing = contextlib.nullcontext
    monkeypatch.setattr(torch.cuda, "Stream", lambda *a, **k: stream)
    monkeypatch.setattr(torch.cuda, "stream", lambda s: nothing())
    monkeypatch.setattr(torch.cuda, "current_stream", lambda *a: stream)
    monkeypatch.setattr(torch.cuda, "graph", lambda g, pool=None, stream=None: nothing())
    monkeypatch.setattr(torch.cuda, "CUDAGraph", StandInGraph)
    proxy = types.SimpleNamespace(
        device=StandInCudaDevice("cpu"), attn_backend=mr.attn_backend, model=mr.model
    )
    runner = CudaGraphRunner(proxy, max_bs, 0, mr.model_config.dllm_block_size)
    for key, graph in runner.graphs.items():

        def rerun(key=key) -> None:
            runner.outputs[key].copy_(mr.model.forward(runner.batches[key], mr.attn_backend))

        graph.fn = rerun
    return runner


@pytest.mark.parametrize("threshold", [0.95, 0.5])
def test_cuda_graph_runner_dllm_path_on_a_stand_in(monkeypatch, threshold):
    """The CUDA runner's DLLM_EXTEND path without a GPU: batches of one block per request replay
    (padded to the ladder's sizes), the others run eagerly, and the tokens are the eager ones."""
    pytest.importorskip("triton")
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    prompts = PROMPTS + [[9 + i % 200 for i in range(13)]]
    params = SamplingParams(max_new_tokens=12, temperature=0.0, ignore_eos=True)
    outs = []
    for graphs in (False, True):
        eng = Engine(
            model_path=MODEL,
            attention_backend="triton",
            max_total_tokens=512,
            max_running_requests=4,
            dllm_threshold=threshold,
            cpu_graph="off",
        )
        mr = eng.model_runner
        use_reference_kernels(mr)
        if graphs:
            mr.graph_runner = runner = stand_in_cuda_graphs(monkeypatch, mr, 16)
            assert runner.dllm_ladder == [1, 2, 4] and not runner.decode_ladder
            assert sorted(runner.graphs) == [(ForwardMode.DLLM_EXTEND, s) for s in (1, 2, 4)]
        outs.append([o.token_ids for o in eng.generate(input_ids=prompts, sampling_params=params)])
        eng.check_memory()
    assert outs[1] == outs[0]
    assert 0 < runner.replays[ForwardMode.DLLM_EXTEND] < eng.scheduler.dllm.forwards


@pytest.mark.gpu
@pytest.mark.parametrize("threshold", [0.95, 0.0])
def test_cuda_graph_replay_matches_eager(threshold):
    """Graphed DLLM_EXTEND batches (one block per request, width B) give the eager tokens."""
    params = SamplingParams(max_new_tokens=16, temperature=0.0, ignore_eos=True)
    kw = dict(
        model_path=MODEL,
        device="cuda",
        dtype="float32",
        attention_backend="triton",
        dllm_threshold=threshold,
        cuda_graph_max_bs=16,
    )
    eager = Engine(disable_cuda_graph=True, **kw).generate(
        input_ids=PROMPTS, sampling_params=params
    )
    graphed = Engine(**kw)
    runner = graphed.model_runner.graph_runner
    assert runner is not None and runner.dllm_ladder == [1, 2, 4] and not runner.decode_ladder
    outs = graphed.generate(input_ids=PROMPTS, sampling_params=params)
    assert [o.token_ids for o in outs] == [e.token_ids for e in eager]
    if threshold > 0:  # at 0 every step commits (two blocks per request): eager
        assert runner.replays[ForwardMode.DLLM_EXTEND] > 0
    graphed.check_memory()
