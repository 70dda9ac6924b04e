"""`python -m engine.bench`: the engine side by side with baselines, one summary line per case.

Cases (same machine, same weights, float32, greedy, ignore_eos):
  mixed       64 requests, prompts U[16,256], outputs U[32,512]: this engine vs transformers
              `generate` in static batches of 16 (left padding, each batch runs to its longest).
  prefill     32 prompts x 256 tokens, one output token: prompt tokens/s vs one transformers forward.
  prefix      4 groups x 16 requests, 1024-token shared prefix + 32 unique, 32 outputs:
              radix cache on vs off (total tokens/s).
  overhead    decode at batch 32: share of step wall time spent outside the model forward.
  roofline    decode at batch 64: achieved FLOP/s (2 x params x tokens/s) vs a 2048^3 torch.mm
              (and vs the same GEMM through oneDNN, which is faster on AMD CPUs).
  overlap     decode-heavy workload (32 x 256 tokens): overlap scheduling on vs off.
  linear      the model's GEMMs at 1, 32, 64 and 2048 rows: F.linear (MKL) vs oneDNN prepacked.
  spec        speculative decoding (k=4) with n-gram drafts and with a draft model, against plain
              decoding, batch 1 and 8, greedy, 128 new tokens: (a) the bench model, whose random-
              weight greedy output falls into loops the n-gram drafter predicts, drafting with its
              own first 2 layers; (b) stories260K's real text (needs RADIXRAY_TEST_DATA), drafting
              with itself (every draft kept by construction: the machinery's cost). Decode
              tokens/s, acceptance, mean accepted length.
  structured  JSON-schema-constrained vs unconstrained greedy decoding at batch 32 (the same tokens
              per request); per installed grammar backend: schema compile and per-step mask time.
  roofline_bs1  decode against the memory roofline, on a 21.7M-parameter Llama (87 MB of fp32
              weights): this machine's read bandwidth (best streaming read of a buffer 4x the last-
              level cache: a torch reduction and the project's C++ kernel with every thread), the
              decode floor (weight bytes / bandwidth), decode tok/s at batch 1, 8 and 32 with the CPU
              decode graphs on and off (fp32 and bf16), prefill tok/s (the project's GEMM vs
              oneDNN), and the CPU-side launch overhead of a decode step (the same layers at
              hidden size 16: all dispatch, no math), which is what graphs save on a GPU too.
  quant       SmolLM2-135M-Instruct from its GGUF file as F32, BF16, Q4_1 (kept quantized), int8 and
              int4: decode tok/s at batch 1, 8, 32, prefill, bytes read per step (engine/bench_quant.py);
              with --llama-cpp DIR, llama.cpp on the same file.
  quant_moe   a random 75M Qwen3-MoE (8 experts, top 2) as float32, int8 and int4, experts kept
              quantized: decode tok/s at batch 1, 8, 32 and weight bytes (engine/bench_quant.py).
  split       a stream decoding while 1,000- and 4,000-token prompts arrive: the stream's longest
              gap and p99 ITL, each prompt's TTFT and prefill tok/s, unsplit vs chunked (512) vs
              split prefill; the ITL distributions as a PNG (engine/bench_split.py).
  dllm        the built-in block-diffusion model (blocks of 4): tokens per DLLM_EXTEND forward and
              tok/s at batch 1 and 8 for LowConfidence thresholds 0.95, 0.5 and 0 (engine/bench_dllm.py).
  hicache     a multi-turn chat trace and the churn trace: pool only vs host tier vs host + file
              storage (hit rate, prefill tokens computed, TTFT p50/p90, a PNG), and the eviction
              policies replayed on both (engine/bench_hicache.py).
  tp          tensor parallelism: TP=2 over two CPU ranks (one thread each) vs one rank with two
              threads, decode tok/s at batch 1, 8, 32 and the time per step in collectives
              (engine/bench_tp.py).
  lora        batch-32 decode with 0, 1, 8 and 32 distinct LoRA adapters (rank 16, every attention
              and MLP projection, round robin over the requests; max_loras_per_batch=32, so all 32
              share each batch) vs the base model and a plain engine: decode tok/s, ms per step,
              floors 0.75x at 8 adapters and 0.6x at 32; load_lora_adapter time per MB; a PNG
              (engine/bench_lora.py).
`--quick` shrinks every workload (a smoke run, not a measurement to quote).
"""

