"""Helpers shared by test modules (test modules never import each other). No Ray import here:
the GPU machine runs the engine tests without Ray."""

from __future__ import annotations

import asyncio
import random
from collections.abc import Callable
from typing import TYPE_CHECKING

from engine import Engine, SamplingParams, StreamDelta
from engine.builtin_model import byte_level_tokenizer, random_llama_weights, write_checkpoint
from engine.engine import collect_output

if TYPE_CHECKING:
    from cluster import Cluster

GREEDY = SamplingParams(max_new_tokens=16, temperature=0.0, ignore_eos=True)
TIE = 1e-3  # logprob gap under which float summation order may pick either token


def write_random_models(root, configs: dict[str, dict], seed: int) -> dict[str, str]:
    """name -> a checkpoint folder under `root` of that config's random weights (std 0.15: peaked
    logits, so float rounding never decides a greedy tie) and the byte-level tokenizer."""
    return {name: write_checkpoint(str(root / name), cfg, random_llama_weights(cfg, seed=seed, std=0.15),
                                   byte_level_tokenizer())
            for name, cfg in configs.items()}


def prompts(engine: Engine, n: int, seed: int = 0, lo: int = 3, hi: int = 40) -> list[list[int]]:
    rng = random.Random(seed)
    vocab = engine.model_config.vocab_size
    return [[1] + [rng.randrange(5, vocab) for _ in range(rng.randint(lo, hi))] for _ in range(n)]


def assert_matches_hf(engine: Engine, hf, path: str, ids: list[list[int]], outs, n: int = 16) -> None:
    for p, o in zip(ids, outs):
        assert o.token_ids == hf.greedy(path, p, n), f"prompt of {len(p)} tokens diverged"
        assert o.finish_reason == "length"


def run_staggered(eng: Engine, ids: list[list[int]], params: SamplingParams, every: int = 3) -> list:
    """Submit one request every `every` steps, so prefills land while others decode."""
    results: dict[str, list] = {}
    order = []
    for i, p in enumerate(ids):
        rid = f"r{i}"
        results[rid] = []
        eng.submit(p, params, lambda d: results[d.rid].append(d), rid=rid)
        order.append(rid)
        for _ in range(every):
            eng.step()
    while eng.step():
        pass
    return [collect_output(rid, results[rid]) for rid in order]


async def finals_after(cl: Cluster, prompts: list[str], params: SamplingParams, action: Callable[[], None],
                       timeout_s: float = 240) -> list[StreamDelta]:
    """Stream every prompt; once each has streamed a delta (and none has ended), run `action`;
    return each stream's last delta (a condition, not a sleep: a fast engine could finish first)."""
    streaming: set[int] = set()
    all_streaming = asyncio.Event()

    async def final(i: int) -> StreamDelta:
        deltas = []
        async for delta in cl.stream(prompt=prompts[i], sampling_params=params):
            deltas.append(delta)
            streaming.add(i)
            if len(streaming) == len(prompts):
                all_streaming.set()
        return deltas[-1]

    tasks = [asyncio.create_task(final(i)) for i in range(len(prompts))]
    await asyncio.wait_for(all_streaming.wait(), timeout=60)
    assert not any(t.done() for t in tasks), "a request ended before the action: make them longer"
    action()
    return await asyncio.wait_for(asyncio.gather(*tasks), timeout=timeout_s)


def tree_paths(cache) -> set[tuple[int, ...]]:
    """Every leaf's token path in a RadixCache, walked here (not with the cache's own methods):
    the property tests' view of what the tree holds."""
    paths, stack = set(), [(cache.root, ())]
    while stack:
        node, prefix = stack.pop()
        path = prefix + tuple(node.key)
        if not node.children and node is not cache.root:
            paths.add(path)
        stack.extend((c, path) for c in node.children.values())
    return paths


def write_peft_adapters(model_path: str, root, specs: dict[str, dict], seed: int) -> dict[str, str]:
    """PEFT adapter folders of the checkpoint at model_path under `root`, one per name in `specs`
    (LoraConfig keyword arguments), random A and B (PEFT's default zero B would make every
    update 0): name -> folder. peft and transformers are imported here, for the callers that
    skip without them."""
    import copy

    import peft
    import torch
    import transformers

    base = transformers.AutoModelForCausalLM.from_pretrained(model_path, dtype=torch.float32)
    folders = {}
    for i, (name, kw) in enumerate(specs.items()):
        torch.manual_seed(seed + i)
        model = peft.get_peft_model(copy.deepcopy(base), peft.LoraConfig(init_lora_weights=False, **kw))
        folders[name] = str(root / name)
        model.save_pretrained(folders[name])
    return folders


def assert_greedy_agrees(got: list[int], want) -> None:
    """An attention-DP group's greedy tokens are the single engine's (`want`: its output with
    top_logprobs >= 2), or they part where the reference's two best tokens are within TIE of each
    other, and the group took the second: the group sums each MLP's halves over its members, in
    another order than one engine, which can only decide a near-tie the other way."""
    if got == want.token_ids:
        return
    i = next(k for k, (a, b) in enumerate(zip(got, want.token_ids)) if a != b)
    (_, first), (second_id, second) = want.logprobs[i].top_logprobs[:2]
    assert first - second < TIE and got[i] == second_id, (i, got, want.token_ids, want.logprobs[i])
