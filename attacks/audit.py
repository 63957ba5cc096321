"""Empirical DP audits: a statistically honest lower bound on epsilon for a mechanism, set beside its claim.

Two tests on releases of the mechanism on a worst-case pair of neighbouring inputs: a black-box threshold test
(:func:`audit_mechanism`, :func:`audit_samples`; Clopper-Pearson bounds on the false-positive and false-negative
rates give a lower bound on epsilon) and a delta-violation test at the claimed epsilon (:func:`audit_delta`).
:func:`audit_dp_gmm` audits one block of a jointly calibrated DP-GMM release; :func:`audit_privatize` and
:func:`run_audit` run the audits of ``privfl attack audit`` (:func:`audit_parser`, :func:`audit_main`).

The two tests' statistics and the DP-GMM block audit: docs/attacks.md, "Empirical DP audits".
"""

from __future__ import annotations

import argparse
import json
import math
import numbers
import sys
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass
from pathlib import Path

import numpy as np
from scipy import stats

from accounting.validation import is_int_at_least, is_real
from privfl.registry import Registry

__all__ = ["AuditResult", "DeltaAudit", "MECHANISMS", "audit_delta", "audit_dp_gmm", "audit_main", "audit_mechanism",
           "audit_privatize", "dp_gmm_worst_case_pair", "audit_samples", "clopper_pearson", "format_table", "run_audit",
           "worst_case_pair"]

_MIN_TRIALS = 10
_UPPER = "say D if score > t"
_LOWER = "say D' if score <= t"


# -- validation -----------------------------------------------------------------------------------------------------

def _err(message: str) -> ValueError:
    try:  # the project's user error (CLI exit status 2) when available; it is a ValueError either way
        from privfl.errors import ConfigError
        return ConfigError(message)
    except ImportError:  # pragma: no cover
        return ValueError(message)


def _check_trials(trials: object) -> int:
    if isinstance(trials, bool) or not isinstance(trials, numbers.Integral) or trials < _MIN_TRIALS:
        raise _err(f"trials must be an int >= {_MIN_TRIALS} (releases per neighbouring input), got {trials!r}")
    return int(trials)


def _check_epsilon(epsilon: object) -> float:
    if isinstance(epsilon, bool) or not isinstance(epsilon, numbers.Real) or not math.isfinite(epsilon) \
            or epsilon <= 0:
        raise _err(f"epsilon must be a finite number > 0 (natural log), got {epsilon!r}")
    return float(epsilon)


def _check_delta(delta: object) -> float:
    if not is_real(delta) or not 0 <= delta < 1:
        raise _err(f"delta must be a probability in [0, 1), got {delta!r}")
    return float(delta)


def _check_confidence(confidence: object) -> float:
    if not is_real(confidence) or not 0 < confidence < 1:
        raise _err(f"confidence must be in the open interval (0, 1), got {confidence!r}")
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
    confidence = _check_confidence(confidence)
    k_arr, n_arr = np.asarray(k, dtype=float), np.asarray(n, dtype=float)
    if np.any(n_arr < 1) or np.any(k_arr < 0) or np.any(k_arr > n_arr) or np.any(k_arr != np.round(k_arr)):
        raise _err(f"clopper_pearson needs integer counts 0 <= k <= n with n >= 1, got k={k!r}, n={n!r}")
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
        raise _err(f"{name} must be finite releases of shape [trials, dim], got shape {arr.shape}")
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
            raise _err(f"statistic direction has {w.shape[0]} entries, releases have dim {x_d.shape[1]}")
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
    epsilon_claimed = _check_epsilon(epsilon_claimed)
    delta = _check_delta(delta)
    confidence = _check_confidence(confidence)
    x_d, x_dp = _as_2d(releases_d, "releases_d"), _as_2d(releases_d_prime, "releases_d_prime")
    if x_d.shape != x_dp.shape:
        raise _err(f"releases_d and releases_d_prime must have the same shape, got {x_d.shape} and {x_dp.shape}")
    trials = _check_trials(x_d.shape[0])
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
    trials = _check_trials(trials)
    delta = _check_delta(delta)
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


