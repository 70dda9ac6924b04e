"""LoRA adapters served by the engine (issue 31): greedy output per request equal to transformers +
PEFT with that adapter merged, with several adapters of different ranks and targets in one batch,
more adapters than max_loras_per_batch, base-model requests beside them, in every batching mode;
the radix cache keyed by adapter; load and unload at run time; errors; the idle invariant."""

from __future__ import annotations

import copy

import pytest
import torch

peft = pytest.importorskip("peft", reason="needs peft (python3 -m pip install --no-deps peft)")
transformers = pytest.importorskip("transformers")

from engine import Engine, SamplingParams  # noqa: E402
from engine.cache_manager import KVEvent  # noqa: E402
from engine.errors import ConfigError  # noqa: E402
from engine.lora import TARGET_MODULES, LoRAAdapterError, UnknownLoRAError  # noqa: E402

# name -> LoraConfig kwargs: every projection; q and v only (rsLoRA); the MLP only, per-module rank.
ADAPTERS = {
    "all8": dict(
        r=8,
        lora_alpha=16,
        target_modules=list(TARGET_MODULES),
    ),
    "qv4": dict(r=4, lora_alpha=8, use_rslora=True, target_modules=["q_proj", "v_proj"]),
    "mlp16": dict(
        r=16,
        lora_alpha=16,
        target_modules=["gate_proj", "up_proj", "down_proj"],
        rank_pattern={"down_proj": 2},
    ),
}
PROMPTS = [
    [5, 17, 33, 9, 60, 2, 11, 70, 71],
    [40, 41, 42, 43, 44],
    [7, 7, 8, 9, 10, 90, 3, 4, 100, 101, 102],
    [1, 2, 3, 4, 5, 6],
    [200, 13, 13, 13, 88],
    [33, 34, 35, 36, 37, 38, 39, 40],
]
NAMES = ["all8", "qv4", None, "mlp16", "all8", None]
N = 10
GREEDY = SamplingParams(max_new_tokens=N, temperature=0, ignore_eos=True)


@pytest.fixture(scope="module")
def loras(model_dirs, tmp_path_factory):
    """(adapter folders by name, greedy reference(prompt, name) from PEFT's merged models)."""
    path = model_dirs["llama"]
    base = transformers.AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    root = tmp_path_factory.mktemp("loras")
    folders, models = {}, {None: base}
    for i, (name, kw) in enumerate(ADAPTERS.items()):
        torch.manual_seed(20 + i)
        # init_lora_weights=False: B random too (PEFT's default zero B makes every update 0).
        pm = peft.get_peft_model(
            copy.deepcopy(base), peft.LoraConfig(init_lora_weights=False, **kw)
        )
        folders[name] = str(root / name)
        pm.save_pretrained(folders[name])
        models[name] = pm.merge_and_unload().eval()
    cache: dict = {}

    def ref(prompt: list[int], name: str | None, n: int = N) -> list[int]:
        key = (tuple(prompt), name, n)
        if key not in cache:
            with torch.no_grad():
                out = models[name].generate(
                    torch.tensor([prompt]),
                    max_new_tokens=n,
                    do_sample=False,
                    eos_token_id=None,
                    pad_token_id=0,
                    attention_mask=torch.ones(1, len(prompt), dtype=torch.long),
                )
            cache[key] = out[0, len(prompt) :].tolist()
        return cache[key]

    return folders, ref


def make(model_dirs, loras, **kw) -> Engine:
    folders, _ = loras
    return Engine(model_path=model_dirs["llama"], lora_paths=dict(folders), **kw)


def check_batch(eng: Engine, ref, prompts=PROMPTS, names=NAMES, n: int = N) -> list:
    params = SamplingParams(max_new_tokens=n, temperature=0, ignore_eos=True)
    outs = eng.generate(input_ids=prompts, sampling_params=params, lora_name=list(names))
    for p, name, o in zip(prompts, names, outs):
        assert o.error is None, o.error
        assert o.token_ids == ref(p, name, n), (name, p)
    eng.check_memory()
    return outs


