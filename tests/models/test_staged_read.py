"""The staged safetensors reader (libkk/models/staged_read.py): bytes, order and errors, on the
CPU with small chunks and few slots so tensors span chunks and the slots wrap many times."""

from __future__ import annotations

import os

import pytest
import torch
from safetensors.torch import load_file, save_file

from libkk.errors import CorruptCheckpointError
from libkk.models.staged_read import (
    MIN_STAGED_BYTES,
    StagedReader,
    TensorSpan,
    _runs,
    tensor_spans,
    worth_staging,
)


def _tensors() -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(0)
    return {
        "embed": torch.randn(301, 17, generator=g).to(torch.bfloat16),  # many chunks
        "scalar": torch.tensor(3.5),
        "empty": torch.empty(0, 4),
        "flags": torch.rand(9, generator=g) > 0.5,
        "ids": torch.randint(-(2**40), 2**40, (13,), generator=g),
        "packed": torch.randint(0, 256, (7, 33), dtype=torch.uint8, generator=g),
        "fp8": torch.randn(5, 6, generator=g).to(torch.float8_e4m3fn),
        "half": torch.randn(1000, generator=g).half(),
    }


@pytest.fixture
def checkpoint(tmp_path):
    path = tmp_path / "model.safetensors"
    save_file(_tensors(), str(path))
    return path


def _bytes(t: torch.Tensor) -> torch.Tensor:
    return t.contiguous().view(-1).view(torch.uint8)


@pytest.mark.parametrize("chunk_bytes,slots,threads", [(64, 2, 1), (1000, 3, 2), (1 << 20, 16, 4)])
def test_reads_every_tensor_bit_for_bit_in_file_order(checkpoint, chunk_bytes, slots, threads):
    expected = load_file(str(checkpoint))
    names = ["half", "embed", "scalar", "empty", "flags", "ids", "packed", "fp8"]
    spans = tensor_spans(checkpoint, names)
    with StagedReader(torch.device("cpu"), chunk_bytes, slots, threads) as reader:
        got = list(reader.read([(checkpoint, spans)]))
    assert [name for _, name, _ in got] == [s.name for s in sorted(spans, key=lambda s: s.offset)]
    for _, name, tensor in got:
        want = expected[name]
        assert tensor.dtype == want.dtype and tensor.shape == want.shape, name
        assert torch.equal(_bytes(tensor), _bytes(want)), name


def test_reads_run_on_across_many_small_files(tmp_path):
    files, expected = [], {}
    for i in range(7):
        path = tmp_path / f"model-{i}.safetensors"
        tensors = {
            f"w{i}": torch.arange(100 + 37 * i, dtype=torch.float32) + i,
            f"b{i}": torch.ones(i),
        }
        save_file(tensors, str(path))
        files.append((path, tensor_spans(path, sorted(tensors))))
        expected.update(tensors)
    with StagedReader(torch.device("cpu"), chunk_bytes=128, slots=5, threads=3) as reader:
        got = list(reader.read(files))
    assert [(f, name) for f, name, _ in got] == [
        (i, s.name)
        for i, (_, spans) in enumerate(files)
        for s in sorted(spans, key=lambda s: s.offset)
    ]
    for _, name, tensor in got:
        assert torch.equal(tensor, expected[name]), name


def test_a_caller_that_stops_early_leaves_no_read_running(checkpoint):
    spans = tensor_spans(checkpoint, ["embed", "half", "ids"])
    with StagedReader(torch.device("cpu"), chunk_bytes=64, slots=4, threads=2) as reader:
        stream = reader.read([(checkpoint, spans)])
        _, name, _ = next(stream)
        stream.close()  # waits for the reads in flight, closes the file
        assert name == min(spans, key=lambda s: s.offset).name
        # The reader still works afterwards.
        ((_, _, ids),) = reader.read([(checkpoint, tensor_spans(checkpoint, ["ids"]))])
    assert torch.equal(ids, load_file(str(checkpoint))["ids"])


def test_a_file_cut_short_after_its_header_was_read_fails_with_the_file_named(checkpoint):
    spans = tensor_spans(checkpoint, list(_tensors()))
    os.truncate(checkpoint, spans[0].offset + 10)
    with StagedReader(torch.device("cpu"), chunk_bytes=64, slots=2, threads=1) as reader:
        with pytest.raises(CorruptCheckpointError, match="model.safetensors.*truncated"):
            list(reader.read([(checkpoint, spans)]))


