"""Tensor-parallel sharding (engine/tp): a forward computed from two ranks' shards with the
TPGroup's collectives equals the forward of the full weights.

Two real processes (torch.multiprocessing spawn, gloo over a FileStore in tmp_path) run every
model case once (one spawn for the module: each process imports torch once) and write what they
measured; the tests below read it. The forward is written here over a weight dict, a TPLayout
and a TPGroup: with the full weights, a one-rank layout and a one-rank group it is the
reference. Tolerance: atol 1e-5 in float32 (the sharded matmuls sum over their K in pieces and
the all-reduce adds the ranks' partial sums, so the bits may differ from the full matmul's)."""

from __future__ import annotations

import json
import threading
import traceback
from pathlib import Path

import msgspec
import pytest
import torch
import torch.multiprocessing as mp
import torch.nn.functional as F

from engine.builtin_model import llama_config, moe_config, random_llama_weights, write_checkpoint
from engine.config import ModelConfig
from engine.errors import ConfigError
from engine.models import load_weights
from engine.models.layers import RoPE, apply_rope, rms_norm
from engine.tp import (
    TPGroup,
    TPLayout,
    rank_weight_bytes,
    replicated_numel,
    serve_store,
    shard_bytes,
    shard_kind,
    shard_weights,
    vocab_parallel_embedding,
    vocab_parallel_logits,
)
from engine.tp.loader import can_read_slices, read_rank_weights
from engine.tp.sharding import row_bias_shard, shard_tensor, weight_nbytes
from kernels.quant import QuantWeight, quantize_int4, quantize_int8

TP = 2
ATOL = 1e-5
# vocab 261: odd, so the second rank's shard ends in one padding row; ids straddle the split (131).
SMALL = dict(
    hidden_size=64,
    intermediate_size=96,
    num_hidden_layers=1,
    num_attention_heads=4,
    head_dim=16,
    max_position_embeddings=64,
    vocab_size=261,
)
IDS = [0, 5, 130, 131, 200, 260, 7]
MOE = dict(
    SMALL,
    num_hidden_layers=2,
    num_key_value_heads=2,
    moe_intermediate_size=32,
    num_experts=4,
    num_experts_per_tok=2,
    norm_topk_prob=True,
)
CASES: dict[str, dict] = {
    "mha_tied": llama_config(**SMALL, num_key_value_heads=4, tie_word_embeddings=True),
    "gqa_untied": llama_config(**SMALL, num_key_value_heads=2, tie_word_embeddings=False),
    "mqa_replicated_kv": llama_config(**SMALL, num_key_value_heads=1, tie_word_embeddings=False),
    "qwen2_bias": llama_config(
        **SMALL,
        num_key_value_heads=2,
        architectures=["Qwen2ForCausalLM"],
        model_type="qwen2",
        tie_word_embeddings=False,
    ),
    "qwen3_qk_norm": llama_config(
        **SMALL, num_key_value_heads=2, architectures=["Qwen3ForCausalLM"], model_type="qwen3"
    ),
    # Layer 0 dense, layer 1 sparse with a sigmoid-gated shared expert (and Qwen2's q/k/v bias).
    "qwen2_moe": moe_config(
        **MOE,
        architectures=["Qwen2MoeForCausalLM"],
        model_type="qwen2_moe",
        mlp_only_layers=[0],
        shared_expert_intermediate_size=48,
    ),
    "mixtral": llama_config(
        **dict(MOE, num_experts=None, intermediate_size=32),
        num_local_experts=4,
        architectures=["MixtralForCausalLM"],
        model_type="mixtral",
        tie_word_embeddings=False,
    ),
}


class StepMeta(msgspec.Struct):
    """Stand-in for the scheduler's per-step batch metadata."""

    mode: str
    req_ids: list[str]
    input_ids: list[int]


# ---- the forward under test ----------------------------------------------------------------


def gated_mlp(w: dict, x: str, names: tuple[str, str, str], h: torch.Tensor) -> torch.Tensor:
    gate, up, down = (w[f"{x}{n}.weight"] for n in names)
    return F.linear(F.silu(F.linear(h, gate)) * F.linear(h, up), down)


