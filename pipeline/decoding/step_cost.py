"""What one batched decode step costs, from the latency table and from the steps themselves.

A step over requests i with n_i cached tokens, M rows in all, and q_i query rows each
request's attention computes (its own rows; in a KV pool, the batch's widest block):

    T = fixed + per_row · M + per_key · Σ n_i + per_key_row · Σ n_i (q_i − 1)

The linears read the weights once (`fixed`) and grow by rows (`per_row`); each request
reads its own cache (`per_key` per cached token) and pays more for each query row past
the first (`per_key_row`). The latency table gives a first estimate (a table measured
on a busy machine can be off by a quarter), and the engine's own step timings correct
it: a least-squares fit with no coefficient below zero, pulled toward the table's
proportions, at whatever scale the steps run, where they say little (a batch that never
drafts says nothing of `per_key_row`; a request alone, one shape of step, tells only its
total: the table is scaled to it), weighted to the most recent steps so that a device
slowing down mid-run is followed (restarted from the latest steps when they all miss the
same way: a device several times slower), and robust to steps stalled by a neighbour.
"""

from __future__ import annotations

import math
from collections import deque
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Protocol

import numpy as np

# Steps remembered, and the age (in steps) at which one counts half.
DEFAULT_WINDOW = 128
DEFAULT_HALF_LIFE = 32.0
# The table's weight in the fit, in steps' worth: a step outvotes it.
PRIOR_STEPS = 0.25
# A fit costs ~3 ms on a CPU (a tenth of a small model's step there): every REFIT_EVERY steps
# while it has seen fewer than SETTLED steps since it started (or restarted), then every
# REFIT_SETTLED (a fit every four steps of 25 ms took ~3% off a request decoding alone).
REFIT_EVERY = 4
REFIT_SETTLED = 16
SETTLED = 32
ERRORS_KEPT = 4096
# Relative errors beyond this weigh less (Huber); beyond STALL, none in the final fit.
HUBER_DELTA = 0.1
STALL = 0.5
# CHANGE_STEPS steps in a row that the fit missed by more than CHANGE_ERROR the same way are
# no stalls but a device that changed speed: the fit restarts from them. (A fit of relative
# errors over the old and the new steps would sit near the old speed: a step predicted 10×
# too slow costs it 9, one predicted 10× too fast at most 1; and the stall rule would then
# drop the new steps.)
CHANGE_STEPS = 8
CHANGE_ERROR = 0.25
# Timed steps a fit has seen before a plan is made from it (the table alone before: a plan made
# from one or two steps would follow their noise).
MIN_TIMED_STEPS = 4


class StepLatency(Protocol):
    """What a latency table (knapspec.latency's LatencyModel or PipelineLatency) answers."""

    @property
    def max_verify(self) -> int: ...

    def t_forward(self, n: int) -> float: ...

    def t_verify(self, k: int, n: int) -> float: ...


@dataclass(frozen=True)
class StepCost:
    """The coefficients of the step's cost (seconds; see the module's formula)."""

    fixed: float
    per_row: float
    per_key: float
    per_key_row: float

    @classmethod
    def from_table(cls, latency: StepLatency, probe_context: int = 4096) -> StepCost:
        """From a table: one row's forward at context 0 and at `probe_context`, and the slope
        of its verify curve (the last measured ratio, per row), shared by linears and attention."""
        base = latency.t_forward(0)
        per_key = max(latency.t_forward(probe_context) - base, 0.0) / probe_context
        widest = latency.max_verify
        slope = (latency.t_verify(widest, 0) / base - 1.0) / (widest - 1) if widest > 1 and base > 0 else 0.0
        slope = max(slope, 0.0)
        return cls(fixed=base * (1 - slope), per_row=base * slope, per_key=per_key, per_key_row=per_key * slope)

    @staticmethod
    def features(contexts: Sequence[int], rows: Sequence[int], padded: bool) -> tuple[float, float, float, float]:
        """What the coefficients multiply: 1, M, Σ nᵢ, Σ nᵢ (qᵢ − 1)."""
        if not contexts or len(contexts) != len(rows) or min(rows) < 1:
            raise ValueError(f"a batch step needs one row count (>= 1) per request, got {list(rows)}")
        widest = max(rows)
        queries = [widest] * len(rows) if padded else rows
        return 1.0, float(sum(rows)), float(sum(contexts)), float(sum(n * (q - 1) for n, q in zip(contexts, queries)))

    def seconds(self, contexts: Sequence[int], rows: Sequence[int], padded: bool = False) -> float:
        """One step over requests at `contexts` with `rows` rows each; `padded`: their caches are
        slots of one KV pool (layers.pooled_attention computes the widest block for every slot)."""
        f = self.features(contexts, rows, padded)
        return f[0] * self.fixed + f[1] * self.per_row + f[2] * self.per_key + f[3] * self.per_key_row

    def as_tuple(self) -> tuple[float, float, float, float]:
        return self.fixed, self.per_row, self.per_key, self.per_key_row


