"""When a request reached each stage of its life, and the durations derived from that.

Times are `time.monotonic()` seconds: good for durations, not wall-clock dates.
"""

from __future__ import annotations

import msgspec


class Timeline(msgspec.Struct, kw_only=True):
    # Stamped when the caller hands the request over, before tokenization.
    arrival: float
    first_scheduled: float | None = None
    first_token: float | None = None
    last_token: float | None = None
    finished: float | None = None
    # Last time the request advanced (scheduled, computed or produced a token).
    last_progress: float | None = None
    num_output_tokens: int = 0

    @property
    def queue_time(self) -> float | None:
        """Arrival to first scheduled."""
        return _diff(self.first_scheduled, self.arrival)

    @property
    def prefill_time(self) -> float | None:
        """First scheduled to first token."""
        return _diff(self.first_token, self.first_scheduled)

    @property
    def time_to_first_token(self) -> float | None:
        return _diff(self.first_token, self.arrival)

    @property
    def decode_time(self) -> float | None:
        """First token to last token."""
        return _diff(self.last_token, self.first_token)

    @property
    def mean_inter_token_time(self) -> float | None:
        decode = self.decode_time
        if decode is None or self.num_output_tokens < 2:
            return None
        return decode / (self.num_output_tokens - 1)

    @property
    def total_time(self) -> float | None:
        return _diff(self.finished, self.arrival)

    def summary(self, now: float) -> str:
        """One line for logs: each stage relative to arrival, in milliseconds."""

        def rel(t: float | None) -> str:
            return "-" if t is None else f"{(t - self.arrival) * 1e3:.1f}ms"

        return (
            f"arrival=0 first_scheduled={rel(self.first_scheduled)} "
            f"first_token={rel(self.first_token)} last_token={rel(self.last_token)} "
            f"finished={rel(self.finished)} now={rel(now)} tokens={self.num_output_tokens}"
        )


def _diff(later: float | None, earlier: float | None) -> float | None:
    return None if later is None or earlier is None else later - earlier
