"""What a block-diffusion model cannot do is refused where the request arrives, naming the
parameter (the OpenAI `param` of a 400): the batch job's rows and the front end's checks use the
model's block size as the engine does."""

from __future__ import annotations

import pytest

from cluster.batch.preprocess import Preprocess
from engine.errors import InvalidRequestError
from engine.sampling import SamplingParams


@pytest.mark.parametrize("param, params", [
    ("logprobs", SamplingParams(logprobs=True)),
    ("frequency_penalty", SamplingParams(frequency_penalty=0.5)),
    ("min_tokens", SamplingParams(min_tokens=2, max_new_tokens=8)),
    ("response_format", SamplingParams(json_schema='{"type": "object"}')),
])
def test_a_batch_row_for_a_block_diffusion_model_names_what_it_cannot_do(param: str, params: SamplingParams) -> None:
    inputs = Preprocess({"model_path": "builtin-dllm"}, [None], window=1, group_rows=1)._processor()
    assert inputs.dllm_block_size > 0
    with pytest.raises(InvalidRequestError) as e:
        inputs.validate_request(8, params)
    assert e.value.param == param
    inputs.validate_request(8, SamplingParams(max_new_tokens=8))  # what it can do passes


def test_an_autoregressive_model_takes_them() -> None:
    inputs = Preprocess({}, [None], window=1, group_rows=1)._processor()  # the built-in Llama
    assert inputs.dllm_block_size == 0
    inputs.validate_request(8, SamplingParams(logprobs=True, frequency_penalty=0.5))
