"""apply_token_bitmask: structured output's mask on the logits of a whole batch, in one launch.

bitmask [G, W] int32 holds one row per constrained logits row (`rows[g]` is its row in logits):
bit t % 32 of word t // 32 set means token t is allowed. Every disallowed token's logit becomes
-inf in place; tokens at or past 32 * W (a model vocabulary padded past the tokenizer's) are
disallowed; rows not listed are untouched. `apply_token_bitmask_ref` is the torch reference.
"""

from __future__ import annotations

import torch
import triton.language as tl

from ._jit import check_device, jit, kernel_op

_BLOCK = 1024  # tokens a program masks (32 words)


@jit
def _bitmask_kernel(
    logits_ptr,
    mask_ptr,
    rows_ptr,
    vocab_size,
    words,
    stride_logits,
    stride_mask,
    BLOCK: tl.constexpr,
):
    g = tl.program_id(0)
    t = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    row = tl.load(rows_ptr + g).to(tl.int64)
    in_vocab = t < vocab_size
    word = tl.load(mask_ptr + g * stride_mask + t // 32, mask=in_vocab & (t // 32 < words), other=0)
    allowed = ((word >> (t % 32)) & 1) != 0
    ptrs = logits_ptr + row * stride_logits + t
    tl.store(ptrs, tl.full([BLOCK], float("-inf"), logits_ptr.dtype.element_ty),
             mask=in_vocab & ~allowed)  # fmt: skip


@kernel_op("libkk::apply_token_bitmask", mutates_args=("logits",))
def _apply_token_bitmask_op(
    logits: torch.Tensor, bitmask: torch.Tensor, rows: torch.Tensor
) -> None:
    check_device(logits)
    if bitmask.shape[0] and logits.shape[1]:
        grid = (bitmask.shape[0], -(-logits.shape[1] // _BLOCK))
        _bitmask_kernel[grid](
            logits, bitmask, rows, logits.shape[1], bitmask.shape[1], logits.stride(0),
            bitmask.stride(0), BLOCK=_BLOCK,
        )  # fmt: skip


@_apply_token_bitmask_op.register_fake
def _(logits, bitmask, rows) -> None:
    return None


def apply_token_bitmask(
    logits: torch.Tensor,  # [R, V] float, unit stride along V
    bitmask: torch.Tensor,  # [G, W] int32 on logits' device
    rows: torch.Tensor,  # [G] int32/int64: the logits row of each mask row
) -> torch.Tensor:
    """Masks `logits` in place and returns it."""
    _check(logits, bitmask, rows)
    _apply_token_bitmask_op(logits, bitmask, rows)
    return logits


def apply_token_bitmask_ref(
    logits: torch.Tensor, bitmask: torch.Tensor, rows: torch.Tensor
) -> torch.Tensor:
    """Torch reference of `apply_token_bitmask`."""
    _check(logits, bitmask, rows)
    num_masks, words = bitmask.shape
    vocab_size = logits.shape[1]
    bits = torch.arange(32, dtype=torch.int32, device=bitmask.device)
    allowed = ((bitmask[:, :, None] >> bits) & 1).bool().reshape(num_masks, words * 32)
    disallowed = torch.ones(num_masks, vocab_size, dtype=torch.bool, device=logits.device)
    n = min(vocab_size, words * 32)
    disallowed[:, :n] = ~allowed[:, :n]
    index = rows.long()
    logits[index] = logits[index].masked_fill(disallowed, float("-inf"))
    return logits


def _check(logits: torch.Tensor, bitmask: torch.Tensor, rows: torch.Tensor) -> None:
    if logits.dim() != 2 or not logits.is_floating_point() or logits.stride(1) != 1:
        raise ValueError(
            f"logits must be a float [rows, vocab] tensor with unit stride along vocab, got "
            f"{logits.dtype} {tuple(logits.shape)}"
        )
    if bitmask.dim() != 2 or bitmask.dtype != torch.int32 or bitmask.stride(1) != 1:
        raise ValueError(
            f"bitmask must be an int32 [masks, words] tensor, got {bitmask.dtype} "
            f"{tuple(bitmask.shape)}"
        )
    if rows.shape != (bitmask.shape[0],) or rows.dtype not in (torch.int32, torch.int64):
        raise ValueError(
            f"rows must be int32/int64 [{bitmask.shape[0]}] (one logits row per mask), got "
            f"{rows.dtype} {tuple(rows.shape)}"
        )
    if bitmask.device != logits.device or rows.device != logits.device:
        raise ValueError("logits, bitmask and rows must be on one device")
