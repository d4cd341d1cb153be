"""The errors libkk raises: one class per kind of failure a caller can handle.

Every message names the field or path at fault, the value seen and what was expected.
"""

from __future__ import annotations


class LibkkError(Exception):
    """Base class of every error libkk raises on purpose."""


class ConfigError(LibkkError, ValueError):
    """An engine setting is unknown, of the wrong type or out of range."""


class SamplingParamsError(LibkkError, ValueError):
    """A sampling parameter is out of range."""


class InvalidRequestError(LibkkError, ValueError):
    """A request cannot be served as given (empty prompt, bad token ids, ...)."""


class UnknownArgumentError(InvalidRequestError, TypeError):
    """A call got an argument it does not take: an unknown keyword (a misspelt name, say) or a
    positional argument too many. Also a TypeError, which Python raises for these."""


class UnknownSamplingParamError(SamplingParamsError, UnknownArgumentError):
    """SamplingParams got a keyword that is not one of its fields."""


class PromptTooLongError(InvalidRequestError):
    """The prompt (plus min_tokens) does not fit in max_model_len."""


class StructuredOutputError(InvalidRequestError):
    """A request's structured-output constraint cannot be used: a malformed JSON Schema, an
    invalid regex or grammar, one that admits no output, or a setting it does not work with."""


class UnknownRequestError(LibkkError, KeyError):
    """A request id that the session does not know (never submitted, or already collected)."""

    def __str__(self) -> str:  # KeyError quotes its argument; keep the message readable
        return str(self.args[0]) if self.args else ""


class ModelLoadError(LibkkError):
    """A model folder or checkpoint cannot be read."""


class ModelNotFoundError(ModelLoadError, FileNotFoundError):
    """The model path does not exist or lacks a required file."""


class CorruptCheckpointError(ModelLoadError):
    """A checkpoint file is truncated, unreadable, or does not match the model's shapes."""


class UnsupportedModelError(ModelLoadError):
    """The checkpoint's architecture (or a feature of it) is not supported."""


class MissingDependencyError(LibkkError, ImportError):
    """An optional package is needed; the message gives the exact install command."""


class SessionClosedError(LibkkError, RuntimeError):
    """The session was closed; no further calls are accepted."""


class TensorParallelError(LibkkError, RuntimeError):
    """A tensor-parallel worker failed or stopped answering; the session runs no further steps
    (close it and start a new one)."""


class SpeculationInputError(LibkkError, ValueError):
    """A tensor or value handed to the speculation helpers has the wrong shape, type or range."""
