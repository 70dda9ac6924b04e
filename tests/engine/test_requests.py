"""Stopping, sampling, streaming, abort and bad input on a real engine."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from engine import Engine, ForwardMode, InvalidRequestError, SamplingParams
from engine.config import EngineConfig
from engine.errors import ConfigError
from engine.schedule_batch import ScheduleBatch


@pytest.fixture(scope="module")
def stories(model_dirs):
    return Engine(model_path=model_dirs["stories"])


def test_stop_string_across_token_boundaries(stories):
    base = stories.generate(prompt="Once upon a time", sampling_params=SamplingParams(max_new_tokens=32, temperature=0))
    # "little girl" spans several tokens; the text must end right before it.
    out = stories.generate(prompt="Once upon a time",
                           sampling_params=SamplingParams(max_new_tokens=32, temperature=0, stop=["ttle gi"]))
    assert out.finish_reason == "stop"
    assert out.text == base.text[:base.text.index("ttle gi")]
    streamed = list(stories.stream(prompt="Once upon a time",
                                   sampling_params=SamplingParams(max_new_tokens=32, temperature=0, stop=["ttle gi"])))
    assert "".join(d.text for d in streamed) == out.text
    assert streamed[-1].finish_reason == "stop"
    stories.check_memory()


def test_stop_token_ids_and_eos(stories, tmp_path):
    base = stories.generate(prompt="Once upon a time", sampling_params=SamplingParams(max_new_tokens=20, temperature=0))
    stop_tok = base.token_ids[5]
    out = stories.generate(prompt="Once upon a time",
                           sampling_params=SamplingParams(max_new_tokens=20, temperature=0, stop_token_ids=[stop_tok]))
    assert out.token_ids == base.token_ids[:base.token_ids.index(stop_tok) + 1]
    assert out.finish_reason == "stop"
    # EOS from generation_config.json, which may list several ids: make "." an EOS token.
    dot = stories.tokenizer.encode(".", add_special_tokens=False)[-1]
    assert dot in base.token_ids
    folder = tmp_path / "stories-eos"
    folder.mkdir()
    for f in Path(stories.model_path).iterdir():
        (folder / f.name).symlink_to(f)
    (folder / "generation_config.json").unlink()
    (folder / "generation_config.json").write_text(json.dumps({"eos_token_id": [2, dot]}))
    eng = Engine(model_path=str(folder))
    out = eng.generate(prompt="Once upon a time", sampling_params=SamplingParams(max_new_tokens=20, temperature=0))
    assert out.finish_reason == "stop" and out.token_ids == base.token_ids[:base.token_ids.index(dot) + 1]
    ignored = eng.generate(prompt="Once upon a time",
                           sampling_params=SamplingParams(max_new_tokens=20, temperature=0, ignore_eos=True))
    assert ignored.finish_reason == "length" and ignored.token_ids == base.token_ids
    eng.check_memory()
    stories.check_memory()


def test_seeded_sampling_is_reproducible(stories):
    p = SamplingParams(max_new_tokens=24, temperature=0.9, top_p=0.9, top_k=50, seed=1234)
    a = stories.generate(prompt="Once upon a time", sampling_params=p)
    # Same seed inside a batch with other requests: same tokens.
    batch = stories.generate(prompt=["The dog", "Once upon a time", "A cat"],
                             sampling_params=[SamplingParams(max_new_tokens=10, temperature=1.0), p,
                                              SamplingParams(max_new_tokens=30, temperature=0.5)])
    assert batch[1].token_ids == a.token_ids
    other = stories.generate(prompt="Once upon a time", sampling_params=SamplingParams(
        max_new_tokens=24, temperature=0.9, top_p=0.9, top_k=50, seed=99))
    assert other.token_ids != a.token_ids
    stories.check_memory()


def test_seeded_sampling_does_not_depend_on_prompt_chunking(model_dirs, stories):
    """A prompt computed in chunks draws from its RNG only for the token it keeps: the chunks
    before the prompt's end sample nothing."""
    prompt = "Once upon a time there was a little girl named Lily. She loved to play outside in the park."
    params = [SamplingParams(max_new_tokens=16, temperature=1.0, seed=s, ignore_eos=True) for s in (5, 6, 7)]
    ref = [o.token_ids for o in stories.generate(prompt=[prompt] * 3, sampling_params=params)]
    chunked = Engine(model_path=model_dirs["stories"], chunked_prefill_size=8, disable_radix_cache=True)
    assert [o.token_ids for o in chunked.generate(prompt=[prompt] * 3, sampling_params=params)] == ref
    assert chunked.stats().batches_by_mode["EXTEND"] > 3  # the prompts did go in chunks
    chunked.check_memory()
    chunked.shutdown()


