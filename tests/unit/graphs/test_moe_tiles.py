"""Measured MoE tile choices: the kernels' registry (buckets, lookup, fallback to the static table,
the opaque op under torch.compile) and the tuner's selection, recording and reloading through a real
artifact cache, with a fake timer (no GPU; the kernel launches are replaced by spies)."""

from __future__ import annotations

import logging

import pytest
import torch
from libkk.graphs.artifact_key import ArtifactKey
from libkk.graphs.artifacts import ArtifactCache
from libkk.graphs.moe_tiles import (
    STORE_KERNELS,
    TileMismatch,
    TuneProblem,
    candidate_configs,
    packed_moe_problems,
    static_config,
    store_key,
    tune_moe_tiles,
    tuning_buckets,
)
from libkk.kernels import moe as M
from libkk.kernels.moe import w4a8, w4a16
from torch import nn

from libkk.layers.moe import SparseMoeBlock
from libkk.layers.quant_moe import MoeOptions, moe_options

SHAPE = M.MoeShape("nvfp4", "w4a16", 4, 64, 32, 2)
A = M.MoeTileConfig(block_m=16, block_n=64, block_k=64, num_warps=4, num_stages=2)
B = M.MoeTileConfig(block_m=32, block_n=32, block_k=32, num_warps=8, num_stages=3)
C = M.MoeTileConfig(block_m=64, block_n=16, block_k=128, num_warps=4, num_stages=4)


@pytest.fixture(autouse=True)
def _clean_registry():
    M.clear_tile_choices()
    yield
    M.clear_tile_choices()


# ---- registry -------------------------------------------------------------------------------


def test_token_bucket_is_the_next_power_of_two():
    got = {n: M.token_bucket(n) for n in (0, 1, 2, 3, 4, 5, 63, 64, 65, 2048, 2049)}
    assert got == {0: 1, 1: 1, 2: 2, 3: 4, 4: 4, 5: 8, 63: 64, 64: 64, 65: 128, 2048: 2048,
                   2049: 4096}  # fmt: skip
    with pytest.raises(M.MoeKernelError):
        M.token_bucket(-1)
    assert tuning_buckets(1) == [1]
    assert tuning_buckets(100) == [1, 2, 4, 8, 16, 32, 64, 128]
    with pytest.raises(ValueError):
        tuning_buckets(0)


def test_lookup_takes_the_smallest_installed_bucket_at_or_above_the_count():
    assert M.tile_choice(SHAPE, 5) is None  # nothing installed: the static table
    M.install_tile_choice(SHAPE, 64, C)
    M.install_tile_choice(SHAPE, 1, A)
    M.install_tile_choice(SHAPE, 4, B)
    want = {0: A, 1: A, 2: B, 4: B, 5: C, 64: C, 65: C, 10_000: C}
    assert {n: M.tile_choice(SHAPE, n) for n in want} == want
    assert M.tile_choice(SHAPE._replace(top_k=4), 1) is None  # another shape
    assert M.tile_choice(SHAPE._replace(activations="w4a8"), 1) is None
    M.install_tile_choice(SHAPE, 4, A)  # a later choice replaces the bucket's
    assert M.tile_choice(SHAPE, 3) == A
    assert M.installed_tile_choices() == {SHAPE: {1: A, 4: A, 64: C}}
    M.clear_tile_choices()
    assert M.tile_choice(SHAPE, 1) is None


