"""engine/lora: PEFT adapters written by `peft` itself on a tiny random transformers Llama, read by
`engine.lora`, applied by `kernels.lora` on top of the base weights, against PEFT's merged model
(per projection, and whole-model logits with the update hooked into the base model's forward);
validation errors; the manager's host LRU, pinning, reference counts and device slots."""

from __future__ import annotations

import copy
import json
import os
import shutil

import pytest
import torch

peft = pytest.importorskip("peft", reason="needs peft (python3 -m pip install --no-deps peft)")
transformers = pytest.importorskip("transformers")

from engine.config import ModelConfig  # noqa: E402
from engine.errors import ConfigError, InvalidRequestError  # noqa: E402
from engine.lora import (  # noqa: E402
    PROJECTION_GROUPS,
    TARGET_MODULES,
    LoRAAdapterError,
    LoRAConfig,
    LoRAManager,
    LoRAPath,
    LoRASlotsFullError,
    UnknownLoRAError,
    load_adapter,
)
from kernels.lora import sgmv, sgmv_torch  # noqa: E402

HF = dict(
    vocab_size=96,
    hidden_size=64,
    intermediate_size=96,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    max_position_embeddings=128,
    tie_word_embeddings=False,
)
# name -> LoraConfig kwargs: every projection; a partial q/k/v (k absent) with rsLoRA; the MLP only
# with a per-module rank and alpha (rank_pattern, alpha_pattern).
ADAPTERS = {
    "all8": dict(
        r=8,
        lora_alpha=16,
        target_modules=list(TARGET_MODULES),
    ),
    "qv4": dict(r=4, lora_alpha=8, use_rslora=True, target_modules=["q_proj", "v_proj"]),
    "mlp16": dict(
        r=16,
        lora_alpha=8,
        target_modules=["gate_proj", "down_proj"],
        rank_pattern={"down_proj": 2},
        alpha_pattern={"down_proj": 4},
    ),
}


@pytest.fixture(scope="module")
def base():
    torch.manual_seed(0)
    cfg = transformers.LlamaConfig(**HF)
    model = transformers.LlamaForCausalLM(cfg).eval()
    return model, ModelConfig.from_hf(cfg.to_dict())


@pytest.fixture(scope="module")
def adapters(base, tmp_path_factory):
    """name -> (adapter folder, PEFT's merged copy of the base model)."""
    model, _ = base
    root = tmp_path_factory.mktemp("loras")
    out = {}
    for i, (name, kw) in enumerate(ADAPTERS.items()):
        torch.manual_seed(10 + i)
        # init_lora_weights=False: B random too (PEFT's default zero B would make every update 0).
        pm = peft.get_peft_model(
            copy.deepcopy(model), peft.LoraConfig(init_lora_weights=False, **kw)
        )
        with torch.no_grad():  # small updates, as trained adapters are (logits stay comparable)
            for n, p in pm.named_parameters():
                if "lora_" in n:
                    p.mul_(0.3)
        path = str(root / name)
        pm.save_pretrained(path)
        out[name] = (path, pm.merge_and_unload().eval())
    return out


def manager(base, adapters, **kw) -> LoRAManager:
    _, mcfg = base
    return LoRAManager(LoRAConfig(lora_paths={n: p for n, (p, _) in adapters.items()}, **kw), mcfg)


def group_weight(model, layer: int, group: str) -> torch.Tensor:
    blk = model.model.layers[layer]
    parts = [
        getattr(
            blk.self_attn if t in ("q_proj", "k_proj", "v_proj", "o_proj") else blk.mlp, t
        ).weight
        for t in PROJECTION_GROUPS[group]
    ]
    return torch.cat(parts).detach()


