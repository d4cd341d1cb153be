"""Which forwards torch.compile runs: `CompilationConfig.compiles`."""

from __future__ import annotations


def test_torch_compile_auto_compiles_where_inductor_has_work():
    """torch_compile="auto" leaves compiling off for the families whose CUDA forward is libkk
    kernels alone (Llama, Mistral, Qwen2, Qwen3, gpt-oss), compiles those with torch ops of their
    own (the MoE routers, Gemma 3, Phi-3) and every PIECEWISE mode, and never compiles on the
    CPU."""
    from libkk.config import CompilationConfig
    from libkk.models.gemma3 import Gemma3ForCausalLM
    from libkk.models.gpt_oss import GptOssForCausalLM
    from libkk.models.llama import LlamaForCausalLM, Qwen2ForCausalLM
    from libkk.models.mistral import MistralForCausalLM
    from libkk.models.mixtral import MixtralForCausalLM
    from libkk.models.phi3 import Phi3ForCausalLM
    from libkk.models.qwen3 import Qwen3ForCausalLM
    from libkk.models.qwen3_moe import Qwen3MoeForCausalLM

    def model(cls):
        return object.__new__(cls)

    eager = [LlamaForCausalLM, MistralForCausalLM, Qwen2ForCausalLM, Qwen3ForCausalLM]
    eager.append(GptOssForCausalLM)
    compiled = [Qwen3MoeForCausalLM, MixtralForCausalLM, Gemma3ForCausalLM, Phi3ForCausalLM]
    auto = CompilationConfig()
    assert auto.torch_compile == "auto"
    assert [auto.compiles("cuda", model(c)) for c in eager] == [False] * len(eager)
    assert [auto.compiles("cuda", model(c)) for c in compiled] == [True] * len(compiled)
    qwen3, moe = model(Qwen3ForCausalLM), model(Qwen3MoeForCausalLM)
    assert CompilationConfig(cudagraph_mode="FULL_AND_PIECEWISE").compiles("cuda", qwen3)
    assert CompilationConfig(torch_compile=True).compiles("cuda", qwen3)
    assert not CompilationConfig(torch_compile=False).compiles("cuda", moe)
    assert not any(c.compiles("cpu", moe) for c in (auto, CompilationConfig(torch_compile=True)))