class OnlineStepCost:
    """The step cost fitted to the steps the engine timed, starting from a table's."""

    def __init__(self, prior: StepCost, window: int = DEFAULT_WINDOW, half_life: float = DEFAULT_HALF_LIFE) -> None:
        self.prior = prior
        self._steps: deque[tuple[tuple[float, ...], float]] = deque(maxlen=window)
        self._half_life = half_life
        self._fitted = prior
        self._unfitted = 0  # steps observed since the last fit
        # Per timed step: the relative error of the table's prediction and of the fit's as last
        # made before the step was seen (what a plan made then would have assumed, up to the refit
        # interval); the last ERRORS_KEPT of them, a replica's batcher living as long as its job.
        self.errors: deque[tuple[float, float]] = deque(maxlen=ERRORS_KEPT)
        self.num_observed = 0
        self.num_changes = 0  # times the fit restarted from a device that changed speed
        self._missed = 0  # the last steps the fit missed by more than CHANGE_ERROR, all one way
        self._missed_slower = False

    def observe(self, contexts: Sequence[int], rows: Sequence[int], padded: bool, seconds: float) -> None:
        """One timed step (without a prefill chunk: its rows cost by other rules)."""
        if math.isfinite(seconds) and seconds > 0:
            table = self.prior.seconds(contexts, rows, padded)
            # The fit as last made (the first one made now): refitting is left to those who plan
            # from it (`current`), so a request that never asks (one decoding plainly) pays for no fit.
            fit = self.current() if self._fitted is self.prior else self._fitted
            fitted = fit.seconds(contexts, rows, padded)
            self.errors.append((abs(table - seconds) / seconds, abs(fitted - seconds) / seconds))
            self.num_observed += 1
            self._steps.append((StepCost.features(contexts, rows, padded), seconds))
            self._unfitted += 1
            self._note_miss(fitted, seconds)

    def _note_miss(self, fitted: float, seconds: float) -> None:
        if abs(fitted - seconds) <= CHANGE_ERROR * seconds:
            self._missed = 0
            return
        slower = seconds > fitted
        self._missed = self._missed + 1 if self._missed and slower == self._missed_slower else 1
        self._missed_slower = slower
        if self._missed >= CHANGE_STEPS:
            recent = list(self._steps)[-CHANGE_STEPS:]
            self._steps.clear()
            self._steps.extend(recent)
            # Refitted now, not when next asked: the misses are counted against the last fit.
            self._fitted, self._unfitted, self._missed = self._fit(), 0, 0
            self.num_changes += 1

    def prediction_errors(self, after: int = 0) -> tuple[float, float] | None:
        """Mean relative error of the table's and of the fit's step predictions over the steps
        past the first `after` of all observed (of those still kept; None before any)."""
        dropped = self.num_observed - len(self.errors)
        seen = list(self.errors)[max(after - dropped, 0) :]
        if not seen:
            return None
        return sum(t for t, _ in seen) / len(seen), sum(f for _, f in seen) / len(seen)

    @property
    def num_steps(self) -> int:
        return len(self._steps)

    def current(self) -> StepCost:
        every = REFIT_EVERY if len(self._steps) < SETTLED else REFIT_SETTLED
        if self._unfitted >= every or (self._unfitted and self._fitted is self.prior):
            self._fitted, self._unfitted = self._fit(), 0
        return self._fitted

    def _fit(self) -> StepCost:
        # NumPy, not torch: a fit is some hundred operations on a few numbers, where each of
        # torch's costs several times NumPy's (3.6 ms a fit in torch: 1% of a batch's decode).
        prior = np.array(self.prior.as_tuple(), dtype=np.float64)
        x = np.array([f for f, _ in self._steps], dtype=np.float64)  # [S, 4]
        y = np.array([t for _, t in self._steps], dtype=np.float64)
        ages = np.arange(len(y) - 1, -1, -1, dtype=np.float64)
        recency = 0.5 ** (ages / self._half_life)
        # Relative errors: a long step counts as much as a short one.
        x, target = x / y[:, None], np.ones_like(y)
        # The table's pull: toward its coefficients times a free factor (a fifth unknown), so that
        # a device uniformly slower or faster than its table, by any factor, costs the fit nothing;
        # a change of the table's proportions costs, per coefficient, PRIOR_STEPS steps' worth of
        # its share of a step times its squared relative change. Steps of one shape (a request
        # decoding alone) tell only their total: the fit scales the table to it, its split kept.
        # A coefficient the steps never show (no step drafted) keeps its place in the table's
        # proportions. Shares and relative changes are at the steps' own speed (`speed`: how many
        # times the table's time they took), or a device 30x slower would be held to its table.
        speed = float(np.clip(_lower_median(1.0 / np.maximum(x @ prior, 1e-12)), 1e-3, 1e3))
        seen = (np.abs(x) * recency[:, None]).sum(0) / recency.sum()
        scaled = prior * speed
        relative = np.sqrt(seen * scaled) / np.maximum(scaled, 1e-30)
        unseen = np.where(prior > 0, 1e-3 / np.maximum(scaled, 1e-30), 1.0)
        pull = np.maximum(np.where(prior > 0, relative, seen), unseen) * math.sqrt(PRIOR_STEPS)

        def solve(weights: np.ndarray) -> np.ndarray:
            if not (weights > 0).any():
                return prior
            sw = np.sqrt(weights)
            data = np.concatenate([x * sw[:, None], np.zeros((len(y), 1))], 1)
            pulls = np.concatenate([np.diag(pull), -(pull * prior)[:, None]], 1)  # θ − factor · table
            a = np.concatenate([data, pulls])
            b = np.concatenate([target * sw, np.zeros_like(prior)])
            return nonnegative_lstsq(a, b)[:4]

        theta = prior
        for _ in range(8):  # iteratively reweighted least squares from the table (Huber)
            residual = np.abs(target - x @ theta)
            # A stalled step (a neighbour's burst) is no evidence at all, once the fit is near.
            stalled = residual >= STALL if theta is not prior else np.zeros(len(residual), dtype=bool)
            theta = solve(recency * np.minimum(HUBER_DELTA / np.maximum(residual, 1e-12), 1.0) * ~stalled)
        return StepCost(*(float(v) for v in theta))