def test_batch_of_adapters_matches_merged_peft(model_dirs, loras):
    _, ref = loras
    # The adapters change the output (else the comparison would prove nothing).
    assert sum(ref(p, "all8") != ref(p, None) for p in PROMPTS) >= 4
    assert sum(ref(p, "mlp16") != ref(p, None) for p in PROMPTS) >= 3
    # 3 adapters, 2 slots: admission rotates them; base-model requests take no slot.
    eng = make(model_dirs, loras, max_loras_per_batch=2)
    check_batch(eng, ref)
    assert eng.model_runner.lora_manager.active() == set()
    # One name for every prompt.
    outs = eng.generate(input_ids=PROMPTS[:3], sampling_params=GREEDY, lora_name="qv4")
    assert [o.token_ids for o in outs] == [ref(p, "qv4") for p in PROMPTS[:3]]
    eng.check_memory()


def test_long_prefill_row_blocks(model_dirs, loras):
    """A prefill past the CPU row block (512 rows): each block's rows keep their adapters."""
    _, ref = loras
    g = torch.Generator().manual_seed(3)
    prompts = [torch.randint(3, 250, (n,), generator=g).tolist() for n in (300, 280)]
    eng = make(model_dirs, loras)
    check_batch(eng, ref, prompts, ["mlp16", "all8"], n=4)


def test_slice_batch_info():
    from kernels.lora import batch_info, slice_batch_info

    info = batch_info([1, 1, -1, 2], [3, 2, 4, 5])  # segments: slot 1 x5, -1 x4, 2 x5
    sub = slice_batch_info(info, 3, 10)
    assert sub.seg_indptr_host == (0, 2, 6, 7) and sub.weight_indices_host == (1, -1, 2)
    assert sub.max_seg_len == 4 and sub.seg_indptr.tolist() == [0, 2, 6, 7]


@pytest.mark.parametrize(
    "kw, mode",
    [
        (dict(chunked_prefill_size=4), "EXTEND"),
        (dict(enable_overlap_schedule=True), "DECODE"),
        (dict(enable_mixed_chunk=True, chunked_prefill_size=6), "MIXED"),
        (dict(speculative_algorithm="ngram"), "TARGET_VERIFY"),
        (dict(enable_split_prefill=True, split_forward_token_budget=8), "SPLIT_PREFILL"),
        (dict(max_loras_per_batch=1, max_loaded_loras=1), "DECODE"),
        # The base model as the draft, without the adapters: the target verifies with them.
        (dict(speculative_algorithm="draft_model"), "TARGET_VERIFY"),
    ],
    ids=["chunked", "overlap", "mixed", "ngram", "split", "one_slot_reload", "draft_model"],
)
def test_batching_modes(model_dirs, loras, kw, mode):
    _, ref = loras
    if kw.get("speculative_algorithm") == "draft_model":
        kw = dict(kw, speculative_draft_model_path=model_dirs["llama"])
    eng = make(model_dirs, loras, **{"max_loras_per_batch": 3, **kw})
    prompts = PROMPTS + [p * 3 for p in PROMPTS[:2]]  # (repeats: n-gram drafts)
    names = NAMES + ["qv4", "all8"]
    # Half now, half while those decode (a split or MIXED prefill needs running requests).
    got: dict[str, list] = {}

    def sink(delta):
        assert delta.error is None, delta.error
        got.setdefault(delta.rid, []).extend(delta.token_ids)

    rids = [eng.submit(p, GREEDY, sink, lora_name=n) for p, n in zip(prompts[:4], names[:4])]
    for _ in range(3):
        eng.step()
    rids += [eng.submit(p, GREEDY, sink, lora_name=n) for p, n in zip(prompts[4:], names[4:])]
    while eng.has_pending():
        eng.step()
    for rid, p, n in zip(rids, prompts, names):
        assert got[rid] == ref(p, n), (n, p)
    eng.check_memory()
    assert eng.stats().batches_by_mode[mode] > 0
    if kw.get("enable_overlap_schedule"):
        assert eng.stats().overlapped_steps > 0
    eng.shutdown()


