"""LoRA adapters over HTTP (issue 31) with the openai client: adapters as model names (listed in
/v1/models with the base model as parent), a streamed completion under an adapter equal to the
engine's greedy output, an unknown adapter a 404, and vLLM's load/unload endpoints behind the API
key and the allowed root. One app: one engine with one adapter loaded at start."""

from __future__ import annotations

import os

import httpx
import openai
import pytest

pytest.importorskip("peft", reason="needs peft (python3 -m pip install --no-deps peft)")
pytest.importorskip("transformers")

from engine import Engine, SamplingParams  # noqa: E402
from engine.lora import TARGET_MODULES  # noqa: E402
from tests.helpers import write_peft_adapters  # noqa: E402
from tests.serve.helpers import wait_for_engines  # noqa: E402

KEY = "sk-lora-test"
AUTH = {"Authorization": f"Bearer {KEY}"}
BASE = "tiny-base"
PROMPT = "Hello adapters"
N = 12
ADAPTERS = {"a": dict(r=8, lora_alpha=16, target_modules=list(TARGET_MODULES)),
            "b": dict(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj", "down_proj"])}


@pytest.fixture(scope="module")
def folders(model_dirs, tmp_path_factory) -> dict[str, str]:
    """PEFT adapters of the "llama" checkpoint under one root folder (the app's allowed root)."""
    root = tmp_path_factory.mktemp("http-loras")
    return {"root": str(root), **write_peft_adapters(model_dirs["llama"], root, ADAPTERS, seed=70)}


@pytest.fixture(scope="module")
def app(serve_base, model_dirs, folders):
    from ray import serve

    from deploy.app import build_app

    args = {"model_path": model_dirs["llama"], "num_engines": 1, "served_model_name": BASE, "api_key": KEY,
            "lora_paths": {"a": folders["a"]}, "allowed_lora_root": folders["root"]}
    serve.run(build_app(args), name="lora", route_prefix="/lora")
    base = f"{serve_base}/lora"
    try:
        wait_for_engines(base, 1)
        yield base
    finally:
        serve.delete("lora", _blocking=False)


@pytest.fixture(scope="module")
def client(app) -> openai.OpenAI:
    return openai.OpenAI(base_url=app + "/v1", api_key=KEY, max_retries=0)


@pytest.fixture(scope="module")
def reference(model_dirs, folders) -> Engine:
    return Engine(model_path=model_dirs["llama"], lora_paths={"a": folders["a"], "b": folders["b"]})


def greedy_text(reference: Engine, name: str | None) -> str:
    params = SamplingParams(max_new_tokens=N, temperature=0.0, ignore_eos=True)
    return reference.generate(prompt=PROMPT, sampling_params=params, lora_name=name).text


def stream_text(client: openai.OpenAI, model: str) -> str:
    chunks = list(client.completions.create(model=model, prompt=PROMPT, max_tokens=N, temperature=0, stream=True,
                                            extra_body={"ignore_eos": True}))
    assert {c.model for c in chunks} == {model}
    return "".join(c.choices[0].text for c in chunks if c.choices)


def test_adapters_are_models_with_the_base_as_parent(client):
    models = {m.id: m for m in client.models.list()}
    assert set(models) == {BASE, "a"}
    assert models["a"].model_extra["parent"] == BASE and models[BASE].model_extra["parent"] is None


def test_streamed_completion_under_an_adapter_equals_the_engine(client, reference):
    text = stream_text(client, "a")
    assert text == greedy_text(reference, "a")
    assert stream_text(client, BASE) == greedy_text(reference, None) != text


def test_unknown_adapter_is_a_404_naming_it(client):
    with pytest.raises(openai.NotFoundError) as e:
        client.completions.create(model="nope", prompt=PROMPT, max_tokens=2)
    assert e.value.body["code"] == "model_not_found" and "'nope'" in e.value.body["message"]
    with pytest.raises(openai.NotFoundError):
        client.chat.completions.create(model="nope", messages=[{"role": "user", "content": "hi"}], max_tokens=2)


def test_load_and_unload_endpoints(app, client, reference, folders, tmp_path):
    load, unload = f"{app}/v1/load_lora_adapter", f"{app}/v1/unload_lora_adapter"
    body = {"lora_name": "b", "lora_path": folders["b"]}
    assert httpx.post(load, json=body, timeout=60).status_code == 401  # behind the API key
    # Outside the allowed root (also through a link inside it, or a relative path): 400 naming lora_path.
    link = os.path.join(folders["root"], "escape")
    if not os.path.lexists(link):
        os.symlink(str(tmp_path), link)
    for path in (str(tmp_path), link, "b", os.path.join(folders["root"], "..", "elsewhere")):
        r = httpx.post(load, json={"lora_name": "b", "lora_path": path}, headers=AUTH, timeout=60)
        assert r.status_code == 400 and r.json()["error"]["param"] == "lora_path", (path, r.text)
    # A bad adapter file: 400 naming lora_path; the engine goes on.
    empty = os.path.join(folders["root"], "empty")
    os.makedirs(empty, exist_ok=True)
    r = httpx.post(load, json={"lora_name": "broken", "lora_path": empty}, headers=AUTH, timeout=60)
    assert r.status_code == 400 and r.json()["error"]["param"] == "lora_path" and "'broken'" in r.text
    r = httpx.post(load, json=body, headers=AUTH, timeout=60)
    assert r.status_code == 200, r.text
    assert httpx.post(load, json=body, headers=AUTH, timeout=60).status_code == 400  # already loaded
    assert {m.id for m in client.models.list()} == {BASE, "a", "b"}
    assert stream_text(client, "b") == greedy_text(reference, "b")

    assert httpx.post(unload, json={"lora_name": "b"}, timeout=60).status_code == 401
    r = httpx.post(unload, json={"lora_name": "b"}, headers=AUTH, timeout=60)
    assert r.status_code == 200, r.text
    assert {m.id for m in client.models.list()} == {BASE, "a"}
    with pytest.raises(openai.NotFoundError):
        client.completions.create(model="b", prompt=PROMPT, max_tokens=2)
    r = httpx.post(unload, json={"lora_name": "b"}, headers=AUTH, timeout=60)
    assert r.status_code == 404 and r.json()["error"]["param"] == "lora_name"
    assert httpx.get(f"{app}/health", timeout=30).json()["healthy"]


def test_runtime_updates_need_an_allowed_root():
    """Without allowed_lora_root the endpoints refuse, saying which option turns them on."""
    from types import SimpleNamespace

    from deploy.app import OpenAIServer
    from deploy.options import HTTPOptions

    refused = OpenAIServer.func_or_class._runtime_lora_refused  # (the check alone: no replica)
    r = refused(SimpleNamespace(http=HTTPOptions()))
    assert r.status_code == 403 and b"allowed_lora_root" in r.body
    assert refused(SimpleNamespace(http=HTTPOptions(allowed_lora_root="/srv/loras"))) is None
