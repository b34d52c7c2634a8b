"""A step-time model: how long an engine step takes as a function of the step's work.

    seconds = intercept + Σ coefficient[f] * work[f]

over five work features of a step (`FEATURES`), fitted by least squares (numpy) to the
step wall times a real run recorded, or given by hand for a trace without timings (a
simulated one). `replays.whatif` advances its clock with it. docs/whatif.md describes the
form, the fit and its limits.

This module reads the trace schema only; it does not import the engine.
"""

from __future__ import annotations

import json
import math
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from engine.errors import UserError

# What a step does, from each scheduled entry's (num_tokens, num_spec_tokens,
# num_computed_before). An entry whose query is one token is a decode (a speculative one
# verifies drafts on top); any other query is prefill work.
FEATURES = (
    "prefill_tokens",  # query tokens of the entries that are not decodes
    "decode_requests",  # entries whose query is one token (plus drafts)
    "spec_tokens",  # draft tokens verified
    "context_tokens",  # attended context: Σ (computed before + scheduled) over entries
    "num_requests",  # scheduled entries
)
MIN_STEP_NS = 1_000  # a step takes at least 1 µs: the clock must move even on empty steps
OUTLIER_MADS = 5.0  # residuals beyond this many (scaled) median absolute deviations are dropped
OUTLIER_ROUNDS = 8  # refits with the outliers of the previous fit left out, until stable
OUTLIER_MIN = 0.25  # ... but never one within 25% of its prediction (a clean fit has tiny MADs)
HOLDOUT_EVERY = 5  # every 5th fitted step is held out, predicted by a fit on the others
# Below this held-out R², whatif and sweep warn and mark their predictions (docs/whatif.md):
# the model explains less than half of the steps' variation it did not see.
TRUST_R2 = 0.5


def step_work(entries: Iterable[tuple[int, int, int]]) -> tuple[int, int, int, int, int]:
    """The FEATURES of one step, from (num_tokens, num_spec_tokens, num_computed_before)
    of each scheduled entry."""
    prefill = decodes = spec = context = n = 0
    for num_tokens, num_spec, before in entries:
        n += 1
        spec += num_spec
        context += before + num_tokens
        query = num_tokens - num_spec
        if query == 1:
            decodes += 1
        else:
            prefill += query
    return prefill, decodes, spec, context, n


class CostModelError(UserError, ValueError):
    """A model that cannot be fitted, parsed or loaded."""


@dataclass(frozen=True)
class FitQuality:
    """How well a fitted model explains the steps it was fitted on."""

    source: str  # the trace it was fitted on
    num_steps: int  # steps in the fit (outliers excluded)
    num_outliers: int  # steps dropped as outliers before the final fit
    num_excluded: int  # steps with no measurable duration (the engine was idle before them)
    r2: float  # coefficient of determination on the fitted steps
    rmse_s: float  # root-mean-square error per step, seconds
    mape: float  # mean of |predicted - measured| / measured over the fitted steps
    mean_step_s: float  # mean measured step time, seconds
    holdout_r2: float | None = None  # R² on held-out steps (None: too few steps to hold out)
    holdout_mape: float | None = None  # mean relative error on held-out steps
    num_holdout: int = 0  # steps held out (every HOLDOUT_EVERY-th fitted step)

    @property
    def trust_r2(self) -> float:
        """The R² that says how far to trust predictions: the held-out one where there is
        one (a fit always explains its own steps better than new ones)."""
        return self.r2 if self.holdout_r2 is None else self.holdout_r2


