"""Tensor-parallel loading without processes: each rank's model is built and loaded with the
tensor-parallel state set to (rank, size), then compared with slices of the one-rank model.

Loading runs no collective, so a rank can be loaded alone; the safetensors reader is wrapped to
record what each rank actually reads.
"""

from __future__ import annotations

import contextlib

import pytest
import torch
from transformers import (
    LlamaConfig,
    LlamaForCausalLM,
    Phi3Config,
    Phi3ForCausalLM,
    Qwen3MoeConfig,
    Qwen3MoeForCausalLM,
)

import libkk.models.loader as loader_mod
from libkk.distributed import as_rank
from libkk.errors import ConfigError
from libkk.models.loader import load_model
from libkk.models.quantize import quantize_checkpoint

CPU = torch.device("cpu")


class _Recorder:
    """Wraps safe_open: counts the elements read whole (get_tensor) and by slice (get_slice)."""

    def __init__(self) -> None:
        self.whole: dict[str, int] = {}
        self.sliced: dict[str, int] = {}

    def open(self, *args, **kwargs):
        recorder, real = self, _REAL_SAFE_OPEN(*args, **kwargs)

        class Handle:
            def __enter__(self):
                real.__enter__()
                return self

            def __exit__(self, *exc):
                return real.__exit__(*exc)

            def keys(self):
                return real.keys()

            def get_tensor(self, name):
                t = real.get_tensor(name)
                recorder.whole[name] = t.numel()
                return t

            def get_slice(self, name):
                view = real.get_slice(name)

                class View:
                    def get_dtype(self):
                        return view.get_dtype()

                    def get_shape(self):
                        return view.get_shape()

                    def __getitem__(self, index):
                        t = view[index]
                        recorder.sliced[name] = recorder.sliced.get(name, 0) + t.numel()
                        return t

                return View()

        return Handle()


_REAL_SAFE_OPEN = loader_mod.safe_open


def _load(path, rank: int, size: int, recorder: _Recorder | None = None, **kw):
    with as_rank(rank, size), contextlib.ExitStack() as stack:
        if recorder is not None:
            mp = stack.enter_context(pytest.MonkeyPatch.context())
            mp.setattr(loader_mod, "safe_open", recorder.open)
        model, _ = load_model(path, torch.float32, CPU, progress=False, **kw)
    return {n: p.detach().clone() for n, p in model.named_parameters()}


@pytest.fixture(scope="module")
def llama_dir(tmp_path_factory):
    path = tmp_path_factory.mktemp("tp-llama")
    config = LlamaConfig(
        vocab_size=250, hidden_size=64, intermediate_size=96, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64,
        attention_bias=True, tie_word_embeddings=False,
    )  # fmt: skip
    torch.manual_seed(0)
    LlamaForCausalLM(config).save_pretrained(path)
    return path