def test_cpu_graphs_run_base_batches_only(model_dirs, loras):
    """CPU decode graphs are compiled without adapters: a decode batch with adapter rows runs
    eagerly, one of base-model requests replays its graph."""
    _, ref = loras
    eng = make(model_dirs, loras, cpu_graph="on", enable_lazy_cpu_graph=True, cpu_graph_max_bs=2)
    runner = eng.model_runner.graph_runner
    check_batch(eng, ref, PROMPTS[:2], ["all8", "qv4"], n=4)
    assert runner.replays == 0
    check_batch(eng, ref, PROMPTS[2:4], [None, None], n=4)
    assert runner.replays > 0 and not runner.failed


def test_no_adapter_starves(model_dirs, loras):
    """One slot, a stream of requests of one adapter: a request of another still gets its turn."""
    _, ref = loras
    eng = make(model_dirs, loras, max_loras_per_batch=1)
    got: dict[str, list] = {}

    def sink(delta):
        got.setdefault(delta.rid, []).extend(delta.token_ids)

    long = SamplingParams(max_new_tokens=6, temperature=0, ignore_eos=True)
    eng.submit(PROMPTS[0], long, sink, lora_name="all8")
    eng.step()
    rid = eng.submit(PROMPTS[1], GREEDY, sink, lora_name="qv4")
    for i in range(200):
        eng.submit(PROMPTS[i % 3], long, sink, lora_name="all8")  # always one more of all8 waiting
        eng.step()
        if len(got.get(rid, ())) == N:
            break
    assert got[rid] == ref(PROMPTS[1], "qv4")
    while eng.has_pending():
        eng.step()
    eng.check_memory()


def test_radix_cache_keyed_by_adapter(model_dirs, loras):
    _, ref = loras
    eng = make(model_dirs, loras)
    events: list[KVEvent] = []
    eng.scheduler.cache.subscribe(events.append)
    prompt = list(range(50, 80))
    first = eng.generate(input_ids=prompt, sampling_params=GREEDY, lora_name="all8")
    again = eng.generate(input_ids=prompt, sampling_params=GREEDY, lora_name="all8")
    other = eng.generate(input_ids=prompt, sampling_params=GREEDY, lora_name="qv4")
    base = eng.generate(input_ids=prompt, sampling_params=GREEDY)
    assert first.cached_tokens == 0 and again.cached_tokens == len(prompt) - 1
    assert other.cached_tokens == 0 and base.cached_tokens == 0
    for out, name in ((first, "all8"), (again, "all8"), (other, "qv4"), (base, None)):
        assert out.token_ids == ref(prompt, name)
    stored = [e for e in events if e.kind == "stored"]
    assert {e.lora_name for e in stored} == {"all8", "qv4", None}
    assert all(t < 2**31 for e in stored for t in e.token_ids)  # plain token ids
    eng.check_memory()


def test_quantized_base_batched_equals_alone(model_dirs, loras):
    """int8 base weights: a mixed batch gives each request what it gets alone."""
    eng = make(model_dirs, loras, quantization="int8", max_loras_per_batch=2)
    outs = eng.generate(input_ids=PROMPTS, sampling_params=GREEDY, lora_name=list(NAMES))
    for p, n, o in zip(PROMPTS, NAMES, outs):
        alone = eng.generate(input_ids=p, sampling_params=GREEDY, lora_name=n)
        assert o.token_ids == alone.token_ids, n
    eng.check_memory()