@pytest.mark.parametrize(
    "shape, bucket, config",
    [
        (SHAPE, 3, A),  # not a power of two
        (SHAPE, 0, A),
        (SHAPE._replace(fmt="int4"), 1, A),
        (SHAPE._replace(activations="w8a8"), 1, A),
        (SHAPE, 1, M.W4A8_PREFILL_CONFIG),  # W4A8 tiles for a W4A16 shape
        (SHAPE._replace(activations="w4a8"), 1, A),
        (SHAPE, 1, M.MoeTileConfig(8, 32, 64, 4, 3)),  # block_m below tl.dot's 16
        (SHAPE, 1, M.MoeTileConfig(16, 48, 64, 4, 3)),  # block_n not a power of two
        (SHAPE, 1, M.MoeTileConfig(16, 32, 16, 4, 3)),  # block_k below 32
        (SHAPE, 1, M.MoeTileConfig(16, 32, 64, 4, 0)),
        (SHAPE, 1, M.MoeTileConfig(16, 32, 64, 4, 3, down_block_n=32)),  # sorted: no down tile
        (SHAPE, 1, M.MoeTileConfig(M.PAIR_MAJOR, 8, 64, 2, 1, down_block_n=24)),
        (SHAPE, 1, M.MoeTileConfig(M.PAIR_MAJOR, 8, 64, 2, 1, down_block_k=16)),
        (SHAPE, 1, M.MoeTileConfig(M.PAIR_MAJOR, 8, 64, 2, 1, down_num_warps=-4)),
        (tuple(SHAPE), 1, A),  # a plain tuple is not a MoeShape
    ],
)
def test_install_rejects_bad_input(shape, bucket, config):
    with pytest.raises(M.MoeKernelError):
        M.install_tile_choice(shape, bucket, config)
    assert M.installed_tile_choices() == {}


