"""The statistics of the empirical DP audits: from releases of a mechanism on a worst-case pair of neighbouring
inputs to a statistically honest lower bound on its epsilon.

Test 1, a black-box threshold test (:func:`audit_samples` on releases already drawn, :func:`audit_mechanism` drawing
them): Clopper-Pearson bounds (:func:`clopper_pearson`) on its false-positive and false-negative rates give a lower
bound on epsilon. Test 2, a delta-violation test at the claimed epsilon (:func:`audit_delta`). Results:
:class:`AuditResult`, :class:`DeltaAudit`. The mechanisms audited are in :mod:`attacks.audit_mechanisms`, the audits
of ``privfl attack audit`` in :mod:`attacks.audit`.

The two tests' statistics: docs/attacks.md, "Empirical DP audits".
"""

from __future__ import annotations

import math
import numbers
from collections.abc import Callable
from dataclasses import asdict, dataclass

import numpy as np
from scipy import stats

from accounting.validation import is_real

__all__ = ["AuditResult", "DeltaAudit", "audit_delta", "audit_error", "audit_mechanism", "audit_samples",
           "check_confidence", "check_delta", "check_epsilon", "check_trials", "clopper_pearson"]

_MIN_TRIALS = 10
_UPPER = "say D if score > t"
_LOWER = "say D' if score <= t"


# -- validation -----------------------------------------------------------------------------------------------------

def audit_error(message: str) -> ValueError:
    """The error of a bad audit input: the project's ConfigError (a ValueError)."""
    try:  # the project's user error (CLI exit status 2) when available; it is a ValueError either way
        from privfl.errors import ConfigError
        return ConfigError(message)
    except ImportError:  # pragma: no cover
        return ValueError(message)


def check_trials(trials: object) -> int:
    if isinstance(trials, bool) or not isinstance(trials, numbers.Integral) or trials < _MIN_TRIALS:
        raise audit_error(f"trials must be an int >= {_MIN_TRIALS} (releases per neighbouring input), got {trials!r}")
    return int(trials)


def check_epsilon(epsilon: object) -> float:
    if isinstance(epsilon, bool) or not isinstance(epsilon, numbers.Real) or not math.isfinite(epsilon) \
            or epsilon <= 0:
        raise audit_error(f"epsilon must be a finite number > 0 (natural log), got {epsilon!r}")
    return float(epsilon)


def check_delta(delta: object) -> float:
    if not is_real(delta) or not 0 <= delta < 1:
        raise audit_error(f"delta must be a probability in [0, 1), got {delta!r}")
    return float(delta)


def check_confidence(confidence: object) -> float:
    if not is_real(confidence) or not 0 < confidence < 1:
        raise audit_error(f"confidence must be in the open interval (0, 1), got {confidence!r}")
    return float(confidence)


# -- statistics -----------------------------------------------------------------------------------------------------

def clopper_pearson(k, n, confidence: float = 0.95) -> tuple[np.ndarray | float, np.ndarray | float]:
    """Two-sided Clopper-Pearson (exact binomial) interval for a proportion: ``k`` successes in ``n`` trials.

    ``lower = Beta(alpha/2; k, n - k + 1)`` quantile (0 when k = 0), ``upper = Beta(1 - alpha/2; k + 1, n - k)``
    quantile (1 when k = n), ``alpha = 1 - confidence``; each side alone holds with probability >= 1 - alpha/2.
    Works elementwise on arrays; returns floats for scalar input.

    >>> lo, hi = clopper_pearson(0, 100)
    >>> lo, round(hi, 4)
    (0.0, 0.0362)
    """
    confidence = check_confidence(confidence)
    k_arr, n_arr = np.asarray(k, dtype=float), np.asarray(n, dtype=float)
    if np.any(n_arr < 1) or np.any(k_arr < 0) or np.any(k_arr > n_arr) or np.any(k_arr != np.round(k_arr)):
        raise audit_error(f"clopper_pearson needs integer counts 0 <= k <= n with n >= 1, got k={k!r}, n={n!r}")
    alpha = 1.0 - confidence
    with np.errstate(invalid="ignore", divide="ignore"):
        lower = np.where(k_arr > 0, stats.beta.ppf(alpha / 2, k_arr, n_arr - k_arr + 1), 0.0)
        upper = np.where(k_arr < n_arr, stats.beta.ppf(1 - alpha / 2, k_arr + 1, n_arr - k_arr), 1.0)
    if lower.ndim == 0:
        return float(lower), float(upper)
    return lower, upper


