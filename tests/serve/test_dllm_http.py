"""A block-diffusion model (`builtin-dllm`) over the OpenAI API as any model: completions and
chats, streamed (each block's tokens arrive when it commits) or not, equal to the engine's greedy
output; what block denoising cannot do is a 400 naming the parameter, before anything is queued."""

from __future__ import annotations

import openai
import pytest

from engine import Engine, SamplingParams
from tests.serve.helpers import wait_for_engines

pytestmark = pytest.mark.serve

MODEL = "builtin-dllm"
PROMPT = "Once upon a time"
N = 10  # not a multiple of the block size: the last block is denoised whole, then cut


@pytest.fixture(scope="module")
def client(serve_base) -> openai.OpenAI:
    from ray import serve

    from deploy.app import build_app

    serve.run(build_app({"model_path": MODEL, "num_engines": 1}), name="dllm", route_prefix="/dllm")
    base = f"{serve_base}/dllm"
    try:
        wait_for_engines(base, 1)
        yield openai.OpenAI(base_url=base + "/v1", api_key="none", max_retries=0)
    finally:
        serve.delete("dllm", _blocking=False)


@pytest.fixture(scope="module")
def greedy() -> str:
    eng = Engine(model_path=MODEL)
    out = eng.generate(prompt=PROMPT, sampling_params=SamplingParams(max_new_tokens=N, temperature=0.0,
                                                                     ignore_eos=True))
    eng.shutdown()
    return out.text


def test_completions_streamed_or_not_equal_the_engine(client, greedy):
    body = dict(model=MODEL, prompt=PROMPT, max_tokens=N, temperature=0, extra_body={"ignore_eos": True})
    whole = client.completions.create(**body)
    assert whole.choices[0].text == greedy and whole.choices[0].finish_reason == "length"
    assert whole.usage.completion_tokens == N
    chunks = list(client.completions.create(**body, stream=True))
    assert "".join(c.choices[0].text for c in chunks if c.choices) == greedy
    chat = client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": PROMPT}],
                                          max_tokens=N, temperature=0)
    assert chat.choices[0].message.role == "assistant" and chat.usage.completion_tokens <= N


@pytest.mark.parametrize("param, extra", [
    ("logprobs", {"logprobs": 2}),
    ("frequency_penalty", {"frequency_penalty": 0.5}),
    ("logit_bias", {"logit_bias": {"5": 3}}),
])
def test_what_block_denoising_cannot_do_is_a_400_naming_it(client, param, extra):
    with pytest.raises(openai.BadRequestError) as e:
        client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=N, **extra)
    assert e.value.body["param"] == param, e.value.body
    assert "block-diffusion" in e.value.body["message"]
