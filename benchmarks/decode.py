"""GPU decode speed at real model shapes: libkk vs Hugging Face transformers vs the bandwidth floor.

Random bf16 weights are written as a real checkpoint folder (config.json, sharded safetensors, a
stand-in tokenizer), so the real loader runs. Every request gets a random prompt of --prompt tokens
and decodes --tokens tokens greedily with EOS ignored. Decode time is measured after the first
token: libkk from the requests' timelines, transformers as generate(N + 1) minus generate(1). The
floor is the bytes a step must read / measured device copy bandwidth: every weight once, except
the embedding table (a step reads one row per request) and, for MoE shapes, only the experts the
batch routes to (expected distinct experts per layer under uniform routing: E * (1 - (1 - k/E)^B)),
plus the KV cache (a sliding-window layer reads only its window). The batch's prefill (its prompts' first step scheduled to its last first token)
is reported beside its floor: the prefill's matmul FLOPs / measured bf16 matmul rate.

    python benchmarks/decode.py --shape qwen3-8b --batch 1 8 32 128 [--no-peer] [--out FILE]
        [--scheduling auto|sync|async]
    python benchmarks/decode.py --shape qwen3-30b-a3b --experts nvfp4 --batch 1 8 32 128
    python benchmarks/decode.py --shape gpt-oss-20b --experts mxfp4 --batch 1 32
    python benchmarks/decode.py --shape gemma3-12b --batch 1 32

`--experts nvfp4|mxfp4` (MoE shapes) writes the experts pre-quantized (`libkk quantize`'s
format, quantized from the random bf16 weights on the GPU); transformers cannot run those
checkpoints, so that case has no peer row. gpt-oss's mxfp4 is the released layout (stacked
blocks and scales, quantization_config mxfp4), which libkk loads packed as stored.
Packed-expert runs print (and record) the MoE tile choices the runner installed for each layer
shape and token bucket, so a result says which tiles its steps ran.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from pathlib import Path

import torch
from floors import copy_bandwidth, matmul_rate
from profiling import profile_steps

# --scheduling: libkk's async_scheduling setting ("auto": the engine decides, asynchronous on CUDA)
SCHEDULING = {"auto": "auto", "sync": False, "async": True}
COMPILE = {"auto": "auto", "on": True, "off": False}  # --compile -> torch_compile

SHAPES = {
    "qwen3-8b": dict(
        architectures=["Qwen3ForCausalLM"],
        model_type="qwen3",
        hidden_size=4096,
        intermediate_size=12288,
        num_hidden_layers=36,
        num_attention_heads=32,
        num_key_value_heads=8,
        head_dim=128,
        vocab_size=151936,
    ),
    # Llama 3.1 8B: Qwen3-8B's size without the q/k norms (the rotation alone before attention).
    "llama3-8b": dict(
        architectures=["LlamaForCausalLM"],
        model_type="llama",
        hidden_size=4096,
        intermediate_size=14336,
        num_hidden_layers=32,
        num_attention_heads=32,
        num_key_value_heads=8,
        head_dim=128,
        vocab_size=128256,
        rope_theta=500000.0,
        rope_scaling={
            "rope_type": "llama3",
            "factor": 8.0,
            "low_freq_factor": 1.0,
            "high_freq_factor": 4.0,
            "original_max_position_embeddings": 8192,
        },
    ),
    "qwen3-30b-a3b": dict(
        architectures=["Qwen3MoeForCausalLM"],
        model_type="qwen3_moe",
        hidden_size=2048,
        intermediate_size=6144,
        moe_intermediate_size=768,
        num_experts=128,
        num_experts_per_tok=8,
        norm_topk_prob=True,
        num_hidden_layers=48,
        num_attention_heads=32,
        num_key_value_heads=4,
        head_dim=128,
        vocab_size=151936,
        decoder_sparse_step=1,
        mlp_only_layers=[],
    ),
    # gpt-oss-20b: 24 layers of 32 experts (top-4) with biases and the clamped SwiGLU, attention
    # sinks, 128-token windows in every other layer. --experts mxfp4 writes the released layout.
    "gpt-oss-20b": dict(
        architectures=["GptOssForCausalLM"],
        model_type="gpt_oss",
        hidden_size=2880,
        intermediate_size=2880,
        moe_intermediate_size=2880,  # for this script's arithmetic (the config has no such key)
        num_local_experts=32,
        num_experts=32,
        num_experts_per_tok=4,
        num_hidden_layers=24,
        num_attention_heads=64,
        num_key_value_heads=8,
        head_dim=64,
        vocab_size=201088,
        sliding_window=128,
        layer_types=["sliding_attention", "full_attention"] * 12,
        attention_bias=True,
        rms_norm_eps=1e-5,
        max_position_embeddings=131072,
        rope_theta=150000.0,
        rope_scaling={
            "rope_type": "yarn",
            "factor": 32.0,
            "beta_fast": 32.0,
            "beta_slow": 1.0,
            "truncate": False,
            "original_max_position_embeddings": 4096,
        },
    ),  # fmt: skip
    # Gemma 3 12B (text): 48 layers, 1024-token windows in five of every six.
    "gemma3-12b": dict(
        architectures=["Gemma3ForCausalLM"],
        model_type="gemma3_text",
        hidden_size=3840,
        intermediate_size=15360,
        num_hidden_layers=48,
        num_attention_heads=16,
        num_key_value_heads=8,
        head_dim=256,
        vocab_size=262208,
        sliding_window=1024,
        sliding_window_pattern=6,
        query_pre_attn_scalar=256,
        rope_local_base_freq=10000.0,
        tie_word_embeddings=True,
        hidden_activation="gelu_pytorch_tanh",
        hidden_act="gelu_pytorch_tanh",
        final_logit_softcapping=None,
    ),
    # A small shape to try the script anywhere.
    "tiny": dict(
        architectures=["Qwen3ForCausalLM"],
        model_type="qwen3",
        hidden_size=256,
        intermediate_size=512,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=64,
        vocab_size=4096,
    ),
}
COMMON = dict(
    max_position_embeddings=40960,
    rms_norm_eps=1e-6,
    rope_theta=1000000.0,
    tie_word_embeddings=False,
    torch_dtype="bfloat16",
    hidden_act="silu",
    bos_token_id=0,
    eos_token_id=1,
    attention_bias=False,
    use_sliding_window=False,
)


def write_word_tokenizer(path: Path, vocab_size: int) -> None:
    """A word-level tokenizer "t0".."t{V-1}": token ids serve as prompts, "t1" is EOS."""
    from tokenizers import Tokenizer, models

    vocab = {f"t{i}": i for i in range(vocab_size)}
    Tokenizer(models.WordLevel(vocab, unk_token="t0")).save(str(path / "tokenizer.json"))
    (path / "tokenizer_config.json").write_text(json.dumps({"eos_token": "t1"}))


def checkpoint_dir(root: Path, shape: str, experts: str = "bf16") -> Path:
    """Where the random checkpoint of `shape` with `experts` weights lives under `root`."""
    return root / (shape if experts == "bf16" else f"{shape}-{experts}")


def write_checkpoint(shape: str, path: Path, device: str, experts: str = "bf16") -> None:
    """Random weights in HF names, written shard by shard so host memory stays small; expert
    weights quantized to `experts` unless it is bf16."""
    from safetensors.torch import save_file

    from libkk.quant.checkpoint import QUANT_CONFIG, quant_config, quantize_tensor

    if (path / "config.json").exists():
        return
    path.mkdir(parents=True, exist_ok=True)
    cfg = {**COMMON, **SHAPES[shape]}
    h, layers = cfg["hidden_size"], cfg["num_hidden_layers"]
    q, kv, d = cfg["num_attention_heads"], cfg["num_key_value_heads"], cfg["head_dim"]
    gen = torch.Generator(device=device).manual_seed(0)

    def rand(*dims: int) -> torch.Tensor:
        scale = dims[-1] ** -0.5
        return (torch.randn(*dims, generator=gen, device=device) * scale).to(torch.bfloat16)

    def ones(n: int) -> torch.Tensor:
        return torch.ones(n, dtype=torch.bfloat16)

    def layer_tensors(i: int) -> dict[str, torch.Tensor]:
        if cfg["model_type"] == "gpt_oss":
            return gpt_oss_layer(i)
        p = f"model.layers.{i}."
        t = {
            p + "self_attn.q_proj.weight": rand(q * d, h),
            p + "self_attn.k_proj.weight": rand(kv * d, h),
            p + "self_attn.v_proj.weight": rand(kv * d, h),
            p + "self_attn.o_proj.weight": rand(h, q * d),
            p + "input_layernorm.weight": torch.ones(h, dtype=torch.bfloat16),
            p + "post_attention_layernorm.weight": torch.ones(h, dtype=torch.bfloat16),
        }
        if cfg["model_type"] != "llama":  # per-head q/k norms
            t[p + "self_attn.q_norm.weight"] = torch.ones(d, dtype=torch.bfloat16)
            t[p + "self_attn.k_norm.weight"] = torch.ones(d, dtype=torch.bfloat16)
        if "num_experts" in cfg:
            inter, num_experts = cfg["moe_intermediate_size"], cfg["num_experts"]
            t[p + "mlp.gate.weight"] = rand(num_experts, h)
            for e in range(num_experts):
                for proj, dims in (("gate_proj", (inter, h)), ("up_proj", (inter, h)),
                                   ("down_proj", (h, inter))):  # fmt: skip
                    name = p + f"mlp.experts.{e}.{proj}.weight"
                    if experts == "bf16":
                        t[name] = rand(*dims)
                    else:
                        t.update(quantize_tensor(name, rand(*dims).float(), experts))
        else:
            inter = cfg["intermediate_size"]
            t[p + "mlp.gate_proj.weight"] = rand(inter, h)
            t[p + "mlp.up_proj.weight"] = rand(inter, h)
            t[p + "mlp.down_proj.weight"] = rand(h, inter)
        if cfg["model_type"] == "gemma3_text":  # its four norms a layer
            t[p + "pre_feedforward_layernorm.weight"] = ones(h) * 0
            t[p + "post_feedforward_layernorm.weight"] = ones(h) * 0
        return t

    def gpt_oss_layer(i: int) -> dict[str, torch.Tensor]:
        """The released layout: stacked experts, MXFP4 blocks and scales (or float)."""
        from libkk.quant.formats import quantize_mxfp4

        p = f"model.layers.{i}."
        e, inter = cfg["num_experts"], cfg["intermediate_size"]
        t = {
            p + "self_attn.q_proj.weight": rand(q * d, h),
            p + "self_attn.k_proj.weight": rand(kv * d, h),
            p + "self_attn.v_proj.weight": rand(kv * d, h),
            p + "self_attn.o_proj.weight": rand(h, q * d),
            p + "self_attn.sinks": rand(q) * 0,
            p + "input_layernorm.weight": ones(h),
            p + "post_attention_layernorm.weight": ones(h),
            p + "mlp.router.weight": rand(e, h),
            p + "mlp.router.bias": rand(e) * 0,
            p + "mlp.experts.gate_up_proj_bias": rand(e, 2 * inter) * 0,
            p + "mlp.experts.down_proj_bias": rand(e, h) * 0,
        }
        for proj in ("q", "k", "v", "o"):
            rows = h if proj == "o" else (q if proj == "q" else kv) * d
            t[p + f"self_attn.{proj}_proj.bias"] = rand(rows) * 0
        for name, rows, cols in (("gate_up_proj", 2 * inter, h), ("down_proj", h, inter)):
            w = [rand(rows, cols) for _ in range(e)]  # [out, in] per expert
            if experts == "bf16":  # transformers' float layout: x @ W
                t[p + f"mlp.experts.{name}"] = torch.stack(w).transpose(1, 2).contiguous()
                continue
            packed = [quantize_mxfp4(x.float()) for x in w]
            blocks = torch.stack([x.weight for x in packed])
            t[p + f"mlp.experts.{name}_blocks"] = blocks.view(e, rows, cols // 32, 16)
            t[p + f"mlp.experts.{name}_scales"] = torch.stack([x.scale for x in packed])
        return t

    index: dict[str, str] = {}
    total_bytes = 0
    head = {
        "model.embed_tokens.weight": rand(cfg["vocab_size"], h),
        "model.norm.weight": torch.ones(h, dtype=torch.bfloat16),
    }
    if not cfg["tie_word_embeddings"]:
        head["lm_head.weight"] = rand(cfg["vocab_size"], h)
    # One shard for the embedding and head, one per layer: built and written one at a time.
    for i in range(layers + 1):
        tensors = head if i == 0 else layer_tensors(i - 1)
        name = f"model-{i:05d}.safetensors"
        save_file({k: v.cpu() for k, v in tensors.items()}, path / name)
        index.update(dict.fromkeys(tensors, name))
        total_bytes += sum(t.numel() * t.element_size() for t in tensors.values())
    (path / "model.safetensors.index.json").write_text(
        json.dumps({"metadata": {"total_size": total_bytes}, "weight_map": index})
    )
    write_word_tokenizer(path, cfg["vocab_size"])
    if experts != "bf16" and cfg["model_type"] == "gpt_oss":  # its own expert format
        cfg["quantization_config"] = {"quant_method": "mxfp4"}
    elif experts != "bf16":
        (path / QUANT_CONFIG).write_text(json.dumps(quant_config(experts)))
    (path / "config.json").write_text(json.dumps(cfg, indent=2))  # last: marks the folder done


def expert_bytes(cfg: dict, experts: str) -> int:
    """Bytes of one expert's three projections in format `experts` (scales included)."""
    if "num_experts" not in cfg:
        return 0
    elements = 3 * cfg["hidden_size"] * cfg["moe_intermediate_size"]
    per_element = {"bf16": 2.0, "nvfp4": 0.5 + 1 / 16, "mxfp4": 0.5 + 1 / 32}
    return int(elements * per_element[experts.removesuffix("-csf")])


