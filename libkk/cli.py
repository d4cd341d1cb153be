"""The `libkk` command: generate, chat, serve, info, quantize, cache, tables, train-drafter."""

from __future__ import annotations

import argparse
import json
import logging
import os
import sys
from importlib.metadata import PackageNotFoundError, version
from pathlib import Path
from typing import Any

from libkk.config import EngineConfig
from libkk.engine.threads import resolve_num_threads
from libkk.errors import LibkkError, MissingDependencyError, ModelNotFoundError
from libkk.quant.checkpoint import FORMATS
from libkk.sample.params import SamplingParams


class _HelpFormatter(argparse.ArgumentDefaultsHelpFormatter):
    """Appends each option's default to its help, except where the help says it already or there
    is no value to show (None, False, an empty list: the help text says what happens then)."""

    def _get_help_string(self, action: argparse.Action) -> str:
        default = action.default
        if default is None or default is False or default == []:
            return action.help or ""
        return super()._get_help_string(action) or ""


def _version() -> str:
    # NOTE: from the installed metadata: importing the top-level package from here would run
    # against the layering (libkk/__init__.py re-exports from every layer).
    try:
        return version("libkk")
    except PackageNotFoundError:
        return "unknown (not installed)"


def _progress_arg(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "--progress",
        action=argparse.BooleanOptionalAction,
        default=None,
        help="progress bars for loading and conversion, on stderr (default: only when stderr is "
        "a terminal)",
    )


def _show_progress(args: argparse.Namespace) -> bool:
    return sys.stderr.isatty() if args.progress is None else args.progress


def _parse_setting(item: str) -> tuple[str, Any]:
    if "=" not in item:
        raise argparse.ArgumentTypeError(f"--set expects KEY=VALUE, got {item!r}")
    key, raw = item.split("=", 1)
    try:
        value = json.loads(raw)
    except json.JSONDecodeError:
        value = raw  # a bare string such as dtype=bfloat16
    return key.strip(), value


def _add_engine_args(p: argparse.ArgumentParser, *, model_positional: bool = False) -> None:
    model_help = (
        "HF-layout folder or .gguf file (default: SmolLM2-135M-Instruct, the default model)"
    )
    if model_positional:
        p.add_argument("model", nargs="?", default=None, help=model_help)
    else:
        p.add_argument("--model", default=None, help=model_help)
    p.add_argument(
        "--config", default=None, help="engine settings as a JSON or TOML file (default: none)"
    )
    p.add_argument(
        "--set",
        dest="settings",
        action="append",
        default=[],
        type=_parse_setting,
        metavar="KEY=VALUE",
        help="one engine setting, e.g. --set max_num_seqs=8; repeatable (default: none)",
    )
    p.add_argument(
        "--tensor-parallel-size",
        type=int,
        default=None,
        metavar="N",
        help="split the model across N ranks (CUDA: N GPUs; CPU: N processes) (default: 1)",
    )
    p.add_argument(
        "--threads",
        type=int,
        default=None,
        metavar="N",
        help="CPU threads for torch, the setting num_threads (default: the physical cores this "
        "process may run on)",
    )
    _progress_arg(p)


def _add_sampling_args(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "--max-tokens",
        type=int,
        default=128,
        help="tokens to generate at most (capped to the room left in max_model_len)",
    )
    p.add_argument("--temperature", type=float, default=0.0, help="0 means greedy")
    p.add_argument("--top-p", type=float, default=1.0, help="nucleus sampling; 1 turns it off")
    p.add_argument("--top-k", type=int, default=0, help="0 turns it off")
    p.add_argument("--min-p", type=float, default=0.0, help="0 turns it off")
    p.add_argument("--repetition-penalty", type=float, default=1.0, help="1 turns it off")
    p.add_argument(
        "--stop",
        action="append",
        default=[],
        metavar="TEXT",
        help="stop when this text appears; repeatable (default: no stop strings)",
    )
    p.add_argument(
        "--seed",
        type=int,
        default=None,
        help="same seed, same tokens (default: a fresh random seed per request)",
    )