def test_defaults_follow_lora_paths(base, adapters):
    m = manager(base, adapters)
    assert m.max_lora_rank == 16 and m.max_loaded_loras == 8 and m.max_loras_per_batch == 8
    assert m.target_modules == {
        "q_proj",
        "k_proj",
        "v_proj",
        "o_proj",
        "gate_proj",
        "up_proj",
        "down_proj",
    }
    a = load_adapter("qv4", adapters["qv4"][0], base[1], 16)
    assert a.targets == {"q_proj", "v_proj"} and a.rank == 4
    assert a.module(0, "q_proj").scaling == pytest.approx(8 / 2)  # rsLoRA: alpha / sqrt(r)
    c = load_adapter("mlp16", adapters["mlp16"][0], base[1], 16)
    assert c.module(1, "down_proj").rank == 2 and c.module(1, "down_proj").scaling == pytest.approx(
        4 / 2
    )
    assert c.module(1, "gate_proj").rank == 16 and c.module(
        1, "gate_proj"
    ).scaling == pytest.approx(8 / 16)


@pytest.mark.parametrize("path", ["kernel", "torch"])
def test_projections_match_peft_merged(base, adapters, path):
    """A batch mixing every adapter and base rows: base GEMM + the LoRA update of each fused
    projection equals x @ W_merged^T of that row's adapter."""
    model, _ = base
    m = manager(base, adapters)
    names = ["all8", None, "qv4", "mlp16", "all8", None, "qv4"]
    rows = [3, 2, 1, 4, 1, 1, 2]
    info = m.batch_info(names, rows)
    row_names = [n for n, k in zip(names, rows) for _ in range(k)]
    g = torch.Generator().manual_seed(3)
    apply = sgmv if path == "kernel" else sgmv_torch
    for layer in range(HF["num_hidden_layers"]):
        for group in PROJECTION_GROUPS:
            w_base = group_weight(model, layer, group)
            x = torch.randn(len(row_names), w_base.shape[1], generator=g)
            got = apply(x @ w_base.T, x, m.weights(layer, group), info)
            for i, n in enumerate(row_names):
                w = w_base if n is None else group_weight(adapters[n][1], layer, group)
                torch.testing.assert_close(
                    got[i],
                    x[i] @ w.T,
                    atol=2e-5,
                    rtol=1e-4,
                    msg=f"layer {layer} {group} row {i} ({n})",
                )


def test_whole_model_logits_match_peft_merged(base, adapters):
    """The base transformers model with the update hooked into every adapted projection (one batch
    of three sequences: two adapters and the base model) gives each merged model's logits."""
    model, _ = base
    m = manager(base, adapters)
    names, seq = ["all8", None, "qv4", "mlp16"], 6
    info = m.batch_info(names, [seq] * len(names))
    ids = torch.randint(
        0, HF["vocab_size"], (len(names), seq), generator=torch.Generator().manual_seed(4)
    )
    hooks = []
    for layer, blk in enumerate(model.model.layers):
        for group, targets in PROJECTION_GROUPS.items():
            w = m.weights(layer, group)
            offs = w.out_offsets.tolist()
            for j, t in enumerate(targets):
                mod = getattr(blk.self_attn if group in ("qkv_proj", "o_proj") else blk.mlp, t)

                def hook(mod, inp, out, w=w, lo=offs[j], hi=offs[j + 1]):
                    x = inp[0].reshape(-1, inp[0].shape[-1])
                    delta = sgmv(x.new_zeros(x.shape[0], w.lora_b.shape[2]), x, w, info)[:, lo:hi]
                    return out + delta.view(*out.shape)

                hooks.append(mod.register_forward_hook(hook))
    try:
        with torch.no_grad():
            got = model(ids).logits
    finally:
        for h in hooks:
            h.remove()
    with torch.no_grad():
        for i, n in enumerate(names):
            want = (model if n is None else adapters[n][1])(ids[i : i + 1]).logits[0]
            torch.testing.assert_close(got[i], want, atol=1e-4, rtol=1e-4, msg=str(n))
            if n is not None:  # the adapter changes the output: the comparison is not vacuous
                assert (want - model(ids[i : i + 1]).logits[0]).abs().max() > 1e-2