from __future__ import annotations

import argparse
import gc
import os
import random
import shutil
import time

import torch
import torch.nn.functional as F

from engine import Engine, SamplingParams
from engine.bench_common import (
    GREEDY_WARMUP,
    decode_rates,
    line,
    llc_bytes,
    random_prompts,
    read_bandwidth,
    run_engine,
)
from engine.bench_dllm import case_dllm
from engine.bench_hicache import case_hicache
from engine.bench_lora import case_lora
from engine.bench_quant import case_quant, case_quant_moe
from engine.bench_split import case_split
from engine.bench_tp import case_tp
from engine.builtin_model import (
    byte_level_tokenizer,
    cached_random_checkpoint,
    llama_config,
    moe_config,
    write_checkpoint,
)
from kernels.cpu_linear import Linear, onednn_linear_works

BENCH_ARCH = dict(vocab_size=32000, hidden_size=512, intermediate_size=2048, num_hidden_layers=8,
                  num_attention_heads=8, num_key_value_heads=8, max_position_embeddings=2048,
                  tie_word_embeddings=True)
# About 75M parameters: 50M in the experts (8 layers x 8 experts x 3 x 512 x 512), 25M dense
# (a tied 32000-token embedding, attention).
BENCH_MOE_ARCH = dict(BENCH_ARCH, head_dim=64, num_experts=8, num_experts_per_tok=2, moe_intermediate_size=512,
                      norm_topk_prob=True)
# roofline_bs1: 21.7M parameters, 87 MB in fp32 (12.3M of them the tied embedding / lm_head).
ROOFLINE_ARCH = dict(vocab_size=32000, hidden_size=384, intermediate_size=1024, num_hidden_layers=6,
                     num_attention_heads=6, num_key_value_heads=2, max_position_embeddings=2048,
                     tie_word_embeddings=True)
# The same layers with almost no math: a decode step of it is the per-step dispatch cost.
OVERHEAD_ARCH = dict(ROOFLINE_ARCH, vocab_size=256, hidden_size=16, intermediate_size=32, num_attention_heads=2,
                     num_key_value_heads=1)


def bench_model_path() -> str:
    """The ~50M-parameter random Llama used by every case (built once, cached)."""
    return cached_random_checkpoint("bench-llama-50m-v1", llama_config(**BENCH_ARCH), std=0.02)


def bench_moe_model_path() -> str:
    """The random Qwen3-MoE of the quant_moe case and of the cluster bench's moe case (cached)."""
    return cached_random_checkpoint("bench-qwen3moe-75m-v1", moe_config(**BENCH_MOE_ARCH), std=0.02)


def layer_skip_draft(path: str, layers: int) -> str:
    """A draft model made of a checkpoint's first `layers` layers (same embedding, final norm and
    head: LayerSkip-style self-speculation), built once beside it."""
    import json

    from safetensors.torch import load_file

    out = f"{path}-first{layers}"
    if os.path.isfile(os.path.join(out, "model.safetensors")):
        return out
    with open(os.path.join(path, "config.json")) as f:
        cfg = {**json.load(f), "num_hidden_layers": layers}
    weights = {k: v for k, v in load_file(os.path.join(path, "model.safetensors")).items()
               if not k.startswith("model.layers.") or int(k.split(".")[2]) < layers}
    tmp = write_checkpoint(f"{out}.tmp{os.getpid()}", cfg, weights, byte_level_tokenizer())
    try:
        os.rename(tmp, out)
    except OSError:  # another process built it meanwhile
        shutil.rmtree(tmp, ignore_errors=True)
    return out


def run_hf_static(path: str, prompts: list[list[int]], outs: list[int], batch: int = 16) -> float:
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    model.generation_config.eos_token_id = None
    model.generation_config.pad_token_id = 0
    t0 = time.perf_counter()
    for i in range(0, len(prompts), batch):
        chunk, n_out = prompts[i:i + batch], max(outs[i:i + batch])
        width = max(len(p) for p in chunk)
        ids = torch.tensor([[0] * (width - len(p)) + p for p in chunk])
        mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in chunk])
        with torch.no_grad():
            out = model.generate(ids, attention_mask=mask, max_new_tokens=n_out, do_sample=False)
        assert out.shape[1] == width + n_out, "transformers stopped early"
    return time.perf_counter() - t0