# -- the mechanisms audited -----------------------------------------------------------------------------------------

def worst_case_pair(n: int, bound: float = 1.0):
    """A privatisable 1-D DeepSet and a replace-one pair whose clipped means differ by exactly ``2 * bound / n``.

    The encoder is a :class:`~privfl.models.set_encoders.DPDeepSetEncoder` whose ``phi`` is the identity on 1-D
    inputs (a bias-free ``Linear(1, 1)`` with weight 1) and whose ``psi`` is the identity, so the released descriptor
    *is* the noisy clipped mean. ``D`` is ``n - 1`` zeros and one sample ``10 * bound`` (clipped to ``+bound``);
    ``D'`` replaces it by ``-10 * bound`` (clipped to ``-bound``).
    """
    import torch
    from torch import nn

    from privfl.models.set_encoders import DPDeepSetEncoder

    encoder = DPDeepSetEncoder(input_dim=1, hidden=1, output_dim=1)
    linear = nn.Linear(1, 1, bias=False)
    with torch.no_grad():
        linear.weight.fill_(1.0)
    encoder.phi = nn.Sequential(nn.Flatten(), linear)
    encoder.psi = nn.Identity()
    x_d = torch.zeros(n, 1)
    x_d[-1, 0] = 10.0 * bound
    x_dp = torch.zeros(n, 1)
    x_dp[-1, 0] = -10.0 * bound
    return encoder, x_d, x_dp


def _torch_generator(seed: int):
    import torch
    g = torch.Generator()
    g.manual_seed(int(seed))
    return g


def _privatize_releases(eps, delta, trials, bound, n, seed, vectorised):
    from privfl.privacy import privatize

    encoder, x_d, x_dp = worst_case_pair(n, bound)
    generator = _torch_generator(seed)
    private = privatize(encoder, eps, delta, bound=bound, relation="replace_one",
                                         noise="seeded", generator=generator)
    mean_d, mean_dp = private.clipped_mean(x_d), private.clipped_mean(x_dp)
    gap = float((mean_d - mean_dp).norm())
    if not math.isclose(gap, 2 * bound / n, rel_tol=1e-9):
        raise AssertionError(f"worst-case pair broken: clipped means differ by {gap}, not 2*bound/n")
    if not vectorised:  # the full release path, one call per release
        rd = np.stack([private.release(x_d)[0].double().numpy() for _ in range(trials)])
        rdp = np.stack([private.release(x_dp)[0].double().numpy() for _ in range(trials)])
        return rd, rdp
    # Vectorised: `trials` independent draws of exactly the noise release() adds (the same mechanism object, same
    # sigma, same add_noise), on the same clipped means; psi is the identity, so this is the released descriptor.
    mechanism = private.mechanism(n)
    rd = mechanism.add_noise(mean_d.expand(trials, -1).clone()).numpy()
    rdp = mechanism.add_noise(mean_dp.expand(trials, -1).clone()).numpy()
    return rd, rdp


def odpflhn_gradient_pair(n: int, bound: float = 1.0):
    """The worst-case add/remove-one pair of ODPFL-HN's record-level encoder-gradient release (stage 2 of a round,
    :meth:`privfl.methods.odpflhn.ODPFLHNClient._private_backprop`, the path a training client runs).

    The server chooses the encoder and the descriptor gradient: phi a bias-free ``Linear(2, 1)`` with weight
    ``[1, 0]``, psi the identity (so ``v = J_psi^T de = de``), ``de = [10]``. Record ``a = [0.9, 0]`` gives the
    per-record contribution ``de * a = [9, 0]``, clipped to ``[C, 0]``; ``b = -a`` gives ``[-C, 0]``. ``D`` is ``n``
    copies of ``a`` (``n`` = the public lower bound ``min_samples``), ``D'`` adds ``b``: the means of the clipped
    contributions are ``[C, 0]`` and ``[C (n - 1) / (n + 1), 0]``, ``2 C / (n + 1)`` apart, against the certified
    sensitivity ``2 C / n`` (n private, calibrated at ``min_samples``). Returns ``(encoder, x_d, x_dp, de)``.
    """
    import torch
    from torch import nn

    from privfl.models.set_encoders import DPDeepSetEncoder

    encoder = DPDeepSetEncoder(input_dim=2, hidden=1, output_dim=1)
    linear = nn.Linear(2, 1, bias=False)
    with torch.no_grad():
        linear.weight.copy_(torch.tensor([[1.0, 0.0]]))
    encoder.phi = nn.Sequential(nn.Flatten(), linear)
    encoder.psi = nn.Identity()
    record = torch.tensor([[0.9, 0.0]])
    x_d = record.repeat(n, 1)
    x_dp = torch.cat([x_d, -record])
    return encoder, x_d, x_dp, torch.tensor([10.0])


