"""The speculative settings: defaults, validated combinations, the proposer registry."""

from __future__ import annotations

import pytest
import torch

import libkk.spec_decode as spec_registry
from libkk.config import EngineConfig
from libkk.errors import ConfigError
from libkk.spec_decode import make_proposer
from libkk.spec_decode.ngram import NgramProposer


def test_defaults_and_flat_names():
    cfg = EngineConfig.from_settings(method="ngram", num_speculative_tokens=7)
    assert cfg.speculative.method == "ngram"
    assert cfg.speculative.num_speculative_tokens == 7
    assert EngineConfig().speculative.method is None
    assert not EngineConfig().speculative.adaptive_verification
    same = EngineConfig.from_settings(speculative={"method": "ngram", "num_speculative_tokens": 7})
    assert same == cfg and same.config_hash() == cfg.config_hash()


@pytest.mark.parametrize(
    ("settings", "match"),
    [
        (dict(method="draft_model"), "needs draft_model"),
        (dict(method="ngram", draft_model="/x"), "only used by methods"),
        (dict(method="eagle"), "speculative.method"),
        (dict(method="ngram", num_speculative_tokens=0), "num_speculative_tokens"),
        (dict(method="ngram", num_speculative_tokens=17), "num_speculative_tokens"),
        (dict(method="ngram", prompt_lookup_min=4, prompt_lookup_max=2), "prompt_lookup_min"),
        (dict(method="ngram", draft_sampling="probabilistic"), "model drafter"),
        (dict(method="ngram", rejection_sample_method="synthetic"), "synthetic_acceptance_rates"),
        (
            dict(
                method="ngram",
                num_speculative_tokens=4,
                rejection_sample_method="synthetic",
                synthetic_acceptance_rates=[0.5, 0.5],
            ),
            "expected 1 or",
        ),
        (dict(method="ngram", synthetic_acceptance_rates=[0.5]), "only used with"),
        (
            dict(
                method="ngram",
                rejection_sample_method="synthetic",
                synthetic_acceptance_rates=[1.5],
            ),
            "synthetic_acceptance_rates",
        ),
        (dict(rejection_sample_method="synthetic", synthetic_acceptance_rates=[0.5]), "needs a"),
        (dict(adaptive_verification=True), "needs a speculative method"),
        (dict(method="ngram", draft_sampling="sometimes"), "draft_sampling"),
        (dict(method="ngram", vocab_parallel_drafting=True), "needs method 'dflash'"),
    ],
)
def test_bad_combinations_raise_config_error(settings, match):
    with pytest.raises(ConfigError, match=match):
        EngineConfig.from_settings(**settings)


def test_registry_builds_ngram_and_reports_missing_modules(monkeypatch):
    cfg = EngineConfig.from_settings(method="ngram", prompt_lookup_min=2, prompt_lookup_max=3)
    proposer = make_proposer(cfg, torch.nn.Linear(1, 1))
    assert isinstance(proposer, NgramProposer) and (proposer.min_n, proposer.max_n) == (2, 3)
    with pytest.raises(ConfigError, match="needs a speculative method"):
        make_proposer(EngineConfig(), torch.nn.Linear(1, 1))
    monkeypatch.setitem(
        spec_registry._REGISTRY, "dflash", "libkk.spec_decode.no_such_module:DFlashProposer"
    )
    with pytest.raises(ConfigError, match="no_such_module"):
        make_proposer(EngineConfig.from_settings(method="dflash"), torch.nn.Linear(1, 1))
