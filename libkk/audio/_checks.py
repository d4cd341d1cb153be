"""Argument checks shared by the audio transforms: one message format, one error class."""

from __future__ import annotations

import math
import operator
from typing import Any, NoReturn

import torch

from libkk.errors import InvalidRequestError


def bad(where: str, value: Any, expected: str) -> NoReturn:
    raise InvalidRequestError(f"{where}={value!r} is invalid: expected {expected}")


def as_rate(where: str, value: Any) -> int:
    """A sample rate as a positive int; integral floats such as 44100.0 are accepted."""
    if isinstance(value, bool):
        bad(where, value, "a positive integer number of Hz")
    if isinstance(value, float):
        if not math.isfinite(value) or not value.is_integer():
            bad(
                where,
                value,
                "an integer number of Hz; scale both rates to integers with the "
                "same ratio (e.g. 441 -> 160 instead of 22050.0 -> 8000.0)",
            )
        value = int(value)
    try:
        rate = operator.index(value)
    except TypeError:
        bad(where, value, "a positive integer number of Hz")
    if rate <= 0:
        bad(where, value, "a positive integer number of Hz")
    return rate


def as_int(where: str, value: Any, minimum: int) -> int:
    if isinstance(value, bool):
        bad(where, value, f"an integer >= {minimum}")
    try:
        number = operator.index(value)
    except TypeError:
        bad(where, value, f"an integer >= {minimum}")
    if number < minimum:
        bad(where, value, f"an integer >= {minimum}")
    return number


def as_float(where: str, value: Any) -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
        bad(where, value, "a finite number")
    return float(value)


def one_of(where: str, value: Any, choices: tuple[Any, ...]) -> None:
    if value not in choices:
        bad(where, value, "one of " + ", ".join(repr(c) for c in choices))


def check_waveform(where: str, waveform: Any) -> None:
    """A real floating-point tensor of shape [..., time] with at least one sample."""
    if not isinstance(waveform, torch.Tensor):
        raise InvalidRequestError(
            f"{where}: expected a torch.Tensor, got {type(waveform).__name__}"
        )
    if not waveform.is_floating_point():
        raise InvalidRequestError(
            f"{where}.dtype={waveform.dtype} is invalid: expected a floating-point waveform; "
            "convert integer PCM first (e.g. int16 samples / 32768.0)"
        )
    if waveform.dim() == 0 or waveform.numel() == 0:
        raise InvalidRequestError(
            f"{where}.shape={tuple(waveform.shape)} is invalid: expected [..., time] "
            "with at least one sample"
        )
