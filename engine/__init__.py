"""One device's serving engine: scheduler, radix prefix cache, KV pool and forward path.

No Ray import anywhere in this package: `from engine import Engine` works standalone."""

from engine.config import EngineConfig, ModelConfig
from engine.engine import Engine, GenerateOutput, StreamDelta, TokenLogprob
from engine.errors import ConfigError, EngineDeadError, InvalidRequestError, MemoryInvariantError
from engine.forward_batch import ForwardBatch, ForwardMode
from engine.sampling import PromptLogprob, SamplingParams

__all__ = [
    "ConfigError", "Engine", "EngineConfig", "EngineDeadError", "ForwardBatch", "ForwardMode",
    "GenerateOutput", "InvalidRequestError", "MemoryInvariantError", "ModelConfig", "PromptLogprob", "SamplingParams",
    "StreamDelta", "TokenLogprob",
]
