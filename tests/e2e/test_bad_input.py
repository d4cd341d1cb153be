"""Every bad input gets its LibkkError subclass with a message naming the field; a failing request
never takes the engine or the other requests down."""

from __future__ import annotations

import json
import shutil

import pytest
import torch

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

    monkeypatch.setattr(runner.step_backends.eager, "forward", forward)
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


def test_max_tokens_far_beyond_max_model_len_is_capped_to_the_room_left(session):
    """The documented rule (SamplingParams.max_tokens, README): accepted, capped, and the request
    ends with "length" when the sequence fills max_model_len."""
    prompt = [5] * 10
    out = session.generate(prompt, SamplingParams(max_tokens=1_000_000, ignore_eos=True))
    assert out.finish_reason == "length"
    assert len(out.token_ids) == session.max_model_len - len(prompt) == 54


@pytest.mark.parametrize(
    "call, match",
    [
        (lambda s: s.generate(None), "prompts must be .* got NoneType"),
        (lambda s: s.generate(42), "prompts must be .* got int"),
        (lambda s: s.generate("abc", 5), "params must be .* got int"),
        (lambda s: s.submit(None), "prompt must be .* got NoneType"),
        (lambda s: s.generate([1, 2.5]), r"token ids\[1\] must be an int, got float"),
        (lambda s: s.generate([3, True]), r"token ids\[1\] must be an int, got bool"),
        (lambda s: s.generate(torch.tensor(3)), "prompts must be a string or a list"),
        (lambda s: s.submit(torch.tensor(3)), "prompt must be a string or a sequence"),
        (lambda s: s.generate("abc \udcff"), r"prompt has a lone surrogate '\\udcff' at index 4"),
        (lambda s: s.chat(None), "messages must be a list"),
        (
            lambda s: s.chat([{"role": "user", "content": "a\udcffb"}]),
            r"messages\[0\]\['content'\] has a lone surrogate",
        ),
    ],
)
def test_bad_arguments_raise_invalid_request_naming_them(session, call, match):
    with pytest.raises(InvalidRequestError, match=match):
        call(session)
    assert session.generate("abc", GREEDY).finish_reason == "length"  # still serving


def test_token_ids_from_any_iterable(session):
    ids = [5, 6, 7]
    expected = session.generate(ids, GREEDY).token_ids
    assert session.generate(iter(ids), GREEDY).token_ids == expected
    assert session.generate(tuple(ids), GREEDY).token_ids == expected
    # A list of prompts given as tensors is a batch.
    batch = session.generate([torch.tensor(ids), torch.tensor(ids[:2])], GREEDY)
    assert batch[0].token_ids == expected


@pytest.mark.parametrize("role", ["robot", "User", "", "function"])
def test_unknown_chat_role_is_refused_naming_it(session, role):
    messages = [{"role": "user", "content": "hi"}, {"role": role, "content": "x"}]
    with pytest.raises(InvalidRequestError, match=rf"messages\[1\]\['role'\] is '{role}'"):
        session.chat(messages, GREEDY)


@pytest.mark.parametrize(
    "call, name",
    [
        (lambda s: s.generate("abc", max_tokens=5), "max_tokens"),
        (lambda s: s.submit("abc", sampling_params=GREEDY), "sampling_params"),
        (lambda s: s.stream("abc", temperature=0.0), "temperature"),
        (lambda s: s.abort("x", force=True), "force"),
        (lambda s: s.step(block=True), "block"),
        (lambda s: s.generate("abc", GREEDY, "extra"), "positional"),
    ],
)
def test_unknown_session_arguments_raise_a_libkk_error_naming_them(session, call, name):
    from libkk.errors import UnknownArgumentError

    with pytest.raises(UnknownArgumentError, match=name) as info:
        call(session)
    assert isinstance(info.value, (InvalidRequestError, TypeError))


def test_a_type_error_inside_a_session_method_is_not_taken_for_a_bad_argument(session, monkeypatch):
    def broken(*args, **kwargs):
        raise TypeError("a bug inside")

    monkeypatch.setattr(session, "_add", broken)
    with pytest.raises(TypeError, match="a bug inside") as info:
        session.submit("abc", GREEDY)
    assert not isinstance(info.value, InvalidRequestError)


def test_unknown_sampling_param_is_a_libkk_error_and_a_type_error():
    from libkk.errors import LibkkError

    with pytest.raises(SamplingParamsError, match="'maxtokens'.*max_tokens") as info:
        SamplingParams(maxtokens=5)
    assert isinstance(info.value, LibkkError) and isinstance(info.value, TypeError)
    with pytest.raises(SamplingParamsError, match="positional"):
        SamplingParams(5)
    # from_dict reports an unknown field the same way.
    with pytest.raises(SamplingParamsError, match="maxtokens"):
        SamplingParams.from_dict({"maxtokens": 5})