def step_bytes(cfg: dict, weights_bytes: int, experts: str, batch: int, context: int) -> float:
    """Bytes one decode step must read (see the module docstring)."""
    h, layers = cfg["hidden_size"], cfg["num_hidden_layers"]
    embedding = cfg["vocab_size"] * h * 2 * (not cfg["tie_word_embeddings"])
    total = weights_bytes - embedding + batch * h * 2
    if "num_experts" in cfg:
        e, k = cfg["num_experts"], cfg["num_experts_per_tok"]
        touched = e * (1 - (1 - k / e) ** batch)
        total -= (e - touched) * layers * expert_bytes(cfg, experts)
    # KV read: a windowed layer reads its last `sliding_window` positions only.
    kv_per_token_layer = 2 * cfg["num_key_value_heads"] * cfg["head_dim"] * 2
    kinds = cfg.get("layer_types") or [
        "full_attention" if (i + 1) % cfg.get("sliding_window_pattern", 1) == 0 else "sliding"
        for i in range(layers)
    ]
    window = cfg.get("sliding_window") or context
    read = sum(context if k == "full_attention" else min(context, window) for k in kinds)
    return total + batch * read * kv_per_token_layer


def prefill_flops(cfg: dict, batch: int, prompt: int) -> float:
    """Matmul FLOPs of prefilling `batch` prompts of `prompt` tokens: the projections for every
    token (for MoE shapes, the router and the top-k experts only), causal attention's scores and
    values, and the LM head for each prompt's last token."""
    h, layers, d = cfg["hidden_size"], cfg["num_hidden_layers"], cfg["head_dim"]
    q_dim, kv_dim = cfg["num_attention_heads"] * d, cfg["num_key_value_heads"] * d
    per_token = h * (q_dim + 2 * kv_dim) + q_dim * h
    if "num_experts" in cfg:
        per_token += h * cfg["num_experts"]
        per_token += cfg["num_experts_per_tok"] * 3 * h * cfg["moe_intermediate_size"]
    else:
        per_token += 3 * h * cfg["intermediate_size"]
    tokens = batch * prompt
    pairs = batch * prompt * (prompt + 1) / 2  # (query, key) pairs under the causal mask
    attention = 4 * cfg["num_attention_heads"] * d * pairs
    return layers * (2 * per_token * tokens + attention) + 2 * h * cfg["vocab_size"] * batch


