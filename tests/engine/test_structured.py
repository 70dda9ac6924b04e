"""Structured outputs in the engine: JSON schema, regex and EBNF constraints on a random-weight
model (the hard case: only the mask keeps its output valid), in every batching mode."""

from __future__ import annotations

import json
import re

import jsonschema
import msgspec
import pytest
import torch

from engine import Engine, EngineConfig, InvalidRequestError, SamplingParams
from engine.errors import ConfigError
from engine.grammar import (
    GRAMMAR_BACKENDS,
    LLGuidanceBackend,
    bitmask_allows,
    create_grammar_backend,
    register_backend,
)
from openai_api.params import NamedToolChoice, OpenAITools, Tool
from tests.helpers import prompts, run_staggered

SCHEMA = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 8},
        "age": {"type": "integer", "minimum": 0, "maximum": 150},
        "role": {"enum": ["admin", "user", "guest"]},
        "tags": {"type": "array", "items": {"type": "string", "maxLength": 4}, "maxItems": 3},
        "address": {
            "type": "object",
            "properties": {"city": {"type": "string", "maxLength": 6},
                           "zip": {"type": "string", "pattern": "^[0-9]{5}$"}},
            "required": ["city", "zip"],
            "additionalProperties": False,
        },
        "active": {"type": "boolean"},
    },
    "required": ["name", "age", "role", "tags", "address"],
    "additionalProperties": False,
}
REGEX = r"[0-9]{3}-[a-z]{2,5}( (yes|no))?"
EBNF = r'''root ::= "(" pair ("," pair)? ")"
pair ::= key "=" digits
key ::= "x" | "y" | "zed"
digits ::= [0-9] [0-9]?'''
EBNF_AS_REGEX = r"\((x|y|zed)=[0-9][0-9]?(,(x|y|zed)=[0-9][0-9]?)?\)"

MAX_NEW = 400  # room for the longest conforming JSON


def constrained_params(seed: int = 0) -> list[SamplingParams]:
    """Greedy and sampled requests of each kind, plus one unconstrained."""
    schema = json.dumps(SCHEMA)
    out = []
    for temp, s in ((0.0, None), (1.0, seed), (0.8, seed + 1)):
        out += [SamplingParams(max_new_tokens=MAX_NEW, temperature=temp, seed=s, json_schema=schema),
                SamplingParams(max_new_tokens=60, temperature=temp, seed=s, regex=REGEX),
                SamplingParams(max_new_tokens=60, temperature=temp, seed=s, ebnf=EBNF)]
    out.append(SamplingParams(max_new_tokens=20, temperature=0.0, ignore_eos=True))
    return out


def check_conforms(eng: Engine, params: SamplingParams, out) -> None:
    """A finished output matches its constraint; one cut by max_tokens is a prefix of a match."""
    constraint = params.constraint
    if constraint is None:
        return
    kind, spec = constraint
    if out.finish_reason == "length":
        assert len(out.token_ids) == params.max_new_tokens
        m = eng.inputs.grammar_matcher(params)
        assert m.accept_prefix(out.token_ids) == len(out.token_ids), out.text
        return
    assert out.finish_reason == "stop", (out.finish_reason, out.error)
    if kind == "json_schema":
        jsonschema.validate(json.loads(out.text), json.loads(spec))
    elif kind == "regex":
        assert re.fullmatch(spec, out.text), out.text
    else:
        assert re.fullmatch(EBNF_AS_REGEX, out.text), out.text


def run_all(eng: Engine, ids: list[list[int]], params: list[SamplingParams]) -> list:
    outs = eng.generate(input_ids=ids, sampling_params=params)
    for p, o in zip(params, outs):
        check_conforms(eng, p, o)
    eng.check_memory()
    return outs


@pytest.fixture(scope="module")
def reference(model_dirs):
    """The plain engine's outputs: every batching mode must give the same greedy tokens."""
    eng = Engine(model_path=model_dirs["llama"])
    params = constrained_params()
    ids = prompts(eng, len(params), seed=31, lo=5, hi=30)
    outs = run_all(eng, ids, params)
    return eng, ids, params, outs


def test_every_output_conforms(reference):
    eng, _, params, outs = reference
    finished = [o for p, o in zip(params, outs) if p.constraint and o.finish_reason == "stop"]
    assert len(finished) >= 7, [(o.finish_reason, o.text) for o in outs]  # most end by their grammar
    assert eng.inputs.grammar_backend.compiles == 3  # one compile per distinct constraint
    # json: the longest output still leaves room: the bound on whitespace holds.
    assert all(len(o.token_ids) < MAX_NEW for p, o in zip(params, outs) if p.json_schema)