def _add_speculative_args(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "--speculative",
        choices=["ngram", "draft_model", "dflash"],
        default=None,
        metavar="METHOD",
        help="speculative decoding: ngram, draft_model (needs --draft-model) or dflash "
        "(default: none)",
    )
    p.add_argument(
        "--num-speculative-tokens",
        type=int,
        default=None,
        metavar="K",
        help="drafts verified per step at most (default: 4)",
    )
    p.add_argument(
        "--draft-model",
        default=None,
        help="the drafter's folder or .gguf (default: none; dflash on the default model uses the "
        "drafter shipped with libkk)",
    )


def _engine_config(args: argparse.Namespace) -> EngineConfig:
    config = EngineConfig.from_file(args.config) if args.config else EngineConfig()
    if args.model is not None:
        config = config.updated(model=args.model)
    settings = dict(args.settings)
    if getattr(args, "tensor_parallel_size", None) is not None:
        settings["tensor_parallel_size"] = args.tensor_parallel_size
    if getattr(args, "threads", None) is not None:
        settings["num_threads"] = args.threads
    # Progress bars only on a terminal, unless asked for (or set in --set/--config).
    if args.progress is not None:
        settings["progress"] = args.progress
    elif "progress" not in settings and config.progress:
        settings["progress"] = sys.stderr.isatty()
    for flag, key in (
        ("speculative", "method"),
        ("num_speculative_tokens", "num_speculative_tokens"),
        ("draft_model", "draft_model"),
    ):
        if getattr(args, flag, None) is not None:
            settings[key] = getattr(args, flag)
    return config.updated(**settings)


def _sampling(args: argparse.Namespace) -> SamplingParams:
    return SamplingParams(
        max_tokens=args.max_tokens,
        temperature=args.temperature,
        top_p=args.top_p,
        top_k=args.top_k,
        min_p=args.min_p,
        repetition_penalty=args.repetition_penalty,
        stop=list(args.stop),
        seed=args.seed,
    )


def cmd_generate(args: argparse.Namespace) -> int:
    from libkk.api.session import Session

    # Both checked before the model loads: a bad value fails at once.
    params, config = _sampling(args), _engine_config(args)
    with Session(config=config) as session:
        for output in session.stream(args.prompt, params):
            sys.stdout.write(output.delta_text)
            sys.stdout.flush()
        sys.stdout.write("\n")
        t = output.timeline
        if args.verbose and t is not None:
            print(
                f"[{len(output.token_ids)} tokens, finish={output.finish_reason}, "
                f"ttft={t.time_to_first_token * 1e3:.0f} ms, "
                f"decode {(len(output.token_ids) - 1) / max(t.decode_time or 0, 1e-9):.1f} tok/s]",
                file=sys.stderr,
            )
        stats = session.stats()
        if args.verbose and "spec_mean_acceptance_length" in stats:
            print(
                f"[speculative: {stats['spec_num_accepted_tokens']} of "
                f"{stats['spec_num_draft_tokens']} drafts accepted, mean acceptance length "
                f"{stats['spec_mean_acceptance_length']:.2f}]",
                file=sys.stderr,
            )
    return 0


def cmd_chat(args: argparse.Namespace) -> int:
    from libkk.api.session import Session

    messages: list[dict[str, str]] = []
    if args.system:
        messages.append({"role": "system", "content": args.system})
    params, config = _sampling(args), _engine_config(args)
    with Session(config=config) as session:
        print("libkk chat: an empty line or Ctrl-D ends the conversation.", file=sys.stderr)
        while True:
            try:
                line = _read_line("> ")
            except EOFError:
                break
            if not line.strip():
                break
            messages.append({"role": "user", "content": line})
            reply = session.chat(messages, params)
            print(reply.text)
            messages.append({"role": "assistant", "content": reply.text})
    return 0


def cmd_serve(args: argparse.Namespace) -> int:
    # Checked before the model loads: without the extra there is nothing to serve with.
    try:
        import fastapi  # noqa: F401
        import uvicorn  # noqa: F401
    except ImportError as e:
        raise MissingDependencyError(
            f"libkk serve needs FastAPI and uvicorn ({e.name} is missing): "
            'pip install "libkk[serve]"'
        ) from None
    from libkk.api.session import Session
    from libkk.serve.runner import run_server

    config = _engine_config(args)
    with Session(config=config) as session:
        run_server(
            session,
            host=args.host,
            port=args.port,
            model_name=args.served_model_name,
            shutdown_grace_s=args.shutdown_timeout,
            access_log=args.verbose,
        )
    return 0