def test_load_unload_at_run_time(model_dirs, loras):
    folders, ref = loras
    eng = Engine(
        model_path=model_dirs["llama"],
        enable_lora=True,
        max_loras_per_batch=2,
        max_loaded_loras=4,
        max_lora_rank=16,
    )
    with pytest.raises(UnknownLoRAError, match="all8"):
        eng.generate(input_ids=PROMPTS[0], sampling_params=GREEDY, lora_name="all8")
    eng.load_lora_adapter("all8", folders["all8"])
    eng.load_lora_adapter("mlp", folders["mlp16"], pinned=True)
    assert set(eng.lora_adapters()) == {"all8", "mlp"}
    # Unload under traffic: the running requests finish with the adapter; new ones are refused.
    got: dict[str, list] = {}

    def sink(delta):
        got.setdefault(delta.rid, []).extend(delta.token_ids)

    rids = [eng.submit(p, GREEDY, sink, lora_name="all8") for p in PROMPTS[:3]]
    rid_mlp = eng.submit(PROMPTS[3], GREEDY, sink, lora_name="mlp")
    for _ in range(3):
        eng.step()
    assert eng.unload_lora_adapter("all8") is False  # draining: its requests still run
    with pytest.raises(UnknownLoRAError):
        eng.submit(PROMPTS[0], GREEDY, sink, lora_name="all8")
    while eng.has_pending():
        eng.step()
    for rid, p in zip(rids, PROMPTS[:3]):
        assert got[rid] == ref(p, "all8")
    assert got[rid_mlp] == ref(PROMPTS[3], "mlp16")
    assert set(eng.lora_adapters()) == {"mlp"}
    # Loaded again under the same name: no KV of the old load is reused (a new namespace).
    eng.load_lora_adapter("all8", folders["qv4"])
    out = eng.generate(input_ids=PROMPTS[0], sampling_params=GREEDY, lora_name="all8")
    assert out.cached_tokens == 0 and out.token_ids == ref(PROMPTS[0], "qv4")
    assert eng.unload_lora_adapter("all8") is True
    with pytest.raises(UnknownLoRAError):
        eng.unload_lora_adapter("all8")
    # Unloaded between submit and admission: the request ends with an error, the engine goes on.
    errors: list = []
    eng.submit(PROMPTS[2], GREEDY, lambda d: errors.append(d.error), lora_name="mlp")
    assert eng.unload_lora_adapter("mlp") is True
    while eng.has_pending():
        eng.step()
    assert errors and "'mlp' is not loaded" in errors[-1]
    assert eng.generate(input_ids=PROMPTS[2], sampling_params=GREEDY).token_ids == ref(
        PROMPTS[2], None
    )
    eng.check_memory()


def test_a_run_time_load_reads_its_files_while_steps_go_on(model_dirs, loras):
    """The adapter's files are read outside the step lock: a stream keeps decoding while a load is
    stuck reading (here, held until the stream has made progress), and then the adapter serves."""
    import threading

    folders, ref = loras
    eng = Engine(model_path=model_dirs["llama"], enable_lora=True, max_lora_rank=16)
    eng.start_loop()
    try:
        tokens: list[int] = []
        progressed = threading.Event()

        def sink(delta):
            tokens.extend(delta.token_ids)
            if len(tokens) >= 8:
                progressed.set()

        read = eng.lora._read  # what a load reads the folder with

        def slow_read(name, path):
            started.set()
            assert progressed.wait(60), "no decode step ran while the adapter was being read"
            return read(name, path)

        started = threading.Event()
        eng.lora._read = slow_read
        loader = threading.Thread(target=eng.load_lora_adapter, args=("all8", folders["all8"]))
        loader.start()
        assert started.wait(10)
        eng.submit(PROMPTS[1], SamplingParams(max_new_tokens=40, temperature=0, ignore_eos=True), sink)
        loader.join(60)
        assert not loader.is_alive() and progressed.is_set()
        out = eng.generate(input_ids=PROMPTS[0], sampling_params=GREEDY, lora_name="all8")
        assert out.token_ids == ref(PROMPTS[0], "all8")
        while eng.has_pending():
            threading.Event().wait(0.01)
        eng.check_memory()
    finally:
        eng.shutdown()


def test_bad_adapters_never_kill_the_engine(model_dirs, loras, tmp_path):
    folders, ref = loras
    eng = Engine(model_path=model_dirs["llama"], enable_lora=True, max_lora_rank=8)
    with pytest.raises(LoRAAdapterError, match="max_lora_rank"):
        eng.load_lora_adapter("big", folders["mlp16"])  # rank 16 > 8
    with pytest.raises(LoRAAdapterError, match="adapter_config.json"):
        eng.load_lora_adapter("none", str(tmp_path))
    eng.load_lora_adapter("qv4", folders["qv4"])
    with pytest.raises(LoRAAdapterError, match="already loaded"):
        eng.load_lora_adapter("qv4", folders["qv4"])
    with pytest.raises(UnknownLoRAError, match="nope"):
        eng.generate(
            input_ids=[PROMPTS[0], PROMPTS[1]], sampling_params=GREEDY, lora_name=["qv4", "nope"]
        )
    out = eng.generate(input_ids=PROMPTS[1], sampling_params=GREEDY, lora_name="qv4")
    assert out.token_ids == ref(PROMPTS[1], "qv4")
    eng.check_memory()