MODES = {
    "no_radix": {"disable_radix_cache": True},
    "chunked": {"chunked_prefill_size": 8},
    # Optimistic admission into a pool the outputs outgrow (with each request twice, below).
    "retraction": {"max_total_tokens": 700, "init_new_token_ratio": 0.05, "min_new_token_ratio": 0.05},
    "overlap": {"enable_overlap": True},
    "speculative": {"speculative_algorithm": "ngram", "speculative_num_draft_tokens": 4},
}


@pytest.mark.parametrize("mode", sorted(MODES))
def test_batching_modes_give_the_same_constrained_outputs(model_dirs, reference, mode):
    _, ids, params, ref = reference
    if mode == "retraction":
        ids, params, ref = ids * 2, params * 2, ref * 2
    eng = Engine(model_path=model_dirs["llama"], **MODES[mode])
    outs = run_all(eng, ids, params)
    for p, o, r in zip(params, outs, ref):
        # Greedy only: a prefill chunk or a rejection step draws random numbers of its own.
        if p.is_greedy:
            assert (o.token_ids, o.finish_reason) == (r.token_ids, r.finish_reason), (mode, p.constraint)
    stats = eng.stats()
    if mode == "retraction":
        assert stats.num_retracted > 0
    if mode == "speculative":
        assert stats.spec_draft_tokens > 0


def test_mixed_chunks_with_staggered_arrivals(model_dirs, reference):
    _, ids, params, ref = reference
    eng = Engine(model_path=model_dirs["llama"], enable_mixed_chunk=True, chunked_prefill_size=8)
    for i, (p, r) in enumerate(zip(params, ref)):
        if p.is_greedy:
            out = run_staggered(eng, [ids[i]] * 3, p, every=2)
            assert all(o.token_ids == r.token_ids for o in out)
    assert eng.stats().batches_by_mode["MIXED"] > 0
    eng.check_memory()


def test_overlap_keeps_unconstrained_requests_overlapped(model_dirs):
    """A constrained request makes the steps it is in run plainly; alone, the others overlap."""
    eng = Engine(model_path=model_dirs["llama"], enable_overlap=True)
    plain = SamplingParams(max_new_tokens=40, temperature=0.0, ignore_eos=True)
    eng.generate(input_ids=prompts(eng, 2, seed=3), sampling_params=plain)
    overlapped = eng.stats().overlapped_steps
    assert overlapped > 0
    ids = prompts(eng, 2, seed=4)
    outs = eng.generate(input_ids=ids, sampling_params=[plain, SamplingParams(max_new_tokens=40, temperature=0.0,
                                                                               regex="[a-z]{30}")])
    assert re.fullmatch("[a-z]{30}", outs[1].text) and outs[1].finish_reason == "stop"
    eng.check_memory()


def test_eos_only_where_the_grammar_may_end(model_dirs):
    eng = Engine(model_path=model_dirs["llama"])
    eos = 2
    ids = prompts(eng, 1, seed=5)[0]
    # EOS favoured: it still cannot come before the grammar allows an end.
    eager = eng.generate(input_ids=ids, sampling_params=SamplingParams(
        max_new_tokens=20, temperature=0.0, regex="[a-z]{2,5}", logit_bias={eos: 100}))
    assert re.fullmatch("[a-z]{2}", eager.text) and eager.token_ids[-1] == eos and eager.finish_reason == "stop"
    # EOS banned: the request ends when its grammar is complete, with no EOS.
    never = eng.generate(input_ids=ids, sampling_params=SamplingParams(
        max_new_tokens=20, temperature=0.0, regex="[a-z]{2,5}", logit_bias={eos: -100}))
    assert re.fullmatch("[a-z]{5}", never.text) and eos not in never.token_ids and never.finish_reason == "stop"


def test_max_tokens_returns_the_truncated_prefix(model_dirs):
    eng = Engine(model_path=model_dirs["llama"])
    params = SamplingParams(max_new_tokens=6, temperature=0.0, json_schema=json.dumps(SCHEMA))
    out = eng.generate(input_ids=prompts(eng, 1, seed=6)[0], sampling_params=params)
    assert out.finish_reason == "length" and len(out.token_ids) == 6 and out.text.startswith("{")
    check_conforms(eng, params, out)


