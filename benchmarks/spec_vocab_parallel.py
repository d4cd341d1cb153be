"""Vocab-parallel drafting + verification vs the full-vocab path, per speculative step.

The step: draft K tokens per request from a block drafter's logits (one forward gives all K
slots), then verify them against the target's K+1 rows. Full-vocab path: every rank all-gathers
its vocab shard of the draft and target logits and runs `sample_draft_full` + `rejection_sample`
on whole rows. Vocab-parallel path: `vocab_parallel_draft` + `vocab_parallel_rejection_sample`,
whose three all-gathers carry a few numbers per row.

    python benchmarks/spec_vocab_parallel.py                              # 1 GPU, 2 simulated shards
    torchrun --nproc_per_node 2 benchmarks/spec_vocab_parallel.py         # 2 GPUs, NCCL

Defaults: Qwen3 vocab 151936, K = 7, batch 1 / 8 / 32. Prints a table (ms per step, bytes
gathered per rank) and writes JSON (--out). In one process the simulated shards run one after
the other, so its vocab-parallel time is the work of all ranks together; under torchrun each
rank times its own shard plus the real NCCL all-gathers.
"""

from __future__ import annotations

import argparse
import json
import os
import time

import torch
import torch.distributed as dist

from libkk.sample.rejection import rejection_sample
from libkk.spec_decode.vocab_parallel import (
    sample_draft_full,
    stack_gather,
    vocab_parallel_draft,
    vocab_parallel_rejection_sample,
    vocab_starts,
)


def _all_gather(local: torch.Tensor) -> torch.Tensor:
    out = torch.empty((dist.get_world_size(), *local.shape), dtype=local.dtype, device=local.device)
    dist.all_gather_into_tensor(out, local.contiguous())
    return out


class Bytes:
    """Wraps a gather to count the bytes each rank contributes."""

    def __init__(self, gather) -> None:
        self.gather, self.bytes = gather, 0

    def __call__(self, tensors: list[torch.Tensor]) -> torch.Tensor:
        self.bytes += sum(t.numel() * t.element_size() for t in tensors) // len(tensors)
        return self.gather(tensors)


def _sync() -> None:
    if torch.cuda.is_available():
        torch.cuda.synchronize()


def _timed(fn, iters: int) -> float:
    for _ in range(3):
        fn()
    _sync()
    start = time.perf_counter()
    for _ in range(iters):
        fn()
    _sync()
    return (time.perf_counter() - start) / iters * 1e3


def bench_batch(
    batch: int,
    args: argparse.Namespace,
    dev: torch.device,
    sizes: list[int],
    mine: list[int],
    base_gather,
) -> dict:
    """Time one batch size on both paths; this process holds the shards listed in `mine`."""
    k = args.k
    starts = vocab_starts(sizes)
    my_starts = [starts[i] for i in mine]
    g = torch.Generator(device=dev).manual_seed(batch)
    draft = torch.randn(batch, k, args.vocab, device=dev, generator=g) * 3  # [R, K, V]
    target = draft + torch.randn(batch, k, args.vocab, device=dev, generator=g)
    target = torch.cat([target, torch.randn_like(target[:, :1]) * 3], dim=1)  # [R, K+1, V]
    draft_shards = [draft[..., starts[s] : starts[s] + sizes[s]].contiguous() for s in mine]
    target_shards = [target[..., starts[s] : starts[s] + sizes[s]].contiguous() for s in mine]
    del draft, target
    temps = torch.full((batch,), args.temperature, device=dev)
    seeds = torch.arange(batch, dtype=torch.int64, device=dev) * 7919
    positions = torch.full((batch,), 1000, dtype=torch.int64, device=dev)
    num_draft = torch.full((batch,), k, dtype=torch.int64, device=dev)
    flat_t = temps.repeat_interleave(k)
    flat_s = seeds.repeat_interleave(k)
    flat_p = (positions[:, None] + torch.arange(k, device=dev)).reshape(-1)
    full_bytes = Bytes(base_gather)
    vp_bytes = Bytes(base_gather)

    def full_step(counter: Bytes = full_bytes) -> None:
        d = counter([x.reshape(batch * k, -1) for x in draft_shards])  # [S, R*K, Vs]
        d = torch.cat(list(d), dim=-1)  # [R*K, V]
        tokens = sample_draft_full(d, flat_t, flat_s, flat_p).view(batch, k)
        probs = torch.softmax(d.view(batch, k, -1) / temps[:, None, None], dim=-1)
        t = torch.cat(list(counter(target_shards)), dim=-1)  # [R, K+1, V]
        rejection_sample(t, tokens, probs, temps, seeds, positions, num_draft)

    def vp_step(counter: Bytes = vp_bytes) -> None:
        flat = [x.reshape(batch * k, -1) for x in draft_shards]
        s = vocab_parallel_draft(flat, my_starts, flat_t, flat_s, flat_p, counter)
        vocab_parallel_rejection_sample(
            target_shards,
            draft_shards,
            my_starts,
            s.token_ids.view(batch, k),
            s.logprobs.view(batch, k),
            s.lse.view(batch, k),
            temps,
            seeds,
            positions,
            num_draft,
            counter,
        )

    full_step()
    vp_step()
    row = dict(
        batch=batch,
        full_gather_bytes=full_bytes.bytes,
        vocab_parallel_gather_bytes=vp_bytes.bytes,
    )
    row["full_ms"] = _timed(full_step, args.iters)
    row["vocab_parallel_ms"] = _timed(vp_step, args.iters)
    return row


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--vocab", type=int, default=151936)
    ap.add_argument("--k", type=int, default=7)
    ap.add_argument("--batches", default="1,8,32")
    ap.add_argument("--shards", type=int, default=2, help="simulated shards (single process)")
    ap.add_argument("--temperature", type=float, default=0.8)
    ap.add_argument("--iters", type=int, default=20)
    ap.add_argument("--out", default="spec_vocab_parallel.json")
    ap.add_argument("--device", default="cuda", help="cpu: a quick run of the script itself")
    args = ap.parse_args()

    distributed = "WORLD_SIZE" in os.environ
    if distributed:
        torch.cuda.set_device(int(os.environ["LOCAL_RANK"]))
        dist.init_process_group("nccl")
        rank, world = dist.get_rank(), dist.get_world_size()
    else:
        rank, world = 0, args.shards
    dev = torch.device(args.device)
    # Vocab-parallel heads pad to equal shards; so do all_gather_into_tensor and this benchmark.
    if args.vocab % world:
        raise SystemExit(f"--vocab {args.vocab} must divide into {world} equal shards")
    sizes = [args.vocab // world] * world
    mine = [rank] if distributed else list(range(world))
    base_gather = (lambda ts: _all_gather(ts[0])) if distributed else stack_gather

    results = []
    for batch in (int(b) for b in args.batches.split(",")):
        row = bench_batch(batch, args, dev, sizes, mine, base_gather)
        row.update(world=world, distributed=distributed)
        results.append(row)
        if rank == 0:
            print(
                f"batch {batch:3d}  shards {world}  full {row['full_ms']:8.3f} ms "
                f"({row['full_gather_bytes'] / 1e6:8.2f} MB gathered)  vocab-parallel "
                f"{row['vocab_parallel_ms']:8.3f} ms "
                f"({row['vocab_parallel_gather_bytes'] / 1e3:8.2f} KB gathered)"
            )
    if rank == 0:
        with open(args.out, "w") as f:
            json.dump(dict(vocab=args.vocab, k=args.k, results=results), f, indent=1)
    if distributed:
        dist.destroy_process_group()


if __name__ == "__main__":
    main()