def edited_copy(src: str, dst, edit) -> str:
    shutil.copytree(src, dst)
    with open(os.path.join(dst, "adapter_config.json")) as f:
        cfg = json.load(f)
    edit(cfg)
    with open(os.path.join(dst, "adapter_config.json"), "w") as f:
        json.dump(cfg, f)
    return str(dst)


def test_bad_adapters_are_typed_errors_naming_them(base, adapters, tmp_path):
    _, mcfg = base
    src = adapters["all8"][0]
    cases = {
        "use_dora": (lambda c: c.update(use_dora=True), "use_dora"),
        "bias": (lambda c: c.update(bias="all"), "bias"),
        "lm_head": (lambda c: c.update(target_modules=["q_proj", "lm_head"]), "lm_head"),
        "modules": (lambda c: c.update(modules_to_save=["lm_head"]), "modules_to_save"),
        "rank": (lambda c: c.update(r=4), "rank 8"),
    }
    for case, (edit, words) in cases.items():
        path = edited_copy(src, tmp_path / case, edit)
        with pytest.raises(LoRAAdapterError, match=words) as e:
            load_adapter(f"bad-{case}", path, mcfg, 64)
        assert f"'bad-{case}'" in str(e.value) and isinstance(e.value, InvalidRequestError)
    with pytest.raises(LoRAAdapterError, match="over max_lora_rank=4"):
        load_adapter("big", src, mcfg, 4)
    other = ModelConfig.from_hf(transformers.LlamaConfig(**{**HF, "hidden_size": 32}).to_dict())
    with pytest.raises(LoRAAdapterError, match="do not fit the base model"):
        load_adapter("other", src, other, 64)
    with pytest.raises(LoRAAdapterError, match="no adapter_config.json"):
        load_adapter("missing", str(tmp_path / "nowhere"), mcfg, 64)
    broken = edited_copy(src, tmp_path / "broken", lambda c: None)
    with open(os.path.join(broken, "adapter_model.safetensors"), "wb") as f:
        f.write(b"not a safetensors file")
    with pytest.raises(LoRAAdapterError, match="cannot read its weights"):
        load_adapter("broken", broken, mcfg, 64)
    m = manager(base, {"qv4": adapters["qv4"]}, lora_target_modules=("q_proj", "v_proj"))
    with pytest.raises(LoRAAdapterError, match="no adapter slots"):
        m.load_adapter("all8", src)
    assert m.names() == ["qv4"]  # a failed load changes nothing
    with pytest.raises(ConfigError, match="'bad'"):  # at start: a configuration error
        LoRAManager(LoRAConfig(lora_paths={"bad": str(tmp_path / "bias")}), mcfg)


def test_config_validation():
    with pytest.raises(ConfigError):
        LoRAConfig(max_loras_per_batch=0)
    with pytest.raises(ConfigError, match="max_loaded_loras"):
        LoRAConfig(max_loras_per_batch=4, max_loaded_loras=2)
    with pytest.raises(ConfigError, match="pinned"):
        LoRAConfig(max_loras_per_batch=1, lora_paths={"a": LoRAPath(lora_path="/x", pinned=True)})
    assert LoRAConfig(lora_paths={"a": "/p"}).paths() == {"a": LoRAPath(lora_path="/p")}


def many(base, adapters, n: int, **kw) -> LoRAManager:
    """A manager with no adapters at start; n copies of qv4 loaded by name at run time."""
    m = LoRAManager(LoRAConfig(max_lora_rank=8, **kw), base[1])
    for i in range(n):
        m.load_adapter(f"x{i}", adapters["qv4"][0])
    return m