def _eps_from_rates(fpr, fnr, delta: float):
    """``ln((1 - delta - fnr) / fpr)`` elementwise, -inf where the numerator is <= 0, +inf where fpr = 0."""
    fpr, fnr = np.asarray(fpr, dtype=float), np.asarray(fnr, dtype=float)
    num = 1.0 - delta - fnr
    with np.errstate(divide="ignore", invalid="ignore"):
        out = np.where(num > 0, np.log(np.where(num > 0, num, 1.0)) - np.log(fpr), -np.inf)
    return out


# -- results --------------------------------------------------------------------------------------------------------

@dataclass(frozen=True)
class DeltaAudit:
    """A delta-violation test at fixed epsilon (module docstring, test 2).

    ``delta_lower`` is a lower confidence bound on ``Pr[M(D) in S] - e^eps Pr[M(D') in S]`` for ``S = {score >
    threshold}``; the claim (epsilon, delta_claimed) is violated (with probability >= confidence of being right,
    given the Gaussian model of the D' tail) when ``delta_lower > delta_claimed``.
    """

    epsilon: float
    delta_claimed: float
    delta_lower: float
    p_d_lower: float
    p_d_prime_upper: float
    threshold: float
    confidence: float
    trials: int
    model: str = "gaussian tail of the score under D' (white-box assumption)"

    @property
    def violated(self) -> bool:
        return self.delta_lower > self.delta_claimed

    def to_dict(self) -> dict:
        return {**asdict(self), "violated": self.violated}


@dataclass(frozen=True)
class AuditResult:
    """An empirical lower bound on epsilon beside the claimed epsilon.

    Attributes:
        epsilon_lower: lower confidence bound on the true epsilon (>= 0; 0 when no test beats chance).
        epsilon_claimed: the epsilon the mechanism claims.
        delta: the delta the bound is computed at (the claimed delta).
        trials: releases per neighbouring input (half select the test, half evaluate it).
        fpr, fnr: the chosen test's false-positive / false-negative rates on the evaluation half (point estimates,
            in the direction of the test that gave the bound).
        threshold: the threshold of that test on the score, oriented (sign chosen on the selection half) so that D
            scores high.
        ratio: ``epsilon_lower / epsilon_claimed``; above 1 is an empirical violation of the claim.
        epsilon_point: the same formula on the raw (not upper-bounded) rates: an estimate, not a bound.
        fpr_upper, fnr_upper: the Clopper-Pearson upper bounds used.
        confidence: the confidence of the bound.
        direction: ``"say D if score > t"`` or ``"say D' if score <= t"`` (the swapped test).
        delta_audit: the delta-violation test at the claimed epsilon, if run.
        audited: what was audited: ``"whole release"``, or the one block of a composed release (then
            ``epsilon_claimed`` is that block's own epsilon at ``delta``, the release's delta).
        epsilon_release, delta_release: the whole release's claimed (epsilon, delta) when only a block was audited
            (NaN otherwise: then the release's claim is ``epsilon_claimed``).
    """

    epsilon_lower: float
    epsilon_claimed: float
    delta: float
    trials: int
    fpr: float
    fnr: float
    threshold: float
    ratio: float
    epsilon_point: float = float("nan")
    fpr_upper: float = float("nan")
    fnr_upper: float = float("nan")
    confidence: float = 0.95
    direction: str = _UPPER
    delta_audit: DeltaAudit | None = None
    audited: str = "whole release"
    epsilon_release: float = float("nan")
    delta_release: float = float("nan")

    @property
    def violated(self) -> bool:
        """True when the audit shows the claim is false: eps_lb > claimed eps, or the delta test rejects."""
        return self.epsilon_lower > self.epsilon_claimed or (self.delta_audit is not None and self.delta_audit.violated)

    @property
    def verdict(self) -> str:
        if self.epsilon_lower > self.epsilon_claimed:
            return "VIOLATION (eps_lb > claimed eps)"
        if self.delta_audit is not None and self.delta_audit.violated:
            return "VIOLATION (delta at claimed eps > claimed delta)"
        return "consistent with claim"

    def to_dict(self) -> dict:
        out = asdict(self)
        out["delta_audit"] = None if self.delta_audit is None else self.delta_audit.to_dict()
        out["violated"] = self.violated
        out["verdict"] = self.verdict
        return {k: (None if isinstance(v, float) and math.isnan(v) else v) for k, v in out.items()}