def _odpflhn_gradient_releases(eps, delta, trials, bound, n, seed, vectorised):
    """Releases of ODPFL-HN's encoder gradient on the worst-case pair (:func:`odpflhn_gradient_pair`), from the
    record-level client's own code at the noise multiplier whose single release is ``(eps, delta)``-DP
    (``bound`` is the per-record clip C, ``n`` the public ``min_samples``). Every release on D and on D' must carry
    the same event and the same sigma: a noise scale that depended on n would show here first."""
    import torch

    from accounting import analytic_gaussian_sigma
    from privfl.data import TrainingClient
    from privfl.federation.context import ClientContext
    from privfl.methods.base import ModelFactory
    from privfl.methods.odpflhn import ENCODER_GRADIENT_NOISE, NOISY_MEAN, ODPFLHNClient, ODPFLHNConfig
    from privfl.privacy.training import TrainingPrivacy

    encoder, x_d, x_dp, descriptor_grad = odpflhn_gradient_pair(n, bound)
    z = analytic_gaussian_sigma(eps, delta, 1.0)          # one Gaussian release of noise multiplier z is (eps, delta)
    privacy = TrainingPrivacy(mode="record", noise_multiplier=z, clip=float(bound), min_samples=n, noise="seeded",
                              noise_seed=int(seed))
    client = ODPFLHNClient(model_factory=ModelFactory("mlp2nn", (2,), 2), config=ODPFLHNConfig(embed_dim=1),
                           privacy=privacy)

    def release(x, round):
        data = TrainingClient(client_id=0, x_train=x, y_train=torch.zeros(len(x), dtype=torch.int64),
                              x_val=x[:0], y_val=torch.zeros(0, dtype=torch.int64))
        ctx = ClientContext(client_id=0, round=round, run_seed=0, rng=np.random.default_rng(round))
        state = {NOISY_MEAN: torch.zeros(1, dtype=torch.float64)}
        out = client._private_backprop(encoder, data, descriptor_grad, state, ctx)
        return out.message.arrays["phi.1.weight"].double().reshape(-1), out.event

    if not vectorised:
        rd, rdp, events = [], [], set()
        for t in range(trials):
            value, event = release(x_d, t)
            rd.append(value.numpy())
            events.add(event)
            value, event = release(x_dp, trials + t)
            rdp.append(value.numpy())
            events.add(event)
        if len(events) != 1:
            raise AssertionError(f"the releases on D and D' carry different events: {events}")
        return np.stack(rd), np.stack(rdp)
    # Vectorised: one release on each input with the same seeded noise gives each data term (release minus that
    # noise, drawn again from the same seed by the same mechanism); then `trials` draws of the mechanism's own noise
    value_d, event_d = release(x_d, 0)
    value_dp, event_dp = release(x_dp, 0)
    if event_d != event_dp:
        raise AssertionError(f"the releases on D and D' carry different events: {event_d} and {event_dp}")
    kind = client.encoder_gradient_release()
    ctx = ClientContext(client_id=0, round=0, run_seed=0, rng=np.random.default_rng(0))
    mechanism = kind.mechanism(client.noise_multiplier(), **client.noise_source(ctx, ENCODER_GRADIENT_NOISE))
    noise = mechanism.add_noise(torch.zeros_like(value_d))
    mean_d, mean_dp = value_d - noise, value_dp - noise
    gap = float((mean_d - mean_dp).norm())
    if not math.isclose(gap, 2 * bound / (n + 1), rel_tol=1e-4):
        raise AssertionError(f"worst-case pair broken: the data terms differ by {gap}, not 2 C / (n + 1)")
    fresh = kind.mechanism(client.noise_multiplier())    # secure noise, the same sigma
    rd = fresh.add_noise(mean_d.expand(trials, -1).clone()).numpy()
    rdp = fresh.add_noise(mean_dp.expand(trials, -1).clone()).numpy()
    return rd, rdp


