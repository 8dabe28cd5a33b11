"""What a draft costs on this machine: an online model of a forward pass's time as a fixed
part, a part per row and a verify pass's premium over a decode pass, fitted to the passes the
engine ran.

Adaptive drafting weighs a request's accepted drafts against this cost. On a CPU the rows
make the matrix products compute-bound and a 13-row verify pass costs ~2.6 decode passes, so
drafts that are not accepted cost real time. On a GPU a dozen draft rows cost little, but
with a small model a verify pass's host work (tree metadata, the walk and commit) costs ~2
decodes whatever its rows: the premium, which the requests drafting in a pass share.
"""

from __future__ import annotations

import math
from typing import NamedTuple

import numpy as np


class Fit(NamedTuple):
    """Seconds: `fixed` per pass, `per_row` per query row, and `verify_premium` more for a
    verify pass than for a decode pass of as many rows (its own graphs, tree metadata, the
    host's walk of the trees and commit); 0 where the passes seen cannot tell it apart."""

    fixed: float
    per_row: float
    verify_premium: float


class PassCost:
    """Least squares of `seconds ~ fixed + per_row * rows + verify_premium * is_verify` over
    the observed passes. Decode and verify passes are kept apart, each kind's weights decaying
    by `decay` per newer pass of that kind (the machine's load changes), so that a long run of
    one kind does not wash out the other. Where the passes cannot tell the three apart (one
    kind unseen, or rows that move with the kind: verify passes of one size beside decode
    passes of another), the fit is `fixed + per_row * rows`, as if verify passes cost only
    their rows; where the per-row time comes out negative (rows nearly free, and noise),
    `fixed + verify_premium * is_verify`."""

    def __init__(self, decay: float = 0.97) -> None:
        if not 0.0 < decay < 1.0:
            raise ValueError(f"decay={decay!r} is not allowed; need a number in (0, 1)")
        self.decay = decay
        # per kind (0: decode, 1: verify) the decayed sums of w, w*rows, w*rows^2, w*seconds
        # and w*rows*seconds: with f = (1, rows, is_verify), is_verify fixed per kind, they are
        # every entry of the kind's sums of w * f f^T and w * f * seconds (`_normal`), kept as
        # plain floats (a pass's observation is five multiply-adds on the host)
        self._sums = [[0.0] * 5, [0.0] * 5]
        self._fit: Fit | None = None
        self._fitted = True  # _fit is current
        self._verify_step: tuple[int, float] | None = None  # (rows, seconds): `observe_step`

    def observe(self, rows: int, seconds: float, verify: bool = False) -> None:
        """One forward pass of `rows` query rows (requests plus their draft nodes); `verify`:
        a verify pass (trees), else a decode pass."""
        if rows < 1 or not math.isfinite(seconds) or seconds < 0:
            raise ValueError(
                f"rows={rows}, seconds={seconds} is not a pass; need rows >= 1 "
                f"and a finite time >= 0"
            )
        sums, decay, r, t = self._sums[int(bool(verify))], self.decay, float(rows), float(seconds)
        sums[0] = decay * sums[0] + 1.0
        sums[1] = decay * sums[1] + r
        sums[2] = decay * sums[2] + r * r
        sums[3] = decay * sums[3] + t
        sums[4] = decay * sums[4] + r * t
        self._fitted = False

    def observe_step(self, rows: int, seconds: float, verify: bool = False) -> None:
        """An engine step's time (propose to commit; a verify step's up to the next pass's
        launch where it makes that) and its pass's rows. A verify step is observed with the
        step after it: nothing was launched ahead during the verify pass (the next pass is
        launched after its walk, at best planned during it), so a decode step after it takes
        longer than a decode step; that time beyond the decode the fit expects is the verify
        step's too, and that decode is not observed as one. A verify step after a verify
        step is observed alone."""
        verify_step, self._verify_step = self._verify_step, None
        if verify:
            if verify_step is not None:
                self.observe(*verify_step, verify=True)
            self._verify_step = (rows, seconds)
            return
        if verify_step is None:
            self.observe(rows, seconds)
            return
        expected = self._decode_seconds(rows)
        if expected is None:  # nothing to tell the decode's extra by: both as they are
            self.observe(*verify_step, verify=True)
            self.observe(rows, seconds)
            return
        extra = max(0.0, seconds - expected)
        self.observe(verify_step[0], verify_step[1] + extra, verify=True)

    def _decode_seconds(self, rows: int) -> float | None:
        """A decode pass of `rows` rows, from the decode passes alone (the full fit moves
        with the verify passes, which this is about to add to): their least-squares line in
        rows where their rows differ, else their (decayed) mean; None before any."""
        n, r, rr, t, rt = self._sums[0]
        if n <= 0:
            return None
        line = _solve([[n, r], [r, rr]], [t, rt])
        if line is None:  # one row count (batch 1): the mean
            return t / n
        return max(0.0, line[0] + line[1] * rows)

    def _normal(self, kind: int) -> tuple[list[list[float]], list[float]]:
        """The kind's sums of w * f f^T (3 x 3) and w * f * seconds (3), f = (1, rows, kind)."""
        n, r, rr, t, rt = self._sums[kind]
        k = float(kind)
        return [[n, r, k * n], [r, rr, k * r], [k * n, k * r, k * n]], [t, rt, k * t]

    def fit(self) -> Fit | None:
        """The fitted times, or None until passes of two row counts were seen."""
        if not self._fitted:
            self._fit, self._fitted = self._solve_fit(), True
        return self._fit

    def _solve_fit(self) -> Fit | None:
        # 3 x 3 sums as Python floats: each step is the IEEE operation numpy's would be, at
        # a fraction of the host time (this runs every verify step); LAPACK does the rest
        (decode, decode_target), (verify, verify_target) = self._normal(0), self._normal(1)
        normal = [
            [a + b for a, b in zip(decode_row, verify_row, strict=True)]
            for decode_row, verify_row in zip(decode, verify, strict=True)
        ]
        target = [a + b for a, b in zip(decode_target, verify_target, strict=True)]
        if decode[0][0] > 0 and verify[0][0] > 0:  # both kinds seen
            full = _solve(normal, target)
            if full is not None and full[1] >= 0 and full[2] >= 0:
                return Fit(max(0.0, full[0]), full[1], full[2])
            if full is not None and full[1] < 0:  # rows nearly free: noise made them < 0
                no_rows = _solve(
                    [[normal[0][0], normal[0][2]], [normal[2][0], normal[2][2]]],
                    [target[0], target[2]],
                )
                if no_rows is not None and no_rows[1] >= 0:
                    return Fit(max(0.0, no_rows[0]), 0.0, no_rows[1])
        rows_only = _solve([normal[0][:2], normal[1][:2]], target[:2])
        if rows_only is None:
            return None
        per_row = max(0.0, rows_only[1])
        return Fit(max(0.0, (target[0] - per_row * normal[0][1]) / normal[0][0]), per_row, 0.0)

    def _per_token(self, fit: Fit, batch: int) -> float:
        return (fit.fixed + fit.per_row * batch) / batch

    def draft_cost(self, batch: int) -> float:
        """The time of one draft row over the time a decode pass of `batch` requests spends
        per token: the decoded tokens one draft row must win back to pay for itself. 0.0 (free)
        while the model is not fitted yet."""
        fit = self.fit()
        if fit is None or batch < 1:
            return 0.0
        per_token = self._per_token(fit, batch)
        # <= 1 in exact arithmetic (fixed is clamped >= 0), but with fixed 0 the division
        # rounds to 1 + 2**-52 at some batches (57, for one fit), which SpecStats refuses
        return min(1.0, fit.per_row / per_token) if per_token > 0 else 0.0

    def verify_premium(self, batch: int) -> float:
        """What a verify pass of `batch` requests costs beyond its rows, in decoded tokens'
        time (the requests that drafted in it share this). 0.0 while not fitted."""
        fit = self.fit()
        if fit is None or batch < 1:
            return 0.0
        per_token = self._per_token(fit, batch)
        return fit.verify_premium / per_token if per_token > 0 else 0.0