# -- the audit itself -----------------------------------------------------------------------------------------------

def _as_2d(releases, name: str) -> np.ndarray:
    arr = np.asarray(releases, dtype=float)
    if arr.ndim == 1:
        arr = arr[:, None]
    if arr.ndim != 2 or not np.all(np.isfinite(arr)):
        raise audit_error(f"{name} must be finite releases of shape [trials, dim], got shape {arr.shape}")
    return arr


def _scores(x_d: np.ndarray, x_dp: np.ndarray, statistic) -> tuple[np.ndarray, np.ndarray, tuple]:
    """Split each side in halves (A: select, B: evaluate) and reduce releases to scalar scores."""
    half = x_d.shape[0] // 2
    a1, b1, a0, b0 = x_d[:half], x_d[half:], x_dp[:half], x_dp[half:]
    if statistic is None:
        w = a1.mean(axis=0) - a0.mean(axis=0)  # direction of the mean difference, from the held-out half only
        if not np.any(w):
            w = np.ones(x_d.shape[1])
        score = lambda x: x @ w  # noqa: E731
    elif callable(statistic):
        score = lambda x: np.asarray(statistic(x), dtype=float).reshape(x.shape[0])  # noqa: E731
    else:
        w = np.asarray(statistic, dtype=float).reshape(-1)
        if w.shape[0] != x_d.shape[1]:
            raise audit_error(f"statistic direction has {w.shape[0]} entries, releases have dim {x_d.shape[1]}")
        score = lambda x: x @ w  # noqa: E731
    s1a, s0a, s1b, s0b = score(a1), score(a0), score(b1), score(b0)
    if s1a.mean() < s0a.mean():  # orient on the selection half so that D scores high (the tests below assume it)
        s1a, s0a, s1b, s0b = -s1a, -s0a, -s1b, -s0b
    return s1a, s0a, (s1b, s0b)


