"""Tokenizer: BOS handling, and incremental detokenization that is exact across UTF-8 splits."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from engine.tokenizer import IncrementalDetokenizer, Tokenizer


@pytest.fixture(scope="module", params=["stories", "llama"])
def tok(request, model_dirs):
    return Tokenizer(model_dirs[request.param])


TEXTS = ["Once upon a time 😀 there was a 猫 named Zoë.", "naïve café — ünïcödé ✓✓", "plain ascii", "🙂🙃"]


@pytest.mark.parametrize("text", TEXTS)
def test_stream_of_deltas_concatenates_to_full_decode(tok, text):
    ids = tok.encode(text, add_special_tokens=False)
    detok = IncrementalDetokenizer(tok)
    deltas = [detok.step([t], finished=(i == len(ids) - 1)) for i, t in enumerate(ids)]
    assert "".join(deltas) == tok.decode(ids)
    assert all("\ufffd" not in d for d in deltas)


@settings(max_examples=200, deadline=None)
@given(st.data())
def test_random_token_streams(model_dirs, data):
    for name in ("stories", "llama"):
        tok = Tokenizer(model_dirs[name]) if name not in _TOKS else _TOKS[name]
        _TOKS[name] = tok
        ids = data.draw(st.lists(st.integers(0, tok.vocab_size - 1), max_size=30))
        chunks = data.draw(st.lists(st.integers(1, 4), min_size=len(ids), max_size=len(ids)))
        stop = data.draw(st.sampled_from([(), ("e",), ("ab", "xyz")]))
        detok = IncrementalDetokenizer(tok, stop=stop)
        out, i = [], 0
        while i < len(ids):
            n = chunks[i]
            out.append(detok.step(ids[i:i + n], finished=i + n >= len(ids)))
            i += n
        if not ids:
            out.append(detok.step([], finished=True))
        assert "".join(out) == detok.final_text()
        assert not any(s in detok.final_text() for s in stop)


_TOKS: dict = {}


def test_bos_added_like_transformers(model_dirs):
    from transformers import AutoTokenizer

    for name in ("stories", "llama"):
        ours = Tokenizer(model_dirs[name])
        theirs = AutoTokenizer.from_pretrained(model_dirs[name])
        for text in TEXTS:
            assert ours.encode(text) == theirs(text).input_ids
            assert ours.encode(text)[0] == 1


@pytest.mark.parametrize("stop", [(), ("zz", "qqq")])
def test_detokenization_cost_is_linear_in_the_output(tok, stop):
    """Each step decodes a window, not the whole output: a stream costs O(n), not O(n^2)."""
    ids = tok.encode(" ".join(TEXTS * 40), add_special_tokens=False)
    decoded = []
    detok = IncrementalDetokenizer(tok, stop=stop)
    real = tok.decode
    tok.decode = lambda x, skip_special_tokens=True: decoded.append(len(x)) or real(x, skip_special_tokens)
    try:
        out = [detok.step([t], finished=(i == len(ids) - 1)) for i, t in enumerate(ids)]
    finally:
        del tok.decode
    assert "".join(out) == real(ids)
    streaming = sum(decoded) - len(ids)  # the last step decodes everything once
    assert streaming < 40 * len(ids), (streaming, len(ids))
