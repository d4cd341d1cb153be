"""Band-limited sinc resampling, bit-for-bit with torchaudio 2.x.

The kernel is a windowed sinc evaluated at `new` output phases; one strided conv1d with stride
`orig` then produces `new` output samples per `orig` input samples (rates reduced by their gcd).
Every floating-point step below mirrors torchaudio's `_get_sinc_resample_kernel` and
`_apply_sinc_resample_kernel` in order and dtype, because reordering even one product changes
the last bits of the output.
"""

from __future__ import annotations

import functools
import math
from typing import Any

import torch
import torch.nn.functional as F

from libkk.audio._checks import as_float, as_int, as_rate, bad, check_waveform, one_of

RESAMPLING_METHODS = ("sinc_interp_hann", "sinc_interp_kaiser")
# torchaudio's default Kaiser shape parameter.
DEFAULT_KAISER_BETA = 14.769656459379492
_KERNEL_CACHE_SIZE = 64


def _build_kernel(
    orig: int,
    new: int,
    lowpass_filter_width: int,
    rolloff: float,
    method: str,
    beta: float | None,
    dtype: torch.dtype | None,
    device: torch.device,
) -> tuple[torch.Tensor, int]:
    """Kernel [new, 1, 2 * width + orig] for gcd-reduced rates, and the padding width.

    dtype None builds in float64 and returns float32 (the transform's choice); a dtype builds and
    returns in that dtype (the functional form's choice, which uses the waveform's dtype).
    """
    base_freq = min(orig, new) * rolloff
    width = math.ceil(lowpass_filter_width * orig / base_freq)
    idx_dtype = dtype if dtype is not None else torch.float64
    # [1, 1, K] input offsets in units of input periods
    idx = torch.arange(-width, width + orig, dtype=idx_dtype, device=device)[None, None] / orig
    # NOTE: with dtype None this arange is int64 and the division yields the default float dtype
    # (float32), which is then widened by the sum: the phases carry float32 rounding. Kept as is.
    phases = torch.arange(0, -new, -1, dtype=dtype, device=device)[:, None, None] / new
    t = (phases + idx) * base_freq  # [new, 1, K]
    t = t.clamp(-lowpass_filter_width, lowpass_filter_width)
    if method == "sinc_interp_hann":
        window = torch.cos(t * math.pi / lowpass_filter_width / 2) ** 2
    else:
        # NOTE: beta goes through a default-dtype (float32) scalar tensor, as in torchaudio, so
        # both its value and i0(beta) carry float32 rounding even when the kernel is float64.
        beta_t = torch.tensor(float(DEFAULT_KAISER_BETA if beta is None else beta))
        i0_beta = torch.i0(beta_t)
        window = torch.i0(beta_t * torch.sqrt(1 - (t / lowpass_filter_width) ** 2)) / i0_beta
    t = t * math.pi
    scale = base_freq / orig
    kernel = torch.where(t == 0, torch.tensor(1.0).to(t), t.sin() / t)
    kernel = kernel * (window * scale)
    if dtype is None:
        kernel = kernel.to(torch.float32)
    return kernel, width


@functools.lru_cache(maxsize=_KERNEL_CACHE_SIZE)
def _cached_kernel(
    orig: int,
    new: int,
    lowpass_filter_width: int,
    rolloff: float,
    method: str,
    beta: float | None,
    dtype: torch.dtype | None,
    device: torch.device,
) -> tuple[torch.Tensor, int]:
    # NOTE: built outside inference mode so a kernel first made under torch.inference_mode() can
    # still be used later by code that records autograd. Cached tensors are shared: read-only.
    with torch.inference_mode(False), torch.no_grad():
        return _build_kernel(orig, new, lowpass_filter_width, rolloff, method, beta, dtype, device)


def kernel_cache_info() -> Any:
    """Hit/miss statistics of the per-rate-pair kernel cache (functools.lru_cache info)."""
    return _cached_kernel.cache_info()


def clear_kernel_cache() -> None:
    _cached_kernel.cache_clear()


class _Plan:
    """Validated, gcd-reduced resampling settings."""

    __slots__ = (
        "orig",
        "new",
        "orig_freq",
        "new_freq",
        "lowpass_filter_width",
        "rolloff",
        "method",
        "beta",
    )

    def __init__(
        self,
        where: str,
        orig_freq: Any,
        new_freq: Any,
        lowpass_filter_width: Any,
        rolloff: Any,
        resampling_method: Any,
        beta: Any,
    ) -> None:
        self.orig_freq = as_rate(f"{where}.orig_freq", orig_freq)
        self.new_freq = as_rate(f"{where}.new_freq", new_freq)
        self.lowpass_filter_width = as_int(f"{where}.lowpass_filter_width", lowpass_filter_width, 1)
        self.rolloff = as_float(f"{where}.rolloff", rolloff)
        if not 0.0 < self.rolloff <= 1.0:
            bad(f"{where}.rolloff", rolloff, "0 < rolloff <= 1 (a fraction of the lower Nyquist)")
        one_of(f"{where}.resampling_method", resampling_method, RESAMPLING_METHODS)
        self.method: str = resampling_method
        self.beta: float | None = None
        if beta is not None:
            self.beta = as_float(f"{where}.beta", beta)
            if self.beta < 0:
                bad(f"{where}.beta", beta, "a Kaiser shape parameter >= 0, or None")
        if self.method == "sinc_interp_hann":
            self.beta = None  # unused by the Hann window; keeps cache keys canonical
        gcd = math.gcd(self.orig_freq, self.new_freq)
        self.orig = self.orig_freq // gcd
        self.new = self.new_freq // gcd

    @property
    def identity(self) -> bool:
        return self.orig_freq == self.new_freq

    def kernel(self, dtype: torch.dtype | None, device: torch.device) -> tuple[torch.Tensor, int]:
        return _cached_kernel(
            self.orig,
            self.new,
            self.lowpass_filter_width,
            self.rolloff,
            self.method,
            self.beta,
            dtype,
            device,
        )