def _classic_releases(eps, delta, trials, bound, n, seed):
    """DELIBERATELY BROKEN: the worst-case pair with noise from the classic closed form (proved only for eps < 1)."""
    encoder, x_d, x_dp = worst_case_pair(n, bound)
    from privfl.privacy import privatize
    private = privatize(encoder, eps, delta, bound=bound, noise="seeded", generator=_torch_generator(seed))
    sens = 2 * bound / n
    sigma = sens * math.sqrt(2 * math.log(1.25 / delta)) / eps  # classic formula, deliberately broken (audit target)
    rng = np.random.default_rng(seed)
    rd = private.clipped_mean(x_d).numpy() + sigma * rng.standard_normal((trials, 1))
    rdp = private.clipped_mean(x_dp).numpy() + sigma * rng.standard_normal((trials, 1))
    return rd, rdp


def _maxpool_releases(eps, delta, trials, bound, n, seed):
    """DELIBERATELY BROKEN: a mean+max DeepSet released with noise calibrated for the mean's ``2 * bound / n``.

    privatize refuses this encoder (encoder.pool is MeanMaxPool), so the release is built by hand: phi per sample,
    clipped to the L2 ball of radius ``bound`` exactly as privatize clips, the encoder's own MeanMaxPool, then the
    Gaussian mechanism with the mean-of-clipped certificate. The max half moves by O(bound) whatever n.
    """
    import torch
    from torch import nn

    from privfl.models.set_encoders import DeepSetEncoder
    from privfl.privacy.mechanisms import GaussianMechanism
    from privfl.privacy.sensitivity import certify_mean_of_clipped

    encoder = DeepSetEncoder(input_dim=1, hidden=2, output_dim=1)
    linear = nn.Linear(1, 2, bias=False)
    with torch.no_grad():
        linear.weight.fill_(1.0)
    encoder.phi = nn.Sequential(nn.Flatten(), linear)
    # Replace-one pair for the max: D = n-1 samples at -b and one at +b; D' = all n at -b.
    x_d = torch.full((n, 1), -10.0 * bound)
    x_d[-1, 0] = 10.0 * bound
    x_dp = torch.full((n, 1), -10.0 * bound)

    def pooled(x):
        with torch.no_grad():
            v = encoder.phi(x).double()
            v = v * torch.clamp(bound / v.norm(dim=1, keepdim=True), max=1.0)
            return encoder.pool(v)

    sens = certify_mean_of_clipped(bound, n, "replace_one", n_public=True, delta=delta).value  # the false claim
    mechanism = GaussianMechanism(epsilon=eps, delta=delta, sensitivity=sens, generator=_torch_generator(seed))
    rd = mechanism.add_noise(pooled(x_d).expand(trials, -1).clone()).numpy()
    rdp = mechanism.add_noise(pooled(x_dp).expand(trials, -1).clone()).numpy()
    return rd, rdp