def prompts(batch: int, length: int, vocab: int, seed: int = 0) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    return torch.randint(2, vocab, (batch, length), generator=g).tolist()


def moe_tiles() -> list[str]:
    """The MoE tile choices the session's runner installed (measured at start-up or read from
    the artifact cache), one line per layer shape: which tiles the timed steps ran."""
    from dataclasses import astuple

    from libkk.kernels.moe import installed_tile_choices

    return [
        f"MoE tiles {shape.fmt} {shape.activations} e{shape.num_experts} h{shape.hidden} "
        f"i{shape.intermediate} top{shape.top_k}: "
        + "; ".join(f"<={bucket}: {astuple(cfg)}" for bucket, cfg in sorted(choices.items()))
        for shape, choices in installed_tile_choices().items()
    ]


def bench_libkk(
    path: Path,
    batch: int,
    prompt: int,
    tokens: int,
    repeats: int,
    profile: bool = False,
    async_scheduling: bool | str = "auto",
    torch_compile: bool | str = "auto",
    capture_sizes: list[int] | None = None,
    capture: str = "startup",
) -> dict:
    from libkk import SamplingParams, Session

    params = SamplingParams(max_tokens=tokens + 1, temperature=0.0, ignore_eos=True)
    with Session(
        str(path),
        dtype="bfloat16",
        max_model_len=prompt + tokens + 16,
        max_num_seqs=batch,
        max_num_batched_tokens=max(8192, prompt),
        async_scheduling=async_scheduling,
        torch_compile=torch_compile,
        cudagraph_capture_sizes=capture_sizes,
        cudagraph_capture=capture,
        progress=False,
    ) as s:
        ids = prompts(batch, prompt, s.engine.arch.vocab_size)
        tiles = moe_tiles()
        for line in tiles:
            print(line, flush=True)
        s.generate(ids, SamplingParams(max_tokens=4, ignore_eos=True))  # warm up
        steps, prefills = [], []
        for r in range(repeats):
            # Fresh prompts each time: repeated ones would prefill from the prefix cache.
            outs = s.generate(prompts(batch, prompt, s.engine.arch.vocab_size, seed=1 + r), params)
            steps.append(max(o.timeline.decode_time for o in outs) / tokens)
            # The batch's prefill: its first step scheduled to its last first token.
            lines = [o.timeline for o in outs]
            prefills.append(
                max(t.first_token for t in lines) - min(t.first_scheduled for t in lines)
            )
        weights = s.engine.weights_bytes
        launched_ahead = s.engine.config.scheduler.async_scheduling  # "auto" decided
        if profile:
            profile_steps(s, ids, tokens)
    return {
        "ms_per_step": [t * 1e3 for t in steps],
        "prefill_ms": [t * 1e3 for t in prefills],
        "weights_bytes": weights,
        "async_scheduling": launched_ahead,
        "moe_tiles": tiles,
    }