def case_mixed(path: str, scale: float) -> None:
    rng = random.Random(0)
    n = max(4, int(64 * scale))
    prompts = random_prompts(n, 16, 256, BENCH_ARCH["vocab_size"], rng)
    outs = [rng.randint(32, max(33, int(512 * scale))) for _ in range(n)]
    eng = Engine(model_path=path, max_total_tokens=65536, max_running_requests=64)
    ours = sum(outs) / run_engine(eng, prompts, outs)
    del eng
    gc.collect()
    theirs = sum(outs) / run_hf_static(path, prompts, outs)
    line("mixed", "radixray", ours, "transformers_static16", theirs, "out tok/s", "(floor 3x)")


def case_prefill(path: str, scale: float) -> None:
    """32 prompts of 256 tokens, one output token each: a single 8192-token EXTEND batch."""
    rng = random.Random(5)
    n, plen = 32, max(32, int(256 * scale))
    prompts, outs = random_prompts(n, plen, plen, BENCH_ARCH["vocab_size"], rng), [1] * n
    eng = Engine(model_path=path, max_total_tokens=65536)
    run_engine(eng, random_prompts(2, 8, 8, BENCH_ARCH["vocab_size"], rng), [1, 1])  # warm-up
    ours = n * plen / run_engine(eng, prompts, outs)
    assert eng.step_count["EXTEND"] == 2, "the prompts did not prefill as one batch"
    del eng
    gc.collect()
    theirs = n * plen / run_hf_static(path, prompts, outs, batch=n)
    line("prefill", "radixray", ours, "transformers", theirs, "prompt tok/s", f"({n} x {plen} tokens, one forward)")


def case_prefix(path: str, scale: float) -> None:
    rng = random.Random(1)
    groups, per, plen = 4, max(2, int(16 * scale)), max(64, int(1024 * scale))
    prompts = []
    for _ in range(groups):
        prefix = random_prompts(1, plen, plen, BENCH_ARCH["vocab_size"], rng)[0]
        prompts += [prefix + u for u in random_prompts(per, 32, 32, BENCH_ARCH["vocab_size"], rng)]
    outs = [32] * len(prompts)
    total = sum(len(p) for p in prompts) + sum(outs)
    rates = {}
    for disable in (False, True):
        eng = Engine(model_path=path, max_total_tokens=32768, disable_radix_cache=disable)
        rates[disable] = total / run_engine(eng, prompts, outs)
        stats = eng.stats()
        hit = stats.cached_tokens / stats.prompt_tokens
        del eng
        gc.collect()
        if not disable:
            hit_on = hit
    line("prefix", "radix_on", rates[False], "radix_off", rates[True], "total tok/s",
         f"(cache hit {hit_on:.0%}; floor 4x)")


def decode_run(path: str, bs: int, out_len: int, **engine_kwargs) -> Engine:
    rng = random.Random(2)
    prompts = random_prompts(bs, 32, 32, BENCH_ARCH["vocab_size"], rng)
    eng = Engine(model_path=path, max_total_tokens=16384, max_running_requests=bs, **engine_kwargs)
    run_engine(eng, prompts, [out_len] * bs)
    return eng


def case_overhead(path: str, scale: float) -> None:
    eng = decode_run(path, 32, max(16, int(128 * scale)))
    step, fwd = eng.step_seconds["DECODE"], eng.scheduler.forward_seconds["DECODE"]
    frac = (step - fwd) / step
    print(f"overhead   decode bs=32: step={1e3 * step / eng.step_count['DECODE']:.2f} ms  "
          f"forward={1e3 * fwd / eng.step_count['DECODE']:.2f} ms  outside-forward={frac:.1%} (ceiling 10%)",
          flush=True)


def _time(fn, reps: int) -> float:
    for _ in range(2):
        fn()
    t0 = time.perf_counter()
    for _ in range(reps):
        fn()
    return (time.perf_counter() - t0) / reps


def matmul_flops() -> dict[str, float]:
    """FLOP/s of a 2048^3 fp32 GEMM: torch.mm (MKL) and oneDNN with a prepacked weight."""
    a, b = torch.randn(2048, 2048), torch.randn(2048, 2048)
    flops = {"mm": 2 * 2048 ** 3 / _time(lambda: torch.mm(a, b), 10)}
    if onednn_linear_works(torch.float32):
        lin = Linear(b.t().contiguous(), onednn=True)
        flops["onednn"] = 2 * 2048 ** 3 / _time(lambda: lin(a), 10)
    return flops