def dp_gmm_worst_case_pair(n: int, bound: float = 1.0, dim: int = 2, relation: str = "replace_one"):
    """Worst-case neighbouring client datasets ``(x_d, x_dp, y_d, y_dp)`` for the DP-GMM release's S1 block.

    One class (label 0). ``replace_one`` (with public or noisy counts; the replaced record keeps its label): D is
    ``n - 1`` records at 0 and one at ``+bound * e1``, D' the same with ``-bound * e1``, so ``S1`` moves by exactly
    ``2 * bound`` (its sensitivity) while the counts and the second-moment sums (``v*v``, ``vv^T``, ``||v||^2`` are
    even in v) are identical: the S1 block is the only block that differs. ``add_or_remove_one`` (noisy counts): D
    is ``n - 1`` zeros plus ``+bound * e1``, D' the ``n - 1`` zeros; S1 moves by exactly ``bound`` (its sensitivity);
    the counts and second moments move too, but only the S1 block is audited.
    """
    x_d = np.zeros((n, dim))
    x_d[-1, 0] = bound
    if relation == "add_or_remove_one":
        x_dp = np.zeros((n - 1, dim))
    else:
        x_dp = x_d.copy()
        x_dp[-1, 0] = -bound
    return x_d, x_dp, np.zeros(len(x_d), dtype=np.int64), np.zeros(len(x_dp), dtype=np.int64)


def _dp_gmm_releases(eps, delta, trials, bound, n, dim, covariance, counts, relation, seed):
    """``trials`` noisy S1 blocks of the one class on each side, the number k of released blocks, and the S1 block's
    own epsilon at ``delta`` (the claim the audit is set against).

    The noise is drawn by the release's own calibration (:func:`privfl.privacy.dp_gmm.calibrate_blocks` on
    ``block_sensitivities(...).blocks()``, as release_class_gaussians builds it), checked against one real release on
    D (its ``sigmas["sum"]`` and its event); then one ``add_noise("sum", ...)`` call per side on the exact clipped
    sums expanded to ``[trials, dim]``.
    """
    import torch

    from accounting import GaussianEvent
    from accounting import epsilon as accountant_epsilon
    from privfl.privacy.dp_gmm import block_sensitivities, calibrate_blocks, clipped_class_sums, release_class_gaussians

    x_d, x_dp, y_d, y_dp = dp_gmm_worst_case_pair(n, bound, dim, relation)
    generator = _torch_generator(seed)
    probe = release_class_gaussians(x_d, y_d, num_classes=1, epsilon=eps, delta=delta, bound=bound,
                                    covariance=covariance, counts=counts, relation=relation, noise="seeded",
                                    generator=_torch_generator(seed + 1))
    sens = block_sensitivities(bound=bound, covariance=covariance, relation=relation, counts=counts)
    k = len(sens.blocks())
    calibration = calibrate_blocks(epsilon=eps, delta=delta, sensitivities=sens.blocks(), relation=relation,
                                   noise="seeded", generator=generator)
    if calibration.sigmas["sum"] != probe.sigmas["sum"] or calibration.event != probe.event \
            or probe.sensitivities.sum != sens.sum:
        raise AssertionError(f"audit noise path out of step with release_class_gaussians: sigma "
                             f"{calibration.sigmas['sum']} vs {probe.sigmas['sum']}")
    block_epsilon = accountant_epsilon(GaussianEvent(sigma=calibration.sigmas["sum"], sensitivity=sens.sum,
                                                     relation=relation), delta)
    s1_d = clipped_class_sums(x_d, y_d, num_classes=1, bound=bound, covariance=covariance)[0][0]
    s1_dp = clipped_class_sums(x_dp, y_dp, num_classes=1, bound=bound, covariance=covariance)[0][0]
    gap = float(torch.linalg.vector_norm(s1_d - s1_dp))
    if not math.isclose(gap, sens.sum, rel_tol=1e-9):
        raise AssertionError(f"worst-case pair broken: S1 blocks differ by {gap}, not the sensitivity {sens.sum}")
    rd = calibration.add_noise("sum", s1_d.expand(trials, -1).clone()).numpy()
    rdp = calibration.add_noise("sum", s1_dp.expand(trials, -1).clone()).numpy()
    return rd, rdp, k, block_epsilon


