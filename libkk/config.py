"""Every engine setting, as frozen msgspec Structs validated through one entry point.

`EngineConfig.from_settings(model, **settings)` takes flat keywords (`max_num_seqs=8`) or whole
sections (`scheduler={"max_num_seqs": 8}`); `EngineConfig.from_file` reads JSON or TOML. Errors
carry the path of the bad field (`$.scheduler.max_num_seqs`). `config_hash()` is stable across
processes and keys on-disk caches.
"""

from __future__ import annotations

import hashlib
import tomllib
from os import PathLike
from pathlib import Path
from typing import Annotated, Any, Literal

import msgspec

from libkk.errors import ConfigError

PositiveInt = Annotated[int, msgspec.Meta(ge=1)]
Fraction = Annotated[float, msgspec.Meta(gt=0.0, le=1.0)]

_STRUCT = dict(frozen=True, kw_only=True, forbid_unknown_fields=True)


class ModelConfig(msgspec.Struct, **_STRUCT):
    # Path of an HF-layout folder or a .gguf file; None means the default model.
    model: str | None = None
    # "auto": float32 on CPU (exact parity with transformers), bfloat16 on CUDA.
    dtype: Literal["auto", "float32", "bfloat16", "float16"] = "auto"
    # None: the checkpoint's max_position_embeddings.
    max_model_len: PositiveInt | None = None
    # Map the embedding matrix from one shared copy per host (/dev/shm/libkk, or $LIBKK_SHM_DIR)
    # instead of a private copy per process (on CUDA each step's rows are gathered from it).
    shared_host_tables: bool = False
    # Quantize the experts of a full-precision MoE checkpoint on load (the weights a
    # `libkk quantize --format` checkpoint would load); None keeps the checkpoint's own format.
    moe_weight_format: Literal["nvfp4", "mxfp4"] | None = None
    # Quantize every linear (attention and MLP projections) on load to FP8 with one scale per
    # 128x128 block: the weights an FP8 per-block checkpoint would load.
    quantization: Literal["fp8_per_block"] | None = None
    # Packed 4-bit experts (CUDA): keep each MoE layer's scales CSF-compressed on the device and
    # expand the next layer's on a side stream while the current layer's attention runs.
    csf_prefetch: bool = False
    # Opt-in FP8 activations for prefill rows of packed 4-bit experts, only in layers with
    # calibrated input scales; decode and verification rows always run W4A16. Start-up logs
    # what each MoE layer's rows run.
    moe_prefill_activations: Literal["fp8"] | None = None


class CacheConfig(msgspec.Struct, **_STRUCT):
    block_size: Annotated[int, msgspec.Meta(ge=1, le=1024)] = 16
    # Exact number of KV blocks (the null block included); overrides the memory budget.
    num_gpu_blocks: Annotated[int, msgspec.Meta(ge=2)] | None = None
    # Share of device memory (of available RAM on CPU) that weights + KV cache may use.
    gpu_memory_utilization: Fraction = 0.9
    # A fixed KV budget in bytes; overrides gpu_memory_utilization.
    kv_cache_memory_bytes: PositiveInt | None = None
    enable_prefix_caching: bool = True
    # Host RAM for a CPU tier of the KV cache: prefix blocks evicted from the device pool are kept
    # there and copied back on a later hit instead of recomputed. None: no tier.
    kv_offload_bytes: PositiveInt | None = None
    # "auto": the model dtype; "fp8": float8_e4m3fn (half of bf16's bytes) with one k and one v
    # scale per layer: the checkpoint's k_scale/v_scale if it has them, else 1.0.
    kv_cache_dtype: Literal["auto", "fp8"] = "auto"
    # FP8 caches only: each layer sets its scales from the first prefill it stores
    # (amax(|k|) / 448, likewise for v), replacing 1.0 or the checkpoint's, then keeps them.
    calculate_kv_scales: bool = False

    def __post_init__(self) -> None:
        if self.calculate_kv_scales and self.kv_cache_dtype != "fp8":
            raise ValueError(
                "calculate_kv_scales needs kv_cache_dtype='fp8' (other caches have no scales)"
            )


