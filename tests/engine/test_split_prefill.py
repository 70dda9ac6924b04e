"""Split prefill (ForwardMode.SPLIT_PREFILL): a prefill admitted while requests decode runs a few
layers per step beside the decode batch. It computes exactly what the unsplit prefill computes
(greedy and seeded tokens identical), is counted in batches_by_mode, and an abort while it is in
flight frees everything."""

from __future__ import annotations

import random

import pytest

from engine import Engine, SamplingParams
from engine.builtin_model import (
    llama_config,
    moe_config,
)
from engine.engine import collect_output
from engine.schedule_batch import ScheduleBatch
from tests.helpers import write_random_models

# Four layers (a split runs 1 to 3 of them per step), tiny widths: fast.
TINY = dict(
    hidden_size=64,
    intermediate_size=128,
    num_hidden_layers=4,
    num_attention_heads=4,
    num_key_value_heads=2,
    max_position_embeddings=1024,
)
GREEDY = SamplingParams(max_new_tokens=12, temperature=0.0, ignore_eos=True)
SPLIT = dict(enable_split_prefill=True, split_forward_token_budget=96)


@pytest.fixture(scope="module")
def tiny(tmp_path_factory) -> dict[str, str]:
    configs = {
        "llama": llama_config(**TINY),
        "moe": moe_config(**TINY, head_dim=16, moe_intermediate_size=32, num_experts=4),
    }
    return write_random_models(tmp_path_factory.mktemp("split"), configs, seed=3)


def random_ids(
    n: int, lo: int, hi: int, seed: int, head: list[int] | None = None
) -> list[list[int]]:
    rng = random.Random(seed)
    return [
        [1, *(head or [])] + [rng.randrange(5, 250) for _ in range(rng.randint(lo, hi))]
        for _ in range(n)
    ]


def staggered(
    eng: Engine, ids: list[list[int]], params: list[SamplingParams], every: int = 2
) -> list:
    """One request every `every` steps (after a first one that decodes), so prefills land while
    others decode: those are the ones that get split."""
    results: dict[str, list] = {f"r{i}": [] for i in range(len(ids))}
    for i, (p, sp) in enumerate(zip(ids, params)):
        eng.submit(p, sp, lambda d: results[d.rid].append(d), rid=f"r{i}")
        for _ in range(every):
            eng.step()
    while eng.step():
        pass
    return [collect_output(rid, deltas) for rid, deltas in results.items()]


SCENARIOS = {
    # prompt lengths around the budget: 96 // n layers per step is 4 (not split) down to 1
    "budget": dict(ids=dict(n=8, lo=15, hi=200), kw={}),
    "radix": dict(ids=dict(n=8, lo=5, hi=60, head=list(range(10, 90))), kw={}),
    "retraction": dict(ids=dict(n=10, lo=20, hi=60), kw={"max_total_tokens": 200}, new=40),
    "chunked": dict(ids=dict(n=6, lo=40, hi=200), kw={"chunked_prefill_size": 48}),
    "chunked_mixed": dict(
        ids=dict(n=6, lo=40, hi=200), kw={"chunked_prefill_size": 48, "enable_mixed_chunk": True}
    ),
    "overlap": dict(ids=dict(n=8, lo=15, hi=200), kw={"enable_overlap_schedule": True}),
    "overlap_chunked_radix": dict(
        ids=dict(n=8, lo=20, hi=120, head=list(range(10, 60))),
        kw={"enable_overlap_schedule": True, "chunked_prefill_size": 40},
    ),
    "no_radix": dict(ids=dict(n=6, lo=15, hi=200), kw={"disable_radix_cache": True}),
    "ngram": dict(ids=dict(n=6, lo=15, hi=200), kw={"speculative_algorithm": "ngram"}),
    "sampled": dict(ids=dict(n=6, lo=15, hi=200), kw={"chunked_prefill_size": 64}, sampled=True),
}