def audit_dp_gmm(eps: float, delta: float, *, trials: int, bound: float = 1.0, n: int = 20, dim: int = 2,
                 covariance: str = "diag", counts: str = "public", relation: str = "replace_one", seed: int = 0,
                 confidence: float = 0.95) -> AuditResult:
    """Audit the DP-FedPFT release (:func:`privfl.privacy.dp_gmm.release_class_gaussians`) through its S1 block.

    The pair is :func:`dp_gmm_worst_case_pair` (S1 moves by exactly its sensitivity); the release audited is the
    noisy S1 block of the class (the released mean is ``S1~ / n_c`` projected into the B-ball: post-processing, so
    the block is the strongest place to audit). The ``trials`` releases per side are drawn in one call of the S1
    block's own mechanism (see :func:`_dp_gmm_releases`; identical in distribution to the S1 block of ``trials``
    calls of ``release_class_gaussians``).

    The claim set against the bound is the S1 block's own: its epsilon at ``delta`` from the accountant (the block's
    noise multiplier is ``sqrt(k)`` times the message's, k = 2 blocks with public counts, 3 with noisy counts);
    ``eps`` and ``delta`` (the whole message's) are reported as ``epsilon_release`` / ``delta_release``.
    ``ratio = epsilon_lower / epsilon_claimed`` is the ratio that matters.
    """
    from privfl.privacy.dp_gmm import COUNTS_MODES, COVARIANCE_TYPES
    from privfl.privacy.sensitivity import check_relation

    eps, delta, trials = _check_gaussian_audit(eps, delta, trials, n, bound, "records in the class")
    if not is_int_at_least(dim, 1):
        raise _err(f"dim must be an int >= 1, got {dim!r}")
    if covariance not in COVARIANCE_TYPES:
        raise _err(f"covariance must be one of {', '.join(COVARIANCE_TYPES)}, got {covariance!r}")
    if counts not in COUNTS_MODES:
        raise _err(f"counts must be one of {', '.join(COUNTS_MODES)}, got {counts!r}")
    relation = check_relation(relation).value
    rd, rdp, k, block_epsilon = _dp_gmm_releases(eps, delta, trials, float(bound), int(n), int(dim), covariance,
                                                 counts, relation, seed)
    result = audit_samples(rd, rdp, epsilon_claimed=block_epsilon, delta=delta, confidence=confidence)
    return AuditResult(**{**{f: getattr(result, f) for f in result.__dataclass_fields__},
                          "audited": f"S1 block (1 of k={k} jointly calibrated blocks; {counts} counts, {relation})",
                          "epsilon_release": eps, "delta_release": delta})


def _check_gaussian_audit(eps, delta, trials, n, bound, n_meaning: str) -> tuple[float, float, int]:
    """Validate what every Gaussian audit takes; returns the checked ``(eps, delta, trials)``."""
    eps = _check_epsilon(eps)
    delta = _check_delta(delta)
    if delta == 0:
        raise _err("delta must be > 0 for a Gaussian mechanism, got 0")
    trials = _check_trials(trials)
    if isinstance(n, bool) or not isinstance(n, numbers.Integral) or n < 2:
        raise _err(f"n ({n_meaning}) must be an int >= 2, got {n!r}")
    from privfl.privacy.sensitivity import check_bound

    check_bound(bound)
    return eps, delta, trials


def _threshold_audit(releases: Callable[..., tuple[np.ndarray, np.ndarray]], *, vectorisable: bool = False
                     ) -> Callable[..., AuditResult]:
    """The black-box threshold audit of a mechanism whose ``trials`` releases on the worst-case pair ``(D, D')``
    ``releases(eps, delta, trials, bound, n, seed[, vectorised])`` draws."""
    def run(eps: float, delta: float, *, trials: int, bound: float, n: int, seed: int, confidence: float,
            vectorised: bool) -> AuditResult:
        extra = (vectorised,) if vectorisable else ()
        rd, rdp = releases(eps, delta, trials, bound, n, seed, *extra)
        return audit_samples(rd, rdp, epsilon_claimed=eps, delta=delta, confidence=confidence)
    return run


def _dp_gmm_audit(eps: float, delta: float, *, trials: int, bound: float, n: int, seed: int, confidence: float,
                  vectorised: bool) -> AuditResult:
    return audit_dp_gmm(eps, delta, trials=trials, bound=bound, n=n, seed=seed, confidence=confidence)


