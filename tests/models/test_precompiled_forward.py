"""The precompiled forward (torch's aot_compile, graphs/compile.py): stored with an artifact
entry by one process, loaded by another without Dynamo tracing the model again; a call its
guards reject falls back to plain torch.compile. On CPU with the aot_eager backend."""

from __future__ import annotations

import json
import logging
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch
from libkk.graphs.compile import CompiledForward

from libkk.layers.forward_context import set_forward_context
from libkk.models.loader import load_model
from tests.models.paged_helpers import PagedKV, build_attn_metadata

REPO = Path(__file__).resolve().parents[2]

_START = textwrap.dedent(
    """
    import json, sys
    sys.path.insert(0, sys.argv[3])
    import torch
    from torch._dynamo import convert_frame
    from torch._dynamo.utils import counters
    from libkk.graphs.artifacts import ArtifactCache
    from libkk.graphs.compile import CompiledForward, artifact_cache_scope
    from libkk.layers.forward_context import set_forward_context
    from libkk.models.loader import load_model
    from tests.models.paged_helpers import PagedKV, build_attn_metadata

    captures = []  # Dynamo traces: a precompile's, or plain torch.compile's frames
    capture = convert_frame.fullgraph_capture
    convert_frame.fullgraph_capture = lambda *a, **k: captures.append(1) or capture(*a, **k)
    model, _ = load_model(sys.argv[1], torch.float32, torch.device("cpu"), progress=False)
    PagedKV(model, num_blocks=16, block_size=4)
    requests, tables = [([5, 6, 7, 8, 9], 0), ([11, 12, 13], 0)], [[3, 7], [5]]
    ids, pos, metadata = build_attn_metadata(requests, tables, 4)
    forward = CompiledForward(model, backend="aot_eager")
    cache = ArtifactCache(sys.argv[2])
    with torch.inference_mode(), set_forward_context(metadata, model):
        eager = model.forward(ids, pos)
        with artifact_cache_scope(torch.device("cpu"), {"model": "tiny"}, {}, cache=cache,
                                  forward=forward) as how:
            out = forward(ids, pos)
    print(json.dumps({"how": how, "precompiled": forward.precompiled is not None,
                      "traces": len(captures) + counters["frames"]["total"],
                      "max_diff": (out - eager).abs().max().item()}))
    """
)


# The model calling libkk's Triton ops (in the interpreter) where the CPU path calls their torch
# references, as on CUDA: custom ops with float arguments in the precompiled graph.
_OPS = """
import libkk.kernels as ops, libkk.layers.linear, libkk.layers.norm
libkk.layers.norm.rms_norm_ref, libkk.layers.norm.add_rms_norm_ref = ops.rms_norm, ops.add_rms_norm
libkk.layers.linear.linear = ops.linear
"""


def _start(model_dir: Path, root: Path, triton_ops: bool = False) -> dict:
    script = _START.replace("import torch\n", "import torch\n" + _OPS, 1) if triton_ops else _START
    env = {**os.environ, "TORCHINDUCTOR_CACHE_DIR": str(root / "inductor")}
    if triton_ops:
        env["TRITON_INTERPRET"] = "1"
    done = subprocess.run(
        [sys.executable, "-c", script, str(model_dir), str(root), str(REPO)],
        capture_output=True,
        text=True,
        timeout=600,
        env=env,
    )
    assert done.returncode == 0, done.stderr[-2000:]
    return json.loads(done.stdout.strip().splitlines()[-1])


@pytest.mark.parametrize("triton_ops", [False, True], ids=["torch-ops", "triton-ops"])
def test_a_second_process_loads_the_forward_without_tracing_it(
    tiny_llama_dir, tmp_path, triton_ops
):
    built = _start(tiny_llama_dir, tmp_path, triton_ops)
    assert built["how"] == "built" and built["precompiled"]
    assert built["traces"] == 1 and built["max_diff"] < 1e-5
    assert next(tmp_path.glob("*/forward.bin")).stat().st_size > 0
    loaded = _start(tiny_llama_dir, tmp_path, triton_ops)
    assert loaded["how"] == "loaded" and loaded["precompiled"]
    assert loaded["traces"] == 0  # the stored function ran
    assert loaded["max_diff"] < 1e-5