class SchedulerConfig(msgspec.Struct, **_STRUCT):
    max_num_seqs: PositiveInt = 256
    # Tokens the model may process in one step.
    max_num_batched_tokens: PositiveInt = 2048
    # Tokens the scheduler may issue in a mixed step; None means max_num_batched_tokens.
    max_num_scheduled_tokens: PositiveInt | None = None
    enable_chunked_prefill: bool = True
    # A step with no runnable decode may use max_num_batched_tokens as its cap.
    uncap_prefill_only_steps: bool = False
    # Share of step time prefill gets while prefill and decode contend (0 < s < 1 or "auto");
    # None: every step takes decodes first, then fills the budget with prefill chunks.
    prefill_compute_share: float | Literal["auto"] | None = None
    # Launch step k before step k-1's sampled tokens reach the host, then finish step k-1
    # (append tokens, stop checks, detokenize) while the device runs step k. Same tokens as
    # synchronous mode; a request's outputs may come back one step() call later. A step whose
    # tokens the next needs first (a verification; a request that drafts next, reads token
    # values or awaits a grammar mask) is finished before the next launches. "auto": on for a
    # CUDA device unless something needs every step's tokens on the host before the next can
    # launch (shared_host_tables; speculation without the draft backoff, or under tensor
    # parallelism); off on the CPU, whose forward runs on the calling thread with nothing to
    # overlap.
    async_scheduling: bool | Literal["auto"] = "auto"

    def __post_init__(self) -> None:
        s = self.prefill_compute_share
        if isinstance(s, float) and not 0.0 < s < 1.0:
            raise ValueError(f"prefill_compute_share must be in (0, 1) or 'auto', got {s}")
        if (
            self.max_num_scheduled_tokens is not None
            and self.max_num_scheduled_tokens > self.max_num_batched_tokens
        ):
            raise ValueError(
                f"max_num_scheduled_tokens ({self.max_num_scheduled_tokens}) must not exceed "
                f"max_num_batched_tokens ({self.max_num_batched_tokens})"
            )

    @property
    def scheduled_token_cap(self) -> int:
        return self.max_num_scheduled_tokens or self.max_num_batched_tokens


class CompilationConfig(msgspec.Struct, **_STRUCT):
    # Which batches replay CUDA graphs (CUDA only). "FULL" (the default): uniform decode batches
    # (q tokens per request: 1, or 1 + K when verifying drafts) replay FULL graphs of the whole
    # forward, and batches of any other composition of up to the largest capture size in tokens
    # replay FULL graphs too (one per token count, graphs/capture.py's MixedGraphs).
    # "FULL_DECODE_ONLY": the uniform decode graphs only, the rest runs without graphs.
    # "PIECEWISE": batches of up to the largest capture size in tokens replay the graphed pieces
    # between attention calls, attention runs eagerly. "FULL_AND_PIECEWISE": FULL graphs for
    # uniform decode, PIECEWISE for the rest. "NONE": no graphs. PIECEWISE modes need
    # torch_compile (the pieces are compiled). FULL matches FULL_AND_PIECEWISE on mixed loads at
    # the warm start of FULL_DECODE_ONLY (benchmarks/RESULTS.md, 2026-12-06).
    cudagraph_mode: Literal[
        "NONE", "PIECEWISE", "FULL", "FULL_DECODE_ONLY", "FULL_AND_PIECEWISE"
    ] = "FULL"
    # Batch sizes to capture; None: 1, 2, 4, then every 8 up to 256 (capped at max_num_seqs).
    cudagraph_capture_sizes: list[PositiveInt] | None = None
    # When FULL graphs are captured. "startup": every one as the session starts (each step as
    # fast as it will be from the first). "lazy": the largest of each kind at start-up (the
    # graphs' memory pool reaches its size then), each other one the first time a step needs it,
    # which that step waits for (tens of ms for an 8B model): most of the capture leaves the
    # start. Lazy needs one process and an uncompiled forward; elsewhere every graph is captured
    # at start-up.
    cudagraph_capture: Literal["startup", "lazy"] = "startup"
    # On CUDA, compile the model forward with torch.compile (Inductor fuses the torch ops left
    # between libkk's kernels). "auto": compiled unless the model family runs libkk kernels
    # alone on CUDA (its class's `fused_on_cuda`), where compiling buys nothing in decode or
    # prefill and costs every start (benchmarks/RESULTS.md, 2026-12-05: Qwen3-8B). PIECEWISE
    # modes always compile.
    torch_compile: bool | Literal["auto"] = "auto"
    # On CUDA, for models with packed 4-bit MoE experts: before graph capture, time a few tile
    # configs of the fused MoE kernels per token bucket (powers of two up to the largest step) on
    # the model's real weights, keep the fastest in the artifact cache (a warm start loads them
    # without timing) and run them (graphs/moe_tiles.py). False: the kernels' static tile table.
    tune_moe_tiles: bool = True

    def compiles(self, device_type: str, model: object) -> bool:
        """Whether `model`'s forward runs under torch.compile on this device type."""
        if device_type != "cuda":
            return False
        if self.torch_compile == "auto":
            fused = getattr(model, "fused_on_cuda", False)
            return "PIECEWISE" in self.cudagraph_mode or not fused
        return self.torch_compile

    def __post_init__(self) -> None:
        if "PIECEWISE" in self.cudagraph_mode and self.torch_compile is False:
            raise ValueError(
                f"cudagraph_mode={self.cudagraph_mode!r} needs torch_compile=True "
                "(the graphed pieces are compiled)"
            )