def case_roofline(path: str, scale: float) -> None:
    eng = decode_run(path, 64, max(16, int(128 * scale)))
    params = eng.model_runner.model.num_parameters()
    tok_s = 64 * eng.step_count["DECODE"] / eng.step_seconds["DECODE"]
    achieved = 2 * params * tok_s
    flops = matmul_flops()
    vs_onednn = (f"; the same GEMM through oneDNN {flops['onednn'] / 1e9:.1f} GFLOP/s, "
                 f"{achieved / flops['onednn']:.0%} of it" if "onednn" in flops else "")
    line("roofline", "decode_bs64", achieved / 1e9, "mm2048", flops["mm"] / 1e9, "GFLOP/s",
         f"({params / 1e6:.1f}M params, {tok_s:,.0f} tok/s{vs_onednn}; floor 50% of torch.mm)")


def case_linear(path: str, scale: float) -> None:
    """One decoder's worth of fp32 GEMMs (the bench model's shapes, weights streamed from
    memory as in a real step): oneDNN with prepacked weights vs F.linear (MKL)."""
    if not onednn_linear_works(torch.float32):
        print("linear     oneDNN is unavailable in this torch build", flush=True)
        return
    h, inter, layers = BENCH_ARCH["hidden_size"], BENCH_ARCH["intermediate_size"], BENCH_ARCH["num_hidden_layers"]
    shapes = [(3 * h, h), (h, h), (2 * inter, h), (h, inter)] * layers + [(BENCH_ARCH["vocab_size"], h)]
    dense = [torch.randn(n, k) * 0.02 for n, k in shapes]
    packed = [Linear(w, onednn=True) for w in dense]
    for rows in (1, 32, 64, max(64, int(2048 * scale))):
        xs = {k: torch.randn(rows, k) for k in (h, inter)}
        t_mkl = _time(lambda xs=xs: [F.linear(xs[w.shape[1]], w) for w in dense], 3)
        t_dnn = _time(lambda xs=xs: [lin(xs[lin.in_features]) for lin in packed], 3)
        line("linear", f"rows={rows} torch", 1e3 * t_mkl, "onednn", 1e3 * t_dnn, "ms per model",
             f"(oneDNN's speedup; {2 * rows * sum(n * k for n, k in shapes) / t_dnn / 1e9:.0f} GFLOP/s)")


def case_overlap(path: str, scale: float) -> None:
    """Decode-heavy: 32 requests x 256 output tokens; end-to-end output tokens/s."""
    rates, overlapped = {}, 0
    rng = random.Random(4)
    prompts = random_prompts(32, 32, 32, BENCH_ARCH["vocab_size"], rng)
    outs = [max(16, int(256 * scale))] * 32
    for overlap in (True, False):
        eng = Engine(model_path=path, max_total_tokens=16384, enable_overlap_schedule=overlap)
        rates[overlap] = sum(outs) / run_engine(eng, prompts, outs)
        overlapped = overlapped or eng.stats().overlapped_steps
        del eng
    line("overlap", "overlap_on", rates[True], "overlap_off", rates[False], "out tok/s",
         f"({overlapped} decode steps overlapped)")


