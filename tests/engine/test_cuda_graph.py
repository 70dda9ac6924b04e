"""CUDA graph ladder and padding (CPU), replay parity (GPU)."""

from __future__ import annotations

import pytest
import torch

from engine import Engine, SamplingParams
from engine.cuda_graph import capture_ladder, pad_decode, pad_verify, padded_size
from engine.forward_batch import ForwardBatch, ForwardMode


def test_ladder():
    assert capture_ladder(1) == [1]
    assert capture_ladder(8) == [1, 2, 4, 8]
    assert capture_ladder(64) == [1, 2, 4, 8, 16, 24, 32, 40, 48, 56, 64]
    assert capture_ladder(20)[-1] == 20
    ladder = capture_ladder(64)
    assert [padded_size(b, ladder) for b in (1, 3, 5, 9, 17, 64)] == [1, 4, 8, 16, 24, 64]
    assert padded_size(65, ladder) is None


def test_padding_uses_row_zero_and_slot_zero():
    fb = ForwardBatch(forward_mode=ForwardMode.DECODE, batch_size=3, input_ids=torch.tensor([7, 8, 9]),
                      seq_lens=torch.tensor([5, 2, 9]), out_cache_loc=torch.tensor([11, 12, 13]),
                      req_pool_indices=torch.tensor([3, 1, 2]), positions=torch.tensor([4, 1, 8]))
    p = pad_decode(fb, 8)
    assert p.input_ids.tolist() == [7, 8, 9, 0, 0, 0, 0, 0]
    assert p.req_pool_indices.tolist() == [3, 1, 2, 0, 0, 0, 0, 0]  # row 0: the padding row
    assert p.seq_lens.tolist() == [5, 2, 9, 1, 1, 1, 1, 1]  # one key each: slot 0
    assert p.out_cache_loc.tolist() == [11, 12, 13, 0, 0, 0, 0, 0]  # writes land in reserved slot 0
    assert p.positions.tolist() == [4, 1, 8, 0, 0, 0, 0, 0]
    idle = ForwardBatch(forward_mode=ForwardMode.IDLE, batch_size=0, input_ids=torch.empty(0, dtype=torch.int64),
                        seq_lens=torch.empty(0, dtype=torch.int64), out_cache_loc=torch.empty(0, dtype=torch.int64),
                        req_pool_indices=torch.empty(0, dtype=torch.int64), positions=torch.empty(0, dtype=torch.int64))
    assert pad_decode(idle, 1).req_pool_indices.tolist() == [0]


def test_verify_padding_uses_row_zero_and_slot_zero():
    """Two requests of width 3 padded to 4: the padded rows read row 0's first 3 keys (slot 0)."""
    fb = ForwardBatch(forward_mode=ForwardMode.TARGET_VERIFY, batch_size=2, input_ids=torch.tensor([5, 6, 0, 7, 8, 9]),
                      seq_lens=torch.tensor([10, 4]), out_cache_loc=torch.tensor([21, 22, 23, 31, 32, 33]),
                      req_pool_indices=torch.tensor([2, 1]), positions=torch.tensor([7, 8, 9, 1, 2, 3]))
    p = pad_verify(fb, 4, 3)
    assert p.input_ids.tolist() == [5, 6, 0, 7, 8, 9] + [0] * 6
    assert p.req_pool_indices.tolist() == [2, 1, 0, 0]
    assert p.seq_lens.tolist() == [10, 4, 3, 3]  # no prefix: 3 new tokens each
    assert p.out_cache_loc.tolist() == [21, 22, 23, 31, 32, 33] + [0] * 6
    assert p.positions.tolist() == [7, 8, 9, 1, 2, 3, 0, 1, 2, 0, 1, 2]


def test_padded_rows_touch_nothing(model_dirs):
    """Row 0 and slot 0 are never handed out, so what a padded row reads and writes is inert."""
    eng = Engine(model_path=model_dirs["stories"], max_total_tokens=300)
    s = eng.scheduler.cache
    assert 0 not in s.allocator.free_slots.tolist()
    assert 0 not in s.req_to_token_pool.free_slots
    eng.generate(prompt=["Once upon a time", "The cat"], sampling_params=SamplingParams(max_new_tokens=8))
    assert int(s.req_to_token_pool.req_to_token[0].abs().sum()) == 0
    eng.check_memory()


@pytest.mark.gpu
@pytest.mark.parametrize("name", ["stories", "llama"])
def test_graph_replay_matches_eager(model_dirs, name):
    params = SamplingParams(max_new_tokens=16, temperature=0.0, ignore_eos=True)
    prompts = ["Once upon a time", "The cat sat", "Lily", "A big red"]
    eager = Engine(model_path=model_dirs[name], device="cuda", dtype="float32", attention_backend="triton",
                   disable_cuda_graph=True).generate(prompt=prompts, sampling_params=params)
    graphed = Engine(model_path=model_dirs[name], device="cuda", dtype="float32", attention_backend="triton")
    assert graphed.model_runner.graph_runner is not None
    outs = graphed.generate(prompt=prompts, sampling_params=params)
    assert [o.token_ids for o in outs] == [e.token_ids for e in eager]
    graphed.check_memory()
