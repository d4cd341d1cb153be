"""Reads safetensors tensors straight into device memory through a ring of page-locked buffers.

Copying a memory-mapped tensor to the GPU reads the file one page fault at a time on one thread,
then makes the driver stage the pageable bytes again. Here worker threads `pread` the file's bytes
(the call releases the GIL) into page-locked host buffers while the copies of earlier buffers run
on the device, so reading, faulting and uploading overlap. Tensors that lie back to back in a
file are read and uploaded as one run of up to `chunk_bytes`; each arrives as a device tensor of
the file's dtype and shape (a view into its run's buffer), for the model's weight loaders to copy
from (a device-to-device copy). Host memory used: `slots * chunk_bytes`, released at the end.

The files' headers were checked before (`loader.checkpoint_shards`); every tensor's byte range is
checked again here against its dtype, shape and the file's size.
"""

from __future__ import annotations

import json
import logging
import math
import os
import struct
from collections import deque
from collections.abc import Iterator, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

import torch

from libkk.errors import CorruptCheckpointError

logger = logging.getLogger(__name__)

# safetensors dtype names -> torch dtypes.
_DTYPES = {
    "BOOL": torch.bool,
    "U8": torch.uint8,
    "I8": torch.int8,
    "I16": torch.int16,
    "U16": torch.uint16,
    "I32": torch.int32,
    "U32": torch.uint32,
    "I64": torch.int64,
    "U64": torch.uint64,
    "F16": torch.float16,
    "BF16": torch.bfloat16,
    "F32": torch.float32,
    "F64": torch.float64,
    "F8_E4M3": torch.float8_e4m3fn,
    "F8_E5M2": torch.float8_e5m2,
}
if hasattr(torch, "float8_e8m0fnu"):
    _DTYPES["F8_E8M0"] = torch.float8_e8m0fnu
CHUNK_BYTES = 64 << 20
SLOTS = 16
MAX_THREADS = 8
# Below this a checkpoint loads faster memory-mapped: staging costs about 50 ms whatever the size
# (threads, page-locking the ring) and saves about 80 ms a GB (benchmarks/RESULTS.md, 2026-12-02:
# 10 MB in 0.06 s staged against 0.02 s mapped; 16.4 GB in 1.18 against 2.51 s).
MIN_STAGED_BYTES = 1 << 30


@dataclass(frozen=True)
class TensorSpan:
    name: str
    dtype: torch.dtype
    shape: tuple[int, ...]
    offset: int  # of the first byte in the file
    nbytes: int


def tensor_spans(path: Path, names: Sequence[str]) -> list[TensorSpan] | None:
    """The byte ranges of `names` in the safetensors file at `path`, in the order given; None if
    one has a dtype this reader does not map (read that file through safetensors instead)."""
    size = path.stat().st_size
    with open(path, "rb") as f:
        head = f.read(8)
        if len(head) < 8:
            raise CorruptCheckpointError(f"{str(path)!r} is too short for a safetensors header")
        (header_len,) = struct.unpack("<Q", head)
        if 8 + header_len > size:
            raise CorruptCheckpointError(f"{str(path)!r}: its header runs past the file's end")
        try:
            header = json.loads(f.read(header_len))
        except (UnicodeDecodeError, json.JSONDecodeError) as e:
            raise CorruptCheckpointError(f"{str(path)!r}: unreadable header ({e})") from None
    spans = []
    for name in names:
        entry = header.get(name)
        if not isinstance(entry, dict):
            raise CorruptCheckpointError(f"{str(path)!r} lacks tensor {name!r}")
        if entry.get("dtype") not in _DTYPES:
            return None
        dtype, shape = _DTYPES[entry["dtype"]], tuple(int(d) for d in entry["shape"])
        begin, end = (int(x) for x in entry["data_offsets"])
        nbytes = dtype.itemsize * math.prod(shape)
        if end - begin != nbytes or begin < 0 or 8 + header_len + end > size:
            raise CorruptCheckpointError(
                f"{str(path)!r}: tensor {name!r} ({entry['dtype']} {list(shape)}) has bytes "
                f"{begin}..{end} in a file of {size} bytes (truncated or corrupt?)"
            )
        spans.append(TensorSpan(name, dtype, shape, 8 + header_len + begin, nbytes))
    return spans


def worth_staging(total_bytes: int) -> bool:
    """Whether a checkpoint of this many tensor bytes loads faster staged than memory-mapped."""
    return total_bytes >= MIN_STAGED_BYTES


@dataclass(frozen=True)
class _Run:
    """Whole tensors that lie back to back in one file, read, uploaded and allocated as one: a
    run of small tensors (an MoE layer's experts) costs one upload, not one each."""

    file: int
    offset: int  # in the file
    nbytes: int
    spans: tuple[TensorSpan, ...]


def _runs(files: Sequence[tuple[Path, Sequence[TensorSpan]]], max_bytes: int) -> list[_Run]:
    """Each file's tensors in file order, in runs of at most `max_bytes` (a larger tensor is a
    run of its own)."""
    runs = []
    for f, (_, spans) in enumerate(files):
        members: list[TensorSpan] = []
        start = end = 0
        for span in sorted(spans, key=lambda s: s.offset):
            if members and span.offset == end and end + span.nbytes - start <= max_bytes:
                members.append(span)
                end += span.nbytes
                continue
            if members:
                runs.append(_Run(f, start, end - start, tuple(members)))
            members, start, end = [span], span.offset, span.offset + span.nbytes
        if members:
            runs.append(_Run(f, start, end - start, tuple(members)))
    return runs


def _tensor_at(buf: torch.Tensor, at: int, span: TensorSpan) -> torch.Tensor:
    """The tensor `span` describes, from its bytes at `buf[at:]`."""
    raw = buf[at : at + span.nbytes]
    if at % span.dtype.itemsize:  # a view as a wider dtype must start on an element
        raw = raw.clone()
    return raw.view(span.dtype).view(span.shape)