def mlp_partial(w: dict, cfg: ModelConfig, i: int, h: torch.Tensor) -> torch.Tensor:
    """Layer i's MLP over this rank's slice (the whole MLP with full weights): partial sums."""
    p = f"model.layers.{i}."
    if not cfg.is_sparse_layer(i):
        return gated_mlp(w, p + "mlp.", ("gate_proj", "up_proj", "down_proj"), h)
    mixtral = cfg.model_type == "mixtral"
    m = p + ("block_sparse_moe." if mixtral else "mlp.")
    names = ("w1", "w3", "w2") if mixtral else ("gate_proj", "up_proj", "down_proj")
    probs = torch.softmax(
        F.linear(h, w[m + "gate.weight"]).float(), dim=-1
    )  # the router is replicated
    top_w, top_i = probs.topk(cfg.num_experts_per_tok, dim=-1)
    if cfg.norm_topk_prob:
        top_w = top_w / top_w.sum(dim=-1, keepdim=True)
    out = torch.zeros_like(h)
    for e in range(cfg.num_experts):
        rows, slot = (top_i == e).nonzero(as_tuple=True)
        if rows.numel():
            out[rows] += top_w[rows, slot, None] * gated_mlp(w, f"{m}experts.{e}.", names, h[rows])
    if cfg.shared_expert_intermediate_size:
        gate = torch.sigmoid(F.linear(h, w[m + "shared_expert_gate.weight"]))
        out += gate * gated_mlp(w, m + "shared_expert.", ("gate_proj", "up_proj", "down_proj"), h)
    return out


def forward(
    w: dict, cfg: ModelConfig, layout: TPLayout, group: TPGroup, ids: torch.Tensor
) -> torch.Tensor:
    """Embedding, every decoder layer over one causal sequence, final norm, LM head -> logits
    [T, vocab_size] from a rank's weights (all of them: the reference)."""
    T, hd, eps = ids.shape[0], cfg.head_dim, cfg.rms_norm_eps
    x = vocab_parallel_embedding(ids, w["model.embed_tokens.weight"], layout, group)
    cos, sin = RoPE(hd, cfg.rope_theta, cfg.rope_scaling, 64, torch.float32, torch.device("cpu"))(
        torch.arange(T)
    )
    for i in range(cfg.num_hidden_layers):
        p, a = f"model.layers.{i}.", f"model.layers.{i}.self_attn."
        h = rms_norm(x, w[p + "input_layernorm.weight"], eps)
        q, k, v = (
            F.linear(h, w[f"{a}{n}_proj.weight"], w.get(f"{a}{n}_proj.bias")).view(T, -1, hd)
            for n in "qkv"
        )
        assert q.shape[1] == layout.num_heads and k.shape[1] == layout.num_kv_heads
        if cfg.qk_norm:
            q, k = (
                rms_norm(q, w[a + "q_norm.weight"], eps),
                rms_norm(k, w[a + "k_norm.weight"], eps),
            )
        q, k = apply_rope(q, cos, sin), apply_rope(k, cos, sin)
        rep = (
            layout.num_heads // layout.num_kv_heads
        )  # query head j reads KV head j // rep, as HF's GQA
        k, v = k.repeat_interleave(rep, dim=1), v.repeat_interleave(rep, dim=1)
        o = (
            F.scaled_dot_product_attention(
                q.transpose(0, 1),
                k.transpose(0, 1),
                v.transpose(0, 1),
                is_causal=True,
                scale=hd**-0.5,
            )
            .transpose(0, 1)
            .reshape(T, -1)
        )
        x = x + group.all_reduce(F.linear(o, w[a + "o_proj.weight"]))  # RowParallelLinear
        h = rms_norm(x, w[p + "post_attention_layernorm.weight"], eps)
        x = x + group.all_reduce(mlp_partial(w, cfg, i, h))  # one reduction for the whole MLP
    h = rms_norm(x, w["model.norm.weight"], eps)
    head = w.get("lm_head.weight", w["model.embed_tokens.weight"])  # tied: the embedding's shard
    return vocab_parallel_logits(F.linear(h, head), layout, group)


# ---- the two ranks --------------------------------------------------------------------------