#: The mechanisms ``privfl attack audit`` audits, by name: each runs one audit at the claimed ``(eps, delta)``
#: (:func:`run_audit`). ``classic`` and ``maxpool`` are deliberately broken; the audit must catch them.
MECHANISMS: Registry[Callable[..., AuditResult]] = Registry("audited mechanism", {
    "privatize": _threshold_audit(_privatize_releases, vectorisable=True),
    "classic": _threshold_audit(_classic_releases),
    "maxpool": _threshold_audit(_maxpool_releases),
    "dp_gmm": _dp_gmm_audit,
    "odpflhn_gradient": _threshold_audit(_odpflhn_gradient_releases, vectorisable=True),
})


def run_audit(mechanism: str, eps: float, delta: float, *, trials: int, bound: float = 1.0, n: int = 20,
              seed: int = 0, confidence: float = 0.95, vectorised: bool = True) -> AuditResult:
    """Audit one of :data:`MECHANISMS` at the claimed ``(eps, delta)`` with ``trials`` releases per input.

    ``"privatize"`` is the project's mechanism (:func:`audit_privatize`); ``"classic"`` (Gaussian noise from the
    classic closed-form calibration) and ``"maxpool"`` (a max-pooled branch released as if mean-pooled) are
    deliberately broken mechanisms that the audit must catch. ``"dp_gmm"`` is the DP-FedPFT release audited through
    its S1 block with the defaults of :func:`audit_dp_gmm` (diag covariance, public counts, replace-one, dim 2):
    its ``epsilon_claimed`` is the S1 block's own epsilon, the release's ``eps`` is ``epsilon_release``.
    ``"odpflhn_gradient"`` is ODPFL-HN's record-level encoder-gradient release on its worst-case add/remove-one pair
    (:func:`odpflhn_gradient_pair`; ``n`` is the public ``min_samples``, ``bound`` the per-record clip).
    ``vectorised`` applies to ``"privatize"`` and ``"odpflhn_gradient"``.
    """
    audit = MECHANISMS.lookup(mechanism)
    eps, delta, trials = _check_gaussian_audit(eps, delta, trials, n, bound, "samples per set")
    return audit(eps, delta, trials=trials, bound=bound, n=n, seed=seed, confidence=confidence,
                 vectorised=vectorised)


def audit_privatize(eps: float, delta: float, *, trials: int, bound: float = 1.0, n: int = 20, seed: int = 0,
                    confidence: float = 0.95, vectorised: bool = True) -> AuditResult:
    """Audit :func:`privfl.privacy.privatize` on its worst-case replace-one pair (:func:`worst_case_pair`).

    The release audited is the descriptor of a privatised DPDeepSetEncoder whose psi is the identity, i.e. the
    noisy clipped mean (psi is post-processing, so this is the strongest place to audit). With ``vectorised`` the
    ``trials`` releases are drawn in one call of the privatised encoder's own mechanism on its own clipped means
    (identical in distribution to ``trials`` calls of ``release``); with ``vectorised=False`` each release is one
    call of ``PrivateEncoder.release``.
    """
    return run_audit("privatize", eps, delta, trials=trials, bound=bound, n=n, seed=seed, confidence=confidence,
                     vectorised=vectorised)


# -- command line ---------------------------------------------------------------------------------------------------