def _lower_median(values: np.ndarray) -> float:
    """The lower of the two middle values of an even count (as torch.median takes it)."""
    return float(np.partition(values, (len(values) - 1) // 2)[(len(values) - 1) // 2])


def nonnegative_lstsq(a: np.ndarray, b: np.ndarray, max_rounds: int = 32) -> np.ndarray:
    """argmin |a x - b| over x >= 0 (Lawson and Hanson's active set method, for a few columns).

    A free solve whose negative coefficients are then cut to zero is no fit: the time they
    took off comes back, and the fit misses every step by it."""
    num = a.shape[1]
    x = np.zeros(num)
    free = np.zeros(num, dtype=bool)  # the coefficients allowed off zero
    tolerance = 1e-10 * max(float(np.abs(a.T @ b).max()), 1e-300)
    for _ in range(max_rounds):
        gradient = a.T @ (b - a @ x)  # where the error falls as a coefficient grows
        gradient[free] = -math.inf
        if float(gradient.max()) <= tolerance:
            break
        free[int(gradient.argmax())] = True
        while True:  # solve over the free coefficients, stepping back to the last one that goes <= 0
            z = np.zeros_like(x)
            z[free] = np.linalg.lstsq(a[:, free], b, rcond=None)[0]
            if (z[free] > 0).all():
                x = z
                break
            ratios = np.where(free & (z <= 0), x / np.maximum(x - z, 1e-300), math.inf)
            first = int(ratios.argmin())  # the first coefficient to reach zero on the way to z
            x = np.maximum(x + float(ratios[first]) * (z - x), 0.0)
            x[first] = 0.0
            free &= x > 0
            if not free.any():
                break
    return x