def _comm_checks(rank: int, group: TPGroup) -> dict:
    out: dict = {}
    x = torch.full((3,), float(rank + 1))
    same = group.all_reduce(x)
    out["all_reduce"] = x.tolist()
    out["all_reduce_in_place"] = same is x
    base = torch.arange(6.0).view(2, 3)
    y = (base * (rank + 1)).t()  # not contiguous
    group.all_reduce(y)
    out["all_reduce_strided_ok"] = torch.equal(y, (base * 3).t())
    z = torch.full((1, 2), float(rank))
    out["gather_rows"] = group.all_gather(z, dim=0).tolist()
    out["gather_cols"] = group.all_gather(z, dim=-1).tolist()
    small = {"mode": "decode", "req_ids": ["a", "b"], "input_ids": [1, 2, 3]}
    out["object_small"] = group.broadcast_object(small if rank == 0 else None)
    big = list(range(20_000))  # past the 16 KiB object buffer: a second broadcast
    out["object_big_ok"] = group.broadcast_object(big if rank == 0 else None) == big
    meta = StepMeta("extend", ["r1"], [4, 5])
    got = group.broadcast_object(meta if rank == 1 else None, src=1, as_type=StepMeta)
    out["object_struct_ok"] = got == meta and isinstance(got, StepMeta)
    out["object_empty"] = group.broadcast_object([] if rank == 0 else None)
    # The scheduler thread's broadcasts while the forward thread all-reduces (overlap): each
    # on its own group, so neither sees the other's calls.
    seen: list = []
    sender = threading.Thread(
        target=lambda: seen.extend(
            group.broadcast_object([i] if rank == 0 else None) for i in range(20)
        )
    )
    sender.start()
    sums = [group.all_reduce(torch.tensor([float(i + rank)])).item() for i in range(20)]
    sender.join()
    out["threads_ok"] = seen == [[i] for i in range(20)] and sums == [
        2.0 * i + 1 for i in range(20)
    ]
    # A second private group (TCP rendezvous: rank 0 serves the store, the other joins its
    # init method) beside the first: no global state shared.
    store, init = serve_store("127.0.0.1", TP, 60) if rank == 0 else (None, None)
    init = group.broadcast_object(init)
    if rank == 0:
        other = TPGroup(rank, TP, store=store, timeout_s=60)
    else:
        other = TPGroup(rank, TP, init_method=init, timeout_s=60)
    out["tcp_all_reduce"] = other.all_reduce(torch.tensor([10.0 * (rank + 1)])).tolist()
    other.destroy()
    other.destroy()  # idempotent
    try:
        other.all_reduce(torch.zeros(1))
        out["destroyed_raises"] = False
    except RuntimeError:
        out["destroyed_raises"] = True
    out["collective_calls"] = group.collective_calls
    out["object_calls"] = group.object_calls
    return out


def _worker(rank: int, store_path: str, out_dir: str) -> None:
    torch.set_num_threads(1)
    results: dict = {}
    try:
        group = TPGroup(rank, TP, init_method=f"file://{store_path}", timeout_s=60)
        one = TPGroup(0, 1)
        ids = torch.tensor(IDS)
        for name, hf in CASES.items():
            try:
                cfg = ModelConfig.from_hf(hf)
                full = random_llama_weights(hf, seed=1)
                ref = forward(full, cfg, TPLayout.from_config(cfg, 0, 1), one, ids)
                layout = TPLayout.from_config(cfg, rank, TP)
                shards = shard_weights(full, cfg, rank, TP)
                got = forward(shards, cfg, layout, group, ids)
                tied = "lm_head.weight" not in full
                results[name] = {
                    "max_err": (got - ref).abs().max().item(),
                    "ref_scale": ref.abs().max().item(),
                    "shape": list(got.shape),
                    "argmax_equal": torch.equal(got.argmax(-1), ref.argmax(-1)),
                    "shard_bytes": shard_bytes(shards),
                    "full_bytes": shard_bytes(full),
                    "expected_bytes": rank_weight_bytes(cfg, layout, torch.float32, tied),
                    "replicated_bytes": 4 * replicated_numel(cfg),
                    "padding_bytes": 4 * layout.num_padding * cfg.hidden_size * (1 if tied else 2),
                    # k/v projection bytes a rank holds past its 1/N (a KV head on several ranks)
                    "replicated_kv_bytes": 4
                    * cfg.num_hidden_layers
                    * 2
                    * cfg.hidden_size
                    * (layout.kv_size - cfg.num_key_value_heads * cfg.head_dim / TP),
                    "storages_own": all(
                        weight_nbytes(t) == t.untyped_storage().nbytes()
                        for t in shards.values()
                        if isinstance(t, torch.Tensor)
                    ),
                }
            except Exception:
                results[name] = {"error": traceback.format_exc()}
        results["comm"] = _comm_checks(rank, group)
        group.destroy()
    except Exception:
        results["setup"] = {"error": traceback.format_exc()}
    Path(out_dir, f"rank{rank}.json").write_text(json.dumps(results))