def _apply_kernel(
    waveform: torch.Tensor, orig: int, new: int, kernel: torch.Tensor, width: int
) -> torch.Tensor:
    shape = waveform.shape
    flat = waveform.reshape(-1, shape[-1])  # [num_wavs, time]
    num_wavs, length = flat.shape
    flat = F.pad(flat, (width, width + orig))
    # [num_wavs, new, frames]: output phase p of frame f is output sample f * new + p
    out = F.conv1d(flat[:, None], kernel, stride=orig)
    out = out.transpose(1, 2).reshape(num_wavs, -1)
    target_length = math.ceil(new * length / orig)
    out = out[..., :target_length]
    return out.reshape(*shape[:-1], out.shape[-1])


def resample(
    waveform: torch.Tensor,
    orig_freq: int,
    new_freq: int,
    lowpass_filter_width: int = 6,
    rolloff: float = 0.99,
    resampling_method: str = "sinc_interp_hann",
    beta: float | None = None,
) -> torch.Tensor:
    """Resample `waveform` [..., time] from `orig_freq` to `new_freq` Hz (torchaudio's functional).

    The kernel is built in the waveform's dtype on its device, as torchaudio's functional form
    does, and cached per rate pair; `Resample` instead builds in float64 and stores float32.
    Returns `waveform` itself when the rates are equal.
    """
    plan = _Plan(
        "resample", orig_freq, new_freq, lowpass_filter_width, rolloff, resampling_method, beta
    )
    check_waveform("resample.waveform", waveform)
    if plan.identity:
        return waveform
    kernel, width = plan.kernel(waveform.dtype, waveform.device)
    return _apply_kernel(waveform, plan.orig, plan.new, kernel, width)


class Resample(torch.nn.Module):
    """Resample [..., time] waveforms between two fixed integer rates (torchaudio's transform).

    The kernel is built once in float64 and kept as a float32 buffer (or built and kept in `dtype`
    when given), so it moves with `.to(device)` and appears in `state_dict()` under `kernel`.
    Waveforms of another dtype or device use a converted copy of the kernel for that call.
    """

    kernel: torch.Tensor

    def __init__(
        self,
        orig_freq: int,
        new_freq: int,
        resampling_method: str = "sinc_interp_hann",
        lowpass_filter_width: int = 6,
        rolloff: float = 0.99,
        beta: float | None = None,
        *,
        dtype: torch.dtype | None = None,
    ) -> None:
        super().__init__()
        plan = _Plan(
            "Resample", orig_freq, new_freq, lowpass_filter_width, rolloff, resampling_method, beta
        )
        if dtype is not None and not dtype.is_floating_point:
            bad("Resample.dtype", dtype, "a floating-point dtype or None")
        self._plan = plan
        self.orig_freq = plan.orig_freq
        self.new_freq = plan.new_freq
        self.gcd = math.gcd(plan.orig_freq, plan.new_freq)
        self.resampling_method = plan.method
        self.lowpass_filter_width = plan.lowpass_filter_width
        self.rolloff = plan.rolloff
        self.beta = beta
        self.width = 0
        if not plan.identity:
            kernel, self.width = plan.kernel(dtype, torch.device("cpu"))
            # A private copy: module.to()/load_state_dict must never write into the shared cache.
            self.register_buffer("kernel", kernel.clone())

    def forward(self, waveform: torch.Tensor) -> torch.Tensor:
        check_waveform("Resample.waveform", waveform)
        if self._plan.identity:
            return waveform
        kernel = self.kernel
        if kernel.dtype != waveform.dtype or kernel.device != waveform.device:
            kernel = kernel.to(device=waveform.device, dtype=waveform.dtype)
        return _apply_kernel(waveform, self._plan.orig, self._plan.new, kernel, self.width)

    def output_length(self, length: int) -> int:
        """Number of output samples for `length` input samples."""
        return math.ceil(self._plan.new * length / self._plan.orig)

    def extra_repr(self) -> str:
        return (
            f"orig_freq={self.orig_freq}, new_freq={self.new_freq}, "
            f"resampling_method={self.resampling_method!r}, "
            f"lowpass_filter_width={self.lowpass_filter_width}, rolloff={self.rolloff}"
        )
