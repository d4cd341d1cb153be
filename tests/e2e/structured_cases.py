"""Constraints the structured-output tests under speculation and tensor parallelism share: a
JSON Schema, a regex, a choice and a Lark grammar with short outputs, and their checks."""

from __future__ import annotations

import json
import re

import jsonschema

from libkk import SamplingParams

SCHEMA = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 8},
        "role": {"enum": ["admin", "user", "guest"]},
        "level": {"type": "integer", "minimum": 0, "maximum": 9},
        "tags": {"type": "array", "items": {"enum": ["red", "blue"]}, "maxItems": 2},
    },
    "required": ["name", "role", "level", "tags"],
    "additionalProperties": False,
}
DATE = r"\d{4}-\d{2}-\d{2}"
CHOICES = ["yes", "no", "maybe"]
GREETING = """
start: greeting " " NAME "!"
greeting: "hello" | "hi" | "hey"
NAME: /[A-Z][a-z]{1,8}/
"""
GREETING_RE = r"(hello|hi|hey) [A-Z][a-z]{1,8}!"

# name: (prompt, constraint, max_tokens)
CASES = {
    "json_schema": ('A user record as JSON, e.g. {"name": "Ann", "role": "user"}:', SCHEMA, 64),
    "regex": ("Today's date is", DATE, 24),
    "choice": ("Is the sky blue? Answer:", CHOICES, 8),
    "grammar": ("Greet someone:", GREETING, 24),
}


def structured(name: str) -> dict:
    constraint = CASES[name][1]
    key = {"json_schema": "json_schema", "regex": "regex", "choice": "choice"}.get(name, name)
    return {key: constraint}


def requests(names, seeds, temperature: float) -> tuple[list[str], list[SamplingParams], list]:
    """Prompts, parameters and case names of every (case, seed)."""
    prompts, params, cases = [], [], []
    for name in names:
        prompt, _, max_tokens = CASES[name]
        for seed in seeds:
            prompts.append(prompt)
            params.append(
                SamplingParams(
                    temperature=temperature,
                    seed=seed,
                    max_tokens=max_tokens,
                    structured=structured(name),
                )
            )
            cases.append(name)
    return prompts, params, cases


def check(name: str, text: str) -> None:
    """Raises unless `text` satisfies case `name`'s constraint."""
    if name == "json_schema":
        jsonschema.validate(json.loads(text), SCHEMA)
    elif name == "regex":
        assert re.fullmatch(DATE, text), text
    elif name == "choice":
        assert text in CHOICES, text
    else:
        assert re.fullmatch(GREETING_RE, text), text