@pytest.fixture(scope="module")
def ranks(tmp_path_factory: pytest.TempPathFactory) -> list[dict]:
    d = tmp_path_factory.mktemp("tp")
    mp.spawn(_worker, args=(str(d / "store"), str(d)), nprocs=TP, join=True)
    results = [json.loads((d / f"rank{r}.json").read_text()) for r in range(TP)]
    for r in results:
        assert "setup" not in r, r["setup"]["error"]
    return results


@pytest.mark.parametrize("case", list(CASES))
def test_sharded_forward_matches_full(ranks: list[dict], case: str) -> None:
    for rank, res in enumerate(ranks):
        got = res[case]
        assert "error" not in got, f"rank {rank}: {got.get('error')}"
        assert got["shape"] == [len(IDS), SMALL["vocab_size"]]  # padding cut off
        assert got["max_err"] <= ATOL, (
            f"rank {rank}: max |tp - full| {got['max_err']:.2e} (logits up to {got['ref_scale']:.2f})"
        )
        assert got["argmax_equal"]


@pytest.mark.parametrize("case", list(CASES))
def test_rank_bytes_about_one_over_n(ranks: list[dict], case: str) -> None:
    """Each rank holds what the layout predicts, copies not views of the checkpoint; at most
    1/N of the model plus the replicated parts, the vocabulary padding and replicated KV heads."""
    for res in ranks:
        got = res[case]
        assert got["shard_bytes"] == got["expected_bytes"]
        assert got["storages_own"]
        bound = got["full_bytes"] / TP + got["replicated_bytes"] + got["padding_bytes"]
        bound += got["replicated_kv_bytes"]
        assert (got["replicated_kv_bytes"] > 0) == (case == "mqa_replicated_kv")
        assert got["shard_bytes"] <= bound
        assert got["shard_bytes"] < 0.6 * got["full_bytes"]
    assert sum(r[case]["shard_bytes"] for r in ranks) >= ranks[0][case]["full_bytes"]


def test_group_collectives(ranks: list[dict]) -> None:
    for rank, res in enumerate(ranks):
        c = res["comm"]
        assert (
            c["all_reduce"] == [3.0, 3.0, 3.0]
            and c["all_reduce_in_place"]
            and c["all_reduce_strided_ok"]
        )
        assert c["gather_rows"] == [[0.0, 0.0], [1.0, 1.0]]
        assert c["gather_cols"] == [[0.0, 0.0, 1.0, 1.0]]
        assert c["object_small"] == {
            "mode": "decode",
            "req_ids": ["a", "b"],
            "input_ids": [1, 2, 3],
        }
        assert c["object_big_ok"] and c["object_struct_ok"] and c["object_empty"] == []
        assert c["tcp_all_reduce"] == [30.0] and c["threads_ok"]
        assert c["destroyed_raises"] and c["collective_calls"] > 0 and c["object_calls"] >= 25, rank


# ---- in-process: layout, rules, quantized shards ---------------------------------------------


def config(**overrides) -> ModelConfig:
    return ModelConfig.from_hf(llama_config(**{**SMALL, "num_key_value_heads": 2, **overrides}))


def test_layout_heads_and_vocab() -> None:
    gqa = [
        TPLayout.from_config(config(num_attention_heads=8, num_key_value_heads=4), r, 2)
        for r in range(2)
    ]
    assert [
        (lay.num_heads, lay.head_start, lay.num_kv_heads, lay.kv_head_start) for lay in gqa
    ] == [(4, 0, 2, 0), (4, 4, 2, 2)]
    mqa = [
        TPLayout.from_config(config(num_attention_heads=8, num_key_value_heads=2), r, 4)
        for r in range(4)
    ]
    # Fewer KV heads than ranks: ranks 0-1 hold KV head 0 (their query heads 0-3), ranks 2-3 head 1.
    assert [(lay.num_kv_heads, lay.kv_head_start, lay.kv_head_replicas) for lay in mqa] == [
        (1, 0, 2),
        (1, 0, 2),
        (1, 1, 2),
        (1, 1, 2),
    ]
    lay = [TPLayout.from_config(config(), r, 2) for r in range(2)]
    assert lay[0].padded_vocab_size == 262 and (lay[0].vocab_start, lay[0].vocab_end) == (0, 131)
    assert (lay[1].vocab_start, lay[1].org_vocab_end, lay[1].vocab_end, lay[1].num_padding) == (
        131,
        261,
        262,
        1,
    )
    assert TPLayout.from_config(config(), 0, 2, vocab_pad_multiple=64).padded_vocab_size == 384
    assert lay[1].kv_bytes_per_token(3, torch.float32) == 2 * 3 * 1 * 16 * 4
    assert TPLayout.from_config(config(), 0, 1).num_padding == 0


