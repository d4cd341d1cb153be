"""HostRowsEmbedding: the step's rows gathered from a host table into a static buffer."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from libkk.layers.host_embedding import HostRowsEmbedding


def test_staged_rows_are_the_table_rows_in_a_fixed_buffer():
    table = torch.randn(50, 8)
    emb = HostRowsEmbedding(table, torch.device("cpu"), max_num_tokens=6)
    buffer = emb.rows.data_ptr()
    for ids in ([3, 3, 49, 0], [7], [1, 2, 3, 4, 5, 6]):
        emb.stage(np.array(ids))
        out = emb(torch.tensor(ids))
        assert torch.equal(out, table[ids])
        assert out.data_ptr() == buffer  # graphs replay against the same address
    assert not list(emb.parameters())  # no weights of its own: nothing to load or count


def test_a_step_larger_than_the_buffer_is_refused():
    emb = HostRowsEmbedding(torch.zeros(10, 4), torch.device("cpu"), max_num_tokens=2)
    with pytest.raises(ValueError, match="exceeds the staged embedding's 2 rows"):
        emb.stage(np.array([1, 2, 3]))
