"""Maps a checkpoint's `architectures[0]` to the model class that runs it."""

from __future__ import annotations

import importlib

from torch import nn

from libkk.errors import UnsupportedModelError

# architecture name (as in config.json) -> "module:Class"; imported on first use.
_MODELS: dict[str, str] = {
    "LlamaForCausalLM": "libkk.models.llama:LlamaForCausalLM",
    "Qwen2ForCausalLM": "libkk.models.llama:Qwen2ForCausalLM",
    "Qwen3ForCausalLM": "libkk.models.qwen3:Qwen3ForCausalLM",
    "Qwen3MoeForCausalLM": "libkk.models.qwen3_moe:Qwen3MoeForCausalLM",
    "MixtralForCausalLM": "libkk.models.mixtral:MixtralForCausalLM",
    "MistralForCausalLM": "libkk.models.mistral:MistralForCausalLM",
    # Mistral whose layer_types alternate sliding and full layers.
    "MinistralForCausalLM": "libkk.models.mistral:MistralForCausalLM",
    "Phi3ForCausalLM": "libkk.models.phi3:Phi3ForCausalLM",
    "Gemma3ForCausalLM": "libkk.models.gemma3:Gemma3ForCausalLM",
    # The text tower only: the vision weights are skipped.
    "Gemma3ForConditionalGeneration": "libkk.models.gemma3:Gemma3ForCausalLM",
    "GptOssForCausalLM": "libkk.models.gpt_oss:GptOssForCausalLM",
}


def supported_architectures() -> list[str]:
    return sorted(_MODELS)


def unsupported_architecture(
    architecture: object, source: str = "config.json"
) -> UnsupportedModelError:
    return UnsupportedModelError(
        f"{source}: architecture {architecture!r} is not supported; "
        f"supported architectures: {', '.join(supported_architectures())}"
    )


def get_model_class(architecture: str) -> type[nn.Module]:
    """The class for `architecture`; raises UnsupportedModelError listing the supported ones."""
    target = _MODELS.get(architecture)
    if target is None:
        raise unsupported_architecture(architecture)
    module_name, class_name = target.split(":")
    return getattr(importlib.import_module(module_name), class_name)
