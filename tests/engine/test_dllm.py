"""Block diffusion (DLLM_EXTEND) on the built-in SDAR model: the runner against a plain reference
that recomputes the whole sequence with an explicit block-causal mask at every step; the
backends' block-causal attention against a dense masked one; the denoising rules; prefix-cache
hits at block granularity and the idle invariant."""

from __future__ import annotations

import os

import msgspec
import pytest
import torch
import torch.nn.functional as F
from safetensors.torch import load_file

from engine.attention import TorchAttnBackend, create_attention_backend
from engine.cache_manager import CacheManager
from engine.config import EngineConfig, ModelConfig
from engine.dllm.algorithm import DLLM_ALGORITHMS, LowConfidence, create_dllm_algorithm
from engine.dllm.block import DllmBlock
from engine.dllm.config import DllmConfig
from engine.dllm.runner import DllmRunner
from engine.engine import Engine
from engine.errors import ConfigError, InvalidRequestError
from engine.forward_batch import ForwardBatch, ForwardMode
from engine.memory import KVCache, ReqToTokenPool
from engine.model_path import MODEL_NAMES, resolve_model_path
from engine.model_runner import ModelRunner
from engine.req import Req
from engine.sampling import SamplingParams

CPU = torch.device("cpu")
MODEL = "builtin-dllm"


# Small tensors: one intra-op thread is faster than two on a shared, busy machine.
pytestmark = pytest.mark.usefixtures("one_torch_thread")


@pytest.fixture(scope="module")
def model_runner() -> ModelRunner:
    return ModelRunner(
        EngineConfig(model_path=MODEL, max_total_tokens=1024, max_running_requests=16), MODEL
    )


@pytest.fixture(scope="module")
def dllm_config() -> DllmConfig:
    return DllmConfig.from_dir(MODEL)


@pytest.fixture
def cache(model_runner: ModelRunner):
    """A fresh cache over the runner's pool; emptied afterwards, so the next test starts with all slots free."""
    cm = CacheManager(model_runner.req_to_token_pool, model_runner.allocator)
    yield cm
    cm.tree.evict(cm.total_size)
    cm.check_idle()
    assert cm.free_size() == cm.total_size


def make_runner(
    model_runner: ModelRunner,
    cache: CacheManager,
    config: DllmConfig,
    threshold: float = 0.95,
    eos: frozenset[int] = frozenset(),
) -> DllmRunner:
    return DllmRunner(
        cache,
        config,
        create_dllm_algorithm("low_confidence", threshold),
        eos,
        model_runner.max_context_len,
    )


def make_req(
    rid: str,
    prompt: list[int],
    max_new: int,
    temperature: float = 0.0,
    seed: int | None = None,
    ignore_eos: bool = False,
) -> Req:
    params = SamplingParams(
        max_new_tokens=max_new, temperature=temperature, seed=seed, ignore_eos=ignore_eos
    )
    gen = torch.Generator().manual_seed(seed) if seed is not None else None
    return Req(rid, prompt, params, gen)


def prompt_of(n: int, seed: int = 0) -> list[int]:
    g = torch.Generator().manual_seed(seed)
    return (torch.randint(5, 261, (n,), generator=g)).tolist()