@dataclass(frozen=True)
class CostModel:
    """seconds = intercept_s + Σ coefficients[f] * work[f] (floored at MIN_STEP_NS)."""

    intercept_s: float  # a step's fixed cost, seconds
    coefficients: dict[str, float] = field(default_factory=dict)  # feature -> seconds per unit
    fit: FitQuality | None = None  # None: given by hand, not fitted
    # The engine's first step's one-time cost beyond the model (the C kernel's load, the
    # weights' first touch, the allocator's first blocks), seconds: charged once, to the
    # first step of a run from its start (predict_ns(work, first=True)).
    warmup_s: float = 0.0
    # Derived, not compared: predict_ns runs once per simulated step and reads it each time.
    _vector: tuple[float, ...] = field(init=False, repr=False, compare=False, default=())

    def __post_init__(self) -> None:
        unknown = sorted(set(self.coefficients) - set(FEATURES))
        if unknown:
            raise CostModelError(
                f"unknown feature(s) {', '.join(unknown)}; "
                f"known: intercept, warmup, {', '.join(FEATURES)}"
            )
        values = [self.intercept_s, self.warmup_s, *self.coefficients.values()]
        if not all(isinstance(v, int | float) and math.isfinite(v) for v in values):
            raise CostModelError(f"coefficients must be finite numbers, got {values}")
        # Every feature present, in FEATURES order: equal models compare equal.
        full = {f: float(self.coefficients.get(f, 0.0)) for f in FEATURES}
        object.__setattr__(self, "coefficients", full)
        object.__setattr__(self, "_vector", (self.intercept_s, *full.values()))

    @property
    def vector(self) -> tuple[float, ...]:
        """(intercept, coefficient of each FEATURE in order), seconds."""
        return self._vector

    def predict_ns(self, work: Sequence[int], first: bool = False) -> int:
        """The predicted duration of a step with this work, integer ns; `first`: the
        engine's first step, which pays the warm-up too."""
        c = self._vector
        s = c[0] + c[1] * work[0] + c[2] * work[1] + c[3] * work[2] + c[4] * work[3]
        s += c[5] * work[4]
        if first:
            s += self.warmup_s
        return max(MIN_STEP_NS, round(s * 1e9))

    def predict_many_ns(self, work: np.ndarray) -> np.ndarray:
        """predict_ns for each row of an (n, 5) work array; the same integers."""
        return np.array([self.predict_ns(row) for row in work.tolist()], dtype=np.int64)

    def to_json(self) -> dict[str, Any]:
        out: dict[str, Any] = {
            "form": "linear",
            "unit": "s",
            "intercept": self.intercept_s,
            "coefficients": {f: self.coefficients.get(f, 0.0) for f in FEATURES},
            "warmup": self.warmup_s,
        }
        if self.fit is not None:
            out["fit"] = self.fit.__dict__.copy()
        return out

    @classmethod
    def from_json(cls, data: Any, where: str = "model") -> CostModel:
        if not isinstance(data, dict) or data.get("form", "linear") != "linear":
            raise CostModelError(f"{where}: expected a linear cost model object")
        coef = data.get("coefficients", {})
        if not isinstance(coef, dict):
            raise CostModelError(f"{where}: 'coefficients' must be an object")
        try:
            fit = FitQuality(**data["fit"]) if isinstance(data.get("fit"), dict) else None
            return cls(
                float(data.get("intercept", 0.0)),
                {k: float(v) for k, v in coef.items()},
                fit,
                float(data.get("warmup", 0.0)),
            )
        except (TypeError, ValueError) as e:  # CostModelError is a ValueError too
            raise CostModelError(f"{where}: {e}") from None


def parse_model(spec: str) -> CostModel:
    """A model from a JSON file (as `schedtop stats --cost-model --json` prints it) or
    from `intercept=S,FEATURE=S,...` (seconds; features not named cost nothing)."""
    path = Path(spec)
    if path.is_file():
        try:
            return CostModel.from_json(json.loads(path.read_text()), str(path))
        except (OSError, UnicodeDecodeError, json.JSONDecodeError) as e:
            raise CostModelError(f"{path}: not a cost model file: {e}") from None
    if "=" not in spec:
        raise CostModelError(
            f"--model {spec!r}: neither a file nor intercept=S,FEATURE=S,... "
            f"(features: {', '.join(FEATURES)})"
        )
    intercept = warmup = 0.0
    coef: dict[str, float] = {}
    for part in filter(None, (p.strip() for p in spec.split(","))):
        key, sep, value = part.partition("=")
        try:
            number = float(value)
        except ValueError:
            raise CostModelError(f"--model: {part!r}: {value!r} is not a number") from None
        if not sep:
            raise CostModelError(f"--model: {part!r} is not KEY=SECONDS")
        if key.strip() == "intercept":
            intercept = number
        elif key.strip() == "warmup":
            warmup = number
        else:
            coef[key.strip()] = number
    return CostModel(intercept, coef, warmup_s=warmup)


