"""The one quantile every benchmark here reports: nearest rank, the value at index
int(p * n) of the sorted values (p = 1.0: the largest), NaNs left out, NaN when there is none.
So p99 of n values is their (n - int(0.99 n))-th largest: the largest of 100, the 2nd largest
of 101-200, the 3rd of 201-300."""

from __future__ import annotations

import math
from collections.abc import Iterable


def quantile(values: Iterable[float], p: float) -> float:
    s = sorted(v for v in values if v == v)
    return s[min(len(s) - 1, int(p * len(s)))] if s else math.nan