def bench_transformers(path: Path, batch: int, prompt: int, tokens: int, repeats: int) -> dict:
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(str(path), dtype=torch.bfloat16).cuda().eval()
    ids = torch.tensor(prompts(batch, prompt, model.config.vocab_size), device="cuda")

    def generate(n: int) -> float:
        torch.cuda.synchronize()
        start = time.perf_counter()
        with torch.inference_mode():
            model.generate(
                ids,
                attention_mask=torch.ones_like(ids),
                max_new_tokens=n,
                min_new_tokens=n,
                do_sample=False,
                pad_token_id=1,
            )
        torch.cuda.synchronize()
        return time.perf_counter() - start

    generate(2)
    steps = [(generate(tokens + 1) - generate(1)) / tokens for _ in range(repeats)]
    return {"ms_per_step": [t * 1e3 for t in steps]}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--shape", choices=sorted(SHAPES), default="qwen3-8b")
    ap.add_argument(
        "--experts",
        choices=["bf16", "nvfp4", "mxfp4", "nvfp4-csf", "mxfp4-csf"],
        default="bf16",
        help="expert weight format of MoE shapes (written pre-quantized)",
    )
    ap.add_argument("--batch", type=int, nargs="+", default=[1, 8, 32, 128])
    ap.add_argument("--prompt", type=int, default=512)
    ap.add_argument("--tokens", type=int, default=64)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--no-peer", action="store_true", help="skip transformers")
    ap.add_argument("--dir", default="/tmp/libkk-bench")
    ap.add_argument("--out", default="decode.json")
    ap.add_argument("--profile", action="store_true", help="profile the first batch size")
    ap.add_argument(
        "--no-pdl",
        action="store_true",
        help="launch without programmatic dependent launch (a kernel that waits for its "
        "predecessor under PDL counts the wait as its own time: profiles attribute time "
        "cleanly without it)",
    )
    ap.add_argument(
        "--skinny",
        action="store_true",
        help="products of 2 to 32 tokens on libkk's skinny kernel instead of cuBLAS (its A/B)",
    )
    ap.add_argument(
        "--scheduling",
        choices=sorted(SCHEDULING),
        default="auto",
        help="libkk's async_scheduling: the engine's default (auto: asynchronous on CUDA), or "
        "forced synchronous / asynchronous",
    )
    ap.add_argument(
        "--compile",
        choices=sorted(COMPILE),
        default="auto",
        help="torch_compile: auto (libkk's choice for the family), on, or off (the graphs "
        "capture the eager forward; on against off is what compiling buys)",
    )
    ap.add_argument(
        "--capture-sizes",
        type=int,
        nargs="+",
        default=None,
        help="cudagraph_capture_sizes (default: libkk's); sizes above 256 graph prefill-sized "
        "mixed steps",
    )
    ap.add_argument(
        "--capture",
        choices=["startup", "lazy"],
        default="startup",
        help="cudagraph_capture (lazy: the warm-up run captures what the timed runs replay)",
    )
    args = ap.parse_args()
    if args.no_pdl:
        from libkk.kernels import _jit

        _jit._major = lambda index: 8  # as a pre-Hopper device: no PDL launch attribute
    if args.skinny:
        from libkk.kernels import gemv

        gemv.ROUTE_SKINNY = True  # products of 2 to 32 tokens on the skinny kernel, not cuBLAS
    cfg = {**COMMON, **SHAPES[args.shape]}
    if args.experts != "bf16" and "num_experts" not in cfg:
        ap.error(f"--experts {args.experts} needs an MoE shape, not {args.shape}")
    if args.experts != "bf16" and not args.no_peer:
        print("no transformers row: it cannot run pre-quantized 4-bit experts", flush=True)
        args.no_peer = True

    path = checkpoint_dir(Path(args.dir), args.shape, args.experts)
    t0 = time.perf_counter()
    write_checkpoint(args.shape, path, "cuda", args.experts)
    print(f"checkpoint ready in {time.perf_counter() - t0:.0f} s: {path}")
    bandwidth = copy_bandwidth("cuda")
    flop_rate = matmul_rate("cuda")
    rows = []
    for batch in args.batch:
        profile = args.profile and batch == args.batch[0]
        kk = bench_libkk(
            path,
            batch,
            args.prompt,
            args.tokens,
            args.repeats,
            profile,
            SCHEDULING[args.scheduling],
            COMPILE[args.compile],
            args.capture_sizes,
            args.capture,
        )
        ctx = args.prompt + args.tokens // 2
        floor_ms = step_bytes(cfg, kk["weights_bytes"], args.experts, batch, ctx) / bandwidth * 1e3
        row = {
            "batch": batch,
            "libkk_ms": statistics.median(kk["ms_per_step"]),
            "libkk_spread": [min(kk["ms_per_step"]), max(kk["ms_per_step"])],
            "floor_ms": floor_ms,
            "prefill_ms": statistics.median(kk["prefill_ms"]),
            "prefill_spread": [min(kk["prefill_ms"]), max(kk["prefill_ms"])],
            "prefill_floor_ms": prefill_flops(cfg, batch, args.prompt) / flop_rate * 1e3,
            "async_scheduling": kk["async_scheduling"],
            "moe_tiles": kk["moe_tiles"],
        }
        print(json.dumps(row), flush=True)
        if not args.no_peer:
            hf = bench_transformers(path, batch, args.prompt, args.tokens, args.repeats)
            torch.cuda.empty_cache()
            row["hf_ms"] = statistics.median(hf["ms_per_step"])
            row["hf_spread"] = [min(hf["ms_per_step"]), max(hf["ms_per_step"])]
        rows.append(row)
        print(json.dumps(row), flush=True)
    print(
        f"\n{path.name} decode{' (async scheduling)' if rows and rows[0]['async_scheduling'] else ''}, "
        f"prompt {args.prompt}, {args.tokens} tokens, "
        f"{torch.cuda.get_device_name()}, copy {bandwidth / 1e12:.2f} TB/s, "
        f"bf16 matmul {flop_rate / 1e12:.0f} TFLOP/s"
    )
    print(
        f"{'batch':>6}{'libkk ms':>10}{'tok/s':>9}{'HF ms':>9}{'HF tok/s':>10}"
        f"{'floor ms':>10}{'% floor':>9}{'prefill ms':>12}{'floor ms':>10}{'% floor':>9}"
    )
    for r in rows:
        hf = r.get("hf_ms")
        print(
            f"{r['batch']:>6}{r['libkk_ms']:>10.2f}{r['batch'] * 1e3 / r['libkk_ms']:>9.0f}"
            f"{hf if hf else float('nan'):>9.2f}"
            f"{r['batch'] * 1e3 / hf if hf else float('nan'):>10.0f}"
            f"{r['floor_ms']:>10.2f}{100 * r['floor_ms'] / r['libkk_ms']:>9.0f}"
            f"{r['prefill_ms']:>12.1f}{r['prefill_floor_ms']:>10.1f}"
            f"{100 * r['prefill_floor_ms'] / r['prefill_ms']:>9.0f}"
        )
    Path(args.out).write_text(
        json.dumps(
            {"shape": args.shape, "experts": args.experts, "rows": rows, "bandwidth": bandwidth},
            indent=2,
        )
    )


if __name__ == "__main__":
    main()
