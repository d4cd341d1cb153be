"""An embedding served from a host-memory table: rows are gathered on the host, then copied in.

Used on CUDA with `shared_host_tables=True`: the table stays in the host's shared mapping and
the device holds only a static buffer of the step's rows. The model runner calls `stage(ids)`
with the step's token ids before the forward; `forward` returns the staged rows. Because the
buffer's address never changes, the forward can be compiled and replayed as a CUDA graph: the
gather happens outside the graph, the graph only reads the buffer.
"""

from __future__ import annotations

import numpy as np
import torch
from torch import nn


class HostRowsEmbedding(nn.Module):
    def __init__(self, table: torch.Tensor, device: torch.device, max_num_tokens: int) -> None:
        super().__init__()
        if table.device.type != "cpu" or table.dim() != 2:
            raise ValueError(
                f"host table must be a 2-D CPU tensor, got {table.device} {table.dim()}-D"
            )
        self.table = table  # [vocab, hidden], e.g. a read-only shared mapping
        self.vocab_size, self.hidden_size = table.shape
        self.max_num_tokens = max_num_tokens
        pin = device.type == "cuda"
        self.staging = torch.empty(
            max_num_tokens, self.hidden_size, dtype=table.dtype, pin_memory=pin
        )  # [max_num_tokens, hidden]
        # Not a parameter: nothing loads into it, and weight byte counts leave it out.
        self.register_buffer(
            "rows",
            torch.zeros(max_num_tokens, self.hidden_size, dtype=table.dtype, device=device),
            persistent=False,
        )  # [max_num_tokens, hidden]
        self._copied: torch.cuda.Event | None = None

    def stage(self, input_ids: np.ndarray) -> None:
        """Gathers the rows of `input_ids` [T] into the device buffer (asynchronously on CUDA)."""
        n = len(input_ids)
        if n > self.max_num_tokens:
            raise ValueError(
                f"a step of {n} tokens exceeds the staged embedding's {self.max_num_tokens} rows"
            )
        if self._copied is not None:
            self._copied.synchronize()  # the previous step's copy still reads the staging rows
        ids = torch.from_numpy(np.asarray(input_ids, dtype=np.int64))
        torch.index_select(self.table, 0, ids, out=self.staging[:n])
        self.rows[:n].copy_(self.staging[:n], non_blocking=True)
        if self.rows.is_cuda:
            self._copied = torch.cuda.Event()
            self._copied.record()

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:  # [T] -> [T, hidden]
        return self.rows[: input_ids.shape[0]]

    def extra_repr(self) -> str:
        return f"{self.vocab_size}, {self.hidden_size}, host table, {self.max_num_tokens} rows"