def _best_test(s1: np.ndarray, s0: np.ndarray, delta: float, confidence: float) -> tuple[float, str]:
    """Scan thresholds on the selection half; return the (threshold, direction) with the largest CP eps bound."""
    pooled = np.concatenate([s1, s0])
    qs = np.quantile(pooled, np.linspace(0.0, 1.0, 401))
    edges = [s0.max(), s1.min(), s1.max(), s0.min(), (s0.max() + s1.min()) / 2, (s1.max() + s0.min()) / 2]
    cands = np.unique(np.concatenate([qs, edges]))
    s1s, s0s = np.sort(s1), np.sort(s0)
    n1, n0 = len(s1), len(s0)
    fn = np.searchsorted(s1s, cands, side="right")          # #(s1 <= t)
    fp = n0 - np.searchsorted(s0s, cands, side="right")     # #(s0 > t)
    _, fpr_u = clopper_pearson(fp, n0, confidence)
    _, fnr_u = clopper_pearson(fn, n1, confidence)
    e_fwd = _eps_from_rates(fpr_u, fnr_u, delta)
    e_bwd = _eps_from_rates(fnr_u, fpr_u, delta)
    def middle_of_best(e):  # among tied thresholds, the middle one (not the edge of the selection half's data)
        best = np.flatnonzero(e == e.max())
        return int(best[len(best) // 2])

    i, j = middle_of_best(e_fwd), middle_of_best(e_bwd)
    if e_fwd[i] >= e_bwd[j]:
        return float(cands[i]), _UPPER
    return float(cands[j]), _LOWER


def audit_samples(releases_d, releases_d_prime, *, epsilon_claimed: float, delta: float, confidence: float = 0.95,
                  statistic=None, delta_test: bool = True) -> AuditResult:
    """The audit of :func:`audit_mechanism` on releases already drawn: arrays ``[trials, dim]`` (or ``[trials]``).

    The first half of each array selects the score direction, threshold and direction of the test; the second half
    evaluates it (module docstring, test 1). With ``delta_test`` the delta-violation test at ``epsilon_claimed``
    is run on the same split (test 2).
    """
    epsilon_claimed = check_epsilon(epsilon_claimed)
    delta = check_delta(delta)
    confidence = check_confidence(confidence)
    x_d, x_dp = _as_2d(releases_d, "releases_d"), _as_2d(releases_d_prime, "releases_d_prime")
    if x_d.shape != x_dp.shape:
        raise audit_error(f"releases_d and releases_d_prime must have the same shape, got {x_d.shape} and {x_dp.shape}")
    trials = check_trials(x_d.shape[0])
    s1a, s0a, (s1b, s0b) = _scores(x_d, x_dp, statistic)
    threshold, direction = _best_test(s1a, s0a, delta, confidence)
    n1, n0 = len(s1b), len(s0b)
    fp, fn = int(np.sum(s0b > threshold)), int(np.sum(s1b <= threshold))
    if direction == _LOWER:  # say D' when score <= t: false positives are D's scores <= t, misses D' scores > t
        fp, fn = int(np.sum(s1b <= threshold)), int(np.sum(s0b > threshold))
    _, fpr_u = clopper_pearson(fp, n0, confidence)
    _, fnr_u = clopper_pearson(fn, n1, confidence)
    eps_lb = max(0.0, float(_eps_from_rates(fpr_u, fnr_u, delta)))
    eps_point = float(_eps_from_rates(fp / n0, fn / n1, delta))
    d_audit = None
    if delta_test:
        d_audit = _delta_test(s1a, s0a, s1b, s0b, epsilon_claimed, delta, confidence, trials)
    return AuditResult(epsilon_lower=eps_lb, epsilon_claimed=epsilon_claimed, delta=delta, trials=trials,
                       fpr=fp / n0, fnr=fn / n1, threshold=threshold, ratio=eps_lb / epsilon_claimed,
                       epsilon_point=eps_point, fpr_upper=float(fpr_u), fnr_upper=float(fnr_u),
                       confidence=confidence, direction=direction, delta_audit=d_audit)


def _delta_test(s1a, s0a, s1b, s0b, epsilon: float, delta: float, confidence: float, trials: int) -> DeltaAudit:
    # Threshold on the selection half: where the fitted Gaussian likelihood ratio equals e^eps (the optimal tail set).
    m1, m0 = float(s1a.mean()), float(s0a.mean())
    sd = float(np.sqrt(0.5 * (s1a.var(ddof=1) + s0a.var(ddof=1))))
    if m1 < m0:  # orient the score so that D is the upper tail
        s1a, s0a, s1b, s0b, m1, m0 = -s1a, -s0a, -s1b, -s0b, -m1, -m0
    gap = m1 - m0
    threshold = (m0 + m1) / 2 + epsilon * sd * sd / gap if gap > 0 and sd > 0 else math.inf
    alpha = (1.0 - confidence) / 3.0  # Bonferroni over three one-sided bounds
    n1, n0 = len(s1b), len(s0b)
    k1 = int(np.sum(s1b > threshold))
    p1_lower = float(stats.beta.ppf(alpha, k1, n1 - k1 + 1)) if k1 > 0 else 0.0
    mean0, sd0 = float(s0b.mean()), float(s0b.std(ddof=1))
    mean0_upper = mean0 + float(stats.norm.ppf(1 - alpha)) * sd0 / math.sqrt(n0)
    sd0_upper = sd0 * math.sqrt((n0 - 1) / float(stats.chi2.ppf(alpha, n0 - 1)))
    if not math.isfinite(threshold) or sd0_upper <= 0:
        log_p0 = -math.inf if math.isfinite(threshold) or threshold > 0 else 0.0
    else:
        log_p0 = float(stats.norm.logsf((threshold - mean0_upper) / sd0_upper))
    p0_upper = math.exp(log_p0)
    scaled = math.exp(min(epsilon + log_p0, 700.0))
    return DeltaAudit(epsilon=epsilon, delta_claimed=delta, delta_lower=p1_lower - scaled, p_d_lower=p1_lower,
                      p_d_prime_upper=p0_upper, threshold=float(threshold), confidence=confidence, trials=trials)


def audit_delta(releases_d, releases_d_prime, *, epsilon: float, delta: float, confidence: float = 0.95,
                statistic=None) -> DeltaAudit:
    """Delta-violation test at fixed ``epsilon`` on releases ``[trials, dim]`` (module docstring, test 2)."""
    result = audit_samples(releases_d, releases_d_prime, epsilon_claimed=epsilon, delta=delta, confidence=confidence,
                           statistic=statistic, delta_test=True)
    assert result.delta_audit is not None   # delta_test=True makes it
    return result.delta_audit


def audit_mechanism(sample_d: Callable[[], object], sample_d_prime: Callable[[], object], *, trials: int,
                    delta: float, epsilon_claimed: float = math.inf, confidence: float = 0.95,
                    threshold: float | None = None, statistic=None, delta_test: bool = True) -> AuditResult:
    """Run a mechanism ``trials`` times on each of a worst-case neighbouring pair and bound its epsilon from below.

    Args:
        sample_d, sample_d_prime: callables, each call one fresh release of M(D) / M(D') (numpy-convertible vector).
        trials: releases per input (>= 10); half select the test, half evaluate it.
        delta: the claimed delta; the bound is ``eps_lb = max over directions ln((1 - delta - FNR_upper) /
            FPR_upper)`` with Clopper-Pearson upper bounds (see the module docstring for the assumptions).
        epsilon_claimed: the claimed epsilon, for the ratio and the verdict (default inf: no claim; then no delta
            test is run and the ratio is 0).
        confidence: confidence of the bound.
        threshold: a fixed threshold on the score instead of the scan (then the selection half only fixes the
            score direction).
        statistic: ``None`` (projection on the held-out mean difference), a direction vector, or a callable mapping
            ``[k, dim]`` releases to ``[k]`` scores.

    Returns:
        an :class:`AuditResult`.
    """
    trials = check_trials(trials)
    delta = check_delta(delta)
    x_d = np.stack([np.asarray(sample_d(), dtype=float).reshape(-1) for _ in range(trials)])
    x_dp = np.stack([np.asarray(sample_d_prime(), dtype=float).reshape(-1) for _ in range(trials)])
    claimed = math.inf if epsilon_claimed is None else float(epsilon_claimed)
    finite_claim = math.isfinite(claimed)
    result = audit_samples(x_d, x_dp, epsilon_claimed=claimed if finite_claim else 1.0, delta=delta,
                           confidence=confidence, statistic=statistic, delta_test=delta_test and finite_claim)
    if threshold is not None:
        result = _fixed_threshold(x_d, x_dp, float(threshold), result, statistic)
    if not finite_claim:
        result = AuditResult(**{**{f: getattr(result, f) for f in result.__dataclass_fields__},
                                "epsilon_claimed": math.inf, "ratio": 0.0, "delta_audit": None})
    return result


def _fixed_threshold(x_d, x_dp, threshold: float, result: AuditResult, statistic) -> AuditResult:
    _, _, (s1b, s0b) = _scores(x_d, x_dp, statistic)
    n1, n0 = len(s1b), len(s0b)
    best = None
    for direction, fp, fn in ((_UPPER, int(np.sum(s0b > threshold)), int(np.sum(s1b <= threshold))),
                              (_LOWER, int(np.sum(s1b <= threshold)), int(np.sum(s0b > threshold)))):
        # both directions are evaluated on the same half: split the confidence between them (Bonferroni)
        conf = 1.0 - (1.0 - result.confidence) / 2
        _, fpr_u = clopper_pearson(fp, n0, conf)
        _, fnr_u = clopper_pearson(fn, n1, conf)
        eps = max(0.0, float(_eps_from_rates(fpr_u, fnr_u, result.delta)))
        if best is None or eps > best[0]:
            best = (eps, direction, fp / n0, fn / n1, float(fpr_u), float(fnr_u))
    assert best is not None   # both directions were evaluated
    eps, direction, fpr, fnr, fpr_u, fnr_u = best
    return AuditResult(epsilon_lower=eps, epsilon_claimed=result.epsilon_claimed, delta=result.delta,
                       trials=result.trials, fpr=fpr, fnr=fnr, threshold=threshold,
                       ratio=eps / result.epsilon_claimed, epsilon_point=float(_eps_from_rates(fpr, fnr, result.delta)),
                       fpr_upper=fpr_u, fnr_upper=fnr_u, confidence=result.confidence, direction=direction,
                       delta_audit=result.delta_audit)
