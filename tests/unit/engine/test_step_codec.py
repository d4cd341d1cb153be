"""The step messages rank 0 sends tensor-parallel workers: every decoded step equals the
SchedulerOutput it was encoded from, and a running request's message holds only what is new."""

from __future__ import annotations

import pickle

from libkk import SamplingParams
from libkk.engine.step_codec import StepDecoder, StepEncoder
from libkk.runtime.io import DECODE_STEP, ScheduledRequest, SchedulerOutput
from libkk.sample.sampler import SamplingRow


class _Request:
    """A running request's live lists, as the scheduler and the KV cache manager hold them."""

    def __init__(self, rid: str, prompt_len: int, params: SamplingParams) -> None:
        self.rid = rid
        self.params = params
        self.prompt = list(range(100, 100 + prompt_len))
        self.outputs: list[int] = []
        self.blocks = [len(rid), 7]

    def scheduled(self, sampling: bool = True) -> ScheduledRequest:
        position = len(self.prompt) + len(self.outputs)
        row = None
        if sampling:
            row = SamplingRow(self.params, 3, position, self.prompt, self.outputs, (2,))
        return ScheduledRequest(self.rid, [5], position - 1, [self.blocks], row, [9, 8])


def _send(encoder: StepEncoder, decoder: StepDecoder, requests, preempted=()) -> tuple:
    step = SchedulerOutput(list(requests), list(preempted), kind=DECODE_STEP)
    message = pickle.loads(pickle.dumps(encoder.encode(step)))
    decoded = decoder.decode(message)
    assert decoded == step
    return message, step


def test_every_decoded_step_equals_the_encoded_one_through_growth_preemption_and_id_reuse():
    encoder, decoder = StepEncoder(), StepDecoder()
    greedy, hot = SamplingParams(temperature=0.0), SamplingParams(temperature=0.8, seed=1)
    a, b = _Request("a", 40, greedy), _Request("b", 70, hot)
    message, _ = _send(encoder, decoder, [a.scheduled(sampling=False), b.scheduled()])
    assert all(entry[3] < 0 for entry in message.requests)  # new: whole tables

    for step in range(5):  # both run; tokens and blocks grow
        a.outputs.append(step)
        b.outputs.append(50 + step)
        if step % 2:
            a.blocks.append(20 + step)
        message, _ = _send(encoder, decoder, [a.scheduled(), b.scheduled()])
    for entry in message.requests:  # running: only what is new
        rid, keep_blocks, row = entry[0], entry[3], entry[5]
        static, _, keep_outputs, tail, _ = row
        assert keep_blocks >= 0 and static is None and keep_outputs >= 0 and len(tail) == 1, rid

    # a's blocks freed and allocated again between two steps: a new, longer table goes whole.
    a.blocks = [40, 41, 42, 43, 44, 45, 46, 47]
    message, _ = _send(encoder, decoder, [a.scheduled(), b.scheduled()])
    assert message.requests[0][3] < 0 and message.requests[1][3] >= 0

    # a is preempted (its blocks freed, a new table later); b goes on alone.
    b.outputs.append(60)
    _send(encoder, decoder, [b.scheduled()], preempted=["a"])
    a.blocks = [30, 31, 32]
    message, _ = _send(encoder, decoder, [a.scheduled(), b.scheduled()])
    assert message.requests[0][3] < 0 and message.requests[0][5][0] is not None

    # b finishes and a new request reuses its id with other parameters in the next step.
    b2 = _Request("b", 12, SamplingParams(temperature=1.1, seed=9))
    b2.blocks = b.blocks  # even the same table object: the new parameters and prompt go whole
    message, _ = _send(encoder, decoder, [b2.scheduled()])
    assert message.requests[0][5][0] is not None and message.requests[0][5][2] < 0

    # A request's output list shrank (tokens after a stop string dropped): sent whole.
    b2.outputs.extend([1, 2, 3])
    _send(encoder, decoder, [b2.scheduled()])
    del b2.outputs[1:]
    message, _ = _send(encoder, decoder, [b2.scheduled()])
    assert message.requests[0][5][2] < 0


def test_a_running_batch_message_is_a_fraction_of_the_whole_step():
    encoder, decoder = StepEncoder(), StepDecoder()
    requests = [_Request(f"r{i}", 512, SamplingParams(temperature=0.0)) for i in range(32)]
    for step in range(3):
        for r in requests:
            r.outputs.append(step)
        message, whole = _send(encoder, decoder, [r.scheduled() for r in requests])
    assert len(pickle.dumps(message)) * 10 < len(pickle.dumps(whole))


def test_grammar_masks_reach_the_workers():
    """Structured output: the sampling row's mask and the masks of the rows after the drafts go
    with every step (only rank 0 runs the grammars); unconstrained requests send none."""
    import torch

    encoder, decoder = StepEncoder(), StepDecoder()
    params = SamplingParams(temperature=1.0, seed=1)
    first = torch.tensor([5, -1], dtype=torch.int32)
    after = torch.tensor([[3, 0], [0, 9]], dtype=torch.int32)
    outputs: list[int] = []
    row = SamplingRow(params, 3, 4, [1, 2, 3], outputs, (), first)
    constrained = ScheduledRequest("c", [5, 9, 8], 3, [[1]], row, [9, 8], draft_grammar_masks=after)
    plain = ScheduledRequest("p", [5], 2, [[2]], SamplingRow(params, 4, 3, [1, 2], [], ()))
    for _ in range(2):  # new, then running (sent as deltas): the masks go each time
        step = SchedulerOutput([constrained, plain], [], kind=DECODE_STEP)
        message = pickle.loads(pickle.dumps(encoder.encode(step)))
        c, p = decoder.decode(message).requests
        assert torch.equal(c.sampling.grammar_mask, first)
        assert torch.equal(c.draft_grammar_masks, after)
        assert p.sampling.grammar_mask is None and p.draft_grammar_masks is None
        assert message.requests[1][-1] is None
        outputs.append(7)