def test_json_object(model_dirs):
    eng = Engine(model_path=model_dirs["llama"])
    params = [SamplingParams(max_new_tokens=120, temperature=1.0, seed=s, json_schema='{"type": "object"}')
              for s in range(6)]
    outs = eng.generate(input_ids=prompts(eng, 6, seed=7), sampling_params=params)
    for o in outs:
        if o.finish_reason == "stop":
            assert isinstance(json.loads(o.text), dict)
        else:
            assert o.finish_reason == "length" and o.text.lstrip().startswith("{")
    for p, o in zip(params, outs):
        check_conforms(eng, p, o)


def test_trained_model_and_byte_fallback_tokenizer(model_dirs):
    """stories260K: a sentencepiece-style vocabulary with byte-fallback pieces."""
    eng = Engine(model_path=model_dirs["stories"])
    params = constrained_params(seed=3)
    run_all(eng, [eng.tokenize(prompt=t) for t in ["Once upon a time"] * len(params)], params)


def test_bad_constraints_are_rejected_before_queueing(model_dirs):
    eng = Engine(model_path=model_dirs["llama"])
    bad = [({"json_schema": '{"type": "nope"}'}, "response_format"), ({"json_schema": "{not json"}, "response_format"),
           ({"json_schema": "[1, 2]"}, "response_format"), ({"regex": "(ab"}, "regex"), ({"ebnf": "root ::= nowhere"}, "ebnf"),
           ({"ebnf": 'root ::= "a'}, "ebnf"), ({"regex": "a", "ebnf": 'root ::= "a"'}, "ebnf"), ({"regex": ""}, "regex")]
    for fields, param in bad:
        with pytest.raises(InvalidRequestError) as e:
            eng.generate(input_ids=[1, 5, 6], sampling_params={"max_new_tokens": 4, **fields})
        assert e.value.param == param, (fields, e.value)
    assert not eng.has_pending()


def test_bitmask_apply_matches_a_plain_unpack():
    backend = create_grammar_backend("llguidance", _byte_tokenizer_json(), 300, [2])
    g = torch.Generator().manual_seed(0)
    bitmask = torch.randint(-2**31, 2**31 - 1, (5, backend.bitmask_width), dtype=torch.int32, generator=g)
    logits = torch.randn(5, 300, generator=g)
    out = backend.apply_bitmask(logits, bitmask)
    for row in range(5):
        for t in range(300):
            want = logits[row, t] if bitmask_allows(bitmask, row, t) else float("-inf")
            assert out[row, t] == want


@pytest.mark.gpu
def test_bitmask_apply_on_cuda_matches_cpu():
    backend = create_grammar_backend("llguidance", _byte_tokenizer_json(), 300, [2])
    m = backend.matcher(backend.compile("regex", "[a-c]+"))
    rows = [m, None, m]
    logits = torch.randn(3, 300)
    cpu = backend.apply_bitmask(logits, backend.batch_bitmask(rows, torch.device("cpu")))
    dev = torch.device("cuda")
    gpu = backend.apply_bitmask(logits.to(dev), backend.batch_bitmask(rows, dev))
    assert torch.equal(gpu.cpu(), cpu)
    assert torch.isfinite(cpu[1]).all() and torch.isfinite(cpu[0]).sum() == 3


# A tool call as tool_choice "required" constrains it, with arguments the random model cannot make
# long (an enum and a bounded integer): only whitespace could keep it from finishing.
WEATHER = {"type": "object", "properties": {"unit": {"enum": ["celsius", "fahrenheit"]},
                                            "days": {"type": "integer", "minimum": 1, "maximum": 7}},
           "required": ["unit", "days"], "additionalProperties": False}


class _ToolRequest(msgspec.Struct, OpenAITools, kw_only=True):
    tools: list[Tool] | None = None
    tool_choice: str | NamedToolChoice | None = None
    parallel_tool_calls: bool = True


def tool_call_params(max_new_tokens: int) -> list[SamplingParams]:
    """tool_choice "required" through the server's own constraint, greedy and sampled."""
    req = msgspec.convert({"tools": [{"type": "function", "function": {"name": "get_weather", "parameters": WEATHER}}],
                           "tool_choice": "required", "parallel_tool_calls": False}, _ToolRequest)
    out = [req.constrain_tools(SamplingParams(max_new_tokens=max_new_tokens, temperature=t, seed=s))
           for t, s in ((0.0, None), (1.0, 1), (1.0, 2), (0.7, 3), (1.0, 4), (1.0, 5))]
    assert all(p.constraint[0] == "json_schema" for p in out)  # the kind response_format compiles through
    return out