def case_spec(path: str, scale: float, stories: str | None = None) -> None:
    rng = random.Random(6)
    out_len = max(32, int(128 * scale))
    # (name, target, its draft model, prompts): the bench model drafts with its own first 2 of 8
    # layers; stories260K (one trained model of its tokenizer) drafts with itself.
    workloads = [("loops", path, layer_skip_draft(path, 2), random_prompts(8, 32, 32, BENCH_ARCH["vocab_size"], rng))]
    stories = stories or (os.path.join(os.environ["RADIXRAY_TEST_DATA"], "models", "stories260K")
                          if os.environ.get("RADIXRAY_TEST_DATA") else None)
    if stories:
        from engine.tokenizer import Tokenizer

        tok = Tokenizer(stories)
        texts = ["Once upon a time, there was a little girl named Lily. She loved to", "Tom and his dog went to the park.",
                 "One day, a big bear came to the forest. The bear was", "Sue had a red ball. She liked to play",
                 "The sun was shining. Max wanted to go outside", "There was a little bird who could not fly.",
                 "Mom said, \"Let's bake a cake!\" Ben was happy.", "The boat went on the water. The kids"]
        workloads.append(("stories", stories, stories, [tok.encode(t) for t in texts]))
    for name, model, draft, prompts in workloads:
        for bs in (1, 8):
            rates, spec = {}, {}
            for algo in ("ngram", "draft_model", None):
                eng = Engine(model_path=model, max_total_tokens=16384, speculative_algorithm=algo,
                             speculative_num_draft_tokens=4,
                             speculative_draft_model_path=draft if algo == "draft_model" else None)
                run_engine(eng, prompts[:bs], [4] * bs)  # warm-up
                eng.step_seconds.clear()
                before = eng.stats()
                run_engine(eng, prompts[:bs], [out_len] * bs)
                decode_s = sum(eng.step_seconds[m] for m in ("DECODE", "TARGET_VERIFY"))
                rates[algo] = (eng.stats().generated_tokens - before.generated_tokens - bs) / decode_s
                if algo:
                    after = eng.stats()
                    drafted = after.spec_draft_tokens - before.spec_draft_tokens
                    accepted = after.spec_accepted_tokens - before.spec_accepted_tokens
                    steps = after.spec_verify_requests - before.spec_verify_requests
                    spec[algo] = (accepted / max(drafted, 1), (accepted + steps) / max(steps, 1))
                del eng
            figures = "  ".join(f"{algo}={rates[algo]:,.1f} decode tok/s ({rates[algo] / rates[None]:.2f}x, acceptance="
                             f"{spec[algo][0]:.0%}, mean accepted length={spec[algo][1]:.2f})" for algo in spec)
            print(f"spec       {name} bs={bs}: {figures}  off={rates[None]:,.1f}  "
                  f"(floor 2x at bs=1 where the length is >= 3)", flush=True)
    # Overlap: each verify forward runs on the forward thread while the step before it is
    # delivered; end to end, prefill included.
    prompts, outs, rates = workloads[0][3][:8], [out_len] * 8, {}
    for overlap in (True, False):
        eng = Engine(model_path=path, max_total_tokens=16384, speculative_algorithm="ngram",
                     speculative_num_draft_tokens=4, enable_overlap_schedule=overlap)
        run_engine(eng, prompts, [4] * len(prompts))  # warm-up
        rates[overlap] = sum(outs) / run_engine(eng, prompts, outs)
        del eng
    line("spec", "loops ngram bs=8 overlap_on", rates[True], "overlap_off", rates[False], "out tok/s", "(end to end)")


STRUCTURED_SCHEMA = {
    "type": "object",
    "properties": {
        "id": {"type": "integer", "minimum": 0},
        "name": {"type": "string", "maxLength": 32},
        "status": {"enum": ["active", "inactive", "pending"]},
        "tags": {"type": "array", "items": {"type": "string", "maxLength": 12}, "maxItems": 4},
        "address": {"type": "object", "properties": {
            "street": {"type": "string", "maxLength": 24}, "city": {"type": "string", "maxLength": 16},
            "zip": {"type": "string", "pattern": "^[0-9]{5}$"},
            "geo": {"type": "object", "properties": {"lat": {"type": "number"}, "lon": {"type": "number"}},
                    "required": ["lat", "lon"], "additionalProperties": False}},
            "required": ["street", "city", "zip"], "additionalProperties": False},
        "orders": {"type": "array", "maxItems": 3, "items": {"type": "object", "properties": {
            "sku": {"type": "string", "maxLength": 10}, "qty": {"type": "integer", "minimum": 1},
            "kind": {"enum": ["digital", "physical"]}}, "required": ["sku", "qty", "kind"],
            "additionalProperties": False}},
        "verified": {"type": "boolean"},
        "note": {"anyOf": [{"type": "string", "maxLength": 20}, {"type": "null"}]},
    },
    "required": ["id", "name", "status", "tags", "address", "orders", "verified", "note"],
    "additionalProperties": False,
}


