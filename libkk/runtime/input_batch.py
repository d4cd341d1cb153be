"""Flattens one step's scheduled requests into the tensors the model and attention read."""

from __future__ import annotations

from dataclasses import dataclass
from itertools import chain

import numpy as np
import torch

from libkk.layers.forward_context import AttentionMetadata, grouped_metadata
from libkk.runtime.io import ScheduledRequest, SchedulerOutput
from libkk.sample.sampler import SamplingRow


@dataclass
class InputBatch:
    input_ids: torch.Tensor  # [num_tokens] int64
    # [num_tokens] int64, the host copy (host-table embeddings read it); with async scheduling a
    # token still in flight is PLACEHOLDER_TOKEN_ID here, filled in on the device only.
    input_ids_cpu: np.ndarray
    positions: torch.Tensor  # [num_tokens] int64
    attn_metadata: AttentionMetadata
    # [sum(1 + num_spec)] int64: the last 1 + n rows of each sampling request (n = its drafts).
    logits_indices: torch.Tensor
    sampling_rows: list[SamplingRow]
    sampling_request_ids: list[str]
    num_spec: list[int]  # per sampling request: drafts verified this step


def build_input_batch(
    sched_out: SchedulerOutput, block_size: int, device: torch.device, num_kv_groups: int = 1
) -> InputBatch:
    requests = sched_out.requests
    num_reqs = len(requests)
    query_lens = np.fromiter((len(r.token_ids) for r in requests), np.int64, num_reqs)
    starts = np.fromiter((r.num_computed_tokens for r in requests), np.int64, num_reqs)
    query_start_loc = np.zeros(num_reqs + 1, np.int64)
    np.cumsum(query_lens, out=query_start_loc[1:])
    seq_lens = starts + query_lens
    num_tokens = int(query_start_loc[-1])

    input_ids = np.fromiter(
        chain.from_iterable(r.token_ids for r in requests), np.int64, num_tokens
    )
    # Position of every token: its request's start plus its offset within the query.
    row_req = np.repeat(np.arange(num_reqs), query_lens)
    positions = np.arange(num_tokens) - query_start_loc[row_req] + starts[row_req]

    max_blocks = int(((seq_lens + block_size - 1) // block_size).max())
    block_tables = _block_tables(requests, num_kv_groups, max_blocks)
    slot_mappings = (
        block_tables[:, row_req, positions // block_size].astype(np.int64) * block_size
        + positions % block_size
    )

    # The last 1 + n rows of every sampling request (n = its drafts).
    sampling = [i for i, r in enumerate(requests) if r.sampling is not None]
    num_spec = [requests[i].num_spec_tokens for i in sampling]
    ends = query_start_loc[1:].tolist()
    logits_indices = np.fromiter(
        chain.from_iterable(
            range(ends[i] - 1 - n, ends[i]) for i, n in zip(sampling, num_spec, strict=True)
        ),
        np.int64,
        len(sampling) + sum(num_spec),
    )

    # NOTE: one copy for all of them: a copy that is not asynchronous would wait for the device's
    # queued work, which under async scheduling is the previous step.
    slots, qsl, lens, tables, ids, pos, rows = arrays_to_device(
        [slot_mappings, query_start_loc.astype(np.int32), seq_lens.astype(np.int32), block_tables,
         input_ids, positions.astype(np.int64), logits_indices],
        device,
    )  # fmt: skip
    metadata = grouped_metadata(
        slots,
        tables,
        query_start_loc=qsl,
        seq_lens=lens,
        block_size=block_size,
        max_query_len=int(query_lens.max()),
        max_seq_len=int(seq_lens.max()),
        query_start_loc_cpu=query_start_loc.tolist(),
        seq_lens_cpu=seq_lens.tolist(),
    )
    return InputBatch(
        input_ids=ids,
        input_ids_cpu=input_ids,
        positions=pos,
        attn_metadata=metadata,
        logits_indices=rows,
        sampling_rows=[requests[i].sampling for i in sampling],
        sampling_request_ids=[requests[i].request_id for i in sampling],
        num_spec=num_spec,
    )


def _block_tables(
    requests: list[ScheduledRequest], num_kv_groups: int, max_blocks: int
) -> np.ndarray:
    """[G, num_reqs, max_blocks]: each request's first max_blocks blocks in every KV group (as
    many in each), padded with the null block (0)."""
    num_reqs = len(requests)
    tables = np.zeros((num_kv_groups, num_reqs, max_blocks), np.int32)
    held = np.fromiter((len(r.block_tables[0]) for r in requests), np.int64, num_reqs)
    num_filled = np.minimum(held, max_blocks)
    filled_mask = np.arange(max_blocks)[None, :] < num_filled[:, None]
    for group in range(num_kv_groups):
        filled = np.fromiter(
            chain.from_iterable(
                r.block_tables[group] if h <= max_blocks else r.block_tables[group][:max_blocks]
                for r, h in zip(requests, held.tolist(), strict=True)
            ),
            np.int32,
            int(num_filled.sum()),
        )
        tables[group][filled_mask] = filled  # row-major
    return tables


def host_to_device(t: torch.Tensor, device: torch.device) -> torch.Tensor:
    """An asynchronous host->device copy that never waits for the device's queued work.

    NOTE: on CUDA the source is staged in pinned memory first: a copy from pageable memory may
    wait for the stream, which under async scheduling still runs the previous step.
    """
    if device.type == "cuda":
        t = t.pin_memory()
    return t.to(device, non_blocking=True)


def arrays_to_device(arrays: list[np.ndarray], device: torch.device) -> list[torch.Tensor]:
    """Host arrays as device tensors (same dtypes and shapes) through one asynchronous copy.

    On CUDA the arrays are packed into one pinned byte buffer (each at an 8-byte aligned offset),
    copied once, and viewed back on the device: one copy launch per step instead of one per array.
    """
    if device.type != "cuda":
        return [torch.from_numpy(np.ascontiguousarray(a)) for a in arrays]
    offsets, total = [], 0
    for a in arrays:
        offsets.append(total)
        total += -(-a.nbytes // 8) * 8
    staging = torch.empty(total, dtype=torch.uint8, pin_memory=True)
    packed = staging.numpy()
    for a, at in zip(arrays, offsets, strict=True):
        packed[at : at + a.nbytes] = np.ascontiguousarray(a).reshape(-1).view(np.uint8)
    on_device = staging.to(device, non_blocking=True)
    return [
        on_device[at : at + a.nbytes].view(torch.from_numpy(a).dtype).view(a.shape)
        for a, at in zip(arrays, offsets, strict=True)
    ]
