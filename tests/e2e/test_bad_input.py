"""Every bad input gets its LibkkError subclass with a message naming the field; a failing request
never takes the engine or the other requests down."""

from __future__ import annotations

import json
import shutil

import pytest

from libkk import (
    ConfigError,
    CorruptCheckpointError,
    InvalidRequestError,
    ModelNotFoundError,
    PromptTooLongError,
    SamplingParams,
    SamplingParamsError,
    Session,
    UnsupportedModelError,
)

GREEDY = SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True)


@pytest.fixture(scope="module")
def session(tiny_llama_dir):
    with Session(str(tiny_llama_dir), max_model_len=64) as s:
        yield s


def test_missing_model_folder(tmp_path):
    with pytest.raises(ModelNotFoundError, match="does-not-exist"):
        Session(str(tmp_path / "does-not-exist"))


def test_folder_without_config(tmp_path, tiny_llama_dir):
    broken = tmp_path / "m"
    shutil.copytree(tiny_llama_dir, broken)
    (broken / "config.json").unlink()
    with pytest.raises(ModelNotFoundError, match="config.json"):
        Session(str(broken))


def test_truncated_safetensors(tmp_path, tiny_llama_dir):
    broken = tmp_path / "m"
    shutil.copytree(tiny_llama_dir, broken)
    weights = broken / "model.safetensors"
    weights.write_bytes(weights.read_bytes()[: weights.stat().st_size // 2])
    with pytest.raises(CorruptCheckpointError, match="model.safetensors"):
        Session(str(broken))


def test_unknown_architecture(tmp_path, tiny_llama_dir):
    broken = tmp_path / "m"
    shutil.copytree(tiny_llama_dir, broken)
    cfg = json.loads((broken / "config.json").read_text())
    cfg["architectures"] = ["MadeUpForCausalLM"]
    (broken / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(UnsupportedModelError, match="MadeUpForCausalLM.*LlamaForCausalLM"):
        Session(str(broken))


@pytest.mark.parametrize(
    "settings, path",
    [
        ({"max_num_seqs": 0}, "max_num_seqs"),
        ({"block_size": "big"}, "block_size"),
        ({"gpu_memory_utilization": 1.5}, "gpu_memory_utilization"),
        ({"prefill_compute_share": 1.0}, "prefill_compute_share"),
        ({"dtype": "float8"}, "dtype"),
        ({"no_such_setting": 1}, "no_such_setting"),
    ],
)
def test_bad_settings(tiny_llama_dir, settings, path):
    with pytest.raises(ConfigError, match=path):
        Session(str(tiny_llama_dir), **settings)


def test_max_model_len_beyond_the_model(tiny_llama_dir):
    with pytest.raises(ConfigError, match="max_position_embeddings"):
        Session(str(tiny_llama_dir), max_model_len=100_000)


def test_prompt_too_long(session):
    with pytest.raises(PromptTooLongError, match="max_model_len"):
        session.generate("word " * 100, GREEDY)
    # max_tokens beyond the room left is capped, not an error.
    out = session.generate([5] * 60, SamplingParams(max_tokens=50, ignore_eos=True))
    assert len(out.token_ids) == 4 and out.finish_reason == "length"


@pytest.mark.parametrize(
    "kwargs, field",
    [
        ({"temperature": -1.0}, "temperature"),
        ({"top_p": 0.0}, "top_p"),
        ({"top_k": -5}, "top_k"),
        ({"min_p": 2.0}, "min_p"),
        ({"max_tokens": 0}, "max_tokens"),
        ({"min_tokens": 5, "max_tokens": 2}, "min_tokens"),
        ({"repetition_penalty": 0.0}, "repetition_penalty"),
        ({"presence_penalty": 3.0}, "presence_penalty"),
        ({"logprobs": 100}, "logprobs"),
        ({"stop": [""]}, "stop"),
        ({"temperature": "hot"}, "temperature"),
    ],
)
def test_bad_sampling_params(kwargs, field):
    with pytest.raises(SamplingParamsError, match=field):
        SamplingParams(**kwargs)


@pytest.mark.parametrize(
    "prompt, match",
    [
        ("", "empty"),
        ([], "empty"),
        ([1, -3], "out of range"),
        ([10**9], "out of range"),
        ([1.5, "a"], "token ids"),
    ],
)
def test_bad_prompts(session, prompt, match):
    with pytest.raises(InvalidRequestError, match=match):
        session.generate(prompt, GREEDY)


def test_duplicate_request_id(session):
    session.submit("a", GREEDY, request_id="same")
    with pytest.raises(InvalidRequestError, match="already in use"):
        session.submit("b", GREEDY, request_id="same")
    session.abort("same")


def test_failing_request_fails_alone(session, monkeypatch):
    """A request whose forward raises ends with finish_reason "error"; the others finish as if
    it had never been there."""
    prompts = ["alpha beta", "gamma delta", "epsilon"]
    expected = [o.token_ids for o in session.generate(prompts, GREEDY)]
    poison = 42
    runner = session.engine.runner
    real_forward = runner.forward

    def forward(input_ids, positions):
        if (input_ids == poison).any():
            raise RuntimeError("poisoned input")
        return real_forward(input_ids, positions)

    monkeypatch.setattr(runner, "forward", forward)
    outs = session.generate([prompts[0], [poison, 7, 8], prompts[1], prompts[2]], GREEDY)
    assert outs[1].finish_reason == "error" and "poisoned input" in outs[1].error
    assert [outs[0].token_ids, outs[2].token_ids, outs[3].token_ids] == expected
    monkeypatch.undo()
    # The engine keeps serving.
    assert session.generate(prompts[0], GREEDY).token_ids == expected[0]


def test_piecewise_graphs_need_torch_compile():
    from libkk import ConfigError, EngineConfig

    with pytest.raises(ConfigError, match="needs torch_compile=True"):
        EngineConfig.from_settings(cudagraph_mode="FULL_AND_PIECEWISE", torch_compile=False)
