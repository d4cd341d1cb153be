"""Token embedding and the LM head (its own weight, or tied to the embedding)."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from libkk.layers.linear import linear, new_param


class VocabEmbedding(nn.Module):
    def __init__(self, vocab_size: int, hidden_size: int) -> None:
        super().__init__()
        self.vocab_size = vocab_size
        self.hidden_size = hidden_size
        self.weight = new_param(vocab_size, hidden_size)  # [vocab, hidden]

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:  # [T] -> [T, hidden]
        return F.embedding(input_ids, self.weight)

    def use_table(self, table: torch.Tensor) -> None:
        """Serves the embedding from `table` (e.g. a read-only shared mapping), freeing the loaded
        copy. The Parameter object stays: a head tied to it reads the same table, and
        `parameters()`, `named_parameters()` and byte counts see it as before."""
        weight = self.weight
        if table.shape != weight.shape or table.dtype != weight.dtype:
            raise ValueError(
                f"embedding table is {tuple(table.shape)} {table.dtype}, "
                f"expected {tuple(weight.shape)} {weight.dtype}"
            )
        if table.device != weight.device:
            raise ValueError(f"embedding table is on {table.device}, expected {weight.device}")
        weight.data = table

    def extra_repr(self) -> str:
        return f"{self.vocab_size}, {self.hidden_size}"


class LMHead(nn.Module):
    """Projects hidden states to vocabulary logits.

    With `tie_to`, the head shares the embedding's Parameter object: `named_parameters()` lists it
    once (under the embedding's name), so it is loaded once and never reported missing.
    """

    def __init__(
        self, vocab_size: int, hidden_size: int, tie_to: VocabEmbedding | None = None
    ) -> None:
        super().__init__()
        self.vocab_size = vocab_size
        self.tied = tie_to is not None
        self.weight = tie_to.weight if tie_to is not None else new_param(vocab_size, hidden_size)

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:  # [N, hidden] -> [N, vocab] fp32
        # NOTE: the matmul runs in the model dtype (as HF's lm_head does); only the result is
        # widened, so bf16 logits round the same way as the reference.
        return linear(hidden, self.weight).float()

    def extra_repr(self) -> str:
        return f"vocab={self.vocab_size}, tied={self.tied}"