def test_host_lru_evicts_idle_unpinned_and_reloads(base, adapters):
    m = many(base, adapters, 0, max_loras_per_batch=2, max_loaded_loras=3)
    m.load_adapter("p", adapters["qv4"][0], pinned=True)
    m.load_adapter("x0", adapters["qv4"][0])
    m.load_adapter("x1", adapters["qv4"][0])
    m.acquire("x0")  # running: kept
    m.load_adapter("x2", adapters["qv4"][0])  # evicts x1: the only idle unpinned one
    assert m.resident() == ["p", "x0", "x2"] and "x1" in m  # still known: read again when needed
    assert m.host_reloads == 0
    m.acquire("x1")  # reloaded; evicts x2
    assert set(m.resident()) == {"p", "x0", "x1"} and m.refs("x1") == 1 and m.host_reloads == 1
    with pytest.raises(LoRAAdapterError, match="pinned or in use"):
        m.load_adapter("x3", adapters["qv4"][0])  # p pinned, x0 and x1 running
    assert "x3" not in m
    with pytest.raises(LoRAAdapterError, match="cannot pin"):
        m.load_adapter("p2", adapters["qv4"][0], pinned=True)  # one slot must rotate
    with pytest.raises(UnknownLoRAError):
        m.acquire("nope")


def test_slots_reuse_refcounts_pinning(base, adapters):
    m = many(base, adapters, 4, max_loras_per_batch=2, max_loaded_loras=6)
    assert m.prepare_batch(["x0", None, "x1", "x0"]) == [1, 0, 2, 1]
    assert m.slot_loads == 2 and m.prepare_batch(["x1"]) == [2] and m.slot_loads == 2  # already in a slot
    m.acquire("x0")
    # x1 idle: its slot is reused for x2; x0 is running: kept
    assert m.prepare_batch(["x2"]) == [2] and m.slots() == {"x0": 1, "x2": 2}
    m.acquire("x2")
    with pytest.raises(LoRASlotsFullError):
        m.prepare_batch(["x3"])  # both slots hold running adapters
    with pytest.raises(LoRASlotsFullError):
        m.prepare_batch(["x0", "x1", "x3"])
    m.release("x2")
    assert m.prepare_batch(["x3", "x0"]) == [2, 1]
    # A slot's contents: rank 0 for k (qv4 has no k_proj), ranks of q and v; slot 0 stays base.
    w = m.weights(0, "qkv_proj")
    assert w.ranks[2].tolist() == [4, 0, 4] and w.ranks[0].tolist() == [0, 0, 0]
    # Reusing a slot overwrites every layer: the update is x3's, equal to x1's (same files).
    info = m.batch_info(["x3"], [1])
    x = torch.randn(1, HF["hidden_size"])
    ref = sgmv_torch(torch.zeros(1, w.lora_b.shape[2]), x, w, info)
    assert ref.abs().max() > 0
    m.release("x0")
    with pytest.raises(RuntimeError, match="released more often"):
        m.release("x0")


def test_pinned_slot_is_never_reused(base, adapters):
    m = many(base, adapters, 3, max_loras_per_batch=2, max_loaded_loras=6)
    m.load_adapter("p", adapters["qv4"][0], pinned=True)
    assert m.prepare_batch(["p"]) == [1]
    for name in ("x0", "x1", "x2"):  # idle adapters rotate through the one other slot
        assert m.prepare_batch([name]) == [2]
    assert m.slots() == {"p": 1, "x2": 2}


def test_unload_lets_running_requests_finish(base, adapters):
    m = many(base, adapters, 2, max_loras_per_batch=2)
    m.acquire("x0")
    assert m.prepare_batch(["x0", "x1"]) == [1, 2]
    assert m.unload_adapter("x1") is True and m.slots() == {"x0": 1}
    assert m.unload_adapter("x0") is False  # running: new requests are refused, this one goes on
    assert "x0" not in m
    with pytest.raises(UnknownLoRAError, match="x0"):
        m.acquire("x0")
    assert m.prepare_batch(["x0"]) == [1]  # the running request's batches still get their slot
    m.release("x0")
    assert m.slots() == {} and m.resident() == [] and m.active() == set()
    with pytest.raises(UnknownLoRAError):
        m.unload_adapter("x0")
    m.load_adapter("y", adapters["qv4"][0])
    with pytest.raises(LoRAAdapterError, match="already loaded"):
        m.load_adapter("y", adapters["qv4"][0])
