"""What a draft costs on this machine: an online model of a forward pass's time as a fixed
part plus a part per row, fitted to the passes the engine ran.

Adaptive drafting weighs a request's accepted drafts against this cost. On a GPU a verify
pass with a dozen draft rows costs about what a decode pass does, so a draft is nearly free;
on a CPU the rows make the matrix products compute-bound and a 13-row verify pass costs ~3
decode passes, so drafts that are not accepted cost real time.
"""

from __future__ import annotations

import math


class PassCost:
    """Least squares of `seconds ~ fixed + per_row * rows` over the observed passes, each
    pass's weight decaying by `decay` per newer pass (the machine's load changes)."""

    def __init__(self, decay: float = 0.97) -> None:
        if not 0.0 < decay < 1.0:
            raise ValueError(f"decay={decay!r} is not allowed; need a number in (0, 1)")
        self.decay = decay
        self._sums = [0.0] * 5  # weight, rows, seconds, rows^2, rows*seconds

    def observe(self, rows: int, seconds: float) -> None:
        """One forward pass of `rows` query rows (requests plus their draft nodes)."""
        if rows < 1 or not math.isfinite(seconds) or seconds < 0:
            raise ValueError(f"rows={rows}, seconds={seconds} is not a pass; need rows >= 1 "
                             f"and a finite time >= 0")
        x, y = float(rows), float(seconds)
        self._sums = [self.decay * s + v for s, v in
                      zip(self._sums, (1.0, x, y, x * x, x * y), strict=True)]

    def fit(self) -> tuple[float, float] | None:
        """(fixed, per_row) seconds, or None until passes of two row counts were seen."""
        w, sx, sy, sxx, sxy = self._sums
        spread = w * sxx - sx * sx  # 0 (up to rounding) while every pass had one row count
        if w == 0 or spread <= 1e-9 * w * sxx:
            return None
        per_row = max(0.0, (w * sxy - sx * sy) / spread)
        fixed = max(0.0, (sy - per_row * sx) / w)
        return fixed, per_row

    def draft_cost(self, batch: int) -> float:
        """The time of one draft row over the time a decode pass of `batch` requests spends
        per token: the decoded tokens one draft row must win back to pay for itself. 0.0 (free)
        while the model is not fitted yet."""
        fitted = self.fit()
        if fitted is None or batch < 1:
            return 0.0
        fixed, per_row = fitted
        per_token = (fixed + per_row * batch) / batch
        return per_row / per_token if per_token > 0 else 0.0  # <= 1: fixed is clamped >= 0
