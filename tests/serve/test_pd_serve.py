"""Prefill/decode disaggregation behind the HTTP API: a prefill and a decode engine pool, each a
Serve deployment (the decode deployment holds the prefill one), found by the front ends through
the fleet registry; answers as one engine would, and /metrics shows the transfers per pool."""

from __future__ import annotations

import re

import httpx
import openai
import pytest
import ray

from deploy.app import build_app
from tests.serve.helpers import engines_of, wait_for_engines


@pytest.fixture(scope="module")
def pd_base(serve_base, model_dirs):
    from ray import serve

    path = model_dirs["llama"]
    serve.run(build_app({"model_path": path, "prefill_engines": 1, "decode_engines": 1, "served_model_name": "tiny"}),
              name="pd", route_prefix="/pd")
    base = serve_base + "/pd"
    try:
        wait_for_engines(base, 2)
        yield base, path
    finally:
        serve.delete("pd", _blocking=False)


def test_prefill_and_decode_pools_answer_as_one_engine(pd_base):
    from engine import Engine, SamplingParams

    base, path = pd_base
    prompts = ["Once upon a time", "The quick brown fox", "Once upon a time there"]
    ref = Engine(model_path=path).generate(prompt=prompts, sampling_params=SamplingParams(max_new_tokens=12,
                                                                                          temperature=0.0))
    client = openai.OpenAI(base_url=f"{base}/v1", api_key="none", timeout=60)
    for p, r in zip(prompts, ref):
        out = client.completions.create(model="tiny", prompt=p, max_tokens=12, temperature=0)
        assert out.choices[0].text == r.text
    stream = client.completions.create(model="tiny", prompt=prompts[0], max_tokens=12, temperature=0, stream=True)
    assert "".join(c.choices[0].text for c in stream if c.choices) == ref[0].text

    stats = ray.get([e.stats.remote() for e in engines_of(base)])
    by_role = {s.role: s.engine for s in stats}
    assert set(by_role) == {"prefill", "decode"}
    assert by_role["decode"].kv_transfers >= 4 and by_role["decode"].batches_by_mode["EXTEND"] == 0
    assert by_role["prefill"].batches_by_mode["DECODE"] == 0
    metrics = httpx.get(f"{base}/metrics", timeout=30).text
    decode_transfers = re.search(r'^radixray_kv_transfers_total\{engine="\d+",role="decode",replica="[^"]*"\} (\d+)$',
                                 metrics, re.M)
    assert decode_transfers and int(decode_transfers.group(1)) >= 4, metrics[-2000:]
    assert re.search(r'^radixray_engine_role\{engine="\d+",role="prefill",', metrics, re.M)


def test_the_readme_recipe_parses_and_builds():
    """The README's disaggregation command, as written: its flags parse and the app builds (a
    PrefillServer and a DecodeServer deployment of one engine each)."""
    import shlex

    from cluster.__main__ import serve_parser
    from cluster.cli import given
    from deploy.options import AppArgs
    from tests.conftest import ROOT, data_path

    text = (ROOT / "README.md").read_text()
    section = text[text.index("\n### Prefill/decode disaggregation"):]
    argv = shlex.split(re.search(r"```bash\n(.*?)```", section, re.S).group(1).strip())
    assert argv[:4] == ["python3", "-m", "cluster", "serve"]
    argv = [str(data_path("models/stories260K")) if a == "../shared/models/stories260K" else a for a in argv[4:]]
    ap, fields = serve_parser()
    flat = given(ap.parse_args(argv), fields)
    parsed = AppArgs.from_dict(flat)
    assert (parsed.cluster.prefill_engines, parsed.cluster.decode_engines) == (1, 1)
    assert type(build_app(flat)).__name__ == "Application"
