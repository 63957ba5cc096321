"""Empirical DP audits of the project's mechanisms: a statistically honest lower bound on epsilon for a mechanism,
set beside its claim (``privfl attack audit``).

:func:`run_audit` audits one of :data:`MECHANISMS` (their releases on worst-case pairs: :mod:`attacks.audit_mechanisms`)
with the tests of :mod:`attacks.audit_statistics`; :func:`audit_privatize` audits :func:`privfl.privacy.privatize`,
:func:`audit_dp_gmm` one block of a jointly calibrated DP-GMM release. The command line: :func:`audit_parser`,
:func:`audit_main`, :func:`format_table`.

The two tests' statistics and the DP-GMM block audit: docs/attacks.md, "Empirical DP audits".
"""

from __future__ import annotations

import argparse
import json
import math
import numbers
import sys
from collections.abc import Callable, Sequence
from pathlib import Path

import numpy as np

from accounting.validation import is_int_at_least
from attacks.audit_mechanisms import (
    classic_releases,
    dp_gmm_releases,
    maxpool_releases,
    odpflhn_gradient_releases,
    privatize_releases,
)
from attacks.audit_statistics import AuditResult, audit_error, audit_samples, check_delta, check_epsilon, check_trials
from privfl.registry import Registry

__all__ = ["MECHANISMS", "audit_dp_gmm", "audit_main", "audit_parser", "audit_privatize", "format_table", "run_audit"]


def audit_dp_gmm(eps: float, delta: float, *, trials: int, bound: float = 1.0, n: int = 20, dim: int = 2,
                 covariance: str = "diag", counts: str = "public", relation: str = "replace_one", seed: int = 0,
                 confidence: float = 0.95) -> AuditResult:
    """Audit the DP-FedPFT release (:func:`privfl.privacy.dp_gmm.release_class_gaussians`) through its S1 block.

    The pair is :func:`~attacks.audit_mechanisms.dp_gmm_worst_case_pair` (S1 moves by exactly its sensitivity); the
    release audited is the noisy S1 block of the class (the released mean is ``S1~ / n_c`` projected into the B-ball:
    post-processing, so the block is the strongest place to audit). The ``trials`` releases per side are drawn in one
    call of the S1 block's own mechanism (see :func:`~attacks.audit_mechanisms.dp_gmm_releases`; identical in
    distribution to the S1 block of ``trials`` calls of ``release_class_gaussians``).

    The claim set against the bound is the S1 block's own: its epsilon at ``delta`` from the accountant (the block's
    noise multiplier is ``sqrt(k)`` times the message's, k = 2 blocks with public counts, 3 with noisy counts);
    ``eps`` and ``delta`` (the whole message's) are reported as ``epsilon_release`` / ``delta_release``.
    ``ratio = epsilon_lower / epsilon_claimed`` is the ratio that matters.
    """
    from privfl.privacy.dp_gmm import COUNTS_MODES, COVARIANCE_TYPES
    from privfl.privacy.sensitivity import check_relation

    eps, delta, trials = _check_gaussian_audit(eps, delta, trials, n, bound, "records in the class")
    if not is_int_at_least(dim, 1):
        raise audit_error(f"dim must be an int >= 1, got {dim!r}")
    if covariance not in COVARIANCE_TYPES:
        raise audit_error(f"covariance must be one of {', '.join(COVARIANCE_TYPES)}, got {covariance!r}")
    if counts not in COUNTS_MODES:
        raise audit_error(f"counts must be one of {', '.join(COUNTS_MODES)}, got {counts!r}")
    relation = check_relation(relation).value
    rd, rdp, k, block_epsilon = dp_gmm_releases(eps, delta, trials, float(bound), int(n), int(dim), covariance,
                                                counts, relation, seed)
    result = audit_samples(rd, rdp, epsilon_claimed=block_epsilon, delta=delta, confidence=confidence)
    return AuditResult(**{**{f: getattr(result, f) for f in result.__dataclass_fields__},
                          "audited": f"S1 block (1 of k={k} jointly calibrated blocks; {counts} counts, {relation})",
                          "epsilon_release": eps, "delta_release": delta})


def _check_gaussian_audit(eps, delta, trials, n, bound, n_meaning: str) -> tuple[float, float, int]:
    """Validate what every Gaussian audit takes; returns the checked ``(eps, delta, trials)``."""
    eps = check_epsilon(eps)
    delta = check_delta(delta)
    if delta == 0:
        raise audit_error("delta must be > 0 for a Gaussian mechanism, got 0")
    trials = check_trials(trials)
    if isinstance(n, bool) or not isinstance(n, numbers.Integral) or n < 2:
        raise audit_error(f"n ({n_meaning}) must be an int >= 2, got {n!r}")
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
    "privatize": _threshold_audit(privatize_releases, vectorisable=True),
    "classic": _threshold_audit(classic_releases),
    "maxpool": _threshold_audit(maxpool_releases),
    "dp_gmm": _dp_gmm_audit,
    "odpflhn_gradient": _threshold_audit(odpflhn_gradient_releases, vectorisable=True),
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
    (:func:`~attacks.audit_mechanisms.odpflhn_gradient_pair`; ``n`` is the public ``min_samples``, ``bound`` the
    per-record clip). ``vectorised`` applies to ``"privatize"`` and ``"odpflhn_gradient"``.
    """
    audit = MECHANISMS.lookup(mechanism)
    eps, delta, trials = _check_gaussian_audit(eps, delta, trials, n, bound, "samples per set")
    return audit(eps, delta, trials=trials, bound=bound, n=n, seed=seed, confidence=confidence,
                 vectorised=vectorised)


def audit_privatize(eps: float, delta: float, *, trials: int, bound: float = 1.0, n: int = 20, seed: int = 0,
                    confidence: float = 0.95, vectorised: bool = True) -> AuditResult:
    """Audit :func:`privfl.privacy.privatize` on its worst-case replace-one pair
    (:func:`~attacks.audit_mechanisms.worst_case_pair`).

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
            raise audit_error(f"--mechanism must be one of {', '.join(MECHANISMS)}, got {args.mechanism!r}")
        if not (isinstance(args.delta, float) and 0 < args.delta < 1):
            raise audit_error(f"--delta must be a probability in (0, 1), got {args.delta!r}")
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