def whitespace_runs(text: str) -> list[tuple[str, str]]:
    """(the character before, the run) for each run of whitespace outside JSON strings."""
    runs, in_string, escaped, i = [], False, False, 0
    while i < len(text):
        c = text[i]
        if in_string:
            escaped, in_string = (not escaped and c == "\\"), in_string and (escaped or c != '"')
        elif c == '"':
            in_string = True
        elif c in " \t\r\n":
            j = i
            while j < len(text) and text[j] in " \t\r\n":
                j += 1
            runs.append((text[i - 1:i], text[i:j]))
            i = j
            continue
        i += 1
    return runs


def test_compact_json_by_default():
    """The built-in random model favours whitespace; compact JSON leaves it none to spend, so a
    tool call fits a small max_tokens, and response_format json_object has no runs either."""
    eng = Engine()
    ids = [1, *b"What is the weather in Paris?"]
    tools = tool_call_params(max_new_tokens=90)  # the call itself takes 70-73 tokens here
    objects = [SamplingParams(max_new_tokens=60, temperature=t, seed=s, json_schema='{"type": "object"}')
               for t, s in ((0.0, None), (1.0, 1), (1.0, 2), (0.7, 3))]
    outs = eng.generate(input_ids=[ids] * (len(tools) + len(objects)), sampling_params=tools + objects)
    for p, o in zip(tools, outs):
        assert o.finish_reason == "stop", o.text
        calls = json.loads(o.text)
        jsonschema.validate(calls, json.loads(p.json_schema))
        assert o.text == json.dumps(calls)  # one space after ',' and ':', none elsewhere
    for p, o in zip(objects, outs[len(tools):]):
        check_conforms(eng, p, o)
        assert all(before in ",:" and run == " " for before, run in whitespace_runs(o.text)), o.text
    eng.check_memory()


def test_whitespace_pattern_allows_more():
    """constrained_json_whitespace_pattern: the same requests may now hold whitespace runs (the
    model takes them), still conforming."""
    pattern = "[ \t\r\n]{0,6}"
    eng = Engine(constrained_json_whitespace_pattern=pattern)
    params = tool_call_params(max_new_tokens=400)
    outs = eng.generate(input_ids=[[1, *b"What is the weather in Paris?"]] * len(params), sampling_params=params)
    for p, o in zip(params, outs):
        check_conforms(eng, p, o)
    runs = [run for o in outs for _, run in whitespace_runs(o.text)]
    assert any(len(run) > 1 for run in runs) and all(re.fullmatch(pattern, run) for run in runs), runs
    assert any(o.finish_reason == "stop" for o in outs)
    eng.check_memory()


def test_grammar_backend_config():
    assert EngineConfig().grammar_backend == "llguidance"
    with pytest.raises(ConfigError, match="unknown grammar_backend 'nope'.*llguidance"):
        EngineConfig(grammar_backend="nope")
    with pytest.raises(ConfigError, match="constrained_json_whitespace_pattern"):
        EngineConfig(constrained_json_whitespace_pattern="[ \t")
    try:
        import xgrammar  # noqa: F401
    except ImportError:
        with pytest.raises(ConfigError, match="grammar_backend 'xgrammar' needs the 'xgrammar' package"):
            EngineConfig(grammar_backend="xgrammar")
    else:
        EngineConfig(grammar_backend="xgrammar")
        with pytest.raises(ConfigError, match="'xgrammar' takes no constrained_json_whitespace_pattern"):
            EngineConfig(grammar_backend="xgrammar", constrained_json_whitespace_pattern=" ?")


def test_grammar_backend_is_chosen_by_config():
    """A registered backend is what the engine compiles with when the config names it."""

    class Counting(LLGuidanceBackend):
        package = ""

    register_backend("counting")(Counting)
    try:
        with pytest.raises(ValueError, match="already registered"):
            register_backend("counting")(type("Other", (LLGuidanceBackend,), {}))
        eng = Engine(grammar_backend="counting")
        out = eng.generate(input_ids=[1, 5, 6], sampling_params=SamplingParams(max_new_tokens=8, regex="[a-c]{4}"))
        assert re.fullmatch("[a-c]{4}", out.text)
        assert type(eng.inputs.grammar_backend) is Counting and eng.inputs.grammar_backend.compiles == 1
    finally:
        GRAMMAR_BACKENDS.pop("counting")
    assert type(Engine().inputs.grammar_backend) is LLGuidanceBackend


def _byte_tokenizer_json() -> str:
    from engine.builtin_model import byte_level_tokenizer

    return byte_level_tokenizer().to_str()