@pytest.mark.parametrize(
    "overrides, tp, message",
    [
        (
            {"num_attention_heads": 6, "head_dim": 16, "num_key_value_heads": 6},
            4,
            "num_attention_heads 6 is not divisible by tp_size 4",
        ),
        (
            {"num_attention_heads": 6, "num_key_value_heads": 3},
            2,
            "num_key_value_heads 3 is not divisible by tp_size 2",
        ),
        (
            {"num_attention_heads": 12, "num_key_value_heads": 3},
            4,
            "num_key_value_heads 3 is fewer than tp_size 4",
        ),
        ({"intermediate_size": 90}, 4, "intermediate_size 90"),
    ],
)
def test_indivisible_sizes_are_config_errors(overrides: dict, tp: int, message: str) -> None:
    with pytest.raises(ConfigError, match=message):
        TPLayout.from_config(config(**overrides), 0, tp)
    with pytest.raises(ConfigError):
        TPLayout.from_config(config(), 2, 2)  # rank out of range


def test_shard_rules() -> None:
    cfg = config(tie_word_embeddings=True)
    full = random_llama_weights(llama_config(**{**SMALL, "num_key_value_heads": 2}), seed=2)
    one = shard_weights(full, cfg, 0, 1)
    assert all(one[n] is full[n] for n in full)  # one rank: the checkpoint's own tensors
    s0, s1 = (shard_weights(full, cfg, r, 2) for r in range(2))
    q = "model.layers.0.self_attn.q_proj.weight"
    assert torch.equal(torch.cat([s0[q], s1[q]]), full[q])
    o = "model.layers.0.self_attn.o_proj.weight"
    assert torch.equal(torch.cat([s0[o], s1[o]], dim=1), full[o])
    emb = "model.embed_tokens.weight"
    assert s1[emb].shape == (131, 64) and not s1[emb][-1].any()  # the padding row
    assert torch.equal(torch.cat([s0[emb], s1[emb][:-1]]), full[emb])
    assert s0["model.norm.weight"] is full["model.norm.weight"]
    mqa = config(num_key_value_heads=1)
    k = "model.layers.0.self_attn.k_proj.weight"
    kw = torch.randn(16, 64)
    assert all(
        torch.equal(shard_tensor(k, kw, TPLayout.from_config(mqa, r, 2)), kw) for r in range(2)
    )
    bias = torch.randn(64)
    assert torch.equal(row_bias_shard(bias, 0) + row_bias_shard(bias, 1), bias)  # added once
    assert shard_kind("model.layers.3.block_sparse_moe.experts.7.w2.weight") == "row"
    assert shard_kind("model.layers.3.mlp.gate.weight") == "replicated"
    assert shard_kind("model.layers.3.mlp.experts.0.up_proj.weight") == "column"
    with pytest.raises(ConfigError, match="no tensor-parallel rule"):
        shard_kind("model.layers.0.mystery.weight")
    olmoe = TPLayout.from_config(config(), 0, 2)
    with pytest.raises(ConfigError, match="OLMoE"):
        shard_tensor("model.layers.0.self_attn.q_norm.weight", torch.ones(64), olmoe)


