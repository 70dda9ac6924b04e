"""Shared fixtures: small random-weight checkpoints (built per session) and HF references."""

from __future__ import annotations

import os
import socket
from pathlib import Path

import pytest
import torch

from engine.builtin_model import (
    byte_level_tokenizer,
    llama_config,
    random_llama_weights,
    write_checkpoint,
)

# Triton kernels run in Triton's interpreter on a machine without CUDA (must be set before any
# @triton.jit function is defined, i.e. before kernels.triton_attention is imported).
if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

# CPU decode graphs compile each batch-size bucket on first use, seconds per engine: the suite
# builds hundreds of engines, so it runs them eagerly, and the graph tests (tests/engine/
# test_cpu_graph.py) turn them back on where they test them.
os.environ.setdefault("RADIXRAY_CPU_GRAPHS", "0")

# Under pytest-xdist the two workers share the cores: one intra-op thread each, so neither's torch
# pool waits on threads the other worker's processes hold (the test models are too small to gain).
if os.environ.get("PYTEST_XDIST_WORKER"):
    torch.set_num_threads(1)

ROOT = Path(__file__).resolve().parents[1]
# Data a plain clone does not have (the trained stories260K model, KubeRay's CRD schemas): a folder
# holding models/stories260K and k8s/kuberay-crds. .ci/run points it at ../shared.
TEST_DATA_ENV = "RADIXRAY_TEST_DATA"


def data_path(relative: str) -> Path:
    """A path under $RADIXRAY_TEST_DATA; skips the calling test, saying how to enable it, when unset."""
    root = os.environ.get(TEST_DATA_ENV)
    if not root:
        pytest.skip(f"needs {relative}: set {TEST_DATA_ENV} to a folder that has it (.ci/run uses ../shared)")
    path = Path(root).resolve() / relative
    if not path.exists():
        pytest.fail(f"{TEST_DATA_ENV}={root} has no {relative}")
    return path


class ModelDirs(dict):
    """name -> checkpoint folder; "stories" (trained, from the test data) skips when it is absent."""

    def __getitem__(self, name: str) -> str:
        if name == "stories":
            return str(data_path("models/stories260K"))
        return super().__getitem__(name)

SMALL = dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
             num_key_value_heads=2, max_position_embeddings=1024)
MODEL_CONFIGS = {
    "llama": llama_config(**SMALL),
    "qwen2": llama_config(**SMALL, architectures=["Qwen2ForCausalLM"], model_type="qwen2",
                          tie_word_embeddings=False),
    "qwen3": llama_config(**{**SMALL, "num_key_value_heads": 1}, architectures=["Qwen3ForCausalLM"],
                          model_type="qwen3", head_dim=32, tie_word_embeddings=False,
                          rope_parameters={"rope_theta": 5000.0, "rope_type": "default"}),
}


RAY_DIRS = ("ray", "serve")  # tests/ray, tests/serve: they start Ray (and Serve) clusters


# First, so that xdist's own hook (which names each test's group from its marker) sees the markers.
@pytest.hookimpl(tryfirst=True)
def pytest_collection_modifyitems(config, items):
    if not torch.cuda.is_available():
        skip = pytest.mark.skip(reason="needs a CUDA device")
        for item in items:
            if "gpu" in item.keywords:
                item.add_marker(skip)
    # Under pytest-xdist (pyproject's addopts: two workers, --dist loadgroup) tests/serve runs on
    # one worker and tests/ray (with every other test that starts Ray) on the other, each group in
    # order on its own Ray instance, sharing that session's Serve apps and clusters; the engine
    # tests fill both workers around them. xdist hands out the largest groups first.
    for item in items:
        parts = item.path.relative_to(config.rootpath).parts
        if len(parts) > 1 and parts[0] == "tests" and parts[1] in RAY_DIRS:
            item.add_marker(pytest.mark.xdist_group(parts[1]))
        elif "ray_local" in item.fixturenames:
            item.add_marker(pytest.mark.xdist_group("ray"))


