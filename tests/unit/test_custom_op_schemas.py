"""The conventions every `libkk::` custom op keeps, read from the registered schemas."""

from __future__ import annotations

import torch

import libkk  # noqa: F401 - registers every op (kernels, attention, the quantized MoE layer)


def _libkk_schemas() -> list[torch._C.FunctionSchema]:
    schemas = []
    for name in dir(torch.ops.libkk):
        packet = getattr(torch.ops.libkk, name)
        if isinstance(packet, torch._ops.OpOverloadPacket):
            schemas.append(packet.default._schema)
    return schemas


def test_ops_are_registered():
    names = {s.name for s in _libkk_schemas()}
    assert {"libkk::store_kv", "libkk::paged_attention", "libkk::qk_norm_rope_store_kv"} <= names


def test_ops_that_write_an_argument_return_nothing():
    """An op that writes into an argument hands its results back through arguments too (one
    convention: a caller sees from the schema alone which buffers an op fills)."""
    both = []
    for schema in _libkk_schemas():
        written = [a.name for a in schema.arguments if a.alias_info and a.alias_info.is_write]
        if written and schema.returns:
            both.append(f"{schema.name} writes {written} and returns {len(schema.returns)}")
    assert not both, both
