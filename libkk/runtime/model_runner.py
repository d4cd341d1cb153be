"""Runs one scheduled step: builds the flat batch, calls the model, samples the next tokens."""

from __future__ import annotations

import torch
from torch import nn

from libkk.layers.forward_context import set_forward_context
from libkk.runtime.input_batch import build_input_batch
from libkk.runtime.io import ModelRunnerOutput, SchedulerOutput
from libkk.sample.sampler import Sampler


class ModelRunner:
    def __init__(
        self,
        model: nn.Module,
        kv_caches: list[torch.Tensor],
        block_size: int,
        device: torch.device,
    ) -> None:
        self.model = model
        self.block_size = block_size
        self.device = device
        self.sampler = Sampler()
        self.kv_caches = kv_caches
        layers = model.attention_layers()
        if len(layers) != len(kv_caches):
            raise ValueError(f"{len(layers)} attention layers but {len(kv_caches)} KV caches")
        for layer, cache in zip(layers, kv_caches, strict=True):
            layer.kv_cache = cache

    @torch.inference_mode()
    def execute(self, sched_out: SchedulerOutput) -> ModelRunnerOutput:
        batch = build_input_batch(sched_out, self.block_size, self.device)
        with set_forward_context(batch.attn_metadata):
            hidden = self.model(batch.input_ids, batch.positions)  # [num_tokens, hidden]
        out = ModelRunnerOutput()
        if not batch.sampling_rows:
            return out
        logits = self.model.compute_logits(hidden[batch.logits_indices])  # [num_sampling, vocab]
        sampled = self.sampler(logits, batch.sampling_rows)
        for rid, token, lp in zip(
            batch.sampling_request_ids, sampled.token_ids, sampled.logprobs, strict=True
        ):
            out.sampled_token_ids[rid] = [token]
            out.logprobs[rid] = [lp]
        return out
