"""The HF `tokenizers` tokenizer, and its tokenizer_config.json, that a GGUF file's metadata describes.

A GGUF file ships no tokenizer.json: llama.cpp stores the vocabulary, merges, token types and
special-token ids as metadata. This rebuilds the tokenizer as transformers does for
`AutoTokenizer.from_pretrained(folder, gguf_file=name)` (its GGUF tokenizer converters and the
tokenizer classes they hand the vocabulary to), step for step, so the ids are the same: the same
model, pre-tokenizer, decoder and post-processor, and the same added tokens added in the same
order (the order fixes the ids of special tokens the vocabulary lacks).

Supported: `tokenizer.ggml.model` "gpt2" (byte-level BPE: SmolLM2, Qwen2/3, Llama 3) and "llama"
(SentencePiece BPE with byte fallback: Llama 2, Mistral, TinyLlama; Phi-3's variant too).
"""

from __future__ import annotations

from collections.abc import Collection, Iterable

from tokenizers import (
    AddedToken,
    Regex,
    Tokenizer,
    decoders,
    normalizers,
    pre_tokenizers,
    processors,
)
from tokenizers.models import BPE

from engine.errors import ConfigError

# llama.cpp's token types (gguf.TokenType)
TOKEN_TYPE_CONTROL = 3
TOKEN_TYPE_USER_DEFINED = 4

SPIECE_UNDERLINE = "\u2581"

# Pre-tokenizer split regexes by `tokenizer.ggml.pre`, as transformers maps them; a name not listed
# keeps the tokenizer class's own pre-tokenizer (GPT-2's ByteLevel regex for "smollm", "gpt2", ...).
_LLAMA3_SPLIT = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}"
    r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
_QWEN2_SPLIT = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}"
    r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
_QWEN35_SPLIT = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?[\p{L}\p{M}]+|\p{N}"
    r"| ?[^\s\p{L}\p{M}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