@pytest.mark.parametrize("scenario", sorted(SCENARIOS))
def test_split_matches_unsplit(tiny, scenario):
    sc = SCENARIOS[scenario]
    ids = random_ids(seed=len(scenario), **sc["ids"])
    new = sc.get("new", 12)
    params = [
        SamplingParams(max_new_tokens=new, temperature=0.8, seed=i, ignore_eos=True)
        if sc.get("sampled")
        else SamplingParams(max_new_tokens=new, temperature=0.0, ignore_eos=True)
        for i in range(len(ids))
    ]
    outs = {}
    for split in (False, True):
        eng = Engine(model_path=tiny["llama"], **sc["kw"], **(SPLIT if split else {}))
        outs[split] = staggered(eng, ids, params)
        eng.check_memory()
        stats = eng.stats()
        assert (
            stats.batches_by_mode["SPLIT_PREFILL"] > 0
            if split
            else stats.batches_by_mode["SPLIT_PREFILL"] == 0
        )
        if scenario == "retraction":
            assert stats.num_retracted > 0
        if split and "overlap" in scenario:
            assert stats.overlapped_steps > 0
    assert [(o.token_ids, o.finish_reason) for o in outs[True]] == [
        (o.token_ids, o.finish_reason) for o in outs[False]
    ]


def test_split_moe_and_prompt_logprobs(tiny):
    """An MoE model (its decoder is the Llama one) and prompt logprobs (every position's logits)."""
    ids = random_ids(5, 40, 150, seed=11)
    params = [
        SamplingParams(
            max_new_tokens=8,
            temperature=0.0,
            ignore_eos=True,
            prompt_logprobs=1 if i == 3 else None,
        )
        for i in range(len(ids))
    ]
    ref = staggered(Engine(model_path=tiny["moe"]), ids, params)
    eng = Engine(model_path=tiny["moe"], **SPLIT)
    got = staggered(eng, ids, params)
    assert [o.token_ids for o in got] == [o.token_ids for o in ref]
    assert got[3].prompt_logprobs == ref[3].prompt_logprobs
    assert eng.stats().batches_by_mode["SPLIT_PREFILL"] > 0
    eng.check_memory()


def test_split_counted_one_layer_per_step(tiny):
    """A 200-token prompt at budget 96 runs one layer per step beside the decode; its hidden state
    is carried (and reported) between steps; a prompt arriving with nothing decoding is not split."""
    eng = Engine(model_path=tiny["llama"], **SPLIT)
    first = eng.generate(input_ids=random_ids(1, 200, 200, seed=1)[0], sampling_params=GREEDY)
    assert eng.stats().batches_by_mode["SPLIT_PREFILL"] == 0  # alone: one EXTEND
    got: list = []
    eng.submit(
        random_ids(1, 20, 20, seed=2)[0],
        SamplingParams(max_new_tokens=30, temperature=0.0),
        got.append,
    )
    eng.step()
    eng.submit(random_ids(1, 199, 199, seed=3)[0], GREEDY, got.append, rid="long")
    steps = 0
    seen = []
    while eng.scheduler.split_prefill is not None or steps == 0:
        eng.step()
        steps += 1
        sp = eng.scheduler.split_prefill
        if sp is not None:
            seen.append(sp.fb.split_index)
            assert (
                eng.stats().split_prefill_hidden_bytes == sp.fb.num_tokens * TINY["hidden_size"] * 4
            )  # float32
    assert seen == [1, 2, 3] and steps == 4  # layers 0..3, one per step, beside four decode steps
    stats = eng.stats()
    assert stats.batches_by_mode["SPLIT_PREFILL"] == 1 and stats.split_prefill_layers == 4
    assert stats.split_prefill_hidden_bytes == 0
    while eng.step():
        pass
    eng.check_memory()
    assert first.finish_reason == "length"