def test_lora_config_errors(model_dirs, loras):
    from engine.config import EngineConfig
    from engine.flags import field_docs
    from engine.lora import LoRAConfig

    assert LoRAConfig.from_engine_config(EngineConfig()) == LoRAConfig()  # one set of defaults
    docs = field_docs(EngineConfig)
    assert all(docs.get(f) for f in (*LoRAConfig.__struct_fields__, "enable_lora"))
    cfg = EngineConfig.from_kwargs(
        lora_paths={"a": {"lora_path": "/x", "pinned": True}, "b": "/y"},
        max_loras_per_batch=2,
        lora_target_modules="q_proj, v_proj",
    )
    lora = LoRAConfig.from_engine_config(cfg)
    assert lora.paths()["a"].pinned and not lora.paths()["b"].pinned
    assert lora.target_modules() == ("q_proj", "v_proj") and cfg.lora_enabled
    folders, _ = loras
    with pytest.raises(ConfigError, match="tp_size"):
        Engine(model_path=model_dirs["llama"], lora_paths=dict(folders), tp_size=2)
    with pytest.raises(ConfigError, match="max_loras_per_batch"):
        Engine(model_path=model_dirs["llama"], lora_paths=dict(folders), max_loras_per_batch=0)
    with pytest.raises(ConfigError, match="bad"):
        Engine(model_path=model_dirs["llama"], lora_paths={"bad": "/nonexistent/adapter"})
    eng = Engine(model_path=model_dirs["llama"])
    with pytest.raises(UnknownLoRAError):  # LoRA off: every adapter name is unknown
        eng.generate(input_ids=PROMPTS[0], sampling_params=GREEDY, lora_name="all8")


def test_kv_index_keys_paths_by_adapter():
    from actors.protocol import KVEventBatch
    from cluster.kv_index import KVIndex

    index = KVIndex(1)
    events = [
        KVEvent("stored", [1, 2, 3, 4], 0, "device", "a"),
        KVEvent("stored", [1, 2], 0, "device", None),
        KVEvent("stored", [1, 2, 3, 4, 5], 4, "device", "a"),
    ]
    assert index.apply(0, KVEventBatch("x", 1, events))
    assert index.match(0, [1, 2, 3, 4, 5, 6], "a") == 5
    assert index.match(0, [1, 2, 3, 4], "b") == 0
    assert index.match(0, [1, 2, 3, 4]) == 2
    assert index.apply(
        0, KVEventBatch("x", 4, [KVEvent("removed", [1, 2, 3, 4, 5], 2, "device", "a")])
    )
    assert index.match(0, [1, 2, 3, 4, 5], "a") == 2 and index.match(0, [1, 2, 3]) == 2


def test_structured_outputs_under_adapters(model_dirs, loras):
    """A JSON schema constrains each adapter's output: in one batch of several adapters and the
    base model, every output parses, fits the schema, and equals that request run alone."""
    import json

    schema = {"type": "object", "properties": {"n": {"type": "integer"}}, "required": ["n"]}
    params = SamplingParams(max_new_tokens=24, temperature=0, json_schema=json.dumps(schema))
    eng = make(model_dirs, loras, max_loras_per_batch=3)
    names = ["all8", "qv4", None, "mlp16"]
    prompts = PROMPTS[:4]
    outs = eng.generate(input_ids=prompts, sampling_params=params, lora_name=names)
    for p, name, o in zip(prompts, names, outs):
        assert o.error is None, o.error
        if o.finish_reason == "stop":  # (a length-cut output is a prefix of valid JSON)
            assert isinstance(json.loads(o.text)["n"], int), o.text
        alone = eng.generate(input_ids=p, sampling_params=params, lora_name=name)
        assert alone.token_ids == o.token_ids, name
    assert any(o.finish_reason == "stop" for o in outs), [o.text for o in outs]
    assert len({tuple(o.token_ids) for o in outs}) > 1  # the adapters do change the outputs
    eng.check_memory()
    eng.shutdown()