@pytest.fixture(scope="session")
def model_dirs(tmp_path_factory) -> dict[str, str]:
    """name -> checkpoint folder: the random configs above plus the real stories260K."""
    root = tmp_path_factory.mktemp("models")
    dirs = ModelDirs()
    for name, cfg in MODEL_CONFIGS.items():
        cfg = dict(cfg)
        if "rope_parameters" in cfg:
            cfg.pop("rope_theta")
        # std 0.15: peaked logits, so float32 rounding never decides a greedy tie.
        dirs[name] = write_checkpoint(str(root / name), cfg, random_llama_weights(cfg, seed=1, std=0.15),
                                      byte_level_tokenizer())
    return dirs


@pytest.fixture(scope="session")
def near_draft(model_dirs, tmp_path_factory) -> str:
    """A draft model for the "llama" checkpoint that agrees with it often but not always: its
    weights plus noise (speculative decoding keeps some drafts and rejects others)."""
    from safetensors.torch import load_file

    target = load_file(os.path.join(model_dirs["llama"], "model.safetensors"))
    noise = random_llama_weights(MODEL_CONFIGS["llama"], seed=7, std=0.15)
    weights = {k: v + 0.3 * noise[k] for k, v in target.items()}
    return write_checkpoint(str(tmp_path_factory.mktemp("drafts") / "near"), dict(MODEL_CONFIGS["llama"]), weights,
                            byte_level_tokenizer())


class HFReference:
    """Greedy continuations from transformers `generate`, cached per (model, prompt, n)."""

    def __init__(self) -> None:
        self.models: dict[str, object] = {}
        self.cache: dict[tuple, list[int]] = {}
        # Per model path: config values transformers cannot read from the checkpoint itself.
        self.config_overrides: dict[str, dict] = {}

    def model(self, path: str):
        if path not in self.models:
            from transformers import AutoModelForCausalLM

            if path.endswith(".gguf"):  # transformers dequantizes a GGUF file to float32
                m = AutoModelForCausalLM.from_pretrained(os.path.dirname(path), gguf_file=os.path.basename(path),
                                                         dtype=torch.float32, **self.config_overrides.get(path, {}))
            else:
                m = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
            m.generation_config.eos_token_id = None  # compare full lengths: the engine ignores EOS too
            m.generation_config.pad_token_id = 0
            self.models[path] = m.eval()
        return self.models[path]

    def greedy(self, path: str, prompt: list[int], n: int) -> list[int]:
        key = (path, tuple(prompt), n)
        if key not in self.cache:
            m = self.model(path)
            with torch.no_grad():
                out = m.generate(torch.tensor([prompt]), max_new_tokens=n, do_sample=False,
                                 attention_mask=torch.ones(1, len(prompt), dtype=torch.long))
            self.cache[key] = out[0, len(prompt):].tolist()
        return self.cache[key]

    def logprobs(self, path: str, ids: list[int]) -> torch.Tensor:
        """log-softmax of the next-token logits after each prefix of ids: [len(ids), vocab]."""
        with torch.no_grad():
            logits = self.model(path)(torch.tensor([ids])).logits[0]
        return torch.log_softmax(logits.float(), dim=-1)


@pytest.fixture(scope="module")
def one_torch_thread():
    """One intra-op torch thread for the module (as every xdist worker has anyway)."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


@pytest.fixture(scope="session")
def hf() -> HFReference:
    torch.manual_seed(0)
    return HFReference()


@pytest.fixture(autouse=True, scope="session")
def _quiet_threads():
    # Two cores here: keep intra-op threads from oversubscribing when Ray workers run too.
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")


@pytest.fixture(scope="session")
def ray_local():
    """One local Ray instance for the session (2 CPUs here; engines ask for 1 each)."""
    import ray  # here, not at the top: the GPU machine runs the GPU tests without Ray

    from deploy import http_guard

    # Serve's proxy (started by tests on this Ray) cuts dribbling clients within seconds.
    os.environ.update(http_guard.environment(header_timeout_s=2.0, body_timeout_s=3.0))
    if not ray.is_initialized():
        ray.init(address="local", include_dashboard=False, log_to_driver=False, num_cpus=4)
    yield
    ray.shutdown()


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture(scope="session")
def serve_base(ray_local) -> str:
    """Ray Serve's HTTP proxy, started once per session (its options cannot change later)."""
    from ray import serve

    port = free_port()
    serve.start(http_options={"host": "127.0.0.1", "port": port})
    return f"http://127.0.0.1:{port}"