def case_structured(path: str, scale: float) -> None:
    """Batch 32, greedy: JSON-schema-constrained decoding, then the same prompts unconstrained
    for the same number of tokens each (ignore_eos), on one engine; then, per grammar backend
    that is installed, the cold compile of the schema and the mask of one decode step at batch 32
    (fill the 32 rows + apply to [32, vocab] logits, replaying the constrained outputs)."""
    import json

    from engine.grammar import create_grammar_backend

    bs, max_new = 32, max(32, int(256 * scale))
    rng = random.Random(7)
    prompts = random_prompts(bs, 32, 32, BENCH_ARCH["vocab_size"], rng)
    schema = json.dumps(STRUCTURED_SCHEMA)
    eng = Engine(model_path=path, max_total_tokens=16384, max_running_requests=bs)
    constrained = SamplingParams(max_new_tokens=max_new, temperature=0.0, json_schema=schema)
    eng.generate(input_ids=prompts[:2], sampling_params=[constrained, GREEDY_WARMUP])  # warm-up, compile
    # Alternating rounds, best of each side: a busy machine's stalls hit one run, not the ratio.
    t_con = t_free = float("inf")
    for _ in range(1 if scale < 1 else 5):
        t0 = time.perf_counter()
        outs = eng.generate(input_ids=prompts, sampling_params=constrained)
        t_con = min(t_con, time.perf_counter() - t0)
        lengths = [len(o.token_ids) for o in outs]
        t_free = min(t_free, run_engine(eng, prompts, lengths))
    stopped = sum(o.finish_reason == "stop" for o in outs)
    n = sum(lengths)
    line("structured", "json_schema", n / t_con, "unconstrained", n / t_free, "out tok/s",
         f"(batch {bs}, {n} tokens, {stopped}/{bs} ended by the grammar, best of alternating runs; floor 0.85x)")
    vocab = eng.model_config.vocab_size
    tokenizer_json = eng.tokenizer.tok.to_str()
    for name in ("llguidance", "xgrammar"):
        try:
            t0 = time.perf_counter()
            backend = create_grammar_backend(name, tokenizer_json, vocab, eng.eos_ids)
        except ImportError:
            print(f"structured {name}: not installed", flush=True)
            continue
        t_setup = time.perf_counter() - t0
        t0 = time.perf_counter()
        grammar = backend.compile("json_schema", schema)
        t_compile = time.perf_counter() - t0
        matchers = [backend.matcher(grammar) for _ in outs]
        logits = torch.randn(bs, vocab)
        fill = apply = 0.0
        steps = max(lengths)
        for step in range(steps):
            rows = [m if step < len(o.token_ids) else None for m, o in zip(matchers, outs)]
            t0 = time.perf_counter()
            bitmask = backend.batch_bitmask(rows, logits.device)
            t1 = time.perf_counter()
            backend.apply_bitmask(logits, bitmask)
            t2 = time.perf_counter()
            fill, apply = fill + t1 - t0, apply + t2 - t1
            for m, o in zip(rows, outs):
                if m is not None and not m.is_terminated():
                    m.accept(o.token_ids[step])
        print(f"structured {name}: setup={1e3 * t_setup:.1f} ms  compile={1e3 * t_compile:.1f} ms  "
              f"mask per step at batch {bs}={1e3 * (fill + apply) / steps:.3f} ms (fill {1e3 * fill / steps:.3f} + "
              f"apply {1e3 * apply / steps:.3f}) over {steps} steps", flush=True)