# ---- the plain reference ------------------------------------------------------------------------
class Reference:
    """SDAR in float64 from the checkpoint's tensors: the whole sequence every forward, attention
    under an explicit block-causal mask, no KV cache."""

    def __init__(self, path: str, cfg: ModelConfig, block_size: int) -> None:
        self.w = {
            k: v.double() for k, v in load_file(os.path.join(path, "model.safetensors")).items()
        }
        # Projections as x @ W^T with W^T stored contiguous: a transposed view is far slower on some CPUs.
        self.t = {k: v.T.contiguous() for k, v in self.w.items() if v.dim() == 2}
        self.cfg, self.block_size = cfg, block_size

    def norm(self, x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
        return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.cfg.rms_norm_eps) * w

    def logits(self, ids: list[int]) -> torch.Tensor:
        cfg, w, B = self.cfg, self.w, self.block_size
        T, H, KV, D = len(ids), cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim
        pos = torch.arange(T)
        inv = 1.0 / (cfg.rope_theta ** (torch.arange(0, D, 2, dtype=torch.float64) / D))
        ang = torch.cat([pos[:, None] * inv, pos[:, None] * inv], dim=-1)[:, None, :]
        cos, sin = ang.cos(), ang.sin()

        def rope(x: torch.Tensor) -> torch.Tensor:
            return x * cos + torch.cat([-x[..., D // 2 :], x[..., : D // 2]], dim=-1) * sin

        mask = (pos[None, :] // B) <= (pos[:, None] // B)  # j visible from i iff j // B <= i // B
        h = w["model.embed_tokens.weight"][ids]
        for i in range(cfg.num_hidden_layers):
            p = f"model.layers.{i}."
            x = self.norm(h, w[p + "input_layernorm.weight"])
            q = (x @ self.t[p + "self_attn.q_proj.weight"]).view(T, H, D)
            k = (x @ self.t[p + "self_attn.k_proj.weight"]).view(T, KV, D)
            v = (x @ self.t[p + "self_attn.v_proj.weight"]).view(T, KV, D)
            q = rope(self.norm(q, w[p + "self_attn.q_norm.weight"]))
            k = rope(self.norm(k, w[p + "self_attn.k_norm.weight"]))
            k, v = (t.repeat_interleave(H // KV, dim=1) for t in (k, v))
            s = torch.einsum("qhd,khd->hqk", q, k) * D**-0.5
            a = torch.softmax(s.masked_fill(~mask, float("-inf")), dim=-1)
            o = torch.einsum("hqk,khd->qhd", a, v).reshape(T, H * D)
            h = h + o @ self.t[p + "self_attn.o_proj.weight"]
            x = self.norm(h, w[p + "post_attention_layernorm.weight"])
            g, u = x @ self.t[p + "mlp.gate_proj.weight"], x @ self.t[p + "mlp.up_proj.weight"]
            h = h + (F.silu(g) * u) @ self.t[p + "mlp.down_proj.weight"]
        return self.norm(h, w["model.norm.weight"]) @ self.t["lm_head.weight"]

    def generate(
        self,
        prompt: list[int],
        max_new: int,
        threshold: float,
        mask_id: int,
        eos: frozenset[int] = frozenset(),
    ) -> tuple[list[int], int]:
        """Greedy LowConfidence, the rules as stated: (output, forwards)."""
        B, out, forwards = self.block_size, [], 0
        while True:
            seq = prompt + out
            start = len(seq) // B * B
            block = seq[start:] + [mask_id] * (start + B - len(seq))
            free = len(seq) - start
            while mask_id in block:
                logits = self.logits(seq[:start] + block)[start:]
                forwards += 1
                logits[:, mask_id] = float("-inf")
                probs = torch.softmax(logits, dim=-1)
                masked = [i for i, t in enumerate(block) if t == mask_id]
                conf, tok = probs[masked].max(dim=-1)
                pick = [j for j in range(len(masked)) if conf[j] > threshold] or [
                    int(torch.argmax(conf))
                ]
                for j in pick:
                    block[masked[j]] = int(tok[j])
            for t in block[free:]:
                out.append(t)
                if t in eos or len(out) >= max_new:
                    return out, forwards


@pytest.fixture(scope="module")
def reference(model_runner: ModelRunner, dllm_config: DllmConfig) -> Reference:
    return Reference(resolve_model_path(MODEL), model_runner.model_config, dllm_config.block_size)


# ---- the model and its config ---------------------------------------------------------------------
def test_builtin_dllm_is_an_sdar_model_with_a_mask_token(model_runner, dllm_config):
    assert "builtin-dllm" in MODEL_NAMES
    cfg = model_runner.model_config
    assert cfg.architecture == "SDARForCausalLM" and cfg.model_type == "sdar"
    assert dllm_config.block_size == 4 and dllm_config.mask_token_id == cfg.vocab_size - 1
    assert type(model_runner.model).__name__ == "SDARForCausalLM"
    assert (cfg.dllm_block_size, cfg.dllm_mask_token_id) == (4, dllm_config.mask_token_id)
    assert model_runner.model.block_size == 4 and not ModelConfig.from_dir("builtin").is_dllm
    with pytest.raises(ConfigError, match="block_size"):
        DllmConfig.from_hf({"mask_token_id": 3})


def test_model_block_causal_attention_matches_dense_masked_reference(
    model_runner, dllm_config, reference, cache
):
    """An extend over a cached prefix (a prompt, then a later forward starting inside a block
    computed before) under block-causal attention: every position's logits as the dense
    reference's over the whole sequence."""
    ids = prompt_of(14, seed=3)
    req = make_req("a", ids, 4)
    cache.match_prefix(req)
    cache.lock(req)
    cache.alloc_extend([req], [0], [len(ids)])
    logits = []
    for prefix, end in ((0, 9), (8, 14)):  # the second recomputes position 8 and sees it with 9..13
        rows = torch.tensor([req.req_pool_idx])
        fb = ForwardBatch(
            forward_mode=ForwardMode.DLLM_EXTEND,
            batch_size=1,
            input_ids=torch.tensor(ids[prefix:end]),
            seq_lens=torch.tensor([end]),
            out_cache_loc=cache.req_to_token[req.req_pool_idx, prefix:end].long(),
            req_pool_indices=rows,
            positions=torch.empty(0, dtype=torch.int64),
            seq_lens_cpu=[end],
        )
        fb.set_extend_layout([prefix], [end - prefix])
        fb.last_token_indices = torch.arange(end - prefix)
        logits.append(model_runner.forward(fb).double())
    want = reference.logits(ids)
    # (positions 8 and 9 of the first forward saw no 10 and 11: the second recomputes them)
    torch.testing.assert_close(logits[0][:8], want[:8], atol=2e-4, rtol=1e-4)
    torch.testing.assert_close(logits[1], want[8:], atol=2e-4, rtol=1e-4)
    cache.release_req(req)


@pytest.mark.parametrize("backend", ["torch", "triton"])
def test_backend_block_causal_extend_matches_dense_mask(backend):
    """Two requests, extends starting inside and at block boundaries, blocks of 3: each query sees
    key j iff j // 3 <= its position // 3 (and j < seq_len)."""
    if backend == "triton":
        pytest.importorskip("triton")
    heads, kv_heads, dim, B = 4, 2, 16, 3
    pool = ReqToTokenPool(4, 32, CPU)
    kv = KVCache(64, 1, kv_heads, dim, torch.float32, CPU)
    g = torch.Generator().manual_seed(0)
    kv.k[0].copy_(torch.randn(kv.k[0].shape, generator=g))
    kv.v[0].copy_(torch.randn(kv.v[0].shape, generator=g))
    perm = torch.randperm(64, generator=g) + 1
    pool.write(1, 0, perm[:20])
    pool.write(2, 0, perm[20:40])
    prefix, ext = [4, 6], [5, 3]  # request 1: positions 4..8 (mid-block start); request 2: 6..8
    seq = [p + e for p, e in zip(prefix, ext)]
    fb = ForwardBatch(
        forward_mode=ForwardMode.DLLM_EXTEND,
        batch_size=2,
        input_ids=torch.zeros(8, dtype=torch.int64),
        seq_lens=torch.tensor(seq),
        out_cache_loc=torch.cat([perm[4:9], perm[26:29]]),
        req_pool_indices=torch.tensor([1, 2]),
        positions=torch.empty(0, dtype=torch.int64),
        seq_lens_cpu=seq,
    )
    fb.set_extend_layout(prefix, ext)
    q = torch.randn(8, heads, dim, generator=g)
    k, v = torch.randn(8, kv_heads, dim, generator=g), torch.randn(8, kv_heads, dim, generator=g)
    attn = create_attention_backend(backend, pool, kv, dim**-0.5, CPU)
    fb.attn_metadata = attn.init_forward_metadata(fb)
    fb.attn_metadata = attn.block_causal_metadata(fb, B)
    got = attn.forward(q, k, v, 0, fb)
    start = 0
    for row, p, n, s in zip((1, 2), prefix, ext, seq):
        slots = pool.req_to_token[row, :s].long()
        keys, vals = kv.k[0][slots].transpose(0, 1), kv.v[0][slots].transpose(0, 1)
        qpos = torch.arange(p, s)
        mask = (torch.arange(s)[None, :] // B) <= (qpos[:, None] // B)
        want = F.scaled_dot_product_attention(
            q[start : start + n].transpose(0, 1),
            keys,
            vals,
            attn_mask=mask,
            scale=dim**-0.5,
            enable_gqa=True,
        ).transpose(0, 1)
        torch.testing.assert_close(got[start : start + n], want, atol=1e-5, rtol=1e-4)
        start += n


def test_backend_without_block_causal_attention_is_refused():
    class CausalOnly(TorchAttnBackend):
        block_causal = False

    attn = CausalOnly(ReqToTokenPool(2, 8, CPU), KVCache(8, 1, 1, 8, torch.float32, CPU), 1.0, CPU)
    with pytest.raises(ConfigError, match="block-causal"):
        attn.block_causal_metadata(None, 4)


def test_block_clipped_by_the_context():
    block = DllmBlock.first([1, 2, 3, 4, 5, 6], 4, 4, 9, max_context_len=7)
    assert (block.start, block.end, block.tokens) == (4, 7, [5, 6, 9])
    with pytest.raises(ValueError, match="no room"):
        DllmBlock.first([1] * 7, 0, 4, 9, max_context_len=7)
    with pytest.raises(ValueError, match="block boundary"):
        DllmBlock.first([1] * 6, 2, 4, 9, max_context_len=64)


# ---- the denoising rules --------------------------------------------------------------------------
def test_low_confidence_rules():
    mask = 9
    block = DllmBlock.first([1, 2, 3, 4, 5], 0, 4, mask, 64)  # prompt's last block: [5, m, m, m]
    assert (block.start, block.first_free, block.masked()) == (4, 1, [1, 2, 3])
    logits = torch.full((3, 10), -10.0)
    logits[0, 7] = 10.0  # confident
    logits[1, mask] = 50.0  # the mask token never counts: its next best is chosen
    logits[1, 6] = logits[1, 3] = 1.0  # two equally likely: not confident
    logits[2, 5] = 10.0  # confident
    req = make_req("r", [1, 2, 3, 4, 5], 8)
    assert LowConfidence(0.95).unmask(logits, [block], [req]) == [2]
    assert block.tokens == [5, 7, mask, 5] and block.masked() == [2]
    # None above the threshold: the most confident, the lowest on a tie.
    block = DllmBlock.first([1], 0, 4, mask, 64)
    tie = torch.zeros(3, 10)
    tie[1, 3] = tie[2, 4] = 2.0
    assert LowConfidence(0.95).unmask(tie, [block], [req]) == [1]
    assert block.tokens == [1, mask, 3, mask]
    assert LowConfidence(0.0).unmask(torch.zeros(2, 10), [block], [req]) == [2]  # threshold 0: all
    assert not block.masked()
    with pytest.raises(ConfigError, match="threshold"):
        LowConfidence(1.5)
    with pytest.raises(ConfigError, match="low_confidence"):
        create_dllm_algorithm("nope")
    assert DLLM_ALGORITHMS["low_confidence"] is LowConfidence


# ---- the runner against the reference ---------------------------------------------------------------
@pytest.mark.parametrize("threshold", [0.95, 0.5, 0.0])
def test_runner_matches_reference(model_runner, dllm_config, reference, cache, threshold):
    """A batch of prompts at every offset in their blocks (B = 4), output truncated mid-block."""
    runner = make_runner(model_runner, cache, dllm_config, threshold)
    lengths, max_new = [3, 4, 5, 7, 8, 9], 10
    reqs = [make_req(str(n), prompt_of(n, seed=n), max_new, ignore_eos=True) for n in lengths]
    runner.generate(model_runner, reqs)
    want = [
        reference.generate(r.origin_input_ids, max_new, threshold, dllm_config.mask_token_id)
        for r in reqs
    ]
    assert [r.output_ids for r in reqs] == [w[0] for w in want]
    assert all(len(r.output_ids) == max_new and r.finished_reason.kind == "length" for r in reqs)
    # Every forward advances every running request's block by one denoising step.
    assert runner.forwards == max(w[1] for w in want)
    if threshold == 0.0:
        assert runner.forwards == max(-(-(n % 4 + max_new) // 4) for n in lengths)
    runner.check_idle()


def test_eos_inside_a_committed_block_ends_the_output(model_runner, dllm_config, reference, cache):
    prompt = prompt_of(6, seed=11)
    free, _ = reference.generate(prompt, 12, 0.5, dllm_config.mask_token_id)
    eos = frozenset({free[5]})  # inside the second block
    want, _ = reference.generate(prompt, 12, 0.5, dllm_config.mask_token_id, eos)
    runner = make_runner(model_runner, cache, dllm_config, 0.5, eos)
    req = make_req("e", prompt, 12)
    runner.generate(model_runner, [req])
    assert req.output_ids == want and req.output_ids[-1] in eos and len(want) <= 6
    assert req.finished_reason.kind == "stop"
    runner.check_idle()


def test_seeded_sampling_is_the_same_alone_and_in_a_batch(model_runner, dllm_config, cache):
    runner = make_runner(model_runner, cache, dllm_config, 0.5)
    prompt = prompt_of(5, seed=4)
    alone = make_req("s", prompt, 9, temperature=0.8, seed=7, ignore_eos=True)
    runner.generate(model_runner, [alone])
    batch = [
        make_req("x", prompt_of(3, seed=5), 6, temperature=1.0, seed=1, ignore_eos=True),
        make_req("s2", prompt, 9, temperature=0.8, seed=7, ignore_eos=True),
        make_req("y", prompt_of(10, seed=6), 13, ignore_eos=True),
    ]
    runner.generate(model_runner, batch)
    other = make_req("o", prompt, 9, temperature=0.8, seed=8, ignore_eos=True)
    runner.generate(model_runner, [other])
    assert batch[1].output_ids == alone.output_ids
    assert other.output_ids != alone.output_ids
    runner.check_idle()


def test_prefix_cache_hits_whole_blocks_only(model_runner, dllm_config, reference, cache):
    """A finished request's final blocks are cached; a later prompt that shares them (and more,
    up to inside a block) reuses whole blocks and gets the reference's output; one that leaves
    the cached path inside a block adds nothing that would pair its KV with others' tokens."""
    runner = make_runner(model_runner, cache, dllm_config, 0.5)
    first = make_req("a", prompt_of(9, seed=21), 11, ignore_eos=True)
    runner.generate(model_runner, [first])
    seq = first.origin_input_ids + first.output_ids  # 20 tokens; KV final for 0..15
    assert cache.cached_size() == 16
    # (shares 14 tokens: hits 12; shares 10: hits 8; shares all 16 cached)
    for rid, prompt, hit in (
        ("b", seq[:14] + [7, 8, 9], 12),
        ("c", seq[:10] + [5], 8),
        ("d", seq[:18], 16),
    ):
        req = make_req(rid, prompt, 6, ignore_eos=True)
        runner.admit(req)
        assert len(req.prefix_indices) == hit
        while not req.finished():
            runner.step(model_runner, [req])
        want, _ = reference.generate(prompt, 6, 0.5, dllm_config.mask_token_id)
        assert req.output_ids == want, rid
    runner.check_idle()


def test_abort_mid_block_and_failure_keep_the_idle_invariant(model_runner, dllm_config, cache):
    runner = make_runner(model_runner, cache, dllm_config, 1.0)  # one position per forward
    reqs = [make_req(str(i), prompt_of(5 + i, seed=i), 20, ignore_eos=True) for i in range(3)]
    for r in reqs:
        runner.admit(r)
    waiting = make_req("w", prompt_of(6, seed=9), 5)
    runner.admit(waiting)  # admitted, never run
    for _ in range(6):  # past a commit: the committed block awaits its recomputation
        runner.step(model_runner, reqs)
    assert all(r.output_ids and not r.finished() for r in reqs)
    runner.finish(reqs[0])  # aborted
    runner.release(reqs[1])  # failed
    runner.finish(waiting)
    runner.step(model_runner, reqs[2:])
    runner.finish(reqs[2])
    runner.check_idle()
    assert cache.cached_size() % 4 == 0


# ---- through the Engine: scheduler, streaming, aborts, rejections ---------------------------------
def make_engine(**kw) -> Engine:
    return Engine(model_path=MODEL, max_total_tokens=1024, max_running_requests=16, **kw)


def greedy(max_new: int, **kw) -> SamplingParams:
    return SamplingParams(max_new_tokens=max_new, temperature=0.0, **kw)


@pytest.fixture(scope="module")
def ref_memo(reference, dllm_config):
    """The reference's greedy outputs, memoized (the float64 recompute is the slow part)."""
    memo: dict = {}

    def get(prompt: list[int], max_new: int, threshold: float, eos: frozenset[int] = frozenset()):
        key = (tuple(prompt), max_new, threshold, eos)
        if key not in memo:
            memo[key] = reference.generate(
                prompt, max_new, threshold, dllm_config.mask_token_id, eos
            )[0]
        return memo[key]

    return get


@pytest.mark.parametrize("threshold", [0.95, 0.5, 0.0])
def test_engine_matches_reference(ref_memo, threshold):
    """A batch of prompts at every offset in their blocks (B = 4), output truncated mid-block, one
    DLLM_EXTEND batch per step and no other mode."""
    eng = make_engine(dllm_threshold=threshold)
    prompts = [prompt_of(n, seed=n) for n in (3, 4, 5, 7, 8, 9)]
    outs = eng.generate(input_ids=prompts, sampling_params=greedy(10, ignore_eos=True))
    assert [o.token_ids for o in outs] == [ref_memo(p, 10, threshold) for p in prompts]
    assert all(o.finish_reason == "length" for o in outs)
    modes = eng.stats().batches_by_mode
    assert modes["DLLM_EXTEND"] == eng.scheduler.dllm.forwards > 0
    assert sum(modes.values()) == modes["DLLM_EXTEND"]
    assert eng.stats().generated_tokens == 60
    eng.check_memory()


def test_engine_requests_join_at_any_step_and_hit_whole_blocks(ref_memo):
    """Requests submitted while others are mid-block run in the same DLLM_EXTEND batches; a
    later prompt sharing a finished request's blocks hits them (whole blocks only) and still
    gets the reference's output."""
    eng = make_engine(dllm_threshold=0.5)
    got: dict[str, list[int]] = {}

    def sink(delta):
        got.setdefault(delta.rid, []).extend(delta.token_ids)

    prompts = {"a": prompt_of(6, seed=31), "b": prompt_of(9, seed=32), "c": prompt_of(4, seed=33)}
    eng.submit(prompts["a"], greedy(11, ignore_eos=True), sink, rid="a")
    eng.step()
    eng.step()
    eng.submit(prompts["b"], greedy(7, ignore_eos=True), sink, rid="b")
    eng.step()
    eng.submit(prompts["c"], greedy(9, ignore_eos=True), sink, rid="c")
    while eng.has_pending():
        eng.step()
    for rid, n in (("a", 11), ("b", 7), ("c", 9)):
        assert got[rid] == ref_memo(prompts[rid], n, 0.5), rid
    eng.check_memory()
    # Radix hits: "a" left 16 positions of final KV (its prompt and output up to its last block).
    seq = prompts["a"] + got["a"]
    for prompt, hit in ((seq[:14] + [7, 8, 9], 12), (seq[:10] + [5], 8), (seq[:18], 16)):
        out = eng.generate(input_ids=prompt, sampling_params=greedy(6, ignore_eos=True))
        assert out.cached_tokens == hit and out.token_ids == ref_memo(prompt, 6, 0.5)
    # A request sharing a prompt with a running one hits it once the first has run its first forward.
    twins = eng.generate(
        input_ids=[prompt_of(13, seed=34)] * 2, sampling_params=greedy(5, ignore_eos=True)
    )
    assert twins[0].token_ids == twins[1].token_ids and twins[1].cached_tokens == 12
    eng.check_memory()


def test_engine_stop_tokens_and_strings_end_inside_a_committed_block(ref_memo):
    eng = make_engine(dllm_threshold=0.5)
    prompt = prompt_of(6, seed=11)
    free = ref_memo(prompt, 12, 0.5)
    out = eng.generate(input_ids=prompt, sampling_params=greedy(12, stop_token_ids=[free[5]]))
    assert out.token_ids == ref_memo(prompt, 12, 0.5, frozenset({free[5]}))
    assert out.finish_reason == "stop" and out.token_ids[-1] == free[5]
    # A stop string: the text stops before it, and the streamed deltas add up to the final text.
    whole = eng.generate(input_ids=prompt, sampling_params=greedy(12, ignore_eos=True))
    text = whole.text
    stop = next(text[i : i + 2] for i in range(3, len(text) - 1) if text[i : i + 2].isprintable())
    params = greedy(12, ignore_eos=True, stop=[stop])
    out = eng.generate(input_ids=prompt, sampling_params=params)
    assert out.finish_reason == "stop" and out.text == text[: text.index(stop)]
    deltas = list(eng.stream(input_ids=prompt, sampling_params=params))
    assert "".join(d.text for d in deltas) == out.text and deltas[-1].finish_reason == "stop"
    eng.check_memory()


def test_engine_streams_a_block_when_it_commits(ref_memo):
    eng = make_engine(dllm_threshold=0.0)
    prompt = prompt_of(5, seed=4)  # first block: 1 prompt token + 3 outputs; then blocks of 4
    deltas = list(eng.stream(input_ids=prompt, sampling_params=greedy(10, ignore_eos=True)))
    assert [len(d.token_ids) for d in deltas] == [3, 4, 3]
    assert [t for d in deltas for t in d.token_ids] == ref_memo(prompt, 10, 0.0)
    final = eng.generate(input_ids=prompt, sampling_params=greedy(10, ignore_eos=True))
    assert "".join(d.text for d in deltas) == final.text
    eng.check_memory()


def test_engine_seeded_sampling_is_the_same_alone_and_in_a_batch():
    eng = make_engine(dllm_threshold=0.5)
    prompt = prompt_of(5, seed=4)
    seeded = SamplingParams(max_new_tokens=9, temperature=0.8, seed=7, ignore_eos=True)
    alone = eng.generate(input_ids=prompt, sampling_params=seeded)
    batch = eng.generate(
        input_ids=[prompt_of(3, seed=5), prompt, prompt_of(10, seed=6)],
        sampling_params=[
            SamplingParams(max_new_tokens=6, temperature=1.0, seed=1, ignore_eos=True),
            seeded,
            greedy(13, ignore_eos=True),
        ],
    )
    other = eng.generate(input_ids=prompt, sampling_params=msgspec.structs.replace(seeded, seed=8))
    assert batch[1].token_ids == alone.token_ids != other.token_ids
    eng.check_memory()


def test_engine_overlap_and_retraction_keep_the_outputs(ref_memo):
    """Overlap scheduling runs DLLM batches synchronously; a pool too small for every request's
    blocks retracts some (their KV cached, their block kept) and re-admits them later."""
    prompts = [prompt_of(n, seed=40 + n) for n in (5, 6, 9, 10)]
    want = [ref_memo(p, 14, 0.5) for p in prompts]
    eng = make_engine(dllm_threshold=0.5, enable_overlap_schedule=True)
    outs = eng.generate(input_ids=prompts, sampling_params=greedy(14, ignore_eos=True))
    assert [o.token_ids for o in outs] == want
    eng.check_memory()
    small = Engine(
        model_path=MODEL,
        max_total_tokens=48,
        max_running_requests=8,
        dllm_threshold=0.5,
        init_new_token_ratio=0.05,
        min_new_token_ratio=0.05,
    )  # (admission reserves little)
    outs = small.generate(input_ids=prompts, sampling_params=greedy(14, ignore_eos=True))
    assert [o.token_ids for o in outs] == want
    assert small.stats().num_retracted > 0
    small.check_memory()


def test_engine_abort_mid_block_keeps_the_idle_invariant():
    eng = make_engine(dllm_threshold=1.0)  # one position per forward
    ends: dict[str, object] = {}

    def sink(delta):
        if delta.finish_reason is not None:
            ends[delta.rid] = delta

    for i in range(3):
        eng.submit(prompt_of(5 + i, seed=i), greedy(20, ignore_eos=True), sink, rid=str(i))
    for _ in range(6):  # past a commit: the committed block awaits its recomputation
        eng.step()
    eng.abort("0")
    eng.step()
    eng.submit(prompt_of(6, seed=9), greedy(5), sink, rid="w")
    eng.abort("w")  # aborted before it ran
    eng.step()
    eng.abort("1")
    while eng.has_pending():
        eng.step()
    assert ends["0"].finish_reason == "abort" and ends["0"].error_kind == "aborted"
    assert ends["2"].finish_reason == "length" and ends["w"].finish_reason == "abort"
    assert eng.stats().num_aborted == 3
    eng.check_memory()
    assert eng.scheduler.cache.cached_size() % 4 == 0


@pytest.mark.parametrize(
    "params, param",
    [
        (dict(logprobs=True), "logprobs"),
        (dict(prompt_logprobs=1), "prompt_logprobs"),
        (dict(frequency_penalty=0.5), "frequency_penalty"),
        (dict(repetition_penalty=1.2), "repetition_penalty"),
        (dict(logit_bias={5: 1.0}), "logit_bias"),
        (dict(min_tokens=2), "min_tokens"),
        (dict(json_schema='{"type": "object"}'), "response_format"),
        (dict(regex="[a-z]+"), "regex"),
        (dict(max_new_tokens=1021), "max_tokens"),  # 3 + 1021 rounds up past the pool
    ],
)
def test_engine_rejects_what_block_diffusion_does_not_do(params, param):
    eng = make_engine()
    with pytest.raises(InvalidRequestError) as e:
        eng.generate(input_ids=[5, 6, 7], sampling_params=SamplingParams(**params))
    assert e.value.param == param


@pytest.mark.parametrize(
    "config",
    [
        dict(enable_mixed_chunk=True),
        dict(enable_split_prefill=True),
        dict(chunked_prefill_size=64),
        dict(speculative_algorithm="ngram"),
        dict(disaggregation_mode="prefill"),
    ],
)
def test_engine_refuses_what_block_diffusion_does_not_do(config):
    with pytest.raises(ConfigError, match=next(iter(config))):
        make_engine(**config)


def test_engine_failed_forward_fails_its_requests_only(monkeypatch):
    """A DLLM_EXTEND forward that raises fails its batch's requests (their KV released, nothing
    cached); the next request runs."""
    eng = make_engine(dllm_threshold=0.5)
    forward = eng.model_runner.forward
    calls = iter([True])

    def flaky(fb):
        if next(calls, False):
            raise RuntimeError("device fault")
        return forward(fb)

    monkeypatch.setattr(eng.model_runner, "forward", flaky)
    bad = eng.generate(
        input_ids=[prompt_of(6, seed=1), prompt_of(9, seed=2)], sampling_params=greedy(8)
    )
    assert all(o.error_kind == "engine_error" and "device fault" in o.error for o in bad)
    good = eng.generate(input_ids=prompt_of(6, seed=1), sampling_params=greedy(8, ignore_eos=True))
    assert good.finish_reason == "length" and len(good.token_ids) == 8
    eng.check_memory()
