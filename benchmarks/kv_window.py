"""KV memory one long sequence holds, with and without separate KV groups (hybrid models).

Drives libkk's own KV cache manager through one request at a real model's layer pattern:
a prompt of --context tokens prefilled in --step-tokens chunks, then --decode tokens one at a
time, as the scheduler asks for blocks. Reports, for the layout libkk plans (separate groups for
hybrid models) and for one block table over every layer, the most and the last bytes of KV the
request held (blocks held x bytes a block holds), and what the engine's sizing plans for one
such sequence. Bookkeeping only: no model runs, so it runs anywhere in seconds.

    python benchmarks/kv_window.py --shape gemma3-12b --context 32768
    python benchmarks/kv_window.py --shape gpt-oss-20b --context 32768
"""

from __future__ import annotations

import argparse
import sys
from dataclasses import dataclass, field
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).parent))

from decode import SHAPES

from libkk.cache.kv_cache import (
    KVGroups,
    kv_blocks_per_seq,
    kv_cache_bytes_per_block,
    plan_kv_groups,
)
from libkk.cache.kv_cache_manager import KVCacheManager

GiB = 1 << 30
KV_DTYPES = {"bf16": torch.bfloat16, "fp8": torch.float8_e4m3fn, "fp32": torch.float32}


@dataclass
class _Request:
    request_id: str
    all_token_ids: list[int] = field(default_factory=list)
    num_computed_tokens: int = 0


def layer_windows(cfg: dict) -> list[int | None]:
    layers = cfg["num_hidden_layers"]
    kinds = cfg.get("layer_types") or [
        "full_attention" if (i + 1) % cfg.get("sliding_window_pattern", 1) == 0 else "sliding"
        for i in range(layers)
    ]
    return [None if k == "full_attention" else cfg.get("sliding_window") for k in kinds]


def held_blocks(groups: KVGroups, context: int, step: int, decode: int, bs: int) -> list[int]:
    """Blocks the request holds after each step (every group together)."""
    mgr = KVCacheManager(
        num_blocks=groups.num_groups * (-(-(context + decode) // bs) + 2) + 1,
        block_size=bs,
        enable_caching=False,
        windows=groups.windows,
    )
    req = _Request("r", list(range(context)))
    held = []
    for start in [*range(0, context, step), *range(context, context + decode)]:
        n = min(step, context - start) if start < context else 1
        if start >= context:
            req.all_token_ids.append(start)
        assert mgr.allocate_slots(req, n) is not None
        req.num_computed_tokens += n
        mgr.step_finished(req.request_id, start)
        held.append(mgr.num_held_blocks(req.request_id))
    return held


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--shape", choices=sorted(SHAPES), default="gemma3-12b")
    ap.add_argument("--context", type=int, default=32768, help="prompt tokens (default: 32768)")
    ap.add_argument("--decode", type=int, default=64, help="tokens decoded after (default: 64)")
    ap.add_argument("--step-tokens", type=int, default=2048, help="prefill chunk (default: 2048)")
    ap.add_argument("--block-size", type=int, default=16)
    ap.add_argument("--kv-dtype", choices=sorted(KV_DTYPES), default="bf16")
    args = ap.parse_args()
    cfg = SHAPES[args.shape]
    windows = layer_windows(cfg)
    bs = args.block_size
    rows = []
    for name, separate in (("separate KV groups", True), ("one block table", False)):
        groups = plan_kv_groups(windows, separate=separate)
        per_block = kv_cache_bytes_per_block(
            groups.group_size,
            bs,
            cfg["num_key_value_heads"],
            cfg["head_dim"],
            KV_DTYPES[args.kv_dtype],
        )
        held = held_blocks(groups, args.context, args.step_tokens, args.decode, bs)
        planned = kv_blocks_per_seq(groups, args.context + args.decode, bs, args.step_tokens)
        rows.append(
            (name, groups, max(held) * per_block, held[-1] * per_block, planned * per_block)
        )
    print(
        f"{args.shape}: {len(windows)} layers, windows {sorted(set(windows), key=str)}; "
        f"{args.context} prompt tokens in {args.step_tokens}-token steps, {args.decode} decoded"
    )
    print(f"{'layout':<20}{'groups':>8}{'peak GiB':>10}{'last GiB':>10}{'planned GiB':>13}")
    for name, groups, peak, last, planned in rows:
        print(
            f"{name:<20}{groups.num_groups:>8}{peak / GiB:>10.2f}{last / GiB:>10.2f}"
            f"{planned / GiB:>13.2f}"
        )
    (_, _, _, last, _), (_, _, _, last_one, _) = rows
    print(f"the last step holds {100 * (1 - last / last_one):.0f}% less KV with separate groups")


if __name__ == "__main__":
    main()
