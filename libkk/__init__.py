"""libkk: an embeddable, in-process LLM inference runtime."""

from __future__ import annotations

from libkk.api.session import Session
from libkk.config import CacheConfig, EngineConfig, ModelConfig, SchedulerConfig
from libkk.engine.outputs import Logprob, RequestOutput, ToolCall
from libkk.engine.timeline import Timeline
from libkk.errors import (
    ConfigError,
    CorruptCheckpointError,
    InvalidRequestError,
    LibkkError,
    MissingDependencyError,
    ModelLoadError,
    ModelNotFoundError,
    PromptTooLongError,
    SamplingParamsError,
    SessionClosedError,
    StructuredOutputError,
    TensorParallelError,
    UnknownRequestError,
    UnsupportedModelError,
)
from libkk.sample.params import SamplingParams, StructuredOutput

__version__ = "0.1.0"

__all__ = [
    "CacheConfig",
    "ConfigError",
    "CorruptCheckpointError",
    "EngineConfig",
    "InvalidRequestError",
    "LibkkError",
    "Logprob",
    "MissingDependencyError",
    "ModelConfig",
    "ModelLoadError",
    "ModelNotFoundError",
    "PromptTooLongError",
    "RequestOutput",
    "SamplingParams",
    "SamplingParamsError",
    "SchedulerConfig",
    "Session",
    "SessionClosedError",
    "StructuredOutput",
    "StructuredOutputError",
    "TensorParallelError",
    "Timeline",
    "ToolCall",
    "UnknownRequestError",
    "UnsupportedModelError",
    "__version__",
]
