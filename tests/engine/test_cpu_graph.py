"""CPU decode graphs (engine/cpu_graph.py): greedy output stays token-identical to transformers
with them on, in every batching mode; each engine compiles its own regions; a size that fails to
compile runs eagerly. The suite runs engines eagerly (conftest: RADIXRAY_CPU_GRAPHS=0); these
tests turn the graphs back on, on small models and a short ladder (sizes 1, 2, 4, 8), so that each
compile is about a second once inductor's cache is warm."""

from __future__ import annotations

import pytest
import torch

from engine import Engine, SamplingParams
from engine.builtin_model import byte_level_tokenizer, random_llama_weights, write_checkpoint
from engine.cpu_graph import CpuGraphRunner
from engine.forward_batch import ForwardBatch, ForwardMode
from engine.model_runner import ModelRunner
from kernels import cpu_kernels
from tests.conftest import MODEL_CONFIGS
from tests.helpers import GREEDY, assert_matches_hf, prompts, run_staggered

pytestmark = pytest.mark.skipif(cpu_kernels.load() is None, reason="the CPU decode graphs need the CPU kernels")
LADDER_MAX = 8
PARAMS24 = SamplingParams(max_new_tokens=24, temperature=0.0, ignore_eos=True)


@pytest.fixture(autouse=True)
def graphs_on(monkeypatch):
    monkeypatch.setenv("RADIXRAY_CPU_GRAPHS", "1")


def graph_engine(path: str, **kw) -> Engine:
    eng = Engine(model_path=path, cpu_graph_max_bs=LADDER_MAX, **kw)
    assert isinstance(eng.model_runner.graph_runner, CpuGraphRunner)
    return eng


def assert_graphs_ran(eng: Engine) -> None:
    runner = eng.model_runner.graph_runner
    assert runner.replays > 0 and runner.compiled and not runner.failed


MODES = {  # (engine kwargs, requests, how they arrive)
    "radix": ({}, 6, "together"),
    "chunked": ({"chunked_prefill_size": 7}, 6, "together"),
    "mixed": ({"enable_mixed_chunk": True, "chunked_prefill_size": 8}, 6, "staggered"),
    "retraction": ({"max_total_tokens": 200}, 12, "together"),
    "overlap": ({"enable_overlap_schedule": True, "chunked_prefill_size": 8}, 6, "staggered"),
}


@pytest.mark.parametrize("mode", sorted(MODES))
def test_graphs_match_transformers_in_every_mode(model_dirs, hf, mode):
    kw, n, arrival = MODES[mode]
    path = model_dirs["llama"]
    eng = graph_engine(path, **kw)
    ids = prompts(eng, n, seed=31, lo=10, hi=40)
    if arrival == "staggered":
        outs, length = run_staggered(eng, ids, GREEDY), 16
    else:
        outs, length = eng.generate(input_ids=ids, sampling_params=PARAMS24), 24
    stats = eng.stats()
    if mode == "mixed":
        assert stats.batches_by_mode["MIXED"] > 0
    if mode == "retraction":
        assert stats.num_retracted > 0
    if mode == "overlap":
        assert stats.overlapped_steps > 0
    assert_graphs_ran(eng)
    assert_matches_hf(eng, hf, path, ids, outs, n=length)
    eng.check_memory()


def test_verify_batches_replay_the_decode_graphs(model_dirs, hf):
    """With n-gram speculation, a verify batch runs as decode rows (one per position): the
    decode graphs replay it when its rows fit the ladder. Output stays transformers'."""
    path = model_dirs["llama"]
    eng = graph_engine(path, speculative_algorithm="ngram", speculative_num_draft_tokens=3)
    runner, replayed_rows, verifying = eng.model_runner, [], []
    replay, forward_and_verify = runner.graph_runner.replay, runner.forward_and_verify

    def record_replay(fb, size=None):
        if verifying:
            replayed_rows.append(fb.batch_size)
        return replay(fb, size)

    def record_verify(fb, reqs, drafts):
        verifying.append(True)
        try:
            return forward_and_verify(fb, reqs, drafts)
        finally:
            verifying.clear()

    runner.graph_runner.replay, runner.forward_and_verify = record_replay, record_verify
    ids = prompts(eng, 2, seed=5, lo=10, hi=30)
    outs = eng.generate(input_ids=ids, sampling_params=PARAMS24)
    assert eng.stats().spec_accepted_tokens > 0
    assert any(rows > 2 for rows in replayed_rows)  # a verify batch's rows: more than its 2 requests
    assert_matches_hf(eng, hf, path, ids, outs, n=24)
    eng.check_memory()


def test_graphs_match_transformers_with_qk_norm_and_one_kv_head(model_dirs, hf):
    path = model_dirs["qwen3"]  # per-head q/k RMSNorm, four query heads per kv head, head_dim 32
    eng = graph_engine(path)
    ids = prompts(eng, 3, seed=32, lo=5, hi=30)
    outs = eng.generate(input_ids=ids, sampling_params=GREEDY)
    assert_graphs_ran(eng)
    assert_matches_hf(eng, hf, path, ids, outs)


def test_graphs_match_transformers_with_onednn_linears(model_dirs, hf):
    """fp32 with oneDNN's packed linears (the CPUs without AVX-512, or linear_backend='onednn'):
    the graphs call them as torch.ops.radixray.onednn_linear."""
    path = model_dirs["llama"]
    eng = graph_engine(path, linear_backend="onednn")
    ids = prompts(eng, 4, seed=37)
    outs = eng.generate(input_ids=ids, sampling_params=GREEDY)
    assert_graphs_ran(eng)
    assert_matches_hf(eng, hf, path, ids, outs)