def _expected(full: dict[str, torch.Tensor], name: str, rank: int, size: int) -> torch.Tensor:
    """The part of a one-rank parameter that rank `rank` of `size` should hold."""
    w = full[name]
    if "embed_tokens" in name or "lm_head" in name:  # vocab rows, padded to ceil(V / size)
        per = -(-w.shape[0] // size)
        part = w[rank * per : (rank + 1) * per]
        return torch.cat([part, part.new_zeros(per - part.shape[0], *w.shape[1:])])
    if "qkv_proj" in name:  # 4 heads of 16, 2 KV heads: [q 64 | k 32 | v 32]
        q, k, v = w.split([64, 32, 32])
        kv_heads = 2
        if size <= kv_heads:
            kv_part = lambda t: t.chunk(size)[rank]  # noqa: E731
        else:  # replicated: rank r keeps KV head r * kv / size
            kv_part = lambda t: t.chunk(kv_heads)[rank * kv_heads // size]  # noqa: E731
        return torch.cat([q.chunk(size)[rank], kv_part(k), kv_part(v)])
    if "gate_up_proj" in name:
        gate, up = w.chunk(2)
        return torch.cat([gate.chunk(size)[rank], up.chunk(size)[rank]])
    if name.endswith(("o_proj.weight", "down_proj.weight")):
        return w.chunk(size, dim=1)[rank]
    return w  # replicated (norms, o_proj bias)


@pytest.mark.parametrize("size", [2, 4])
def test_each_rank_loads_its_slices_and_reads_only_them(llama_dir, size):
    full = _load(llama_dir, 0, 1)
    total = sum(t.numel() for t in full.values())
    for rank in range(size):
        rec = _Recorder()
        mine = _load(llama_dir, rank, size, rec)
        assert mine.keys() == full.keys()
        for name, value in mine.items():
            assert torch.equal(value, _expected(full, name, rank, size)), (name, rank)
        # Sharded tensors are only ever read by slice; what is read whole is replicated.
        assert all(("norm" in n or "o_proj.bias" in n) for n in rec.whole), sorted(rec.whole)
        read = sum(rec.whole.values()) + sum(rec.sliced.values())
        local = sum(t.numel() for t in mine.values())
        # Less than a full copy; at most this rank's parameters (padding rows are not read).
        assert read <= local < total


@pytest.mark.parametrize("size", [2, 4])
def test_fused_phi3_projections_load_each_ranks_rows(tmp_path_factory, size):
    """Phi-3 stores qkv_proj and gate_up_proj fused: each rank reads its rows of every part."""
    path = tmp_path_factory.mktemp("tp-phi3")
    config = Phi3Config(
        vocab_size=250, hidden_size=64, intermediate_size=96, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64,
        pad_token_id=None, tie_word_embeddings=False,
    )  # fmt: skip
    torch.manual_seed(0)
    Phi3ForCausalLM(config).save_pretrained(path)
    full = _load(path, 0, 1)
    for rank in range(size):
        rec = _Recorder()
        mine = _load(path, rank, size, rec)
        assert mine.keys() == full.keys()
        for name, value in mine.items():
            assert torch.equal(value, _expected(full, name, rank, size)), (name, rank)
        assert all("norm" in n for n in rec.whole), sorted(rec.whole)


def test_kv_heads_are_replicated_when_fewer_than_ranks(llama_dir):
    with as_rank(3, 4):
        model, _ = load_model(llama_dir, torch.float32, CPU, progress=False)
    attn = model.model.layers[0].self_attn
    assert (attn.num_heads, attn.num_kv_heads) == (1, 1)
    assert model.num_kv_heads == 1  # the runner sizes this rank's KV cache by it


def test_heads_that_do_not_split_are_a_clear_error(llama_dir):
    with pytest.raises(ConfigError, match="tensor_parallel_size=3 does not divide"):
        _load(llama_dir, 0, 3)


# ---- MoE, 4-bit and CSF checkpoints ---------------------------------------------------------


def _moe_dir(tmp_path_factory, moe_intermediate: int):
    path = tmp_path_factory.mktemp(f"tp-moe-{moe_intermediate}")
    config = Qwen3MoeConfig(
        vocab_size=250, hidden_size=64, intermediate_size=96, moe_intermediate_size=moe_intermediate,
        num_hidden_layers=2, num_attention_heads=6, num_key_value_heads=3, head_dim=16,
        num_experts=4, num_experts_per_tok=2, max_position_embeddings=64,
    )  # fmt: skip
    torch.manual_seed(0)
    Qwen3MoeForCausalLM(config).save_pretrained(path)
    return path


def _expert_part(full: dict[str, torch.Tensor], name: str, rank: int, size: int) -> torch.Tensor:
    w = full[name]
    if name.endswith("w13_weight"):  # [E, 2I, H]: rows [gate | up] of each expert
        gate, up = w.chunk(2, dim=1)
        return torch.cat([gate.chunk(size, dim=1)[rank], up.chunk(size, dim=1)[rank]], dim=1)
    return w.chunk(size, dim=2)[rank]  # w2 [E, H, I]


@pytest.mark.parametrize("fmt", ["mxfp4-csf", "nvfp4-csf", "mxfp4"])
def test_slab_aligned_csf_sharding_at_tp3_is_bit_identical(tmp_path_factory, fmt):
    src = _moe_dir(tmp_path_factory, 96)  # 32 rows of gate/up per rank: two 16-row slabs
    dst = tmp_path_factory.mktemp(fmt) / "q"
    quantize_checkpoint(src, dst, fmt, progress=False)
    full = _load(dst, 0, 1)
    for rank in range(3):
        rec = _Recorder()
        mine = _load(dst, rank, 3, rec)
        experts = [n for n in mine if ".experts." in n]
        assert experts
        for name in experts:
            assert torch.equal(mine[name], _expert_part(full, name, rank, 3)), (name, rank)
        # gate/up weights and their block scales (CSF blobs included) are read by slice, never
        # whole (NVFP4's per-tensor global scales are scalars, read whole).
        gate_up = [
            n
            for n in {**rec.whole, **rec.sliced}
            if ("gate_proj" in n or "up_proj" in n) and not n.endswith("weight_scale_2")
        ]
        assert gate_up and not [n for n in gate_up if n in rec.whole]


@pytest.mark.parametrize(
    ("size", "moe_intermediate", "fmt"),
    [(3, 32, "mxfp4-csf"), (4, 32, "mxfp4-csf"), (2, 48, "nvfp4-csf")],
)
def test_csf_rows_not_divisible_by_tp_times_16_are_rejected(
    tmp_path_factory, size, moe_intermediate, fmt
):
    src = _moe_dir(tmp_path_factory, moe_intermediate)
    dst = tmp_path_factory.mktemp("csf-bad") / "q"
    quantize_checkpoint(src, dst, fmt, progress=False)
    _load(dst, 0, 1)  # fine unsplit
    with pytest.raises(ConfigError, match=rf"divisible by {size}\*16={size * 16}"):
        _load(dst, 0, size)


def test_moe_experts_split_on_the_intermediate_dim(tmp_path_factory):
    src = _moe_dir(tmp_path_factory, 96)
    full = _load(src, 0, 1)
    for rank in range(3):
        mine = _load(src, rank, 3)
        for name in (n for n in mine if ".experts." in n):
            assert torch.equal(mine[name], _expert_part(full, name, rank, 3))
        assert torch.equal(
            mine["model.layers.0.mlp.gate.weight"], full["model.layers.0.mlp.gate.weight"]
        )


def test_mixtral_experts_split_on_the_intermediate_dim(tmp_path_factory):
    from transformers import MixtralConfig, MixtralForCausalLM

    path = tmp_path_factory.mktemp("tp-mixtral")
    config = MixtralConfig(
        vocab_size=250, hidden_size=64, intermediate_size=96, num_hidden_layers=2,
        num_attention_heads=6, num_key_value_heads=3, num_local_experts=4,
        num_experts_per_tok=2, max_position_embeddings=64,
    )  # fmt: skip
    torch.manual_seed(0)
    MixtralForCausalLM(config).save_pretrained(path)
    full = _load(path, 0, 1)
    for rank in range(3):
        rec = _Recorder()
        mine = _load(path, rank, 3, rec)
        experts = [n for n in mine if ".experts." in n]
        assert experts
        for name in experts:
            assert torch.equal(mine[name], _expert_part(full, name, rank, 3)), (name, rank)
        assert not [n for n in rec.whole if "experts" in n]


def _packed_part(full: dict[str, torch.Tensor], name: str, rank: int, size: int, group: int):
    """Rank `rank`'s part of a one-rank packed expert parameter: gate/up rows, down columns."""
    w = full[name]
    if ".w13_" in name and w.dim() == 3:  # [E, 2I, ...]: this rank's rows of gate and of up
        gate, up = w.chunk(2, dim=1)
        return torch.cat([gate.chunk(size, dim=1)[rank], up.chunk(size, dim=1)[rank]], dim=1)
    if ".w2_weight" in name and w.dim() == 3:  # [E, H, I/2] bytes or [E, H, I/G] scales
        return w.chunk(size, dim=2)[rank]
    return w  # global and input scales: per tensor, every rank


@pytest.mark.parametrize("fmt", ["nvfp4", "mxfp4", "nvfp4-csf", "mxfp4-csf"])
def test_packed_experts_split_on_the_intermediate_dim(tmp_path_factory, monkeypatch, fmt):
    """Experts kept packed at tensor_parallel_size > 1: each rank holds its rows of gate/up and
    its columns of down, weights and scales alike (a CSF blob cut along its columns is decoded
    and cut by the layer), equal to the one-rank packed layer's slices."""
    from libkk.layers.quant_moe import MoeOptions

    src = _moe_dir(tmp_path_factory, 96)
    dst = tmp_path_factory.mktemp(f"packed-{fmt}") / "q"
    quantize_checkpoint(src, dst, fmt, progress=False)
    algo = fmt.removesuffix("-csf")
    monkeypatch.setattr(loader_mod, "_moe_options", lambda *a: MoeOptions(algo, False, None))
    full = _load(dst, 0, 1)
    assert full["model.layers.0.mlp.experts.w2_weight"].dtype == torch.uint8  # packed
    group = 16 if algo == "nvfp4" else 32
    for rank in range(3):
        rec = _Recorder()
        mine = _load(dst, rank, 3, rec)
        experts = [n for n in mine if ".experts." in n]
        assert mine.keys() == full.keys() and experts
        for name in experts:
            assert torch.equal(mine[name], _packed_part(full, name, rank, 3, group)), (name, rank)
        # Packed weights are read by slice; only scalars and column-cut CSF blobs come whole.
        whole = [n for n in rec.whole if ".experts." in n]
        assert all(n.endswith(("weight_scale_2", "input_scale", "down_proj.weight_scale_csf"))
                   for n in whole), whole  # fmt: skip


def test_packed_experts_quantized_on_load_hold_their_part(tmp_path_factory, monkeypatch):
    """On-load quantization at tensor_parallel_size > 1 quantizes each rank's part of the bf16
    experts: the packed layer holds local shapes whose values approximate that part."""
    from libkk.layers.quant_moe import MoeOptions
    from libkk.quant.formats import dequantize_nvfp4

    src = _moe_dir(tmp_path_factory, 96)
    bf16 = _load(src, 0, 1)  # the plain layer
    monkeypatch.setattr(loader_mod, "_moe_options", lambda *a: MoeOptions("nvfp4", False, None))
    for rank in range(3):
        with as_rank(rank, 3):
            model, _ = load_model(
                src, torch.float32, CPU, progress=False, moe_weight_format="nvfp4"
            )
        experts = model.model.layers[0].mlp.experts
        assert experts.w13_weight.shape == (4, 64, 32) and experts.w2_weight.shape == (4, 64, 16)
        down = dequantize_nvfp4(
            experts.w2_weight[1],
            experts.w2_weight_scale[1].view(torch.float8_e4m3fn),
            experts.w2_weight_scale_2[1, 0],
        )
        want = bf16["model.layers.0.mlp.experts.w2_weight"][1].chunk(3, dim=1)[rank]
        assert (down - want).abs().max() <= 0.25 * want.abs().max()