@pytest.mark.parametrize(
    "quantize",
    [lambda w: quantize_int8(w, 32), lambda w: quantize_int4(w, 32)],
    ids=["int8_g32", "int4_g32"],
)
def test_quantized_shards(quantize) -> None:
    cfg = config(intermediate_size=128)
    lays = [TPLayout.from_config(cfg, r, 2) for r in range(2)]
    g = torch.Generator().manual_seed(3)
    gate, down = torch.randn(128, 64, generator=g), torch.randn(64, 128, generator=g)
    qg, qd = quantize(gate), quantize(down)
    for r, lay in enumerate(lays):
        col = shard_tensor("model.layers.0.mlp.gate_proj.weight", qg, lay)
        assert isinstance(col, QuantWeight) and torch.equal(
            col.dequantize(), qg.dequantize()[64 * r : 64 * (r + 1)]
        )
        row = shard_tensor(
            "model.layers.0.mlp.down_proj.weight", qd, lay
        )  # K split at 64: on a group bound
        assert isinstance(row, QuantWeight) and torch.equal(
            row.dequantize(), qd.dequantize()[:, 64 * r : 64 * (r + 1)]
        )
        assert row.nbytes() * 2 == qd.nbytes()
        for part in (col, row):  # copies, not views of the whole weight's codes
            assert all(
                t.untyped_storage().nbytes() == t.numel() * t.element_size()
                for t in (part.qweight, part.scales, part.biases)
                if t is not None
            )
        emb = shard_tensor(
            "model.embed_tokens.weight", quantize(torch.randn(261, 64, generator=g)), lay
        )
        assert emb.shape == (131, 64)
    qe = quantize(torch.randn(261, 64, generator=g))
    tail = shard_tensor("model.embed_tokens.weight", qe, lays[1])
    assert not tail.dequantize()[-1].any() and torch.equal(
        tail.dequantize()[:-1], qe.dequantize()[131:]
    )
    coarse = quantize_int8(down, 128)  # one group over all 128 columns: a split at 64 cuts it
    with pytest.raises(ConfigError, match="quantization group of 128"):
        shard_tensor("model.layers.0.mlp.down_proj.weight", coarse, lays[0])
    q = quantize(torch.randn(64, 64, generator=g))
    assert shard_tensor("model.layers.0.self_attn.q_proj.weight", q, lays[0]).shape == (
        32,
        64,
    )  # heads 0-1


def test_single_rank_group_is_a_no_op() -> None:
    group = TPGroup(0, 1)
    x = torch.randn(2, 3)
    assert group.all_reduce(x) is x and group.all_gather(x) is x and group.broadcast(x) is x
    meta = StepMeta("decode", ["a"], [1])
    assert group.broadcast_object(meta) is meta
    group.barrier()
    group.destroy()
    assert group.collective_calls == 0
    with pytest.raises(ValueError):
        TPGroup(0, 2)  # several ranks need a rendezvous


@pytest.mark.parametrize("case", ["qwen2_bias", "mixtral"])
def test_read_rank_weights_reads_the_same_shards(tmp_path: Path, case: str) -> None:
    hf = CASES[case]
    model_dir = write_checkpoint(str(tmp_path / case), hf, random_llama_weights(hf, seed=4))
    cfg = ModelConfig.from_dir(model_dir)
    full = load_weights(model_dir)
    for rank in range(TP):
        want = shard_weights(full, cfg, rank, TP)
        got = read_rank_weights(model_dir, cfg, rank, TP)
        assert got.keys() == want.keys()
        for name, t in got.items():
            assert torch.equal(t, want[name]), name
            assert t.untyped_storage().nbytes() == weight_nbytes(t), name  # its slice only
    (tmp_path / "q").mkdir()
    (tmp_path / "q" / "config.json").write_text(
        json.dumps({"quantization_config": {"quant_method": "gptq"}})
    )
    assert not can_read_slices(str(tmp_path / "q"))


def test_a_quantized_expert_split_inside_a_group_is_held_as_float() -> None:
    """TP=2 over a moe_intermediate_size of 96 splits an expert's down projection at 48, inside
    int4's 32-wide groups: that rank's slice is float (as unquantized experts load); a split on
    group bounds stays quantized."""
    name = "model.layers.0.mlp.experts.1.down_proj.weight"
    for inter, quantized in ((96, False), (128, True)):
        cfg = ModelConfig.from_hf(moe_config(**dict(SMALL, moe_intermediate_size=inter, num_experts=2,
                                                    num_experts_per_tok=1)))
        w = torch.randn(cfg.hidden_size, inter)
        q = quantize_int4(w)
        for rank in range(2):
            part = shard_tensor(name, q, TPLayout.from_config(cfg, rank, 2))
            assert isinstance(part, QuantWeight) == quantized and part.shape == (cfg.hidden_size, inter // 2)
            got = part.dequantize() if quantized else part
            torch.testing.assert_close(got, q.dequantize()[:, rank * inter // 2:(rank + 1) * inter // 2])