def test_spans_reject_a_truncated_file_and_a_missing_tensor(checkpoint):
    size = checkpoint.stat().st_size
    with pytest.raises(CorruptCheckpointError, match="lacks tensor 'nope'"):
        tensor_spans(checkpoint, ["nope"])
    os.truncate(checkpoint, size - 1)
    with pytest.raises(CorruptCheckpointError, match="truncated or corrupt"):
        tensor_spans(checkpoint, list(_tensors()))
    os.truncate(checkpoint, 5)
    with pytest.raises(CorruptCheckpointError, match="too short"):
        tensor_spans(checkpoint, ["embed"])


def test_spans_give_way_to_safetensors_for_a_dtype_they_do_not_map(tmp_path):
    import json
    import struct

    header = json.dumps({"odd": {"dtype": "F4", "shape": [2], "data_offsets": [0, 1]}}).encode()
    path = tmp_path / "odd.safetensors"
    path.write_bytes(struct.pack("<Q", len(header)) + header + b"\0")
    assert tensor_spans(path, ["odd"]) is None


def test_only_checkpoints_of_a_gigabyte_or_more_are_worth_staging():
    assert worth_staging(MIN_STAGED_BYTES) and worth_staging(20 << 30)
    assert not worth_staging(MIN_STAGED_BYTES - 1) and not worth_staging(0)


def test_back_to_back_tensors_share_a_run_up_to_its_size_and_a_large_one_has_its_own():
    def span(name: str, offset: int, nbytes: int) -> TensorSpan:
        return TensorSpan(name, torch.uint8, (nbytes,), offset, nbytes)

    a, b, c = span("a", 0, 40), span("b", 40, 50), span("c", 90, 20)  # a + b + c = 110 > 100
    big = span("big", 110, 250)
    gap = span("gap", 400, 10)  # not adjacent to big
    runs = _runs([("f0", [gap, c, big, b, a]), ("f1", [span("d", 8, 5)])], max_bytes=100)
    assert [(r.file, r.offset, r.nbytes, [s.name for s in r.spans]) for r in runs] == [
        (0, 0, 90, ["a", "b"]),
        (0, 90, 20, ["c"]),
        (0, 110, 250, ["big"]),
        (0, 400, 10, ["gap"]),
        (1, 8, 5, ["d"]),
    ]


def test_a_tensor_that_starts_off_its_element_size_in_a_run_reads_right(tmp_path):
    """safetensors files need not align tensors: 3 bytes, then an fp32 pair at byte 3."""
    import json
    import struct

    pair = torch.tensor([1.5, -2.25])
    header = json.dumps({
        "odd": {"dtype": "U8", "shape": [3], "data_offsets": [0, 3]},
        "pair": {"dtype": "F32", "shape": [2], "data_offsets": [3, 11]},
    }).encode()  # fmt: skip
    path = tmp_path / "odd.safetensors"
    path.write_bytes(
        struct.pack("<Q", len(header)) + header + b"\x07\x08\x09" + pair.numpy().tobytes()
    )
    with StagedReader(torch.device("cpu"), chunk_bytes=1 << 10, slots=2, threads=1) as reader:
        got = {name: t for _, name, t in reader.read([(path, tensor_spans(path, ["pair", "odd"]))])}
    assert torch.equal(got["odd"], torch.tensor([7, 8, 9], dtype=torch.uint8))
    assert torch.equal(got["pair"], pair)


def test_the_loader_stream_yields_every_tensor_of_a_sharded_checkpoint(tmp_path, monkeypatch):
    """The loader's glue (`stageable`, `_staged_tensors`) over an indexed two-shard checkpoint,
    staged on the CPU; a shard cut short afterwards fails naming that shard."""
    import json

    from tqdm import tqdm

    import libkk.models.loader as loader

    tensors = _tensors()
    names = sorted(tensors)
    parts = {"a.safetensors": names[:3], "b.safetensors": names[3:]}
    for file, part in parts.items():
        save_file({n: tensors[n] for n in part}, str(tmp_path / file))
    index = {"weight_map": {n: f for f, part in parts.items() for n in part}}
    (tmp_path / "model.safetensors.index.json").write_text(json.dumps(index))
    shards = loader.checkpoint_shards(tmp_path)
    assert loader.stageable(shards) is None  # far below the size that gains from staging
    monkeypatch.setattr(loader, "worth_staging", lambda total_bytes: True)
    files = loader.stageable(shards)
    current: list = []
    with (
        StagedReader(torch.device("cpu"), chunk_bytes=256, slots=3) as reader,
        tqdm(disable=True) as bar,
    ):
        got = dict(loader._staged_tensors(reader, files, shards, current, bar))
        assert sorted(got) == names
        for name in names:
            assert torch.equal(_bytes(got[name]), _bytes(tensors[name])), name
        os.truncate(tmp_path / "b.safetensors", files[1][1][0].offset + 3)
        with pytest.raises(CorruptCheckpointError, match="b.safetensors"):
            list(loader._staged_tensors(reader, files, shards, current, bar))