class SpeculativeConfig(msgspec.Struct, **_STRUCT):
    # None: no speculation. "ngram": prompt/output lookup; "draft_model": a smaller model with the
    # same tokenizer; "dflash": a DFlash block drafter (both need draft_model).
    method: Literal["ngram", "draft_model", "dflash"] | None = None
    # K: the most drafts verified per request and step.
    num_speculative_tokens: Annotated[int, msgspec.Meta(ge=1, le=16)] = 4
    # The drafter: an HF-layout folder (or .gguf) for draft_model; a DFlash drafter folder for
    # dflash (None there: the drafter shipped for the default model).
    draft_model: str | None = None
    # ngram: the longest suffix of min..max tokens found earlier in the request is matched.
    prompt_lookup_min: PositiveInt = 1
    prompt_lookup_max: PositiveInt = 4
    # Model drafters: "greedy" drafts the argmax (one-hot q), "probabilistic" samples drafts with
    # keyed noise on the draft stream (q = the drafter's processed distribution).
    draft_sampling: Literal["greedy", "probabilistic"] = "greedy"
    # "exact": lossless rejection sampling. "synthetic": accept draft k with probability
    # synthetic_acceptance_rates[k] (keyed, deterministic) whatever the target says; for
    # benchmarks only, outputs then differ from the target's.
    rejection_sample_method: Literal["exact", "synthetic"] = "exact"
    synthetic_acceptance_rates: list[Annotated[float, msgspec.Meta(ge=0.0, le=1.0)]] | None = None
    # Verify only the drafts worth their cost under an online acceptance estimate, with step costs
    # profiled at start-up (libkk/engine/speculation.py); the output is unchanged.
    adaptive_verification: bool = False
    # Stop drafting for a request while its drafts do not pay: the acceptance length its
    # estimated per-draft rate gives below what a drafting step costs over a plain one of the
    # same batch size (timed at start-up), looking again (one draft) after a pause sized to keep
    # looks at 1% of its tokens and at least doubling (engine/speculation.py, DraftBackoff).
    # Greedy output is unchanged; one process only (ignored with tensor parallelism).
    draft_backoff: bool = True
    # Tensor parallelism, DFlash: drafts (greedy and probabilistic) are drawn from each rank's
    # vocabulary shard of the LM head with one small all-gather per row, and every rank verifies
    # the drafts from its shard of the target logits (libkk/spec_decode/vocab_parallel.py), instead of
    # gathering [rows, vocab] logits. Rows it does not cover (penalties, banned ids, top-k, top-p,
    # min-p, logprobs) use whole rows: a verification step with any such row falls back entirely.
    # Same tokens as without it. No effect at tensor_parallel_size=1.
    vocab_parallel_drafting: bool = False

    def __post_init__(self) -> None:
        m = self.method
        if m == "draft_model" and not self.draft_model:
            raise ValueError(f"speculative method {m!r} needs draft_model (a checkpoint path)")
        if m in (None, "ngram") and self.draft_model is not None:
            raise ValueError(
                f"draft_model is only used by methods 'draft_model' and 'dflash', not {m!r}"
            )
        if self.prompt_lookup_min > self.prompt_lookup_max:
            raise ValueError(
                f"prompt_lookup_min ({self.prompt_lookup_min}) must not exceed "
                f"prompt_lookup_max ({self.prompt_lookup_max})"
            )
        if self.vocab_parallel_drafting and m != "dflash":
            raise ValueError(f"vocab_parallel_drafting needs method 'dflash', not {m!r}")
        if m == "ngram" and self.draft_sampling != "greedy":
            raise ValueError("draft_sampling='probabilistic' needs a model drafter, not 'ngram'")
        rates = self.synthetic_acceptance_rates
        if self.rejection_sample_method == "synthetic":
            if m is None:
                raise ValueError("rejection_sample_method='synthetic' needs a speculative method")
            if not rates:
                raise ValueError(
                    "rejection_sample_method='synthetic' needs synthetic_acceptance_rates "
                    "(one accept rate per draft position)"
                )
            if len(rates) not in (1, self.num_speculative_tokens):
                raise ValueError(
                    f"synthetic_acceptance_rates has {len(rates)} rates: expected 1 or "
                    f"num_speculative_tokens ({self.num_speculative_tokens})"
                )
        elif rates is not None:
            raise ValueError(
                "synthetic_acceptance_rates is only used with rejection_sample_method='synthetic'"
            )
        if self.adaptive_verification and m is None:
            raise ValueError("adaptive_verification needs a speculative method")