CONDITION_LIMIT = 1e6  # a normal matrix conditioned worse does not determine its fit


def _solve(normal: list[list[float]], target: list[float]) -> list[float] | None:
    """The least-squares coefficients, or None where the passes do not determine them (the
    normal matrix is singular up to rounding, relative to its scale)."""
    scale = [math.sqrt(row[i]) for i, row in enumerate(normal)]  # the sums are >= 0
    if 0.0 in scale:
        return None
    # 1 on the diagonal: conditioning comparable
    unit = [
        [value / (scale[i] * scale[j]) for j, value in enumerate(row)]
        for i, row in enumerate(normal)
    ]
    if not _surely_conditioned(unit) and _condition(np.array(unit)) > CONDITION_LIMIT:
        return None
    solved = np.linalg.solve(unit, [t / s for t, s in zip(target, scale, strict=True)])
    return [x / s for x, s in zip(solved.tolist(), scale, strict=True)]


def _surely_conditioned(unit: list[list[float]]) -> bool:
    """Whether the 2 x 2 or 3 x 3 `unit` is conditioned well within `CONDITION_LIMIT`,
    told without its singular values: the largest is at most the Frobenius norm F and
    their product is |det|, so the condition number is at most F**n / |det|. Half the
    limit leaves room for rounding (det's relative error here is below 1e-9), so where
    this says yes `_condition` is below the limit too; otherwise `_condition` decides."""
    frobenius = math.sqrt(sum(value * value for row in unit for value in row))
    if len(unit) == 2:
        (a, b), (c, d) = unit
        det = a * d - b * c
    else:
        (a, b, c), (d, e, f), (g, h, i) = unit
        det = a * (e * i - f * h) - b * (d * i - f * g) + c * (d * h - e * g)
    # NaN or inf anywhere makes this False
    return frobenius ** len(unit) <= abs(det) * (CONDITION_LIMIT / 2)


def _condition(unit: np.ndarray) -> float:
    """`np.linalg.cond(unit)` (the 2-norm condition number), without its wrapper's work: the
    ratio of the largest singular value to the smallest."""
    singular = np.linalg.svd(unit, compute_uv=False).tolist()
    largest, smallest = singular[0], singular[-1]
    if smallest == 0.0:  # largest >= 1 (a diagonal entry) unless NaN: cond gives inf
        return math.inf if largest != 0.0 else _unless_nan(unit, math.nan)
    return _unless_nan(unit, largest / smallest)


def _unless_nan(unit: np.ndarray, ratio: float) -> float:
    """As `cond`: a NaN ratio is inf, unless `unit` holds a NaN."""
    if math.isnan(ratio) and not np.isnan(unit).any():
        return math.inf
    return ratio