class _KernelSpy:
    """Replaces the align and GEMM ops of kernels/moe/: records each call's tiles, fills the
    outputs with zeros (no kernels run on the CPU)."""

    def __init__(self, monkeypatch: pytest.MonkeyPatch) -> None:
        self.tiles: list[tuple] = []

        def align(topk_ids, num_experts, block_m):
            size = M.max_padded_pairs(topk_ids.numel(), num_experts, block_m)
            return (torch.zeros(size, dtype=torch.int32),
                    torch.zeros(size // block_m, dtype=torch.int32),
                    torch.zeros(1, dtype=torch.int32))  # fmt: skip

        def gemm(name: str, n_fixed: int):
            def op(*args):
                out = args[n_fixed]
                self.tiles.append((name, *args[-(5 if name.startswith("w4a16") else 4) :]))
                out.zero_()

            return op

        # Patched where the fused ops look them up: their defining modules.
        for module in (w4a16, w4a8):
            monkeypatch.setattr(module, "moe_align_block_size", align)
        monkeypatch.setattr(w4a16, "moe_w4a16_gate_up", gemm("w4a16_gate_up", 7))
        monkeypatch.setattr(w4a16, "moe_w4a16_down", gemm("w4a16_down", 8))
        monkeypatch.setattr(w4a8, "moe_w4a8_gate_up", gemm("w4a8_gate_up", 9))
        monkeypatch.setattr(w4a8, "moe_w4a8_down", gemm("w4a8_down", 9))

        def pairs(x, *args):  # the pair-major path: its kernels run inside, so the whole call
            self.tiles.append(("w4a16_pairs", *_tiles(args[-1])))
            topk_ids = args[-3]
            return x.new_zeros(x.shape[0], topk_ids.shape[1], x.shape[1])  # each pair's output

        monkeypatch.setattr(w4a16, "_fused_moe_w4a16_pairs", pairs)

    def take(self) -> list[tuple]:
        tiles, self.tiles = self.tiles, []
        return tiles


def _layer_args(t: int, shape: M.MoeShape = SHAPE):
    e, h, i, k = shape.num_experts, shape.hidden, shape.intermediate, shape.top_k
    g = M.GROUP[shape.fmt]
    x = torch.randn(t, h)
    w13 = torch.zeros(e, 2 * i, h // 2, dtype=torch.uint8)
    s13 = torch.zeros(e, 2 * i, h // g, dtype=torch.uint8)
    w2 = torch.zeros(e, h, i // 2, dtype=torch.uint8)
    s2 = torch.zeros(e, h, i // g, dtype=torch.uint8)
    ids = torch.stack([torch.randperm(e)[:k] for _ in range(t)]).to(torch.int32)
    weights = torch.full((t, k), 1.0 / k)
    return x, w13, s13, torch.ones(e, 2), w2, s2, torch.ones(e, 1), weights, ids


def _tiles(cfg: M.MoeTileConfig) -> tuple:
    return (cfg.block_m, cfg.block_n, cfg.block_k, cfg.num_warps, cfg.num_stages)


def test_fused_call_uses_the_installed_choice_else_the_static_table(monkeypatch):
    spy = _KernelSpy(monkeypatch)
    for t, static in ((20, M.DECODE_CONFIG), (100, M.PREFILL_CONFIG)):
        M.fused_moe_w4a16(*_layer_args(t), "nvfp4")
        assert spy.take() == [("w4a16_gate_up", *_tiles(static)), ("w4a16_down", *_tiles(static))]
    for t, static in ((1, M.PAIR_DECODE_NARROW), (2, M.PAIR_DECODE_NARROW),
                      (3, M.PAIR_DECODE_CONFIG), (16, M.PAIR_DECODE_CONFIG)):  # fmt: skip
        M.fused_moe_w4a16(*_layer_args(t), "nvfp4")
        assert spy.take() == [("w4a16_pairs", *_tiles(static))]
    M.install_tile_choice(SHAPE, 4, A)
    M.install_tile_choice(SHAPE, 128, B)
    for t, cfg in ((3, A), (100, B), (500, B)):
        M.fused_moe_w4a16(*_layer_args(t), "nvfp4")
        assert spy.take() == [("w4a16_gate_up", *_tiles(cfg)), ("w4a16_down", *_tiles(cfg))]
    M.fused_moe_w4a16(*_layer_args(3), "nvfp4", C)  # an explicit config wins
    assert spy.take()[0] == ("w4a16_gate_up", *_tiles(C))
    other = SHAPE._replace(num_experts=8)
    M.fused_moe_w4a16(*_layer_args(3, other), "nvfp4")  # a shape with nothing installed
    assert spy.take()[0] == ("w4a16_pairs", *_tiles(M.PAIR_DECODE_CONFIG))


def test_w4a8_call_uses_the_installed_choice_else_the_prefill_config(monkeypatch):
    spy = _KernelSpy(monkeypatch)
    scale = torch.ones(1)
    x, w13, s13, g13, w2, s2, g2, weights, ids = _layer_args(20)
    args = (x, w13, s13, g13, w2, s2, g2, scale, scale, weights, ids, "nvfp4")
    static = M.W4A8_PREFILL_CONFIG
    M.fused_moe_w4a8(*args)
    assert spy.take()[0] == ("w4a8_gate_up", static.block_m, static.block_n, static.num_warps,
                             static.num_stages)  # fmt: skip
    tuned = M.W4A8TileConfig(block_m=32, block_n=64, num_warps=4, num_stages=2)
    M.install_tile_choice(SHAPE._replace(activations="w4a8"), 32, tuned)
    M.fused_moe_w4a8(*args)
    assert spy.take() == [("w4a8_gate_up", 32, 64, 4, 2), ("w4a8_down", 32, 64, 4, 2)]


def test_compiled_call_picks_tiles_at_run_time_without_recompiling(monkeypatch):
    """Under torch.compile a tuned shape runs as one opaque op, so the trace is not specialised per
    token bucket, and each call still gets its bucket's tiles."""
    spy = _KernelSpy(monkeypatch)
    M.install_tile_choice(SHAPE, 4, A)
    M.install_tile_choice(SHAPE, 32, B)
    M.install_tile_choice(SHAPE, 256, C)
    graphs: list[torch.fx.GraphModule] = []

    def backend(gm, example_inputs):
        graphs.append(gm)
        return gm.forward

    torch._dynamo.reset()
    compiled = torch.compile(lambda *a: M.fused_moe_w4a16(*a, "nvfp4"), backend=backend,
                             dynamic=True)  # fmt: skip
    for t, cfg in ((20, B), (3, A), (200, C), (17, B)):
        compiled(*_layer_args(t))
        assert spy.take()[0] == ("w4a16_gate_up", *_tiles(cfg)), t
    assert len(graphs) == 1
    nodes = list(graphs[0].graph.nodes)
    (op,) = [n for n in nodes if str(n.target) == "libkk.fused_moe_w4a16_measured.default"]
    # the top-k sum stays in the trace (Inductor fuses it into what consumes the layer's output)
    assert [str(u.target) for u in op.users] == ["sum"]
    out = compiled(*_layer_args(5))
    assert out.shape == (5, SHAPE.hidden)


# ---- tuner ----------------------------------------------------------------------------------


def test_candidates_start_with_the_static_choice_and_are_valid():
    for shape in (SHAPE, M.MoeShape("mxfp4", "w4a16", 128, 2048, 768, 8),
                  M.MoeShape("nvfp4", "w4a8", 128, 2048, 768, 8)):  # fmt: skip
        for t in (1, 4, 64, 128, 4096):
            cands = candidate_configs(shape, t)
            assert cands[0] == static_config(shape.activations, t)
            assert len(cands) == len(set(cands)) and 3 <= len(cands) <= 13
            pair_major = [c for c in cands if c.block_m == M.PAIR_MAJOR]
            decode = shape.activations == "w4a16" and t <= M.PAIR_MAJOR_MAX_TOKENS
            assert len(pair_major) == (len(cands) - 1 if decode else 0)
            if decode:  # the sorted path's decode tiles (K step fitted) compete too
                sorted_ = cands[-1]
                assert (sorted_.block_m, sorted_.block_n) == (16, M.DECODE_CONFIG.block_n)
                # and so does the other token range's static pair-major tile
                other = M.PAIR_DECODE_CONFIG if t <= 2 else M.PAIR_DECODE_NARROW
                assert (other.block_n, other.num_warps) in {(c.block_n, c.num_warps) for c in cands}
            for cfg in cands:
                M.check_tile_config(shape.activations, cfg)
                if isinstance(cfg, M.MoeTileConfig) and cfg != cands[0]:  # neighbours only
                    # K steps no longer than the reduction they step along: on the pair-major
                    # path gate_up's is the hidden size and down's the intermediate size
                    shorter = max(32, min(shape.hidden, shape.intermediate))
                    gate_up_k = shape.hidden if cfg.block_m == M.PAIR_MAJOR else shorter
                    assert M.GROUP[shape.fmt] <= cfg.block_k <= gate_up_k
                    assert M.GROUP[shape.fmt] <= cfg.down_tile()[1] <= shorter
    # one token at top-2 fills at most two rows of a tile: no taller M tiles than 16
    assert all(c.block_m in (16, M.PAIR_MAJOR) for c in candidate_configs(SHAPE, 1))


class _TinyMoeModel(nn.Module):
    def __init__(self, fp8: bool = False) -> None:
        super().__init__()
        with moe_options(MoeOptions(weight_format="nvfp4")):
            self.blocks = nn.ModuleList(
                SparseMoeBlock(
                    SHAPE.hidden, SHAPE.num_experts, SHAPE.top_k, SHAPE.intermediate, True
                )  # fmt: skip
                for _ in range(2)
            )
        self.blocks[1].experts.fp8_prefill = fp8


def test_problems_are_one_layer_per_distinct_shape():
    model = _TinyMoeModel()
    assert list(packed_moe_problems(model)) == [SHAPE]
    layer, dtype = packed_moe_problems(model)[SHAPE]
    assert layer is model.blocks[0].experts and dtype == torch.float32
    fp8 = packed_moe_problems(_TinyMoeModel(fp8=True))
    assert set(fp8) == {SHAPE, SHAPE._replace(activations="w4a8")}
    assert packed_moe_problems(nn.Linear(4, 4)) == {}


class _FakeTimer:
    """Times by table: each bucket's fastest is its last candidate; one candidate fails."""

    def __init__(self) -> None:
        self.calls: list[tuple[int, object]] = []

    def __call__(self, problem: TuneProblem, config) -> float:
        self.calls.append((problem.num_tokens, config))
        cands = candidate_configs(problem.shape, problem.num_tokens)
        if config == cands[1]:
            raise RuntimeError("out of shared memory")
        return 1e-6 if config == cands[-1] else 5e-6

    def problems(self) -> set[int]:
        return {t for t, _ in self.calls}


def _entry(root):
    return ArtifactCache(root).entry(ArtifactKey.build({"model": "tiny"}, {"a": 1}, None))


def _no_timing(problem, config):
    raise AssertionError(f"timed {problem.num_tokens} tokens with a recorded choice")


def test_tuner_picks_the_fastest_records_and_a_reload_times_nothing(tmp_path, caplog):
    model = _TinyMoeModel()
    timer = _FakeTimer()
    with caplog.at_level(logging.INFO, logger="libkk"):
        choices = tune_moe_tiles(model, _entry(tmp_path), 20, timer=timer)
    buckets = [1, 2, 4, 8, 16, 32]
    assert [c.bucket for c in choices] == buckets
    assert timer.problems() == set(buckets)
    want = {b: candidate_configs(SHAPE, b)[-1] for b in buckets}
    assert {c.bucket: c.config for c in choices} == want
    assert all(c.source == "measured" and c.seconds == 1e-6 and c.static_seconds == 5e-6
               for c in choices)  # fmt: skip
    assert M.installed_tile_choices() == {SHAPE: want}
    lines = [r for r in caplog.records if r.getMessage().startswith("MoE tiles nvfp4 w4a16")]
    assert len(lines) == len(buckets)

    # What a new process sees: a fresh cache object over the same folder, nothing installed.
    M.clear_tile_choices()
    stored = _entry(tmp_path).load_autotune()[STORE_KERNELS["w4a16"]]
    assert set(stored) == {store_key(SHAPE, b) for b in buckets}
    again = tune_moe_tiles(model, _entry(tmp_path), 20, timer=_no_timing)
    assert [(c.bucket, c.config, c.source) for c in again] == [
        (b, want[b], "recorded") for b in buckets
    ]
    assert M.installed_tile_choices() == {SHAPE: want}


def test_a_tile_whose_output_differs_is_never_chosen(tmp_path, caplog):
    """The timer checks each candidate's output against the static choice's first: a tile that
    would be fastest but computes something else is rejected, with a warning."""

    def timer(problem: TuneProblem, config) -> float:
        if config == candidate_configs(problem.shape, problem.num_tokens)[-1]:
            raise TileMismatch(f"{config} differs")
        return _FakeTimer()(problem, config)

    with caplog.at_level(logging.WARNING, logger="libkk"):
        choices = tune_moe_tiles(_TinyMoeModel(), _entry(tmp_path), 1, timer=timer)
    assert [c.config for c in choices] == [candidate_configs(SHAPE, 1)[0]]  # the static choice
    assert any("MoE tile rejected" in r.getMessage() for r in caplog.records)


def test_a_torn_line_is_skipped_and_only_its_bucket_is_tuned_again(tmp_path):
    model = _TinyMoeModel()
    tune_moe_tiles(model, _entry(tmp_path), 4, timer=_FakeTimer())
    path = _entry(tmp_path).autotune.path
    raw = path.read_bytes()
    path.write_bytes(raw[: len(raw) - 20])  # the last choice (bucket 4) cut short by a crash
    M.clear_tile_choices()
    timer = _FakeTimer()
    choices = tune_moe_tiles(model, _entry(tmp_path), 4, timer=timer)
    assert timer.problems() == {4}
    assert {c.bucket: c.source for c in choices} == {1: "recorded", 2: "recorded", 4: "measured"}
    M.clear_tile_choices()
    final = tune_moe_tiles(model, _entry(tmp_path), 4, timer=_no_timing)  # the re-tuned line kept
    assert [c.bucket for c in final] == [1, 2, 4]


def test_a_recorded_config_that_is_not_valid_is_tuned_again(tmp_path):
    model = _TinyMoeModel()
    entry = _entry(tmp_path)
    entry.record_autotune(STORE_KERNELS["w4a16"], store_key(SHAPE, 1), {"block_m": 16})
    entry.record_autotune(STORE_KERNELS["w4a16"], store_key(SHAPE, 2), {**vars(A), "block_m": 12})
    entry.record_autotune(STORE_KERNELS["w4a16"], store_key(SHAPE, 4), vars(B))
    timer = _FakeTimer()
    choices = tune_moe_tiles(model, entry, 4, timer=timer)
    assert timer.problems() == {1, 2}
    assert {c.bucket: (c.source, c.config) for c in choices}[4] == ("recorded", B)


def test_equal_times_keep_the_static_choice_and_no_entry_still_installs(tmp_path):
    choices = tune_moe_tiles(_TinyMoeModel(), None, 128, timer=lambda p, c: 1e-5)
    assert {c.bucket: c.config for c in choices} == {
        b: static_config("w4a16", b) for b in tuning_buckets(128)
    }
    assert M.tile_choice(SHAPE, 100) == M.PREFILL_CONFIG


def test_no_candidate_running_keeps_the_static_table(tmp_path, caplog):
    def broken(problem, config):
        raise RuntimeError("no")

    assert tune_moe_tiles(_TinyMoeModel(), _entry(tmp_path), 2, timer=broken) == []
    assert M.installed_tile_choices() == {}
    assert _entry(tmp_path).load_autotune() == {}


def test_models_without_packed_experts_tune_nothing(tmp_path):
    assert tune_moe_tiles(nn.Linear(4, 4), _entry(tmp_path), 64, timer=_no_timing) == []
    assert not _entry(tmp_path).autotune.path.exists()


def test_w4a8_shapes_are_tuned_and_stored_apart(tmp_path):
    timer = _FakeTimer()
    choices = tune_moe_tiles(_TinyMoeModel(fp8=True), _entry(tmp_path), 2, timer=timer)
    assert {(c.shape.activations, c.bucket) for c in choices} == {
        (k, b) for k in ("w4a16", "w4a8") for b in (1, 2)
    }
    stored = _entry(tmp_path).load_autotune()
    assert set(stored) == set(STORE_KERNELS.values())
    w4a8 = SHAPE._replace(activations="w4a8")
    assert isinstance(M.tile_choice(w4a8, 2), M.W4A8TileConfig)


def test_choices_installed_earlier_in_the_process_are_reused_and_recorded(tmp_path):
    model = _TinyMoeModel()
    first = tune_moe_tiles(model, _entry(tmp_path / "a"), 8, timer=_FakeTimer())
    second = tune_moe_tiles(model, _entry(tmp_path / "b"), 16, timer=_FakeTimer())
    assert [(c.bucket, c.source) for c in second] == [
        (1, "installed"),
        (2, "installed"),
        (4, "installed"),
        (8, "installed"),
        (16, "measured"),
    ]
    assert [c.config for c in second[:4]] == [c.config for c in first]
    M.clear_tile_choices()
    reloaded = tune_moe_tiles(model, _entry(tmp_path / "b"), 16, timer=_no_timing)
    assert [(c.bucket, c.config) for c in reloaded] == [(c.bucket, c.config) for c in second]


def test_activations_take_the_model_dtype_when_the_router_is_quantized():
    model = _TinyMoeModel().to(torch.bfloat16)
    assert packed_moe_problems(model)[SHAPE][1] == torch.bfloat16
    gate = model.blocks[0].gate
    gate.weight.data = gate.weight.data.to(torch.float8_e4m3fn)
    assert packed_moe_problems(model)[SHAPE][1] == torch.bfloat16