def fit_model(
    work: np.ndarray,
    seconds: np.ndarray,
    source: str,
    excluded: int = 0,
    warmup: bool = False,
) -> CostModel:
    """Least squares of step seconds on [1, work] (work: (n, 5) FEATURES). Plain
    (absolute) least squares, because what the model feeds are sums of step times (a TTFT
    spans many steps), and it keeps those sums unbiased.

    Two refinements keep the model usable outside the fitted range: a feature whose
    coefficient comes out negative is dropped and the rest refitted (more work never makes
    a step faster; a negative term is collinearity, not physics), and steps whose residual
    relative to their own duration exceeds OUTLIER_MADS scaled MADs (and OUTLIER_MIN) are
    left out, refitting until the set is stable (a
    thread-count probe, another process on the machine) before the final fit.

    `warmup`: row 0 is the engine's first step, which pays one-time costs the work does
    not explain (seconds of them on a CPU: the kernel's load, the weights' first touch).
    It is left out of the fit (counted as excluded), and its time beyond the fit is the
    model's `warmup_s`, charged to the first step of a predicted run: without it a
    predicted run's first step ends seconds early, and the requests that arrived during
    the real one join other steps (docs/whatif.md)."""
    first: tuple[np.ndarray, float] | None = None
    if warmup and len(seconds) > 2:
        first = (work[0].astype(np.float64), float(seconds[0]))
        work, seconds, excluded = work[1:], seconds[1:], excluded + 1
    n = len(seconds)
    if n < 2:
        raise CostModelError(
            f"{source}: {n} timed step(s) to fit on; a cost model needs at least 2 "
            "(a simulated trace has none: give one with --model)"
        )
    x = np.hstack([np.ones((n, 1)), work.astype(np.float64)])
    y = np.maximum(seconds.astype(np.float64), MIN_STEP_NS / 1e9)
    keep = np.ones(n, dtype=bool)
    coef = _nonneg_lstsq(x, y)
    for _ in range(OUTLIER_ROUNDS):
        rel = (x @ coef - y) / y
        mad = float(np.median(np.abs(rel - np.median(rel)))) * 1.4826
        now = np.abs(rel - np.median(rel)) <= max(OUTLIER_MADS * mad, OUTLIER_MIN)
        if now.sum() < 2 or (now == keep).all():
            break
        keep = now
        coef = _nonneg_lstsq(x[keep], y[keep])
    xk, yk = x[keep], y[keep]
    pred = xk @ coef
    ss_res = float(((yk - pred) ** 2).sum())
    ss_tot = float(((yk - yk.mean()) ** 2).sum())
    quality = FitQuality(
        source=source,
        num_steps=int(keep.sum()),
        num_outliers=int(n - keep.sum()),
        num_excluded=excluded,
        r2=1.0 - ss_res / ss_tot if ss_tot > 0 else 1.0,
        rmse_s=math.sqrt(ss_res / len(yk)),
        mape=float((np.abs(yk - pred) / yk).mean()),
        mean_step_s=float(yk.mean()),
        **_holdout(xk, yk),
    )
    extra = 0.0
    if first is not None:
        extra = max(0.0, first[1] - float(coef[0] + first[0] @ coef[1:]))
    return CostModel(
        float(coef[0]), {f: float(coef[i + 1]) for i, f in enumerate(FEATURES)}, quality, extra
    )