def format_table(results: Sequence[tuple[str, AuditResult]]) -> str:
    """A short table: mechanism, claimed eps, empirical lower bound (point estimate), ratio, delta test, verdict."""
    lines = [f"{'mechanism':<10} {'claimed eps':>11} {'delta':>8} {'eps_lb':>8} {'(point)':>8} {'ratio':>7} "
             f"{'delta_lb@eps':>12} verdict"]
    for name, r in results:
        dl = "n/a" if r.delta_audit is None else f"{r.delta_audit.delta_lower:.3g}"
        lines.append(f"{name:<10} {r.epsilon_claimed:>11.4g} {r.delta:>8.2g} {r.epsilon_lower:>8.3f} "
                     f"{r.epsilon_point:>8.3f} {r.ratio:>7.3f} {dl:>12} {r.verdict}")
    for name, r in results:
        if isinstance(r.epsilon_release, float) and math.isfinite(r.epsilon_release):
            lines.append(f"{name}: audited {r.audited}: claimed eps above is that block's own epsilon at the "
                         f"release's delta; the whole release claims eps={r.epsilon_release:.4g}, "
                         f"delta={r.delta_release:.2g}")
    if results:
        lines.append(f"eps_lb: {results[0][1].confidence:.0%} Clopper-Pearson lower bound on the evaluation half; "
                     "delta_lb@eps: lower bound on the delta at the claimed eps (Gaussian tail model for D')")
    return "\n".join(lines)


def audit_parser() -> argparse.ArgumentParser:
    """The parser of ``privfl attack audit`` (its ``--help`` shows every default)."""
    from privfl.helpformat import show_defaults

    parser = argparse.ArgumentParser(prog="privfl attack audit",
                                     description="Empirical lower bound on epsilon for a mechanism, beside its claim.")
    parser.add_argument("--mechanism", default="privatize",
                        help=f"one of {', '.join(MECHANISMS)} (classic and maxpool are deliberately broken; dp_gmm "
                             "is audited through its S1 block, claimed eps = that block's own epsilon at the "
                             "release's delta, from the accountant)")
    parser.add_argument("--epsilon", type=float, default=1.0, help="claimed epsilon (natural log)")
    parser.add_argument("--delta", type=float, default=1e-5, help="claimed delta")
    parser.add_argument("--trials", type=int, default=100_000, help="releases per neighbouring input (>= 10)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--n", type=int, default=20, help="samples per set")
    parser.add_argument("--confidence", type=float, default=0.95)
    parser.add_argument("--json", dest="json_out", default=None, metavar="OUT", help="write the result as JSON here")
    return show_defaults(parser)


def audit_main(argv: Sequence[str] | None = None) -> int:
    """``privfl attack audit``: audit one mechanism; print a table; exit 0 (2 with one line on bad input, or an
    output path that cannot be written: checked before the audit runs)."""
    from privfl.errors import PrivflError, check_writable, storage_message

    parser = audit_parser()
    try:
        args = parser.parse_args(list(argv) if argv is not None else None)
    except SystemExit as exc:  # argparse has printed its message (status 2 for bad input, 0 for --help)
        return int(exc.code or 0)
    try:
        if args.mechanism not in MECHANISMS:
            raise _err(f"--mechanism must be one of {', '.join(MECHANISMS)}, got {args.mechanism!r}")
        if not (isinstance(args.delta, float) and 0 < args.delta < 1):
            raise _err(f"--delta must be a probability in (0, 1), got {args.delta!r}")
        if args.json_out:
            check_writable(args.json_out, "--json")     # before the work, not after it
        result = run_audit(args.mechanism, args.epsilon, args.delta, trials=args.trials, n=args.n, seed=args.seed,
                           confidence=args.confidence)
    except (ValueError, PrivflError) as exc:
        print(f"privfl attack audit: error: {exc}", file=sys.stderr)
        return 2
    print(format_table([(args.mechanism, result)]))
    if args.json_out:
        payload = {"mechanism": args.mechanism, "n": args.n, "seed": args.seed, **result.to_dict()}
        try:
            Path(args.json_out).write_text(json.dumps(payload, indent=2, default=_json_default) + "\n")
        except OSError as error:            # the disk filled during the work
            print(f"privfl attack audit: error: --json {args.json_out} cannot be written "
                  f"({storage_message(error)}); the table above is the result", file=sys.stderr)
            return 2
    return 0


def _json_default(value):
    if isinstance(value, float) and math.isinf(value):
        return str(value)
    raise TypeError(f"not JSON serialisable: {value!r}")


if __name__ == "__main__":  # pragma: no cover
    raise SystemExit(audit_main(sys.argv[1:]))
