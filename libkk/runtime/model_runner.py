"""Runs one scheduled step: builds the flat batch, calls the model, samples the next tokens."""

from __future__ import annotations

import torch
from torch import nn

from libkk.config import CompilationConfig
from libkk.graphs.capture import DEFAULT_CAPTURE_SIZES, DecodeGraphs
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
        *,
        compilation: CompilationConfig | None = None,
        max_num_seqs: int = 1,
        max_model_len: int = 1,
        capturable: bool = True,
        progress: bool = False,
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
        self.graphs: DecodeGraphs | None = None
        compilation = compilation or CompilationConfig()
        # model.forward(input_ids, positions), compiled on CUDA (CPU stays eager: exact parity
        # with the reference and no compile time).
        self.forward = model.forward
        if device.type == "cuda" and compilation.torch_compile:
            self.forward = torch.compile(model.forward, dynamic=True)
        if device.type == "cuda" and compilation.cudagraph_mode != "NONE" and capturable:
            sizes = [
                s
                for s in (compilation.cudagraph_capture_sizes or DEFAULT_CAPTURE_SIZES)
                if s <= max_num_seqs
            ] or [max_num_seqs]
            self.graphs = DecodeGraphs(
                self.forward,
                capture_sizes=sizes,
                max_blocks_per_seq=-(-max_model_len // block_size),
                block_size=block_size,
                device=device,
            )
            self.graphs.capture(progress=progress)

    @torch.inference_mode()
    def execute(self, sched_out: SchedulerOutput) -> ModelRunnerOutput:
        batch = build_input_batch(sched_out, self.block_size, self.device)
        num_tokens = batch.input_ids.shape[0]
        if self.graphs is not None and self.graphs.can_run(batch.attn_metadata, num_tokens):
            hidden = self.graphs.run(batch.input_ids, batch.positions, batch.attn_metadata)
        else:
            with set_forward_context(batch.attn_metadata):
                hidden = self.forward(batch.input_ids, batch.positions)  # [num_tokens, hidden]
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
