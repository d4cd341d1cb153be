"""Token embedding and the LM head (its own weight, or tied to the embedding).

Under tensor parallelism both are vocab-parallel: rank r holds rows [r * P, (r + 1) * P) of the
vocabulary, P = ceil(vocab / tp), the last rank's rows past the vocabulary zero-filled. The
embedding looks up the ids it holds (zeros for the rest) and all-reduces; the head returns this
rank's logits [N, P], which the model runner gathers to the full vocabulary (`gather_logits`),
or, for vocab-parallel sampling, keeps as they are (`vocab_shard` names the ids they cover).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from libkk.distributed import all_gather_last_dim, all_reduce, get_tp_rank, get_tp_size
from libkk.layers.linear import check_shape, linear, new_param


def vocab_part(vocab_size: int) -> tuple[range, int]:
    """(this rank's rows of the vocabulary, rows every rank allocates)."""
    size = get_tp_size()
    per = -(-vocab_size // size)
    start = min(get_tp_rank() * per, vocab_size)
    return range(start, min(start + per, vocab_size)), per


def _vocab_param(vocab_size: int, hidden_size: int) -> tuple[nn.Parameter, range]:
    rows, per = vocab_part(vocab_size)
    if get_tp_size() == 1:
        return new_param(vocab_size, hidden_size), rows  # [vocab, hidden]

    def load(param: nn.Parameter, loaded: torch.Tensor, name: str, shard_id: object = None) -> None:
        # The loader hands over rows [start, stop) of the vocabulary; padding rows stay zero.
        target = param.data[: len(rows)]
        check_shape(name, target.shape, loaded.shape)
        target.copy_(loaded)
        param.data[len(rows) :].zero_()

    param = new_param(
        per, hidden_size, loader=load, tp_slices=lambda _: [(0, rows.start, rows.stop)]
    )  # [vocab / tp (rounded up), hidden]
    return param, rows


class VocabEmbedding(nn.Module):
    def __init__(self, vocab_size: int, hidden_size: int) -> None:
        super().__init__()
        self.vocab_size = vocab_size
        self.hidden_size = hidden_size
        self.weight, self.vocab_rows = _vocab_param(vocab_size, hidden_size)

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:  # [T] -> [T, hidden]
        if get_tp_size() == 1:
            return F.embedding(input_ids, self.weight)
        start, stop = self.vocab_rows.start, self.vocab_rows.stop
        mine = (input_ids >= start) & (input_ids < stop)  # [T]
        local = torch.where(mine, input_ids - start, 0)
        out = F.embedding(local, self.weight) * mine[:, None].to(self.weight.dtype)
        return all_reduce(out)  # exactly one rank contributes each row

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
        if tie_to is not None:
            self.weight = tie_to.weight
        else:
            self.weight, _ = _vocab_param(vocab_size, hidden_size)

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        # [N, hidden] -> [N, vocab] fp32; under tensor parallelism this rank's [N, vocab / tp]
        # NOTE: the matmul runs in the model dtype (as HF's lm_head does); only the result is
        # widened, so bf16 logits round the same way as the reference.
        return linear(hidden, self.weight).float()

    @property
    def vocab_shard(self) -> range:
        """The token ids of this rank's logits columns (the columns after them are padding)."""
        return vocab_part(self.vocab_size)[0]

    def gather_logits(self, logits: torch.Tensor) -> torch.Tensor:
        """Every rank's [N, vocab / tp] logits side by side: [N, vocab] (a collective)."""
        if get_tp_size() == 1:
            return logits
        return all_gather_last_dim(logits)[:, : self.vocab_size]

    def argmax(self, hidden: torch.Tensor) -> torch.Tensor:  # [N, hidden] -> [N] int64
        """The argmax token of each row's full-vocabulary logits (ties to the lowest id) on every
        rank. Under tensor parallelism each rank takes its shard's (max, token) and one [N, 2]
        gather picks the winner, instead of gathering [N, vocab] logits."""
        logits = self.forward(hidden)
        if get_tp_size() == 1:
            return logits.argmax(dim=-1)
        rows, _ = vocab_part(self.vocab_size)
        stats = shard_argmax_stats(logits[:, : len(rows)], rows.start)  # padding cut off
        return merge_shard_argmax(all_gather_last_dim(stats[:, :, None]).permute(2, 0, 1))

    def extra_repr(self) -> str:
        return f"vocab={self.vocab_size}, tied={self.tied}"


def vocab_parallel_head(model: nn.Module) -> LMHead | None:
    """The model's LM head if its logits can be used from vocabulary shards: a plain `LMHead`
    whose output `compute_logits` only gathers (every libkk model) and that gives every rank at
    least one token id. None otherwise (callers then gather whole rows)."""
    head = getattr(model, "lm_head", None)
    if not isinstance(head, LMHead):
        return None
    _, per = vocab_part(head.vocab_size)
    if per * (get_tp_size() - 1) >= head.vocab_size:  # the last rank would hold no token
        return None
    return head


def shard_argmax_stats(logits: torch.Tensor, vocab_start: int) -> torch.Tensor:
    """One vocabulary shard's (max logit, its token id) per row.  # [R, 2] float64

    logits: [R, Vs] of token ids vocab_start .. vocab_start + Vs - 1, without padding columns (a
    padded shard's zero rows could win); ties go to the lowest id within the shard. float64
    carries fp32 values and token ids exactly.
    """
    value, index = logits.float().max(dim=-1)
    return torch.stack([value.double(), (index + vocab_start).double()], dim=-1)


def merge_shard_argmax(stats: torch.Tensor) -> torch.Tensor:
    """The argmax token [R] int64 from every shard's [S, R, 2] stats, shards in vocab order: the
    first shard holding the row's max wins, which is argmax's lowest-id rule over the whole row."""
    value, token = stats.unbind(-1)  # [S, R] each
    first = (value == value.amax(dim=0, keepdim=True)).to(torch.int8).argmax(dim=0, keepdim=True)
    return token.gather(0, first).squeeze(0).long()