@dataclass(frozen=True)
class _Chunk:
    run: int  # its index among the runs being read
    file: int  # its file's index
    offset: int  # in the file
    nbytes: int
    into: int  # byte offset in its run


@dataclass(frozen=True)
class _Read:
    chunk: _Chunk
    slot: int
    done: Future


class StagedReader:
    """Reads tensors of safetensors files onto `device` through `slots` host buffers.

    Use as a context manager; `read(files)` yields the tensors. The copies run on the current
    stream, so work the caller queues after them sees the bytes.
    """

    def __init__(
        self,
        device: torch.device,
        chunk_bytes: int = CHUNK_BYTES,
        slots: int = SLOTS,
        threads: int | None = None,
    ) -> None:
        self.device = torch.device(device)
        self.chunk_bytes = chunk_bytes
        self.slots = slots
        self.threads = threads or min(MAX_THREADS, os.cpu_count() or 1)
        self._host: torch.Tensor | None = None
        self._registered = False
        self._pool: ThreadPoolExecutor | None = None
        self._uploads: list[torch.cuda.Event | None] = [None] * slots  # each slot's last upload
        self._next_slot = 0

    def __enter__(self) -> StagedReader:
        self._host = torch.empty(self.slots * self.chunk_bytes, dtype=torch.uint8)
        if self.device.type == "cuda":
            # Page-locked for asynchronous uploads; registered here rather than taken from torch's
            # pinned allocator, which would keep it cached for the process's life.
            err = torch.cuda.cudart().cudaHostRegister(self._host.data_ptr(), self._host.numel(), 0)
            self._registered = int(err) == 0
            if not self._registered:
                logger.info("weights load through pageable buffers (cudaHostRegister: %s)", err)
        self._pool = ThreadPoolExecutor(self.threads, thread_name_prefix="libkk-read")
        return self

    def __exit__(self, *exc: object) -> None:
        if self._pool is not None:
            self._pool.shutdown(wait=True)
        if self.device.type == "cuda":
            torch.cuda.current_stream(self.device).synchronize()  # uploads out of the buffers
            if self._registered:
                torch.cuda.cudart().cudaHostUnregister(self._host.data_ptr())
        self._host = None

    def read(
        self, files: Sequence[tuple[Path, Sequence[TensorSpan]]]
    ) -> Iterator[tuple[int, str, torch.Tensor]]:
        """(file index, name, device tensor) for each span of each file, in file order. The
        reads run ahead across file boundaries, so many small files cost no more than one large
        one; a tensor may be a view into a buffer it shares with its neighbours in the file."""
        assert self._host is not None and self._pool is not None, "use StagedReader as a context"
        paths = [path for path, _ in files]
        runs = _runs(files, self.chunk_bytes)
        counts = [-(-run.nbytes // self.chunk_bytes) for run in runs]
        fds: list[int] = []
        reads: deque[_Read] = deque()  # in file order
        try:
            for path in paths:
                fds.append(os.open(path, os.O_RDONLY))
            chunks = iter(
                [
                    _Chunk(r, run.file, run.offset + at, min(self.chunk_bytes, run.nbytes - at), at)
                    for r, run in enumerate(runs)
                    for at in range(0, run.nbytes, self.chunk_bytes)
                ]
            )
            for _ in range(self.slots):
                self._submit(fds, paths, chunks, reads)
            for r, run in enumerate(runs):
                buf = torch.empty(run.nbytes, dtype=torch.uint8, device=self.device)
                for _ in range(counts[r]):
                    read = reads.popleft()
                    assert read.chunk.run == r
                    read.done.result()
                    self._upload(read, buf)
                    self._submit(fds, paths, chunks, reads)
                for span in run.spans:
                    yield run.file, span.name, _tensor_at(buf, span.offset - run.offset, span)
        finally:  # reads still running (the caller stopped early, or one failed) end first
            for read in reads:
                read.done.exception()
            for fd in fds:
                os.close(fd)

    def _submit(
        self, fds: list[int], paths: list[Path], chunks: Iterator[_Chunk], reads: deque[_Read]
    ) -> None:
        chunk = next(chunks, None)
        if chunk is None:
            return
        slot, self._next_slot = self._next_slot, (self._next_slot + 1) % self.slots
        if self._uploads[slot] is not None:
            self._uploads[slot].synchronize()  # the slot's previous bytes are on the device
        done = self._pool.submit(self._fill, fds[chunk.file], paths[chunk.file], slot, chunk)
        reads.append(_Read(chunk, slot, done))

    def _upload(self, read: _Read, buf: torch.Tensor) -> None:
        c, start = read.chunk, read.slot * self.chunk_bytes
        buf[c.into : c.into + c.nbytes].copy_(
            self._host[start : start + c.nbytes], non_blocking=self._registered
        )
        if self.device.type == "cuda":
            event = torch.cuda.Event()
            event.record()
            self._uploads[read.slot] = event

    def _fill(self, fd: int, path: Path, slot: int, chunk: _Chunk) -> None:
        start = slot * self.chunk_bytes
        view = memoryview(self._host[start : start + chunk.nbytes].numpy())
        done = 0
        while done < chunk.nbytes:  # a read may return fewer bytes than asked
            try:
                got = os.preadv(fd, [view[done:]], chunk.offset + done)
            except OSError as e:
                raise CorruptCheckpointError(f"cannot read {str(path)!r}: {e}") from None
            if got <= 0:
                raise CorruptCheckpointError(
                    f"{str(path)!r} ended at byte {chunk.offset + done} while reading a tensor "
                    "(truncated?)"
                )
            done += got