class ParallelConfig(msgspec.Struct, **_STRUCT):
    # Tensor parallelism: the model's heads, MLP/expert widths and vocabulary split across this many
    # ranks. Rank 0 runs in the caller's process, ranks 1..N-1 in worker processes libkk starts
    # and stops with the Session (CUDA: rank r on cuda:r, NCCL; CPU: gloo).
    tensor_parallel_size: Annotated[int, msgspec.Meta(ge=1, le=64)] = 1
    # A worker that does not start, or a collective that does not complete, within this many
    # seconds fails the Session (a worker that exits fails it at once).
    worker_timeout_s: Annotated[float, msgspec.Meta(gt=0.0)] = 300.0


class EngineConfig(msgspec.Struct, **_STRUCT):
    model: ModelConfig = msgspec.field(default_factory=ModelConfig)
    cache: CacheConfig = msgspec.field(default_factory=CacheConfig)
    scheduler: SchedulerConfig = msgspec.field(default_factory=SchedulerConfig)
    compilation: CompilationConfig = msgspec.field(default_factory=CompilationConfig)
    speculative: SpeculativeConfig = msgspec.field(default_factory=SpeculativeConfig)
    parallel: ParallelConfig = msgspec.field(default_factory=ParallelConfig)
    device: Literal["auto", "cpu", "cuda"] = "auto"
    # CPU threads for torch (torch.set_num_threads, process-wide, set when a Session starts).
    # None: the physical cores this process may run on (its affinity mask, hyper-threads counted
    # once; libkk/engine/threads.py). What the CPU forward runs on; harmless on CUDA.
    num_threads: PositiveInt | None = None
    # A request with no progress for this long is logged with its timeline.
    stall_threshold_s: Annotated[float, msgspec.Meta(gt=0.0)] = 60.0
    # Show progress bars for loading and conversion (stderr).
    progress: bool = True
    # Once the model is ready, collect garbage and freeze every live Python object out of the
    # collector's reach until a session closes (libkk/runtime/heap.py): full collections would
    # otherwise walk the model's objects, a stall inside some step (138 ms on the CPU for a tiny
    # model). Frozen objects of the host that become cyclic garbage meanwhile go at a close.
    freeze_gc: bool = True

    def __post_init__(self) -> None:
        if self.scheduler.async_scheduling is True:
            _check_async_scheduling(self)

    def for_device(self, device_type: str) -> EngineConfig:
        """This config with its "auto" settings decided for the device type it runs on."""
        if self.scheduler.async_scheduling != "auto":
            return self
        on = device_type == "cuda" and self._can_schedule_async()
        scheduler = msgspec.structs.replace(self.scheduler, async_scheduling=on)
        return msgspec.structs.replace(self, scheduler=scheduler)

    def _can_schedule_async(self) -> bool:
        """Speculation runs ahead only of requests the draft backoff pauses: one process only
        (the backoff is off under tensor parallelism, where every step would wait)."""
        speculates = self.speculative.method is not None
        backs_off = self.speculative.draft_backoff and self.parallel.tensor_parallel_size == 1
        return not self.model.shared_host_tables and (not speculates or backs_off)

    @classmethod
    def from_settings(cls, model: str | None = None, **settings: Any) -> EngineConfig:
        """Builds a config from flat keywords and/or whole sections; validates everything."""
        return cls().updated(model=model, **settings)

    def updated(self, **settings: Any) -> EngineConfig:
        """A copy with settings applied on top: flat keywords (`max_num_seqs=8`), whole
        sections (`scheduler={...}`), and `model` as a path (a str) or as a section (a dict)."""
        tree = self.to_dict()
        for key, value in settings.items():
            if key == "model" and (value is None or isinstance(value, (str, PathLike))):
                tree["model"]["model"] = None if value is None else str(value)
            elif key in _SECTIONS:
                if isinstance(value, msgspec.Struct):
                    value = msgspec.structs.asdict(value)
                if not isinstance(value, dict):
                    raise ConfigError(
                        f"setting {key!r} must be a mapping, got {type(value).__name__}"
                    )
                tree[key].update(value)
            elif key in _FIELD_TO_SECTION:
                tree[_FIELD_TO_SECTION[key]][key] = value
            elif key in _TOP_FIELDS:
                tree[key] = value
            else:
                known = sorted({*_FIELD_TO_SECTION, *_TOP_FIELDS, *_SECTIONS})
                raise ConfigError(f"unknown setting {key!r}; known settings: {', '.join(known)}")
        return self.from_dict(tree)

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> EngineConfig:
        try:
            return msgspec.convert(data, cls)
        except msgspec.ValidationError as e:
            raise ConfigError(f"invalid engine setting: {e}") from None

    @classmethod
    def from_file(cls, path: str | Path) -> EngineConfig:
        """Reads a JSON or TOML file holding the same tree as `from_dict`."""
        path = Path(path)
        try:
            raw = path.read_bytes()
        except OSError as e:
            raise ConfigError(f"cannot read config file {str(path)!r}: {e}") from None
        try:
            data = (
                tomllib.loads(raw.decode()) if path.suffix == ".toml" else msgspec.json.decode(raw)
            )
        except (tomllib.TOMLDecodeError, msgspec.DecodeError, UnicodeDecodeError) as e:
            raise ConfigError(
                f"config file {str(path)!r} is not valid {path.suffix[1:]}: {e}"
            ) from None
        if not isinstance(data, dict):
            raise ConfigError(f"config file {str(path)!r} must hold a mapping at the top level")
        return cls.from_dict(data)

    def to_dict(self) -> dict[str, Any]:
        return msgspec.to_builtins(self)

    def config_hash(self) -> str:
        return hashlib.sha256(msgspec.json.encode(self)).hexdigest()[:16]


def _check_async_scheduling(config: EngineConfig) -> None:
    """Settings that read sampled token values on the host before the next step can launch."""
    if config.speculative.method is not None and config.parallel.tensor_parallel_size > 1:
        raise ValueError(
            f"async_scheduling does not support speculative decoding under tensor parallelism "
            f"(method={config.speculative.method!r}): the ranks' proposers need the sampled "
            "tokens before every step"
        )
    if config.model.shared_host_tables:
        raise ValueError(
            "async_scheduling does not support shared_host_tables: its embedding rows are "
            "gathered on the host from token ids the host does not have yet"
        )


_SECTIONS = {
    "model": ModelConfig,
    "cache": CacheConfig,
    "scheduler": SchedulerConfig,
    "compilation": CompilationConfig,
    "speculative": SpeculativeConfig,
    "parallel": ParallelConfig,
}
_FIELD_TO_SECTION = {f: name for name, t in _SECTIONS.items() for f in t.__struct_fields__}
_TOP_FIELDS = {f for f in EngineConfig.__struct_fields__ if f not in _SECTIONS}
assert not set(_FIELD_TO_SECTION) & _TOP_FIELDS, "flat setting names must be unique"