def _read_line(prompt: str) -> str:
    """A line of stdin. The prompt goes to stdout on a terminal, else to stderr, so redirected
    output holds only the replies."""
    if sys.stdout.isatty():
        return input(prompt)
    sys.stderr.write(prompt)
    sys.stderr.flush()
    return input()


def cmd_info(args: argparse.Namespace) -> int:
    from libkk.api.session import Session

    with Session(config=_engine_config(args)) as session:
        engine = session.engine
        arch = engine.arch
        info = {
            "model": str(engine.model_dir),
            "architecture": type(engine.model).__name__,
            "parameters": sum(p.numel() for p in engine.model.parameters()),
            "layers": arch.num_layers,
            "hidden_size": arch.hidden_size,
            "kv_heads": arch.num_kv_heads,
            "head_dim": arch.head_dim,
            "vocab_size": arch.vocab_size,
            "device": str(engine.device),
            "dtype": str(engine.dtype).removeprefix("torch."),
            "max_model_len": engine.max_model_len,
            "memory": {
                "weights_mib": round(engine.weights_bytes / 2**20, 1),
                "kv_cache_mib": round(engine.kv_cache_bytes / 2**20, 1),
                "kv_blocks": engine.num_blocks,
                # Token slots of the pool, a layer each: with several KV groups the groups share
                # them (a sliding group holds a window's worth per sequence).
                "kv_tokens": engine.num_blocks * engine.config.cache.block_size,
                "kv_group_windows": list(engine.kv_cache_manager.windows),
            },
            "settings": engine.config.to_dict(),
        }
        print(json.dumps(info, indent=2))
    return 0


def cmd_cache_list(args: argparse.Namespace) -> int:
    import time

    from libkk.graphs.artifacts import ArtifactCache

    cache = ArtifactCache()
    entries = cache.list_entries()
    if not entries:
        print(f"no compiled-graph artifacts in {cache.root}")
        return 0

    def when(t: float | None) -> str:
        return time.strftime("%Y-%m-%d %H:%M", time.localtime(t)) if t else "-"

    rows = [("KEY", "STATE", "SIZE", "CREATED", "LAST USED", "MODEL")]
    for e in entries:
        state = "ready" if e.ready else f"invalid: {e.problem}"
        rows.append(
            (
                e.key[:16],
                state,
                f"{e.size_bytes / 2**20:.1f} MiB",
                when(e.created),
                when(e.last_used),
                e.model or "-",
            )
        )
    widths = [max(len(row[i]) for row in rows) for i in range(len(rows[0]) - 1)]
    for row in rows:
        print("  ".join(c.ljust(w) for c, w in zip(row, widths, strict=False)) + "  " + row[-1])
    total = sum(e.size_bytes for e in entries) / 2**20
    print(f"{len(entries)} entries, {total:.1f} MiB in {cache.root}")
    return 0


def cmd_cache_prune(args: argparse.Namespace) -> int:
    from libkk.graphs.artifacts import ArtifactCache

    cache = ArtifactCache()
    if args.all:
        removed = cache.prune(all_=True)
    else:
        removed = cache.prune(invalid_only=True)  # broken or unfinished entries always go
        if args.older_than is not None:
            removed += cache.prune(older_than_days=args.older_than, invalid_only=False)
    for e in removed:
        print(f"removed {e.key[:16]}  {'ready' if e.ready else 'invalid'}  {e.model or '-'}")
    freed = sum(e.size_bytes for e in removed) / 2**20
    print(f"removed {len(removed)} entries, {freed:.1f} MiB from {cache.root}")
    return 0


def cmd_cache_warm(args: argparse.Namespace) -> int:
    import time

    from libkk.api.session import Session

    # NOTE: compile and capture happen when an engine with graphs loads the model, so warming is
    # loading it once: the runner stores what it compiled in the artifact cache (and Triton's
    # cache keeps the kernels), and the next start of the same model and settings loads them.
    config = _engine_config(args)
    if args.device is not None:
        config = config.updated(device=args.device)
    start = time.perf_counter()
    with Session(config=config) as session:
        device = session.engine.device
        how = session.engine.runner.compile_cache
    print(
        f"warmed {args.model or 'the default model'} on {device} "
        f"in {time.perf_counter() - start:.1f} s (artifact cache: {how})"
    )
    return 0