def case_roofline_bs1(path: str, scale: float) -> None:
    """Decode against the memory roofline: bandwidth, floor, graphs on/off at batch 1, 8, 32."""
    path = cached_random_checkpoint("roofline-llama-22m-v1", llama_config(**ROOFLINE_ARCH), std=0.02)
    llc = llc_bytes()
    nbytes = max(1 << 30, 4 * llc) if scale >= 1 else max(256 << 20, 2 * llc)
    bw = read_bandwidth(nbytes)
    bandwidth = max(bw.values())
    print("roofline   read bandwidth: " + "  ".join(f"{k}={v / 1e9:.1f} GB/s" for k, v in bw.items())
          + f"  ({nbytes >> 20} MiB buffer, last-level cache {llc >> 20} MiB, best of 5, "
          f"{torch.get_num_threads()} threads)", flush=True)
    out_len, rounds = (128, 5) if scale >= 1 else (32, 1)
    on_off = {"graphs": {"cpu_graph": "on"}, "eager": {"cpu_graph": "off"}}
    for dtype in ("float32", "bfloat16"):
        probe = Engine(model_path=path, dtype=dtype, max_total_tokens=4096, cpu_graph="off")
        params = probe.model_runner.model.num_parameters()
        kind = probe.model_runner.linear_kind
        del probe
        weight_bytes = params * (4 if dtype == "float32" else 2)
        floor_ms = 1e3 * weight_bytes / bandwidth
        # A buffer of the weights' size, read again and again, partly stays in the last-level cache
        # (so does the model): the bound a decode step at batch 1 can actually approach here.
        warm = max(read_bandwidth(weight_bytes).values())
        print(f"roofline   {dtype}: {params / 1e6:.1f}M params, {weight_bytes / 1e6:.1f} MB of weights, "
              f"{kind} linears: decode floor at batch 1 = {floor_ms:.2f} ms/step = {1e3 / floor_ms:,.0f} tok/s "
              f"(a buffer of the weights' size, re-read: {warm / 1e9:.1f} GB/s = {1e3 * weight_bytes / warm:.2f} ms/step)",
              flush=True)
        for bs in (1, 8, 32):
            r = decode_rates(path, bs, out_len, rounds, {k: dict(v, dtype=dtype) for k, v in on_off.items()})
            on, off = r["graphs"], r["eager"]
            extra = f"{floor_ms / on['step_ms']:.0%} of the bandwidth limit, " if bs == 1 else ""
            line("roofline", f"{dtype} bs={bs} graphs", on["decode"], "eager", off["decode"], "decode tok/s",
                 f"({on['step_ms']:.2f} vs {off['step_ms']:.2f} ms/step; {extra}compile {on['compile_s']:.1f} s for {on['compiled']} sizes; "
                 f"prefill {on['prefill']:,.0f} / {off['prefill']:,.0f} tok/s)")
    kinds = {}
    for kind in ("native", "onednn"):
        try:
            Engine(model_path=path, linear_backend=kind, max_total_tokens=4096, cpu_graph="off")
            kinds[kind] = {"linear_backend": kind, "cpu_graph": "off"}
        except Exception as e:  # noqa: BLE001 - a backend this machine lacks
            print(f"roofline   prefill with {kind} linears: unavailable ({e})", flush=True)
    if len(kinds) == 2:
        r = decode_rates(path, 32, 2, rounds, kinds)
        line("roofline", "prefill native", r["native"]["prefill"], "onednn", r["onednn"]["prefill"], "prompt tok/s",
             "(fp32, 32 x 128 tokens, one EXTEND batch; floor 1.0x)")
    tiny = cached_random_checkpoint("roofline-overhead-v1", llama_config(**OVERHEAD_ARCH), std=0.02)
    for bs in (1, 32):
        r = decode_rates(tiny, bs, out_len, rounds, on_off)
        on, off = r["graphs"], r["eager"]
        print(f"roofline   launch overhead per decode step, bs={bs} ({OVERHEAD_ARCH['num_hidden_layers']} layers "
              f"at hidden size 16: dispatch, no math): forward+sample eager {off['forward_ms']:.3f} ms, graphs "
              f"{on['forward_ms']:.3f} ms (saved {off['forward_ms'] - on['forward_ms']:.3f} ms); whole step eager "
              f"{off['step_ms']:.3f} ms, graphs {on['step_ms']:.3f} ms", flush=True)


CASES = {"mixed": case_mixed, "prefill": case_prefill, "prefix": case_prefix, "overhead": case_overhead, "roofline": case_roofline,
         "overlap": case_overlap, "linear": case_linear, "spec": case_spec, "structured": case_structured,
         "roofline_bs1": case_roofline_bs1, "quant": case_quant, "split": case_split,
         "dllm": case_dllm, "tp": case_tp, "hicache": case_hicache, "lora": case_lora,
         "quant_moe": lambda path, scale: case_quant_moe(bench_moe_model_path(), scale)}


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(prog="python -m engine.bench", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--cases", default="mixed,prefill,prefix,overhead,roofline,overlap,linear", help=f"comma list of {list(CASES)}")
    ap.add_argument("--quick", action="store_true", help="tiny workloads: a smoke run, not a measurement")
    ap.add_argument("--threads", type=int, default=None, help="torch threads (default: all cores)")
    ap.add_argument("--llama-cpp", default=None, help="quant case: a llama.cpp build folder (llama-bench, "
                    "llama-batched-bench) to run on the same GGUF file")
    args = ap.parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    path = bench_model_path()
    print(f"# engine bench: torch {torch.__version__}, {torch.get_num_threads()} threads, model {path}", flush=True)
    for name in args.cases.split(","):
        scale = 0.125 if args.quick else 1.0
        if name == "quant":
            case_quant(path, scale, args.llama_cpp)
        else:
            CASES[name](path, scale)


if __name__ == "__main__":
    main()
