"""Chained content hashes of full KV blocks, the keys of automatic prefix caching.

hash(block i) = H(hash(block i-1), token ids of block i), so a block's hash names its whole prefix:
the same tokens after a different prefix hash differently (their KV differs). H is blake2b over a
fixed little-endian encoding, so hashes are the same in every process and on every machine; Python's
`hash()` is salted per process and must not be used here.
"""

from __future__ import annotations

import hashlib
import struct
from collections.abc import Sequence

# A 16-byte digest: collisions are astronomically unlikely, and every hit is verified anyway.
BlockHash = bytes

_DIGEST_SIZE = 16
# NOTE: bump the personalization string whenever the encoding below changes, so hashes of the old
# encoding can never be mistaken for new ones (e.g. in a cache shared between processes).
_PERSON = b"libkk-kvblock-v1"
_ROOT = b"\x00"  # no parent: the first block of a sequence
_CHILD = b"\x01"  # followed by the parent's fixed-size digest


def hash_block_tokens(parent_hash: BlockHash | None, token_ids: Sequence[int]) -> BlockHash:
    """The chained hash of one block: H(parent hash or root marker, token ids as int64 LE)."""
    h = hashlib.blake2b(digest_size=_DIGEST_SIZE, person=_PERSON)
    h.update(_ROOT if parent_hash is None else _CHILD + parent_hash)
    h.update(struct.pack(f"<{len(token_ids)}q", *token_ids))
    return h.digest()


def hash_request_blocks(token_ids: Sequence[int], block_size: int) -> list[BlockHash]:
    """Hashes of every full block of `token_ids`, from scratch (a partial tail block has none)."""
    hashes: list[BlockHash] = []
    _extend_hashes(hashes, token_ids, block_size)
    return hashes


def _extend_hashes(hashes: list[BlockHash], token_ids: Sequence[int], block_size: int) -> None:
    parent = hashes[-1] if hashes else None
    for i in range(len(hashes), len(token_ids) // block_size):
        parent = hash_block_tokens(parent, token_ids[i * block_size : (i + 1) * block_size])
        hashes.append(parent)


class RequestBlockHashes:
    """Per-request cache of full-block hashes, extended incrementally as tokens are appended.

    Assumes a request's token ids only grow by appending (prompt, then sampled tokens; never
    unverified drafts) while it is tracked. If the sequence got shorter, the hashes of blocks
    past the new end are dropped. `pop` forgets a request; call it when the request leaves.
    """

    def __init__(self, block_size: int) -> None:
        if block_size < 1:
            raise ValueError(f"block_size must be >= 1, got {block_size}")
        self.block_size = block_size
        self._hashes: dict[str, list[BlockHash]] = {}

    def get(self, request_id: str, token_ids: Sequence[int]) -> list[BlockHash]:
        """The hashes of all full blocks of `token_ids` (owned by this cache: do not mutate)."""
        hashes = self._hashes.setdefault(request_id, [])
        num_full = len(token_ids) // self.block_size
        if len(hashes) > num_full:
            del hashes[num_full:]
        elif len(hashes) < num_full:
            _extend_hashes(hashes, token_ids, self.block_size)
        return hashes

    def pop(self, request_id: str) -> None:
        self._hashes.pop(request_id, None)

    def __contains__(self, request_id: object) -> bool:
        return request_id in self._hashes

    def __len__(self) -> int:
        return len(self._hashes)