def _holdout(x: np.ndarray, y: np.ndarray) -> dict[str, Any]:
    """The fit's quality on steps it did not see: every HOLDOUT_EVERY-th step held out,
    predicted by a fit (the same constraints) on the others."""
    n = len(y)
    if n < 2 * HOLDOUT_EVERY:
        return {}
    test = np.arange(n) % HOLDOUT_EVERY == HOLDOUT_EVERY - 1
    coef = _nonneg_lstsq(x[~test], y[~test])
    yt, pred = y[test], x[test] @ coef
    ss_tot = float(((yt - yt.mean()) ** 2).sum())
    ss_res = float(((yt - pred) ** 2).sum())
    return {
        "holdout_r2": 1.0 - ss_res / ss_tot if ss_tot > 0 else 1.0,
        "holdout_mape": float((np.abs(yt - pred) / yt).mean()),
        "num_holdout": int(test.sum()),
    }


def trust_warning(m: CostModel) -> str | None:
    """A warning when a fitted model explains too little of its steps to be trusted."""
    q = m.fit
    if q is None or q.trust_r2 >= TRUST_R2:
        return None
    which = "held-out " if q.holdout_r2 is not None else ""
    return (
        f"the step-time model's {which}R² is {q.trust_r2:.3f} (below {TRUST_R2}; fitted on "
        f"{q.source}): its predictions are rough; --min-r2 or --strict refuse them"
    )


def _nonneg_lstsq(x: np.ndarray, y: np.ndarray) -> np.ndarray:
    """Least squares with every feature's coefficient >= 0 (the intercept is free), by
    dropping the most negative one and refitting until none is; columns that never vary
    from 0 are left out from the start (their coefficient is 0)."""
    active = [j for j in range(1, x.shape[1]) if np.any(x[:, j] != 0)]
    while True:
        cols = [0, *active]
        sol = np.linalg.lstsq(x[:, cols], y, rcond=None)[0]
        coef = np.zeros(x.shape[1])
        coef[cols] = sol
        negative = [j for j in active if coef[j] < 0]
        if not negative:
            return coef
        active.remove(min(negative, key=lambda j: coef[j]))


def format_model(m: CostModel) -> str:
    """The model as a few lines: its formula, then its fit quality."""
    units = {
        "prefill_tokens": "per prefill token",
        "decode_requests": "per decode",
        "spec_tokens": "per draft token",
        "context_tokens": "per context token",
        "num_requests": "per request",
    }
    lines = [
        "step time = intercept + Σ coefficient × work",
        f"  intercept        {_us(m.intercept_s)}",
    ]
    for f in FEATURES:
        lines.append(f"  {f:<16} {_us(m.coefficients.get(f, 0.0))} {units[f]}")
    if m.warmup_s:
        lines.append(f"  warm-up          {_us(m.warmup_s)} once, on the engine's first step")
    q = m.fit
    if q is None:
        lines.append("given, not fitted")
    else:
        lines.append(
            f"fitted on {q.num_steps} steps of {q.source} ({q.num_outliers} outliers dropped, "
            f"{q.num_excluded} left out: the engine's first step, steps after unmeasured idle)"
        )
        lines.append(
            f"R² {q.r2:.3f}   RMSE {q.rmse_s * 1e3:.2f} ms   mean relative error "
            f"{q.mape:.1%}   mean step {q.mean_step_s * 1e3:.2f} ms"
        )
        if q.holdout_r2 is not None and q.holdout_mape is not None:
            lines.append(
                f"held out: R² {q.holdout_r2:.3f}   mean relative error {q.holdout_mape:.1%}   "
                f"({q.num_holdout} steps, every {HOLDOUT_EVERY}th, predicted by a fit on "
                "the others)"
            )
        if q.trust_r2 < TRUST_R2:
            lines.append(f"untrusted: R² below {TRUST_R2} (docs/whatif.md)")
    return "\n".join(lines)


def _us(seconds: float) -> str:
    return f"{seconds * 1e6:12.3f} µs"