@pytest.mark.parametrize("overlap", [False, True])
def test_abort_during_split_prefill_frees_everything(tiny, overlap):
    eng = Engine(
        model_path=tiny["llama"], enable_overlap_schedule=overlap, chunked_prefill_size=150, **SPLIT
    )
    got: dict[str, list] = {"d": [], "a": [], "b": [], "c": []}
    eng.submit(
        random_ids(1, 20, 20, seed=4)[0],
        SamplingParams(max_new_tokens=60, temperature=0.0, ignore_eos=True),
        got["d"].append,
        rid="d",
    )
    eng.step()
    # Two prompts in one split batch; "a" is aborted mid-split, "b" goes on (and matches).
    a, b = random_ids(2, 60, 60, seed=5)
    eng.submit(a, GREEDY, got["a"].append, rid="a")
    eng.submit(b, GREEDY, got["b"].append, rid="b")
    eng.step()
    assert (
        eng.scheduler.split_prefill is not None and len(eng.scheduler.split_prefill.batch.reqs) == 2
    )
    eng.abort("a")
    eng.step()
    assert got["a"][-1].finish_reason == "abort"
    while eng.scheduler.split_prefill is not None:
        eng.step()
    # A chunked prompt (150-token chunks, each split) aborted mid-split: the split ends at once.
    eng.submit(random_ids(1, 400, 400, seed=6)[0], GREEDY, got["c"].append, rid="c")
    while not (
        eng.scheduler.split_prefill is not None
        and eng.scheduler.chunked_req is not None
        and eng.scheduler.split_prefill.fb.split_index > 0
        and eng.scheduler.chunked_req.kv_len > 150
    ):
        eng.step()
    eng.abort("c")
    eng.step()
    assert eng.scheduler.split_prefill is None and got["c"][-1].finish_reason == "abort"
    eng.abort("d")
    while eng.step():
        pass
    eng.check_memory()
    assert eng.scheduler.cache.available_size() == eng.scheduler.cache.total_size
    eng.scheduler.cache.allocator.check_no_duplicates()
    assert got["d"][-1].finish_reason == "abort"
    ref = Engine(model_path=tiny["llama"]).generate(input_ids=b, sampling_params=GREEDY)
    assert [t for d in got["b"] for t in d.token_ids] == ref.token_ids


@pytest.mark.parametrize("overlap", [False, True])
def test_retraction_while_split_prefill_in_flight(tiny, monkeypatch, overlap):
    """Decoding requests that outgrow a tight pool while a split prefill holds its slots are
    retracted (never the split's requests); every output matches the unsplit engine's."""
    retract, during, outs = ScheduleBatch.retract_decode, [], {}
    for split in (False, True):
        eng = Engine(
            model_path=tiny["llama"],
            max_total_tokens=300,
            init_new_token_ratio=0.1,
            min_new_token_ratio=0.1,
            enable_overlap_schedule=overlap,
            **(SPLIT if split else {}),
        )

        def spy(batch: ScheduleBatch, eng: Engine = eng) -> list:
            out = retract(batch)
            if out and eng.scheduler.split_prefill is not None:
                during.append(out)
            return out

        monkeypatch.setattr(ScheduleBatch, "retract_decode", spy)
        results: dict[str, list] = {}
        sink = results.setdefault  # (bound now: one results dict per engine)
        params = SamplingParams(max_new_tokens=60, temperature=0.0, ignore_eos=True)
        for i, ids in enumerate(random_ids(6, 10, 10, seed=1)):
            results[f"d{i}"] = []
            eng.submit(ids, params, lambda d, sink=sink: sink(d.rid, []).append(d), rid=f"d{i}")
        for _ in range(25):
            eng.step()
        # Admitted with the pool nearly full: the decodes beside its layers run out of slots.
        results["long"] = []
        eng.submit(
            random_ids(1, 72, 72, seed=2)[0],
            SamplingParams(max_new_tokens=2, temperature=0.0, ignore_eos=True),
            lambda d, sink=sink: sink(d.rid, []).append(d),
            rid="long",
        )
        while eng.step():
            pass
        eng.check_memory()
        outs[split] = [collect_output(rid, deltas).token_ids for rid, deltas in results.items()]
        assert eng.stats().num_retracted > 0
    assert during, "no retraction happened while the split prefill was in flight"
    assert outs[True] == outs[False]