_TEKKEN_SPLIT = (
    r"[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]*[\p{Ll}\p{Lm}\p{Lo}\p{M}]+"
    r"|[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]+[\p{Ll}\p{Lm}\p{Lo}\p{M}]*"
    r"|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n/]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
_GPT4O_SPLIT = (
    r"[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]*[\p{Ll}\p{Lm}\p{Lo}\p{M}]+(?i:'s|'t|'re|'ve|'m|'ll|'d)?"
    r"|[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]+[\p{Ll}\p{Lm}\p{Lo}\p{M}]*(?i:'s|'t|'re|'ve|'m|'ll|'d)?"
    r"|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n/]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
GGUF_PRE_TOKENIZER_SPLITS = {
    **dict.fromkeys(("llama3", "llama-v3", "llama-bpe", "falcon3", "falcon-h1", "pixtral", "midm-2.0",
                     "lfm2", "jina-v5-nano", "dbrx", "smaug-bpe"), _LLAMA3_SPLIT),
    "tekken": _TEKKEN_SPLIT,
    **dict.fromkeys(("qwen2", "deepseek-r1-qwen", "kormo", "f2llmv2", "megrez"), _QWEN2_SPLIT),
    "qwen35": _QWEN35_SPLIT,
    **dict.fromkeys(("gpt-4o", "llama4", "kanana2", "talkie", "minimax-m2"), _GPT4O_SPLIT),
}

# tokenizer_config.json's special-token names and the GGUF keys holding their ids, in the order
# transformers adds them (bos, eos, unk, pad).
_SPECIAL_TOKEN_KEYS = (
    ("bos_token", "tokenizer.ggml.bos_token_id"),
    ("eos_token", "tokenizer.ggml.eos_token_id"),
    ("unk_token", "tokenizer.ggml.unknown_token_id"),
    ("pad_token", "tokenizer.ggml.padding_token_id"),
)
# Architectures whose transformers tokenizer class (Qwen2Tokenizer) re-adds its named special
# tokens as special ones at the end, which turns a user-defined one special.
_READD_SPECIALS_ARCHS = frozenset({"qwen2", "qwen3", "qwen2moe", "qwen3moe"})
# SentencePiece vocabularies that transformers builds differently (Gemma's respelled tokens and
# merge order); not rebuilt here.
_UNSUPPORTED_SPM_ARCHS = frozenset({"gemma", "gemma2", "gemma3"})


def tokenizer_from_gguf(metadata: dict) -> tuple[Tokenizer, dict]:
    """The tokenizer and the tokenizer_config.json dict that `metadata` (GGUF key -> value)
    describes, matching transformers' `AutoTokenizer.from_pretrained(..., gguf_file=...)`."""
    tokens = metadata.get("tokenizer.ggml.tokens")
    if not tokens:
        raise ConfigError("GGUF metadata has no tokenizer.ggml.tokens")
    model_type = metadata.get("tokenizer.ggml.model")
    arch = metadata.get("general.architecture", "")
    if model_type == "gpt2":
        tok = _byte_level_bpe(metadata)
    elif model_type == "llama" and arch not in _UNSUPPORTED_SPM_ARCHS:
        tok = _sentencepiece_bpe(metadata)
        if arch == "phi3":
            # Phi-3 writes its prefix space with a normalizer, not with Metaspace.
            tok.normalizer = normalizers.Sequence(
                [normalizers.Prepend(prepend=SPIECE_UNDERLINE), normalizers.Replace(pattern=" ", content=SPIECE_UNDERLINE)]
            )
            tok.pre_tokenizer = None
    else:
        raise ConfigError(f"GGUF tokenizer {model_type!r} (architecture {arch!r}) is not supported; "
                          "supported: 'gpt2' (byte-level BPE) and 'llama' (SentencePiece BPE)")
    _add_gguf_special_tokens(tok, metadata)
    split = GGUF_PRE_TOKENIZER_SPLITS.get(metadata.get("tokenizer.ggml.pre"))
    if split is not None:
        tok.pre_tokenizer = pre_tokenizers.Sequence([
            pre_tokenizers.Split(Regex(split), behavior="isolated"),
            pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
        ])

    config = _tokenizer_config(metadata)
    named = [config.get(name) for name, _ in _SPECIAL_TOKEN_KEYS]
    _add_named_special_tokens(tok, named)
    if arch in _READD_SPECIALS_ARCHS:
        tok.add_tokens([AddedToken(t, special=True) for t in named if t is not None])
    add_bos, add_eos = _bos_eos_flags(metadata)
    if add_bos is not None or add_eos is not None:
        # The flags are stated: BOS/EOS come from the post-processor, as transformers sets it up.
        tok.post_processor = _template_processing(
            tok, config.get("bos_token") if add_bos else None, config.get("eos_token") if add_eos else None)
    # Only a True flag goes to the config: the post-processor above already does what the flags
    # say, and engine.tokenizer.Tokenizer reads add_bos_token=False as "drop a leading BOS", which
    # would also drop a BOS the text spells (a raw ChatML prompt when BOS is <|im_start|>).
    if add_bos:
        config["add_bos_token"] = True
    if add_eos:
        config["add_eos_token"] = True
    return tok, config


def _tokenizer_config(metadata: dict) -> dict:
    tokens = metadata["tokenizer.ggml.tokens"]
    config: dict = {"tokenizer_class": "PreTrainedTokenizerFast", "clean_up_tokenization_spaces": False}
    for name, key in _SPECIAL_TOKEN_KEYS:
        token_id = metadata.get(key)
        if token_id is None:
            continue
        if not 0 <= token_id < len(tokens):
            raise ConfigError(f"GGUF {key}={token_id} is outside the vocabulary ({len(tokens)} tokens)")
        config[name] = tokens[token_id]
    if metadata.get("tokenizer.chat_template") is not None:
        config["chat_template"] = metadata["tokenizer.chat_template"]
    context_length = metadata.get(f"{metadata.get('general.architecture', '')}.context_length")
    if context_length is not None:
        config["model_max_length"] = int(context_length)
    return config


def _bos_eos_flags(metadata: dict) -> tuple[bool | None, bool | None]:
    """`tokenizer.ggml.add_bos_token` / `add_eos_token`, None where the file does not say."""
    add_bos = metadata.get("tokenizer.ggml.add_bos_token")
    if add_bos is None and metadata.get("tokenizer.ggml.model") == "llama":
        add_bos = True  # llama.cpp adds BOS to a SentencePiece vocabulary that does not say otherwise
    add_eos = metadata.get("tokenizer.ggml.add_eos_token")
    return (None if add_bos is None else bool(add_bos)), (None if add_eos is None else bool(add_eos))


def _byte_level_bpe(metadata: dict) -> Tokenizer:
    """transformers' GPT2Tokenizer over the file's vocabulary, respelled in the byte alphabet."""
    spelling = bytes_to_unicode()
    alphabet = set(spelling.values())
    vocab = {
        t if set(t) <= alphabet else "".join(spelling[b] for b in t.encode("utf-8")): i
        for i, t in enumerate(metadata["tokenizer.ggml.tokens"])
    }
    tok = Tokenizer(BPE(vocab=vocab, merges=_merges(metadata), dropout=None, continuing_subword_prefix="",
                        end_of_word_suffix="", fuse_unk=False))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    _add_named_special_tokens(tok, ["<|endoftext|>"])  # GPT2Tokenizer's default bos/eos/unk
    tok.post_processor = _template_processing(tok, None, None)
    return tok


def _sentencepiece_bpe(metadata: dict) -> Tokenizer:
    """transformers' LlamaTokenizer: BPE with byte fallback, Metaspace prefix on the first piece."""
    vocab = {t: i for i, t in enumerate(metadata["tokenizer.ggml.tokens"])}
    tok = Tokenizer(BPE(vocab=vocab, merges=_merges(metadata), fuse_unk=True, byte_fallback=True, dropout=None))
    tok.pre_tokenizer = pre_tokenizers.Metaspace(replacement=SPIECE_UNDERLINE, prepend_scheme="first", split=False)
    tok.decoder = decoders.Sequence([
        decoders.Replace(SPIECE_UNDERLINE, " "), decoders.ByteFallback(), decoders.Fuse(),
        decoders.Strip(content=" ", left=1),
    ])
    _add_named_special_tokens(tok, ["<s>", "</s>", "<unk>"])  # LlamaTokenizer's default bos/eos/unk
    tok.post_processor = _template_processing(tok, None, None)
    return tok


def _merges(metadata: dict) -> list[tuple[str, ...]]:
    """The file's merges, or (SentencePiece files list none) the ones its scores imply."""
    merges = metadata.get("tokenizer.ggml.merges")
    if merges is not None:
        return [tuple(m.split(" ")) for m in merges]
    tokens = metadata["tokenizer.ggml.tokens"]
    scores = metadata.get("tokenizer.ggml.scores")
    if scores is None:
        raise ConfigError("GGUF tokenizer has neither tokenizer.ggml.merges nor tokenizer.ggml.scores")
    return generate_merges({t: i for i, t in enumerate(tokens)}, dict(zip(tokens, scores)))


def generate_merges(vocab: dict[str, int], vocab_scores: dict[str, float] | None = None,
                    skip_tokens: Collection[str] = ()) -> list[tuple[str, str]]:
    """Every split of a vocabulary token into two vocabulary tokens, best score first (transformers'
    `generate_merges`: ties go to the shorter left piece, then the shorter right one)."""
    skip = set(skip_tokens)
    reverse = vocab_scores is not None
    scores = dict(vocab_scores) if vocab_scores is not None else vocab
    merges = []
    for merge, score in scores.items():
        if merge in skip:
            continue
        local = []
        for index in range(1, len(merge)):
            left, right = merge[:index], merge[index:]
            if left in skip or right in skip:
                continue
            if left in vocab and right in vocab:
                local.append((left, right, score))
        local.sort(key=lambda x: (vocab[x[0]], vocab[x[1]]))
        merges.extend(local)
    merges.sort(key=lambda v: (v[2], len(v[0]), len(v[1])), reverse=reverse)
    return [(left, right) for left, right, _ in merges]


def _add_gguf_special_tokens(tok: Tokenizer, metadata: dict) -> None:
    """CONTROL tokens become special added tokens, USER_DEFINED ones plain added tokens, so the text
    of either encodes as the one token. In a byte-level vocabulary a control token spelled outside
    the byte alphabet is a llama.cpp mislabel and is left alone, as transformers does."""
    tokens = metadata["tokenizer.ggml.tokens"]
    token_types = metadata.get("tokenizer.ggml.token_type") or ()
    alphabet = set(bytes_to_unicode().values()) if metadata.get("tokenizer.ggml.model") == "gpt2" else None
    control = [
        AddedToken(t, normalized=False, special=True)
        for t, kind in zip(tokens, token_types)
        if kind == TOKEN_TYPE_CONTROL and (alphabet is None or set(t) <= alphabet)
    ]
    if control:
        tok.add_special_tokens(control)
    vocab = tok.get_vocab(with_added_tokens=True)
    user_defined = [
        AddedToken(t, normalized=False, special=False)
        for t, kind in zip(tokens, token_types)
        if kind == TOKEN_TYPE_USER_DEFINED and t in vocab
    ]
    if user_defined:
        tok.add_tokens(user_defined)


def _add_named_special_tokens(tok: Tokenizer, names: Iterable[str | None]) -> None:
    """A tokenizer class's bos/eos/unk/pad that are not added tokens yet become special ones (a
    name missing from the vocabulary gets a new id at the end)."""
    added = {t.content for t in tok.get_added_tokens_decoder().values()}
    new: list[str] = []
    for name in names:
        if name is not None and name not in added and name not in new:
            new.append(name)
    if new:
        tok.add_tokens([AddedToken(t, special=True) for t in new])


def _template_processing(tok: Tokenizer, bos: str | None, eos: str | None) -> processors.TemplateProcessing:
    """transformers' `update_post_processor`: BOS before and EOS after each sequence when set."""
    single = f"{bos + ':0 ' if bos else ''}$A:0{' ' + eos + ':0' if eos else ''}"
    pair = f"{single}{' ' + bos + ':1' if bos else ''} $B:1{' ' + eos + ':1' if eos else ''}"
    special_tokens = [(t, tok.token_to_id(t)) for t in (bos, eos) if t]
    return processors.TemplateProcessing(single=single, pair=pair, special_tokens=special_tokens)


def bytes_to_unicode() -> dict[int, str]:
    """GPT-2's byte -> printable character table, which byte-level BPE vocabularies are spelled in."""
    bs = list(range(ord("!"), ord("~") + 1)) + list(range(ord("¡"), ord("¬") + 1)) + list(range(ord("®"), ord("ÿ") + 1))
    cs = bs[:]
    n = 0
    for b in range(256):
        if b not in bs:
            bs.append(b)
            cs.append(256 + n)
            n += 1
    return dict(zip(bs, (chr(c) for c in cs)))