def test_a_call_the_guards_reject_falls_back_to_torch_compile(tiny_llama_dir, caplog):
    model, _ = load_model(tiny_llama_dir, torch.float32, torch.device("cpu"), progress=False)
    PagedKV(model, num_blocks=16, block_size=4)
    ids, pos, metadata = build_attn_metadata([([5, 6, 7, 8, 9], 0)], [[3, 7]], 4)
    torch._dynamo.reset()
    forward = CompiledForward(model, backend="aot_eager")
    with torch.inference_mode(), set_forward_context(metadata, model):
        eager = model.forward(ids, pos)
        torch.testing.assert_close(forward(ids, pos), eager)
        assert forward.precompiled is not None
        with caplog.at_level(logging.WARNING):
            out = forward(ids.to(torch.int32), pos)  # its guards hold the ids' dtype
    torch.testing.assert_close(out, eager)
    assert forward.precompiled is None and "guards reject" in caplog.text


def test_the_precompiled_forward_keeps_the_aux_hidden_states(tiny_llama_dir):
    """A drafter reads hidden states the forward stores on the model as a side effect: the
    precompiled function (as compiled, and as dumped and loaded) stores the eager ones."""
    model, _ = load_model(tiny_llama_dir, torch.float32, torch.device("cpu"), progress=False)
    PagedKV(model, num_blocks=16, block_size=4)
    model.set_aux_hidden_layers((0, 1))
    torch._dynamo.reset()
    with torch.inference_mode():  # inference tensors, as the runner passes
        requests, tables = [([5, 6, 7, 8, 9], 0), ([11, 12], 0)], [[3, 7], [5]]
        ids, pos, metadata = build_attn_metadata(requests, tables, 4)
    with torch.inference_mode(), set_forward_context(metadata, model):
        eager = model.forward(ids, pos)
        eager_aux = model.aux_hidden_states.clone()
        compiled = CompiledForward(model, backend="aot_eager")
        loaded = CompiledForward(model, backend="aot_eager")
        for forward in (compiled, loaded):
            model.set_aux_hidden_layers((0, 1))  # clears the stash
            if forward is loaded:
                assert loaded.load(compiled.dump())
                # as in a fresh process: precompiling marked the first inputs' token dims
                ids, pos = ids.clone(), pos.clone()
            torch.testing.assert_close(forward(ids, pos), eager)
            assert forward.precompiled is not None
            # the raw residual stream (values in the hundreds): compiled code rounds differently
            torch.testing.assert_close(model.aux_hidden_states, eager_aux, rtol=1e-5, atol=1e-3)


def test_an_entry_holding_only_the_precompiled_forward_is_loaded(
    tiny_llama_dir, tmp_path, monkeypatch
):
    """Without torch.compile cache artifacts to store (torch produced none), the entry keeps the
    precompiled forward, and a later start loads it rather than rebuilding."""
    from libkk.graphs.artifacts import COMPILE_ARTIFACTS, ArtifactCache
    from libkk.graphs.compile import artifact_cache_scope

    monkeypatch.setattr(torch.compiler, "save_cache_artifacts", lambda: None)
    model, _ = load_model(tiny_llama_dir, torch.float32, torch.device("cpu"), progress=False)
    PagedKV(model, num_blocks=16, block_size=4)
    cache = ArtifactCache(tmp_path)
    torch._dynamo.reset()
    hows = []
    for _ in range(2):
        with torch.inference_mode():  # fresh inference tensors each start, as the runner's
            ids, pos, metadata = build_attn_metadata([([5, 6, 7], 0)], [[3]], 4)
        forward = CompiledForward(model, backend="aot_eager")
        with torch.inference_mode(), set_forward_context(metadata, model):
            with artifact_cache_scope(
                torch.device("cpu"), {"model": "tiny"}, {}, cache=cache, forward=forward
            ) as how:
                torch.testing.assert_close(forward(ids, pos), model.forward(ids, pos))
        hows.append(how)
        assert forward.precompiled is not None
    assert hows == ["built", "loaded"]
    entry = next(p for p in tmp_path.iterdir() if p.is_dir())
    assert (entry / "forward.bin").exists() and not (entry / COMPILE_ARTIFACTS).exists()