def cmd_tables_list(args: argparse.Namespace) -> int:
    from libkk.cache.host_tables import default_root, list_tables

    root = default_root()
    entries = list_tables(root)
    if not entries:
        print(f"no shared host tables in {root}")
        return 0
    for e in entries:
        if e.ready:
            shape = "x".join(map(str, e.shape or ()))
            what = f"ready  {e.name}  {shape} {e.dtype}"
        else:
            what = f"invalid: {e.problem}"
        print(f"{e.key[:16]}  {e.size_bytes / 2**20:8.1f} MiB  {what}")
    total = sum(e.size_bytes for e in entries) / 2**20
    print(f"{len(entries)} entries, {total:.1f} MiB in {root}")
    return 0


def cmd_tables_prune(args: argparse.Namespace) -> int:
    from libkk.cache.host_tables import default_root, prune_tables

    root = default_root()
    removed = prune_tables(root, all_=args.all)
    for e in removed:
        print(f"removed {e.key[:16]}  {'ready' if e.ready else 'invalid'}  {e.name or '-'}")
    freed = sum(e.size_bytes for e in removed) / 2**20
    print(f"removed {len(removed)} entries, {freed:.1f} MiB from {root}")
    return 0


def cmd_quantize(args: argparse.Namespace) -> int:
    from libkk.models.loader import checkpoint_shards
    from libkk.models.quantize import quantize_checkpoint
    from libkk.quant.checkpoint import is_expert_weight

    if not os.path.isdir(args.src):
        raise ModelNotFoundError(f"model folder {args.src!r} does not exist")
    shards = checkpoint_shards(args.src)  # ModelNotFoundError without safetensors files
    if not any(is_expert_weight(name) for shard in shards for name in shard.names):
        print(
            f"libkk: error: {args.src} has no MoE expert weights (a dense model): `libkk quantize` "
            "writes only experts in 4 bits, so there is nothing to quantize",
            file=sys.stderr,
        )
        return 2
    try:
        report = quantize_checkpoint(args.src, args.dst, args.format, _show_progress(args))
    except (ValueError, FileExistsError) as e:
        print(f"libkk: error: {e}", file=sys.stderr)
        return 2
    mib = 2**20
    print(
        f"{report.num_quantized} expert weights as {args.format}: "
        f"{report.src_bytes / mib:.1f} MiB -> {report.dst_bytes / mib:.1f} MiB; block scales "
        f"{report.scale_bytes / mib:.2f} MiB stored as {report.stored_scale_bytes / mib:.2f} MiB"
    )
    return 0


