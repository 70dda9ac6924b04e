"""The model registry: architecture lookup, errors, and adding an architecture from outside."""

from __future__ import annotations

import os
from types import SimpleNamespace

import msgspec
import pytest
import torch
import torch.nn.functional as F

from engine import Engine
from engine.builtin_model import llama_config, random_llama_weights, write_checkpoint
from engine.config import ModelConfig
from engine.errors import ConfigError
from engine.models import MODEL_REGISTRY, build_model, load_weights, model_class, register_model
from engine.models.layers import GatedMLP
from engine.models.llama import LlamaForCausalLM

CPU = torch.device("cpu")
TINY = dict(hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
            num_key_value_heads=2, max_position_embeddings=64)
FAMILY = {"LlamaForCausalLM": "llama", "MistralForCausalLM": "mistral",
          "Qwen2ForCausalLM": "qwen2", "Qwen3ForCausalLM": "qwen3"}


def checkpoint(path, **overrides) -> str:
    cfg = llama_config(**TINY, **overrides)
    return write_checkpoint(str(path), cfg, random_llama_weights(cfg, seed=0))


@pytest.fixture
def registry():
    """Restores MODEL_REGISTRY after a test that registers its own architecture."""
    saved = dict(MODEL_REGISTRY)
    yield MODEL_REGISTRY
    MODEL_REGISTRY.clear()
    MODEL_REGISTRY.update(saved)


class CausalAttention:
    """Attention over one sequence (the batch), enough to run a model without KV pools."""

    def forward(self, q, k, v, layer, fb):
        rep = q.shape[1] // k.shape[1]
        k, v = k.repeat_interleave(rep, 1), v.repeat_interleave(rep, 1)
        out = F.scaled_dot_product_attention(q.transpose(0, 1), k.transpose(0, 1), v.transpose(0, 1),
                                             is_causal=True)
        return out.transpose(0, 1)


def test_unknown_architecture_lists_supported(tmp_path):
    with pytest.raises(ConfigError) as e:
        Engine(model_path=checkpoint(tmp_path / "gpt2", architectures=["GPT2LMHeadModel"]))
    assert "GPT2LMHeadModel" in str(e.value) and all(name in str(e.value) for name in FAMILY)
    path = checkpoint(tmp_path)
    cfg = msgspec.structs.replace(ModelConfig.from_dir(path), architecture="NopeForCausalLM")
    with pytest.raises(ConfigError, match=r"'NopeForCausalLM' is not supported \(supported: .*Qwen3ForCausalLM"):
        build_model(cfg, path, torch.float32, CPU, 64)


def test_missing_architectures_defaults_to_llama():
    hf = llama_config()
    del hf["architectures"]
    assert ModelConfig.from_hf(hf).architecture == "LlamaForCausalLM"


@pytest.mark.parametrize("arch", FAMILY)
def test_each_family_architecture_builds(tmp_path, arch):
    extra = {"head_dim": 16} if arch == "Qwen3ForCausalLM" else {}
    path = checkpoint(tmp_path, architectures=[arch], model_type=FAMILY[arch], tie_word_embeddings=False, **extra)
    cfg = ModelConfig.from_dir(path)
    assert model_class(arch) is LlamaForCausalLM
    model = build_model(cfg, path, torch.float32, CPU, 64)
    assert type(model) is LlamaForCausalLM and model.scale == cfg.head_dim ** -0.5 and model.mlp_comm is None
    assert model.num_parameters() == sum(t.numel() for t in load_weights(path).values())


def test_registered_architecture_is_built(tmp_path, registry):
    """The extension point: a model file registers a class; build_model picks it up by name. This
    one swaps the MLP slot, as an MoE model would."""
    calls = []

    class CountingMLP(GatedMLP):
        def __call__(self, x):
            calls.append(x.shape[0])
            return super().__call__(x)

    @register_model("TinyForCausalLM")
    class TinyForCausalLM(LlamaForCausalLM):
        def make_mlp(self, w, p, mlp_shard, onednn):
            return CountingMLP(w(p + "mlp.gate_proj.weight"), w(p + "mlp.up_proj.weight"),
                               w(p + "mlp.down_proj.weight"), mlp_shard, onednn)

    path = checkpoint(tmp_path, architectures=["TinyForCausalLM"])
    model = build_model(ModelConfig.from_dir(path), path, torch.float32, CPU, 64)
    assert type(model) is TinyForCausalLM
    fb = SimpleNamespace(input_ids=torch.tensor([5, 6, 7]), positions=torch.arange(3),
                         last_token_indices=torch.tensor([2]), lora_info=None)
    assert model.forward(fb, CausalAttention()).shape == (1, model.cfg.vocab_size)
    assert calls == [3, 3]  # one MLP call per layer
    with pytest.raises(ValueError, match="already registered"):
        register_model("LlamaForCausalLM")(TinyForCausalLM)


def test_missing_weight_is_named(tmp_path):
    cfg = llama_config(**TINY)
    weights = random_llama_weights(cfg, seed=0)
    del weights["model.layers.1.mlp.up_proj.weight"]
    path = write_checkpoint(str(tmp_path), cfg, weights)
    with pytest.raises(ConfigError, match=r"missing weight 'model\.layers\.1\.mlp\.up_proj\.weight'"):
        build_model(ModelConfig.from_dir(path), path, torch.float32, CPU, 64)
    os.remove(os.path.join(path, "model.safetensors"))
    with pytest.raises(ConfigError, match="no \\*.safetensors"):
        build_model(ModelConfig.from_dir(path), path, torch.float32, CPU, 64)
