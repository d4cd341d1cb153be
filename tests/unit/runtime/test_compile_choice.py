"""Which forwards torch.compile runs: `CompilationConfig.compiles`."""

from __future__ import annotations


def test_torch_compile_auto_compiles_where_inductor_has_work():
    """torch_compile="auto" leaves compiling off for a family whose CUDA forward is libkk kernels
    alone (Qwen3, gpt-oss), compiles the others and every PIECEWISE mode, and never compiles on
    the CPU."""
    from libkk.config import CompilationConfig
    from libkk.models.gpt_oss import GptOssForCausalLM
    from libkk.models.llama import LlamaForCausalLM
    from libkk.models.qwen3 import Qwen3ForCausalLM
    from libkk.models.qwen3_moe import Qwen3MoeForCausalLM

    qwen3, llama, moe, oss = (
        object.__new__(Qwen3ForCausalLM),
        object.__new__(LlamaForCausalLM),
        object.__new__(Qwen3MoeForCausalLM),
        object.__new__(GptOssForCausalLM),
    )
    auto = CompilationConfig()
    assert auto.torch_compile == "auto"
    assert not auto.compiles("cuda", qwen3) and not auto.compiles("cuda", oss)
    assert auto.compiles("cuda", llama) and auto.compiles("cuda", moe)
    assert CompilationConfig(cudagraph_mode="FULL_AND_PIECEWISE").compiles("cuda", qwen3)
    assert CompilationConfig(torch_compile=True).compiles("cuda", qwen3)
    assert not CompilationConfig(torch_compile=False).compiles("cuda", llama)
    assert not any(c.compiles("cpu", llama) for c in (auto, CompilationConfig(torch_compile=True)))
