"""PrefillAdder's budgets, including the slots a MIXED batch's decode tokens need."""

from __future__ import annotations

import pytest
import torch

from engine import Engine, SamplingParams
from engine.cache_manager import CacheManager
from engine.memory import ReqToTokenPool, TokenToKVPoolAllocator
from engine.prefill_adder import AddResult, PrefillAdder
from engine.req import Req

CPU = torch.device("cpu")


def _req(rid: str, prompt: int, max_new: int, output: int = 0) -> Req:
    req = Req(rid, list(range(1, prompt + 1)), SamplingParams(max_new_tokens=max_new))
    req.output_ids = [7] * output
    req.extend_input_len = prompt + output
    return req


def _waiting(a: PrefillAdder, *args, **kw) -> Req:
    """A waiting request matched against the adder's (empty) cache, as the scheduler does first."""
    req = _req(*args, **kw)
    a.cache.match_prefix(req)
    return req


def adder(free: int, running: list[Req] = (), ratio: float = 0.5, max_prefill: int = 1000,
          chunk: int = 1000, mixed: bool = False) -> PrefillAdder:
    """An adder over an empty radix cache with `free` free slots."""
    cache = CacheManager(ReqToTokenPool(16, 2048, CPU), TokenToKVPoolAllocator(free, CPU))
    return PrefillAdder(cache, list(running), ratio, max_prefill, chunk, mixed_with_decode=mixed)


def test_reserve_for_running_requests():
    running = [_req("r0", 4, max_new=40, output=20), _req("r1", 4, max_new=20)]  # 20 and 20 to go
    a = adder(free=100, running=running, ratio=0.5)
    assert a.rem_total_tokens == 100 - 0.5 * 40
    assert a.add_one_req(_waiting(a, "a", 50, max_new=10)) == AddResult.CONTINUE  # 50 + 5 <= 80
    assert a.add_one_req(_waiting(a, "b", 30, max_new=10)) == AddResult.NO_TOKEN  # 30 + 5 > 25
    assert [r.rid for r in a.can_run] == ["a"]


def test_first_request_goes_in_whenever_its_prompt_fits():
    a = adder(free=60)
    assert a.add_one_req(_waiting(a, "a", 50, max_new=500)) == AddResult.CONTINUE  # its future is not reserved
    assert a.add_one_req(_waiting(a, "b", 5, max_new=500)) == AddResult.NO_TOKEN


def test_prefill_token_budget_and_chunking():
    a = adder(free=1000, max_prefill=64, chunk=1000)
    assert a.add_one_req(_waiting(a, "a", 40, max_new=1)) == AddResult.CONTINUE
    assert a.add_one_req(_waiting(a, "b", 40, max_new=1)) == AddResult.OTHER  # over max_prefill with one admitted
    c = adder(free=1000, chunk=16)
    long = _waiting(c, "c", 40, max_new=1)
    assert c.add_one_req(long) == AddResult.OTHER
    assert c.new_chunked_req is long and long.extend_input_len == 16


def test_mixed_batch_reserves_one_slot_per_running_request():
    running = [_req(f"r{i}", 4, max_new=10, output=9) for i in range(8)]  # 1 token to go each
    plain = adder(free=100, running=running, ratio=0.1)
    mixed = adder(free=100, running=running, ratio=0.1, mixed=True)
    assert plain.rem_total_tokens == pytest.approx(100 - 0.8)
    assert mixed.rem_total_tokens == pytest.approx(100 - 8)  # the reserve rounds up to a slot each


@pytest.mark.parametrize("chunk", [150, 159])  # 159 fills the pool but for the decode tokens
def test_mixed_chunk_with_decayed_ratio_never_runs_out_of_slots(model_dirs, chunk):
    """Running requests near their max_new_tokens, new_token_ratio decayed to its minimum (their
    reserve is below one slot each), then a chunk that fills the rest of the pool: the MIXED
    batch must still find a slot for every running request's one-token extend."""
    kw = dict(model_path=model_dirs["llama"], max_total_tokens=300, chunked_prefill_size=chunk,
              init_new_token_ratio=0.01, min_new_token_ratio=0.01, disable_radix_cache=True)
    eng = Engine(enable_mixed_chunk=True, **kw)
    sinks: dict[str, list] = {}
    short = SamplingParams(max_new_tokens=12, temperature=0, ignore_eos=True)
    for i in range(8):
        rid = f"short-{i}"
        sinks[rid] = []
        eng.submit([10 + i] * 8, short, sinks[rid].append, rid=rid)
    def outputs() -> list[int]:
        return [len(r.output_ids) for r in eng.scheduler.running_batch.reqs]

    while len(outputs()) < 8 or min(outputs()) < 10:
        eng.step()
    assert len(eng.scheduler.running_batch.reqs) == 8
    assert eng.scheduler.cache.allocator.available_size() == 300 - 8 * 17  # prompt + 9 outputs' KV each
    long = SamplingParams(max_new_tokens=4, temperature=0, ignore_eos=True)
    sinks["long"] = []
    eng.submit(list(range(5, 205)), long, sinks["long"].append, rid="long")
    while eng.step():
        pass
    finals = {rid: deltas[-1] for rid, deltas in sinks.items()}
    assert all(d.error is None for d in finals.values()), {r: d.error for r, d in finals.items() if d.error}
    assert (eng.scheduler.batches_by_mode["MIXED"] > 0) == (chunk == 150)  # 159 waits for room
    ref = Engine(**kw)  # the same requests without mixing: token-exact
    expected = ref.generate(input_ids=[[10 + i] * 8 for i in range(8)] + [list(range(5, 205))],
                            sampling_params=[short] * 8 + [long])
    got = [[t for d in sinks[rid] for t in d.token_ids] for rid in [f"short-{i}" for i in range(8)] + ["long"]]
    assert got == [o.token_ids for o in expected]
    eng.check_memory()