def cmd_train_drafter(args: argparse.Namespace) -> int:
    import torch

    from libkk.errors import ConfigError
    from libkk.models.default import DEFAULT_MODEL_NAME, resolve_model_path
    from libkk.models.loader import load_model
    from libkk.models.tokenizer import Tokenizer
    from libkk.spec_decode.training.distill import TrainOptions, train_drafter

    device = args.device
    if device == "auto":
        device = "cuda" if torch.cuda.is_available() else "cpu"
    torch.set_num_threads(resolve_num_threads(args.threads))
    model_dir = resolve_model_path(args.model)
    tokenizer = Tokenizer.from_folder(model_dir)
    dtype = torch.bfloat16 if device == "cuda" else torch.float32
    target, _ = load_model(model_dir, dtype, torch.device(device), progress=_show_progress(args))
    mask = args.mask_token_id
    if mask is None:  # DFlash's own mask token if the vocabulary has one, else an unused special
        mask = tokenizer.token_to_id("<|MASK|>") or tokenizer.token_to_id("<empty_output>")
    prompts = None
    if args.prompts:
        with open(args.prompts, encoding="utf-8") as f:
            prompts = [line.strip() for line in f if line.strip()]
    if args.measure is not None:  # only measure an existing drafter on held-out prompts
        from libkk.spec_decode.dflash import DFlashProposer
        from libkk.spec_decode.dflash_model import load_drafter
        from libkk.spec_decode.training.distill import held_out_prompt_ids
        from libkk.spec_decode.training.target import measure_acceptance

        drafter = load_drafter(args.measure, device, dtype, quantization=args.quantization)
        proposer = DFlashProposer.from_drafter(drafter, target)
        stops = sorted(tokenizer.eos_token_ids)
        for kind, ids in held_out_prompt_ids(tokenizer, args.eval_prompts, prompts).items():
            report = measure_acceptance(
                target, proposer, ids, args.max_new_tokens, stops, None, _show_progress(args)
            )
            print(
                f"{kind} prompts: acceptance length {report.mean_acceptance_length:.3f} over "
                f"{report.verification_steps} verification steps ({report.generated_tokens} "
                f"tokens, {len(ids)} prompts, K={proposer.num_drafts})"
            )
        return 0
    if args.output is None:
        raise ConfigError("train-drafter needs --output (or --measure DRAFTER to only measure)")
    ids = tuple(int(i) for i in args.target_layers.split(",")) if args.target_layers else None
    options = TrainOptions(
        num_layers=args.layers,
        block_size=args.block_size,
        target_layer_ids=ids,
        mask_token_id=mask,
        num_prompts=args.num_prompts,
        max_new_tokens=args.max_new_tokens,
        gen_batch_size=args.gen_batch_size,
        temperature=args.temperature,
        plain_fraction=args.plain_fraction,
        wide_prompts=args.wide_prompts,
        steps=args.steps,
        seqs_per_step=args.seqs_per_step,
        blocks_per_seq=args.blocks_per_seq,
        lr=args.lr,
        max_minutes=args.max_minutes,
        sampled_softmax=args.sampled_softmax,
        init_from=args.init_from,
        seed=args.seed,
        eval_prompts=args.eval_prompts,
    )
    name = DEFAULT_MODEL_NAME if args.model is None else Path(args.model).name
    report = train_drafter(
        target,
        tokenizer,
        args.output,
        options,
        target_name=name,
        prompts=prompts,
        corpus_path=args.corpus,
    )
    acc = report.acceptance
    print(
        f"wrote {report.output_dir}: {report.steps} steps on {report.num_sequences} sequences "
        f"({report.num_generated_tokens} generated tokens) in {report.seconds / 60:.1f} min; "
        f"loss {report.final_loss:.3f}, training-batch acceptance {report.train_acceptance:.2f}"
    )
    for kind, report in acc.items():
        print(
            f"held-out {kind} prompts: acceptance length {report.mean_acceptance_length:.3f} "
            f"({report.verification_steps} verification steps, {report.generated_tokens} tokens)"
        )
    return 0


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="libkk",
        description="Run an LLM in-process with libkk.",
        formatter_class=_HelpFormatter,
    )
    parser.add_argument("--version", action="version", version=f"%(prog)s {_version()}")
    parser.add_argument("-v", "--verbose", action="store_true", help="log at INFO level")
    # -v also after the subcommand (`libkk generate -v ...`); SUPPRESS keeps a subcommand that
    # was not given -v from resetting one given before it.
    verbose = argparse.ArgumentParser(add_help=False)
    verbose.add_argument(
        "-v", "--verbose", action="store_true", default=argparse.SUPPRESS, help="log at INFO level"
    )

    def command(
        subparsers: Any, name: str, summary: str, description: str
    ) -> argparse.ArgumentParser:
        return subparsers.add_parser(
            name,
            help=summary,
            description=description,
            parents=[verbose],
            formatter_class=_HelpFormatter,
        )

    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")

    gen = command(
        sub,
        "generate",
        "continue a prompt and print the text as it comes",
        "Continue PROMPT with the model and print the text to stdout as it is generated. "
        "With -v, a summary (tokens, finish reason, timings) follows on stderr.",
    )
    gen.add_argument("prompt", help="the text to continue")
    _add_engine_args(gen)
    _add_sampling_args(gen)
    _add_speculative_args(gen)
    gen.set_defaults(func=cmd_generate)

    chat = command(
        sub,
        "chat",
        "an interactive conversation with the chat template",
        "Talk with the model through its chat template: one user message a line on stdin, each "
        "reply on stdout. An empty line or Ctrl-D ends the conversation.",
    )
    chat.add_argument("--system", default=None, help="a system message (default: none)")
    _add_engine_args(chat)
    _add_sampling_args(chat)
    _add_speculative_args(chat)
    chat.set_defaults(func=cmd_chat)

    serve = command(
        sub,
        "serve",
        "an OpenAI-compatible HTTP server (needs the serve extra)",
        "Serve MODEL over HTTP with OpenAI's API: /v1/chat/completions, /v1/completions and "
        "/v1/models, streaming included. SIGTERM or Ctrl-C stops it: requests in flight get "
        "--shutdown-timeout seconds to finish, then are aborted. Needs "
        'pip install "libkk[serve]". With -v, one log line per HTTP request.',
    )
    _add_engine_args(serve, model_positional=True)
    _add_speculative_args(serve)
    serve.add_argument("--host", default="127.0.0.1", help="address to listen on")
    serve.add_argument("--port", type=int, default=8000, help="port to listen on")
    serve.add_argument(
        "--served-model-name",
        default=None,
        metavar="NAME",
        help="the model name clients ask for (default: the model folder's or file's name; the "
        "MODEL argument as given is accepted too)",
    )
    serve.add_argument(
        "--shutdown-timeout",
        type=float,
        default=10.0,
        metavar="SECONDS",
        help="on SIGTERM, how long requests in flight may go on before they are aborted",
    )
    serve.set_defaults(func=cmd_serve)

    info = command(
        sub,
        "info",
        "the model, its memory and the settings, as JSON",
        "Load the model and print its architecture, memory use (weights, KV cache) and the "
        "resolved engine settings as JSON.",
    )
    _add_engine_args(info)
    info.set_defaults(func=cmd_info)

    cache = command(
        sub,
        "cache",
        "the compiled-graph artifact cache: list, warm, prune",
        "Manage the on-disk cache of compiled graphs that CUDA starts reuse.",
    )
    cache_sub = cache.add_subparsers(dest="cache_command", required=True, metavar="ACTION")
    cache_list = command(
        cache_sub,
        "list",
        "every entry: key, state, size, dates, model",
        "List every entry of the compiled-graph artifact cache.",
    )
    cache_list.set_defaults(func=cmd_cache_list)
    warm = command(
        cache_sub,
        "warm",
        "load a model once so its compiled graphs land in the cache",
        "Load a model once with the given settings, so that its compiled graphs are stored and "
        "the next start with the same settings loads them.",
    )
    _add_engine_args(warm, model_positional=True)
    warm.add_argument(
        "--device",
        choices=["auto", "cpu", "cuda"],
        default=None,
        help="where to load it (default: the settings' device, auto)",
    )
    warm.set_defaults(func=cmd_cache_warm)
    prune = command(
        cache_sub,
        "prune",
        "remove invalid entries (and old ones, or all)",
        "Remove invalid or unfinished entries of the artifact cache, and optionally old ones or "
        "all of them.",
    )
    prune.add_argument("--all", action="store_true", help="remove every entry")
    prune.add_argument(
        "--older-than",
        type=float,
        default=None,
        metavar="DAYS",
        help="also remove entries not used for this many days (default: keep valid entries)",
    )
    prune.set_defaults(func=cmd_cache_prune)

    quantize = command(
        sub,
        "quantize",
        "copy a checkpoint with its experts in 4 bits",
        "Write a copy of an MoE checkpoint with its expert weights in a 4-bit format (the "
        "*-csf formats also compress the block scales). A dense model has no experts and is "
        "refused.",
    )
    quantize.add_argument("src", help="HF-layout folder of an MoE model")
    quantize.add_argument("dst", help="new folder to write")
    quantize.add_argument("--format", required=True, choices=FORMATS, help="the 4-bit format")
    _progress_arg(quantize)
    quantize.set_defaults(func=cmd_quantize)

    td = command(
        sub,
        "train-drafter",
        "distill a DFlash drafter from text the target generates itself",
        "Train a DFlash block drafter on continuations the target model generates, or measure "
        "an existing drafter's acceptance length (--measure).",
    )
    td.add_argument(
        "--model", default=None, help="target: HF folder or .gguf (default: the default model)"
    )
    td.add_argument(
        "--output",
        default=None,
        help="folder to write the drafter to (default: none; needed unless --measure)",
    )
    td.add_argument(
        "--measure",
        default=None,
        metavar="DRAFTER",
        help="only measure this drafter's acceptance length on held-out prompts (default: train "
        "a drafter)",
    )
    td.add_argument(
        "--quantization",
        choices=["fp8_per_block"],
        default=None,
        help="with --measure: quantize the drafter's linears (default: none)",
    )
    td.add_argument("--device", choices=["auto", "cpu", "cuda"], default="auto", help="device")
    td.add_argument(
        "--threads",
        type=int,
        default=None,
        help="CPU threads for torch (default: the physical cores this process may run on)",
    )
    _progress_arg(td)
    td.add_argument("--layers", type=int, default=1, help="drafter decoder layers")
    td.add_argument("--block-size", type=int, default=8, help="anchor + K masks")
    td.add_argument(
        "--target-layers",
        default=None,
        help="target layers whose hidden states feed the drafter, e.g. 1,14,27 (default: 3 "
        "spread over the model)",
    )
    td.add_argument(
        "--mask-token-id",
        type=int,
        default=None,
        help="(default: <|MASK|> if the vocabulary has it, else an unused special token)",
    )
    td.add_argument(
        "--prompts", default=None, help="a text file, one prompt a line (default: built-in)"
    )
    td.add_argument(
        "--corpus",
        default=None,
        help="JSON of generated sequences: reused if it exists, else written (default: none)",
    )
    td.add_argument("--num-prompts", type=int, default=256, help="prompts to generate from")
    td.add_argument("--max-new-tokens", type=int, default=128, help="tokens per continuation")
    td.add_argument("--gen-batch-size", type=int, default=32, help="sequences generated at once")
    td.add_argument("--temperature", type=float, default=0.0, help="0: greedy continuations")
    td.add_argument(
        "--plain-fraction",
        type=float,
        default=0.5,
        help="share of prompts given as plain text, without the chat template (default: 0.5)",
    )
    td.add_argument(
        "--wide-prompts",
        action="store_true",
        help="widen the built-in prompts with topics the target lists itself, nouns of its "
        "vocabulary and standard-library function heads (default: the built-in prompts only)",
    )
    td.add_argument("--steps", type=int, default=1000, help="training steps")
    td.add_argument("--seqs-per-step", type=int, default=4, help="sequences per training step")
    td.add_argument("--blocks-per-seq", type=int, default=8, help="blocks drawn per sequence")
    td.add_argument("--lr", type=float, default=6e-4, help="learning rate")
    td.add_argument(
        "--max-minutes",
        type=float,
        default=None,
        help="stop training after this (default: no time limit)",
    )
    td.add_argument(
        "--sampled-softmax",
        type=int,
        default=0,
        metavar="N",
        help="loss over the corpus tokens + N random others (0: the whole vocabulary)",
    )
    td.add_argument(
        "--init-from", default=None, help="continue from this drafter (default: a fresh one)"
    )
    td.add_argument("--seed", type=int, default=0, help="random seed")
    td.add_argument(
        "--eval-prompts", type=int, default=16, help="held-out prompts to measure, of each kind"
    )
    td.set_defaults(func=cmd_train_drafter)

    tables = command(
        sub,
        "tables",
        "shared host tables ($LIBKK_SHM_DIR or /dev/shm/libkk): list, prune",
        "Manage the embedding tables that sessions with shared_host_tables=True share through "
        "$LIBKK_SHM_DIR (default /dev/shm/libkk).",
    )
    tables_sub = tables.add_subparsers(dest="tables_command", required=True, metavar="ACTION")
    tables_list = command(
        tables_sub,
        "list",
        "every entry: key, size, state, tensor",
        "List every shared host table: key, size, state and tensor.",
    )
    tables_list.set_defaults(func=cmd_tables_list)
    tables_prune = command(
        tables_sub,
        "prune",
        "remove invalid entries (or all; processes mapping one keep their pages)",
        "Remove invalid shared host tables, or all of them (processes mapping one keep their "
        "pages until they exit).",
    )
    tables_prune.add_argument("--all", action="store_true", help="remove every entry")
    tables_prune.set_defaults(func=cmd_tables_prune)
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    logging.basicConfig(
        level=logging.INFO if args.verbose else logging.WARNING,
        format="%(levelname)s %(name)s: %(message)s",
    )
    try:
        return args.func(args)
    except LibkkError as e:
        print(f"libkk: error: {e}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        return 130


if __name__ == "__main__":
    sys.exit(main())
