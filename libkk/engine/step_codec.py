"""A step as rank 0 sends it to the tensor-parallel workers: what changed since the last step.

A decode step's `SchedulerOutput` repeats, per request, its whole block table, its sampling
parameters, its prompt and its output tokens; pickling that and rebuilding it on a worker cost
more host time every step than the step's own input preparation (`benchmarks/step_messages.py`).
Both ends therefore keep the same per-request state — the block table, the parameters, the seed,
the prompt and the outputs of each request of the previous message — and a request that was in
the previous message is sent as tuples of what is new: block ids and output tokens appended
since (the lists only grow while a request runs), its position, bans and drafts. Everything else
goes whole: a request absent from the previous message (new, resumed after preemption, or a new
request reusing an id), a list that is no longer the one last sent (blocks freed and allocated
again), or one that shrank. Each end drops the state of requests the message does not hold, so
both always hold the same ids.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from torch import Tensor

from libkk.runtime.io import ScheduledRequest, SchedulerOutput
from libkk.sample.params import SamplingParams
from libkk.sample.sampler import SamplingRow


@dataclass
class _Sent:
    """What rank 0 sent of one request: the lists by identity, and how much of each."""

    block_tables: tuple[list[int], ...]  # each group's table
    num_blocks: int
    row: SamplingRow | None
    num_outputs: int


@dataclass
class StepMessage:
    kind: str
    preempted_request_ids: list[str]
    # Per request: (request_id, token_ids, num_computed_tokens, keep_blocks, new_block_ids,
    # row, spec_token_ids, draft_logits, last_token_in_flight, grammar_masks). new_block_ids:
    # per KV group, what follows the first keep_blocks of the table last sent; keep_blocks < 0:
    # the whole tables. row: None (no sampling) or (static, position,
    # keep_outputs, new_outputs, banned_token_ids); static is None when unchanged, else (params,
    # seed, prompt_token_ids), and keep_outputs < 0 means new_outputs are all of them.
    # grammar_masks: None, or the row's grammar_mask and the draft_grammar_masks, sent whole (only
    # rank 0 runs the grammars; every rank applies the same masks).
    requests: list[tuple]


def _grown(old: list[int] | None, new: list[int], num_sent: int) -> bool:
    """Whether `new` is the list last sent with `num_sent` items, grown or not since."""
    return new is old and len(new) >= num_sent


class StepEncoder:
    """Rank 0's side: turns each SchedulerOutput into the StepMessage the workers decode."""

    def __init__(self) -> None:
        self._sent: dict[str, _Sent] = {}

    def encode(self, sched_out: SchedulerOutput) -> StepMessage:
        sent: dict[str, _Sent] = {}
        entries = []
        for r in sched_out.requests:
            last = self._sent.get(r.request_id)
            tables = tuple(r.block_tables)
            if last is not None and all(
                _grown(sent_table, table, last.num_blocks)
                for sent_table, table in zip(last.block_tables, tables, strict=True)
            ):
                keep_blocks = last.num_blocks
                new_blocks = tuple(table[keep_blocks:] for table in tables)
            else:
                keep_blocks, new_blocks = -1, tables
            row, row_entry, num_outputs = r.sampling, None, 0
            if row is not None:
                last_row = last.row if last is not None else None
                same = last_row is not None and (
                    row.params is last_row.params
                    and row.seed == last_row.seed
                    and row.prompt_token_ids is last_row.prompt_token_ids
                )
                static = None if same else (row.params, row.seed, row.prompt_token_ids)
                outputs = row.output_token_ids
                num_outputs = len(outputs)
                if same and _grown(last_row.output_token_ids, outputs, last.num_outputs):
                    keep, tail = last.num_outputs, outputs[last.num_outputs :]
                else:
                    keep, tail = -1, outputs
                row_entry = (static, row.position, keep, tail, tuple(row.banned_token_ids))
            entries.append(
                (r.request_id, r.token_ids, r.num_computed_tokens, keep_blocks, new_blocks,
                 row_entry, r.spec_token_ids, r.draft_logits, r.last_token_in_flight,
                 _grammar_masks(r))
            )  # fmt: skip
            sent[r.request_id] = _Sent(tables, len(tables[0]), row, num_outputs)
        self._sent = sent
        return StepMessage(sched_out.kind, list(sched_out.preempted_request_ids), entries)


def _grammar_masks(r: ScheduledRequest) -> tuple[Tensor | None, Tensor | None] | None:
    """A request's grammar masks as sent (None: unconstrained)."""
    mask = None if r.sampling is None else r.sampling.grammar_mask
    if mask is None and r.draft_grammar_masks is None:
        return None
    return mask, r.draft_grammar_masks


@dataclass
class _Held:
    """A worker's copy of one request's state, as of the last message."""

    block_tables: list[list[int]]  # each group's
    static: tuple[SamplingParams, int, Sequence[int]] | None  # (params, seed, prompt_token_ids)
    output_token_ids: list[int]


class StepDecoder:
    """A worker's side: rebuilds the SchedulerOutput rank 0 encoded."""

    def __init__(self) -> None:
        self._held: dict[str, _Held] = {}

    def decode(self, message: StepMessage) -> SchedulerOutput:
        held: dict[str, _Held] = {}
        requests = []
        for (rid, token_ids, num_computed, keep_blocks, new_blocks, row_entry, spec_ids,
             draft_logits, in_flight, grammar_masks) in message.requests:  # fmt: skip
            last = self._held.get(rid)
            if keep_blocks < 0:
                tables = list(new_blocks)
            else:
                assert last is not None and len(last.block_tables[0]) >= keep_blocks, rid
                tables = last.block_tables
                for blocks, new in zip(tables, new_blocks, strict=True):
                    del blocks[keep_blocks:]
                    blocks.extend(new)
            state = _Held(tables, None, [])
            if last is not None:
                state.static, state.output_token_ids = last.static, last.output_token_ids
            sampling = None
            if row_entry is not None:
                static, position, keep, tail, banned = row_entry
                if static is not None:
                    state.static, state.output_token_ids = static, []
                assert state.static is not None, f"request {rid}: a row with no parameters held"
                outputs = state.output_token_ids
                assert len(outputs) >= keep, rid
                del outputs[max(keep, 0) :]
                outputs.extend(tail)
                params, seed, prompt = state.static
                sampling = SamplingRow(
                    params=params,
                    seed=seed,
                    position=position,
                    prompt_token_ids=prompt,
                    output_token_ids=outputs,
                    banned_token_ids=banned,
                    grammar_mask=None if grammar_masks is None else grammar_masks[0],
                )
            held[rid] = state
            requests.append(
                ScheduledRequest(
                    request_id=rid,
                    token_ids=token_ids,
                    num_computed_tokens=num_computed,
                    block_tables=tables,
                    sampling=sampling,
                    spec_token_ids=spec_ids,
                    draft_logits=draft_logits,
                    draft_grammar_masks=None if grammar_masks is None else grammar_masks[1],
                    last_token_in_flight=in_flight,
                )
            )
        self._held = held
        return SchedulerOutput(requests, message.preempted_request_ids, kind=message.kind)
