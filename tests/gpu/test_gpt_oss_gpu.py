"""gpt-oss on CUDA: a tiny random model through sessions (graphs replay equal to eager, sinks and
windows in both attention kernels), and its released MXFP4 layout kept packed for the W4A16
kernels (biases and the clamped SwiGLU in the kernels) against the same experts dequantized."""

from __future__ import annotations

import pytest
import torch

from libkk import SamplingParams, Session
from libkk.layers.quant_moe import QuantFusedMoE
from tests.checkpoints import gpt_oss_mxfp4_and_dequantized, save_tiny_gpt_oss

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="CUDA")]

PROMPTS = [[(7 * i + 5) % 256 for i in range(40)], [(13 * i + 2) % 256 for i in range(41)],
           [3, 4, 5], list(range(60, 90))]  # fmt: skip
GREEDY = SamplingParams(max_tokens=24, temperature=0.0, ignore_eos=True)


@pytest.fixture(scope="module")
def dirs(tmp_path_factory):
    src = save_tiny_gpt_oss(tmp_path_factory.mktemp("gpt-oss"))
    mxfp4, dense = gpt_oss_mxfp4_and_dequantized(src, tmp_path_factory.mktemp("gpt-oss-q"))
    return {"float": src, "mxfp4": mxfp4, "dense": dense}


def _tokens(path, **settings) -> list[list[int]]:
    with Session(str(path), device="cuda", max_model_len=128, block_size=16, progress=False,
                 **settings) as s:  # fmt: skip
        return [o.token_ids for o in s.generate(PROMPTS, GREEDY)]


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_graphs_equal_eager(dirs, dtype):
    """Graph replays equal the same forward run eagerly, compiled or not. In fp32 compiling changes
    nothing either, and the CPU path (the reference-checked one) agrees; in bf16 Inductor's fused
    pointwise code rounds where eager ops round each result, so there the compiled forward is
    compared with itself."""
    plain = _tokens(dirs["float"], dtype=dtype, cudagraph_mode="NONE", torch_compile=False)
    assert _tokens(dirs["float"], dtype=dtype, torch_compile=False) == plain
    compiled = _tokens(dirs["float"], dtype=dtype, cudagraph_mode="NONE")
    assert _tokens(dirs["float"], dtype=dtype) == compiled
    if dtype == "float32":
        assert compiled == plain
        with Session(str(dirs["float"]), device="cpu", max_model_len=128, progress=False) as s:
            assert [o.token_ids for o in s.generate(PROMPTS, GREEDY)] == plain


def test_mxfp4_packed_equals_dequantized(dirs):
    """fp32 activations: the kernels multiply exactly the dequantized weights; in bf16 the graphs
    replay what the same forward computes without them."""
    with Session(str(dirs["mxfp4"]), device="cuda", dtype="float32", max_model_len=128,
                 progress=False) as s:  # fmt: skip
        experts = s.engine.model.model.layers[0].mlp.experts
        assert isinstance(experts, QuantFusedMoE) and experts.fused_kernels
        assert experts.w13_bias is not None
        packed = [o.token_ids for o in s.generate(PROMPTS, GREEDY)]
    assert packed == _tokens(dirs["dense"], dtype="float32")
    assert _tokens(dirs["mxfp4"], dtype="bfloat16") == _tokens(
        dirs["mxfp4"], dtype="bfloat16", cudagraph_mode="NONE"
    )