def test_sampling_filters_and_penalties(stories):
    # top_k=1 is greedy; min_p=1.0 keeps only the top token; both must equal greedy.
    greedy = stories.generate(prompt="Once upon a time", sampling_params=SamplingParams(max_new_tokens=12, temperature=0))
    for p in (SamplingParams(max_new_tokens=12, temperature=1.0, top_k=1, seed=3),
              SamplingParams(max_new_tokens=12, temperature=1.0, min_p=1.0, seed=3),
              SamplingParams(max_new_tokens=12, temperature=1.0, top_p=1e-6, seed=3)):
        assert stories.generate(prompt="Once upon a time", sampling_params=p).token_ids == greedy.token_ids
    # A strong repetition penalty changes greedy output and avoids repeats of prompt tokens.
    pen = stories.generate(prompt="Once upon a time",
                           sampling_params=SamplingParams(max_new_tokens=12, temperature=0, frequency_penalty=2.0))
    counts = {t: pen.token_ids.count(t) for t in pen.token_ids}
    assert max(counts.values()) <= max(greedy.token_ids.count(t) for t in greedy.token_ids)
    rep = stories.generate(prompt="Once upon a time",
                           sampling_params=SamplingParams(max_new_tokens=12, temperature=0, repetition_penalty=5.0))
    assert rep.token_ids != greedy.token_ids
    stories.check_memory()


def test_abort_queued_and_running_frees_memory(stories):
    got: dict[str, list] = {"a": [], "b": []}
    p = SamplingParams(max_new_tokens=200, temperature=0, ignore_eos=True)
    ids = stories.tokenize(prompt="Once upon a time")
    stories.submit(ids, p, got["a"].append, rid="a")
    for _ in range(5):
        stories.step()
    stories.submit(ids, p, got["b"].append, rid="b")
    stories.abort("b")  # still queued
    stories.abort("a")  # running
    while stories.step():
        pass
    assert got["a"][-1].finish_reason == "abort" and len(got["a"]) >= 2
    assert got["b"][-1].finish_reason == "abort" and got["b"][-1].token_ids == []
    stories.check_memory()


def test_stream_deltas_concatenate_to_full_text(stories):
    p = SamplingParams(max_new_tokens=40, temperature=0)
    full = stories.generate(prompt="Once upon a time", sampling_params=p)
    deltas = list(stories.stream(prompt="Once upon a time", sampling_params=p))
    assert "".join(d.text for d in deltas) == full.text
    assert [t for d in deltas for t in d.token_ids] == full.token_ids
    assert deltas[-1].finish_reason == full.finish_reason
    # A consumer that walks away aborts its request.
    gen = stories.stream(prompt="Once upon a time", sampling_params=SamplingParams(max_new_tokens=300, ignore_eos=True))
    next(gen)
    gen.close()
    stories.check_memory()


@pytest.mark.parametrize("kwargs, param", [
    (dict(prompt=""), "prompt"),
    (dict(input_ids=[]), "prompt"),
    (dict(input_ids=[1, 2, 99999]), "prompt"),
    (dict(input_ids=[1, -1]), "prompt"),
    (dict(prompt="hi", sampling_params=SamplingParams(max_new_tokens=5000)), "max_tokens"),
])
def test_bad_input_rejected_before_queueing(stories, kwargs, param):
    with pytest.raises(InvalidRequestError) as e:
        stories.generate(**kwargs)
    assert e.value.param == param
    assert not stories.scheduler.has_work()
    stories.check_memory()
    assert stories.generate(prompt="hi", sampling_params=SamplingParams(max_new_tokens=2)).token_ids


@pytest.mark.parametrize("kwargs", [dict(max_new_tokens=0), dict(temperature=-0.1), dict(top_p=0.0),
                                    dict(top_p=1.5), dict(max_new_tokens="3"), dict(top_logprobs=99)])
def test_bad_sampling_params(kwargs):
    with pytest.raises(InvalidRequestError):
        SamplingParams(**kwargs)


