"""With speculation on, sampled tokens keep exactly the target's distribution.

Many seeds sample the first two output tokens of one prompt with a probabilistic draft model; the
second token is decided by verification (an accepted draft, a residual sample or the plain
sampler's draw). The joint empirical distribution of (t0, t1) must match the target's
p(t0) * p(t1 | t0), computed with transformers, within a chi-square bound.
"""

from __future__ import annotations

import importlib.util
import shutil
from pathlib import Path

import pytest
import torch

from libkk import SamplingParams, Session

_spec = importlib.util.spec_from_file_location(
    "chi2", Path(__file__).resolve().parents[1] / "unit" / "sample" / "chi2.py"
)
chi2 = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(chi2)

PROMPT = "Once upon a time"
TEMPERATURE, TOP_K = 2.5, 6
NUM_SEEDS = 1200


@pytest.fixture(scope="module")
def near_draft_dir(tmp_path_factory, tiny_llama_dir, default_model_dir):
    """The target with noise on every weight: q is near p, not equal."""
    from transformers import LlamaForCausalLM

    model = LlamaForCausalLM.from_pretrained(tiny_llama_dir)
    gen = torch.Generator().manual_seed(2)
    with torch.no_grad():
        for p in model.parameters():
            p.add_(torch.randn(p.shape, generator=gen) * 0.15 * p.std())
    path = tmp_path_factory.mktemp("draft-near-dist")
    model.save_pretrained(path)
    for name in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(default_model_dir / name, path / name)
    return path


def _target_joint(path: Path, prompt_ids: list[int]) -> dict[tuple[int, int], float]:
    """p(t0, t1) under temperature + top-k, from transformers in fp32."""
    from transformers import LlamaForCausalLM

    model = LlamaForCausalLM.from_pretrained(path, torch_dtype=torch.float32).eval()

    def step(ids: list[int]) -> dict[int, float]:
        with torch.no_grad():
            logits = model(torch.tensor([ids])).logits[0, -1].double() / TEMPERATURE
        top = logits.topk(TOP_K)
        probs = top.values.softmax(dim=-1)
        return dict(zip(top.indices.tolist(), probs.tolist(), strict=True))

    joint = {}
    for t0, p0 in step(prompt_ids).items():
        for t1, p1 in step([*prompt_ids, t0]).items():
            joint[t0, t1] = p0 * p1
    return joint


@pytest.mark.slow
@pytest.mark.parametrize("drafter", ["near", "self"])
def test_speculative_sampling_keeps_target_distribution(tiny_llama_dir, near_draft_dir, drafter):
    draft = near_draft_dir if drafter == "near" else tiny_llama_dir
    params = [
        SamplingParams(max_tokens=3, temperature=TEMPERATURE, top_k=TOP_K, seed=s, ignore_eos=True)
        for s in range(NUM_SEEDS)
    ]
    with Session(
        str(tiny_llama_dir),
        method="draft_model",
        draft_model=str(draft),
        draft_sampling="probabilistic",
        num_speculative_tokens=2,
        max_num_seqs=256,
        progress=False,
    ) as s:
        prompt_ids = s.engine.tokenizer.encode(PROMPT)
        outs = s.generate([PROMPT] * NUM_SEEDS, params)
        stats = s.stats()
    # Every request verified one draft for its second token.
    assert stats["spec_num_verify_steps"] == NUM_SEEDS
    if drafter == "near":
        assert 0.1 * NUM_SEEDS < stats["spec_num_accepted_tokens"] < 0.97 * NUM_SEEDS
    else:
        # q == p (up to rounding): every draft is accepted.
        assert stats["spec_num_accepted_tokens"] >= 0.99 * NUM_SEEDS

    joint = _target_joint(tiny_llama_dir, prompt_ids)
    counts: dict[tuple[int, int], int] = {}
    for o in outs:
        key = (o.token_ids[0], o.token_ids[1])
        assert key in joint, f"sampled {key}, outside the target's top-k support"
        counts[key] = counts.get(key, 0) + 1
    # Cells with an expected count below 5 are pooled into one.
    stat, pooled_exp, pooled_obs, cells = 0.0, 0.0, 0, 0
    for key, p in joint.items():
        expected, observed = p * NUM_SEEDS, counts.get(key, 0)
        if expected < 5:
            pooled_exp += expected
            pooled_obs += observed
            continue
        stat += (observed - expected) ** 2 / expected
        cells += 1
    if pooled_exp > 0:
        stat += (pooled_obs - pooled_exp) ** 2 / pooled_exp
        cells += 1
    assert cells >= 4, "the test distribution is too peaked to say anything"
    assert stat < chi2.chi2_critical(cells - 1), (stat, cells)