def test_each_engine_compiles_its_own_graphs(model_dirs, hf, tmp_path):
    """Two engines of one architecture with different weights, in one process, interleaved: the
    compiled regions (which check no guards) are never shared."""
    cfg = dict(MODEL_CONFIGS["llama"])
    other = write_checkpoint(str(tmp_path / "llama2"), cfg, random_llama_weights(cfg, seed=2, std=0.15),
                             byte_level_tokenizer())
    a, b = graph_engine(model_dirs["llama"]), graph_engine(other)
    ids = prompts(a, 2, seed=33)
    outs_a = a.generate(input_ids=ids, sampling_params=GREEDY)
    outs_b = b.generate(input_ids=ids, sampling_params=GREEDY)
    again_a = a.generate(input_ids=ids, sampling_params=GREEDY)
    assert [o.token_ids for o in outs_a] != [o.token_ids for o in outs_b]
    assert [o.token_ids for o in again_a] == [o.token_ids for o in outs_a]
    assert_matches_hf(a, hf, model_dirs["llama"], ids, outs_a)
    assert_matches_hf(b, hf, other, ids, outs_b)
    assert_graphs_ran(a)
    assert_graphs_ran(b)


def test_idle_batch_replays_as_one_inert_padded_row(model_dirs):
    """An IDLE batch (no rows) runs the size-1 graph on the padding row: request row 0, slot 0."""
    eng = graph_engine(model_dirs["llama"])
    mr = eng.model_runner
    eng.generate(input_ids=prompts(eng, 1, seed=34), sampling_params=GREEDY)
    kv_before = [t.clone() for t in mr.kv_cache.k]
    empty = torch.empty(0, dtype=torch.int64)
    idle = ForwardBatch(forward_mode=ForwardMode.IDLE, batch_size=0, input_ids=empty, seq_lens=empty,
                        out_cache_loc=empty, req_pool_indices=empty, positions=empty, seq_lens_cpu=[])
    replays = mr.graph_runner.replays
    assert mr.forward(idle) is None and mr.graph_runner.replays == replays + 1
    for before, after in zip(kv_before, mr.kv_cache.k):
        assert torch.equal(before[1:], after[1:])  # only the reserved slot 0 was written
    assert int(mr.req_to_token_pool.req_to_token[0].abs().sum()) == 0
    eng.check_memory()


def test_every_size_compiles_at_start_up_unless_lazy(model_dirs):
    """Start-up compiles the whole ladder (no compile stalls a running stream later); warm-up
    runs are not replays. enable_lazy_cpu_graph compiles a size the first time a batch needs it."""
    path = model_dirs["llama"]
    eager_start = graph_engine(path)
    runner = eager_start.model_runner.graph_runner
    assert sorted(runner.compiled) == runner.ladder == [1, 2, 4, 8] and runner.replays == 0
    lazy = graph_engine(path, enable_lazy_cpu_graph=True)
    assert not lazy.model_runner.graph_runner.compiled
    lazy.generate(input_ids=prompts(lazy, 1, seed=36), sampling_params=GREEDY)
    assert sorted(lazy.model_runner.graph_runner.compiled) == [1]


def test_a_size_that_fails_to_compile_runs_eagerly(model_dirs, hf, monkeypatch):
    def broken(*args, **kwargs):
        def fn():
            raise RuntimeError("no compiler today")
        return fn

    monkeypatch.setattr(torch, "compile", broken)
    path = model_dirs["llama"]
    eng = graph_engine(path)
    ids = prompts(eng, 3, seed=35)
    outs = eng.generate(input_ids=ids, sampling_params=GREEDY)
    runner = eng.model_runner.graph_runner
    assert runner.failed and not runner.compiled and runner.replays == 0
    assert_matches_hf(eng, hf, path, ids, outs)


def test_graphs_off_where_they_cannot_run(model_dirs, monkeypatch):
    from engine.config import EngineConfig

    path = model_dirs["llama"]
    assert Engine(model_path=path, cpu_graph="off").model_runner.graph_runner is None
    # An attention-DP member's MLP runs collectives: eager, as under CUDA graphs.
    assert ModelRunner(EngineConfig(model_path=path), path, mlp_shard=(0, 2)).graph_runner is None
    monkeypatch.setenv("RADIXRAY_CPU_GRAPHS", "0")
    assert Engine(model_path=path).model_runner.graph_runner is None
    # "auto" (the default): graphs for bfloat16 weights only.
    monkeypatch.delenv("RADIXRAY_CPU_GRAPHS")
    assert Engine(model_path=path).model_runner.graph_runner is None
    lazy = dict(enable_lazy_cpu_graph=True, cpu_graph_max_bs=LADDER_MAX)
    assert isinstance(Engine(model_path=path, dtype="bfloat16", **lazy).model_runner.graph_runner, CpuGraphRunner)
    assert isinstance(Engine(model_path=path, cpu_graph="on", **lazy).model_runner.graph_runner, CpuGraphRunner)


def test_bfloat16_graphs_match_bfloat16_eager(model_dirs):
    """bfloat16 decode through graphs: the same kernels as eager (one row: the project's bfloat16
    GEMM; five rows, padded to eight: oneDNN's, an opaque custom op in the graph), so the same tokens."""
    path = model_dirs["llama"]
    eager = Engine(model_path=path, dtype="bfloat16", cpu_graph="off")
    eng = graph_engine(path, dtype="bfloat16")
    for n in (1, 5):
        ids = prompts(eng, n, seed=36 + n)
        want = eager.generate(input_ids=ids, sampling_params=GREEDY)
        assert [o.token_ids for o in eng.generate(input_ids=ids, sampling_params=GREEDY)] == \
            [o.token_ids for o in want]
    assert_graphs_ran(eng)
    assert set(eng.model_runner.graph_runner.compiled) >= {1, 8}