def test_bad_engine_config():
    with pytest.raises(ConfigError, match="unknown engine config field"):
        Engine(max_total_tokenz=5)
    with pytest.raises(ValueError):
        EngineConfig(schedule_policy="random")
    with pytest.raises(ValueError):
        EngineConfig(max_total_tokens=0)


def test_forward_modes(stories):
    assert [m.name for m in ForwardMode] == ["EXTEND", "DECODE", "MIXED", "IDLE", "TARGET_VERIFY",
                                             "DRAFT_EXTEND_V2", "PREBUILT", "SPLIT_PREFILL", "DLLM_EXTEND"]
    assert ForwardMode.MIXED.is_extend() and ForwardMode.MIXED.is_mixed()
    assert ForwardMode.DECODE.is_decode() and not ForwardMode.DECODE.is_extend()
    assert ForwardMode.IDLE.is_idle()
    s = stories.scheduler
    batch = ScheduleBatch([], s.cache, s.device)
    batch.prepare_for_idle()
    assert stories.model_runner.forward(__import__("engine").ForwardBatch.init_new(batch, s.device)) is None
    batch.forward_mode = ForwardMode.PREBUILT
    with pytest.raises(ValueError, match="PREBUILT batch has no forward"):
        __import__("engine").ForwardBatch.init_new(batch, s.device)
    # Every mode runs (SPLIT_PREFILL: tests/engine/test_split_prefill.py; DLLM_EXTEND: tests/engine/test_dllm.py).
    from engine.forward_batch import SUPPORTED_MODES, require_supported

    assert SUPPORTED_MODES == frozenset(ForwardMode)
    for mode in ForwardMode:
        require_supported(mode)


def test_chat_template_and_builtin_model():
    eng = Engine(max_total_tokens=4096)  # the built-in byte-level model
    ids = eng.tokenize(messages=[{"role": "user", "content": "héllo"}])
    assert eng.tokenizer.decode(ids, skip_special_tokens=False).startswith("<|im_start|>user\nhéllo<|im_end|>")
    out = eng.generate(messages=[{"role": "user", "content": "hi"}],
                       sampling_params=SamplingParams(max_new_tokens=8, temperature=0))
    assert out.prompt_tokens == len(eng.tokenize(messages=[{"role": "user", "content": "hi"}]))
    assert 1 <= len(out.token_ids) <= 8
    eng.check_memory()


def test_sharded_checkpoint_loads_the_same(model_dirs, tmp_path):
    from safetensors.torch import load_file, save_file

    src = Path(model_dirs["qwen2"])
    weights = load_file(str(src / "model.safetensors"))
    names = sorted(weights)
    half = len(names) // 2
    shards = {"model-00001-of-00002.safetensors": names[:half], "model-00002-of-00002.safetensors": names[half:]}
    for f in src.iterdir():
        if f.name != "model.safetensors":
            (tmp_path / f.name).symlink_to(f)
    for fname, keys in shards.items():
        save_file({k: weights[k] for k in keys}, str(tmp_path / fname))
    (tmp_path / "model.safetensors.index.json").write_text(json.dumps(
        {"metadata": {}, "weight_map": {k: f for f, ks in shards.items() for k in ks}}))
    p = SamplingParams(max_new_tokens=12, temperature=0, ignore_eos=True)
    a = Engine(model_path=str(src)).generate(input_ids=[1, 50, 60, 70], sampling_params=p)
    b = Engine(model_path=str(tmp_path)).generate(input_ids=[1, 50, 60, 70], sampling_params=p)
    assert a.token_ids == b.token_ids


@pytest.mark.parametrize("dtype", ["bfloat16", "float16"])
def test_half_precision_runs(model_dirs, dtype):
    eng = Engine(model_path=model_dirs["stories"], dtype=dtype)
    assert eng.model_runner.kv_cache.k[0].dtype == getattr(__import__("torch"), dtype)
    out = eng.generate(prompt=["Once upon a time", "The cat"], sampling_params=SamplingParams(max_new_tokens=16, temperature=0))
    ref = Engine(model_path=model_dirs["stories"]).generate(prompt="Once upon a time",
                                                            sampling_params=SamplingParams(max_new_tokens=16, temperature=0))
    assert len(out[0].token_ids) == 16
    assert out[0].token_ids[:4] == ref.token_ids[:4]  # reduced precision: the start agrees
    eng.check_memory()
