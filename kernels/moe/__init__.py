"""Quantized mixture-of-experts ops: routing, expert alignment and fused W4A16 expert GEMMs, plus
W4A8 variants (FP8 e4m3 activations) for prefill rows; see the W4A8 section below.

Pipeline of one MoE layer (no host synchronisation anywhere, so it can be captured in a CUDA graph):

1. `moe_topk_routing`: top-k over softmax or sigmoid router probabilities, optionally renormalized
   (Qwen3-MoE: softmax + renorm when `norm_topk_prob`; Mixtral: softmax + renorm).
2. `moe_align_block_size`: the (token, expert) pairs, pair p = token * top_k + k, sorted by expert
   and each expert's run padded to a multiple of the M tile. Padding slots hold the sentinel
   `num_pairs`; blocks past the padded total have expert -1. Sizes are the static worst case.
3. `moe_w4a16_gate_up`: per M block (one expert), x[token] @ w13[expert]^T with the 4-bit weights
   dequantized in the kernel, plus the expert's gate and up biases where the layer has them, then
   the activation -> intermediate [num_pairs, I].
4. `moe_w4a16_down`: intermediate[pair] @ w2[expert]^T (plus the down bias) times the pair's
   routing weight -> [num_pairs, hidden] (`fused_moe_w4a16_routed`); `fused_moe_w4a16` then sums
   each token's top_k rows, or the caller leaves that sum to the residual add and norm that follow
   (`add_rms_norm`).

Expert options (gpt-oss): biases `w13_bias` [E, 2I] (gate then up) and `w2_bias` [E, H] in the
activations' dtype, and the activation (`ExpertActivation`: SiLU(gate) * up, or the clamped SwiGLU
with its alpha and limit). Each bias is added to its projection's fp32 sums and rounded with them
once, as an unfused `F.linear(x, w, b)` rounds; the activation then rounds after each torch op of
`expert_activation_ref`. Both are constexprs of the W4A16 kernels, so a SiLU layer without biases
compiles no bias or clamp code. The W4A8 kernels run neither (QuantFusedMoE keeps such layers on
W4A16).

4-bit weights: uint8 [E, N, K/2], two E2M1 codes per byte, element 2i in the low nibble. Scales:
uint8 [E, N, K/G] bytes, NVFP4 (G=16) E4M3 with an fp32 global scale per (expert, projection),
MXFP4 (G=32) E8M0 (2^(b-127), 0xFF NaN) with no global scale. The kernel forms each weight exactly
as the torch dequantizer does (e2m1 * (scale * global) in fp32, rounded once to the activation
dtype), so it multiplies the same bf16 weights the dequantized reference path holds. It decodes
through the hardware fp8 conversion (compute capability >= 8.9): a nibble's bits moved into an
e4m3 byte are its value times 2^-6, and the 2^6 rides on the scale.

A tile config with block_m = PAIR_MAJOR replaces steps 2-4 with one matrix-vector product per pair
(see the pair-major section).

The packed bytes hold even and odd K elements in the two nibbles; the sorted-path kernels decode
each nibble plane into its own tile and interleave the two into K order in registers, so one dot
per K step reads the activations contiguously.

Tile configs: a static table (up to 16 tokens the pair-major path; then up to 64 tokens 16-row
M tiles, the weight stream dominates; prefill: 64-row tiles, 128-row ones from 4096 tokens), unless a higher layer installed
measured choices for the layer's shape (`install_tile_choice`; graphs/moe_tiles.py times
candidates on the GPU and keeps them in the artifact cache, which kernels/ cannot import).
Triton's own autotune is not used.
"""

from .common import (
    DECODE_CONFIG,
    FORMATS,
    GATED_ACTIVATIONS,
    GROUP,
    LARGE_PREFILL_CONFIG,
    PAIR_DECODE_CONFIG,
    PAIR_DECODE_NARROW,
    PAIR_MAJOR,
    PAIR_MAJOR_MAX_TOKENS,
    PREFILL_CONFIG,
    SILU,
    W4A8_PREFILL_CONFIG,
    ExpertActivation,
    MoeKernelError,
    MoeTileConfig,
    W4A8TileConfig,
    default_tile_config,
    expert_activation_ref,
)
from .routing import (
    ALIGN_SINGLE_MAX_PAIRS,
    max_padded_pairs,
    moe_align_block_size,
    moe_align_block_size_ref,
    moe_topk_routing,
    moe_topk_routing_ref,
)
from .tiles import (
    ACTIVATIONS,
    MoeShape,
    TileConfig,
    check_tile_config,
    clear_tile_choices,
    install_tile_choice,
    installed_tile_choices,
    tile_choice,
    token_bucket,
)
from .w4a8 import (
    FP8_MAX,
    fused_moe_w4a8,
    fused_moe_w4a8_ref,
    moe_w4a8_down,
    moe_w4a8_gate_up,
    quantize_fp8_per_tensor,
)
from .w4a16 import (
    dequantize_w4_ref,
    fused_moe_w4a16,
    fused_moe_w4a16_measured,
    fused_moe_w4a16_ref,
    fused_moe_w4a16_routed,
    moe_w4a16_down,
    moe_w4a16_down_ref,
    moe_w4a16_gate_up,
    moe_w4a16_gate_up_ref,
)

__all__ = [
    "ACTIVATIONS",
    "ALIGN_SINGLE_MAX_PAIRS",
    "DECODE_CONFIG",
    "FORMATS",
    "GATED_ACTIVATIONS",
    "SILU",
    "ExpertActivation",
    "expert_activation_ref",
    "FP8_MAX",
    "GROUP",
    "PAIR_DECODE_CONFIG",
    "PAIR_DECODE_NARROW",
    "PAIR_MAJOR",
    "PAIR_MAJOR_MAX_TOKENS",
    "LARGE_PREFILL_CONFIG",
    "PREFILL_CONFIG",
    "W4A8_PREFILL_CONFIG",
    "MoeKernelError",
    "MoeShape",
    "MoeTileConfig",
    "TileConfig",
    "W4A8TileConfig",
    "check_tile_config",
    "clear_tile_choices",
    "default_tile_config",
    "dequantize_w4_ref",
    "fused_moe_w4a8",
    "fused_moe_w4a8_ref",
    "fused_moe_w4a16",
    "fused_moe_w4a16_measured",
    "fused_moe_w4a16_ref",
    "fused_moe_w4a16_routed",
    "install_tile_choice",
    "installed_tile_choices",
    "max_padded_pairs",
    "moe_align_block_size",
    "moe_align_block_size_ref",
    "moe_topk_routing",
    "moe_topk_routing_ref",
    "moe_w4a8_down",
    "moe_w4a8_gate_up",
    "moe_w4a16_down",
    "moe_w4a16_down_ref",
    "moe_w4a16_gate_up",
    "moe_w4a16_gate_up_ref",
    "quantize_fp8_per_tensor",
    "tile_choice",
    "token_bucket",
]
