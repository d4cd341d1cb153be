"""Chi-square bounds shared by the statistical tests of the noise and the sampler.

The tests use fixed seeds, so they are deterministic; their bounds are at significance ALPHA (a
correct implementation fails one of them with probability 0.1% for a given choice of seeds).
"""

from __future__ import annotations

import math

ALPHA = 1e-3


def chi2_critical(dof: int, alpha: float = ALPHA) -> float:
    """Upper alpha quantile of chi-square(dof): scipy if installed, else Wilson-Hilferty."""
    try:
        from scipy.stats import chi2
    except ImportError:
        z = 3.0902323  # upper 1e-3 quantile of N(0, 1)
        assert alpha == 1e-3
        a = 2.0 / (9.0 * dof)
        return dof * (1.0 - a + z * math.sqrt(a)) ** 3
    return float(chi2.ppf(1.0 - alpha, dof))
