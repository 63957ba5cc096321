"""Empirical DP audit: Clopper-Pearson bounds, privatize passes, the two deliberately broken mechanisms are caught."""

from __future__ import annotations

import json
import math

import numpy as np
import pytest
from scipy import stats

from accounting import analytic_gaussian_sigma
from attacks.audit import MECHANISMS, audit_main, audit_privatize, run_audit
from attacks.audit_mechanisms import worst_case_pair
from attacks.audit_statistics import AuditResult, audit_mechanism, audit_samples, clopper_pearson
from privfl.registry import Registry


@pytest.mark.parametrize(("k", "n"), [(0, 50), (3, 50), (17, 200), (200, 200), (1, 100000)])
def test_clopper_pearson_matches_beta_quantiles(k, n):
    lo, hi = clopper_pearson(k, n, 0.95)
    assert lo == (0.0 if k == 0 else pytest.approx(stats.beta.ppf(0.025, k, n - k + 1), rel=1e-12))
    assert hi == (1.0 if k == n else pytest.approx(stats.beta.ppf(0.975, k + 1, n - k), rel=1e-12))
    assert lo <= k / n <= hi


def test_clopper_pearson_known_value_and_arrays():
    _, hi = clopper_pearson(0, 100, 0.95)
    assert hi == pytest.approx(1 - 0.025 ** (1 / 100), rel=1e-9)  # closed form for k = 0
    lo, hi = clopper_pearson(np.array([0, 5]), np.array([10, 10]), 0.9)
    assert lo.shape == hi.shape == (2,)
    assert hi[1] == pytest.approx(stats.beta.ppf(0.95, 6, 5))


def test_worst_case_pair_differs_by_two_bound_over_n():
    from privfl.privacy import privatize
    encoder, x_d, x_dp = worst_case_pair(20, bound=1.5)
    private = privatize(encoder, 1.0, 1e-5, bound=1.5)
    gap = float((private.clipped_mean(x_d) - private.clipped_mean(x_dp)).abs().sum())
    assert gap == pytest.approx(2 * 1.5 / 20, rel=1e-12)


def test_privatize_at_eps_1_lower_bound_is_positive_and_below_the_claim():
    result = audit_privatize(1.0, 1e-5, trials=100_000, seed=0)
    assert isinstance(result, AuditResult)
    assert 0.2 < result.epsilon_lower < 1.0
    assert result.ratio == pytest.approx(result.epsilon_lower)
    assert not result.violated and result.verdict == "consistent with claim"
    assert result.delta_audit is not None and result.delta_audit.delta_lower <= 1e-5
    d = result.to_dict()
    assert d["epsilon_claimed"] == 1.0 and d["violated"] is False and d["delta_audit"]["violated"] is False


def test_vectorised_releases_match_the_release_path():
    # one call of PrivateEncoder.release per trial: same noise scale as the vectorised draw
    result = audit_privatize(1.0, 1e-5, trials=400, seed=1, vectorised=False)
    assert not result.violated
    from privfl.privacy import privatize
    encoder, x_d, _ = worst_case_pair(20)
    private = privatize(encoder, 1.0, 1e-5)
    draws = np.array([float(private(x_d)) for _ in range(400)])
    sigma = analytic_gaussian_sigma(1.0, 1e-5, 2 / 20)
    assert draws.std(ddof=1) == pytest.approx(sigma, rel=0.15)
    assert draws.mean() == pytest.approx(1 / 20, abs=4 * sigma / 20)


def test_classic_calibration_at_eps_20_is_caught_by_the_delta_test():
    result = run_audit("classic", 20.0, 1e-5, trials=100_000, seed=0)
    assert result.violated
    assert result.delta_audit.violated
    assert result.delta_audit.delta_lower > 10 * 1e-5  # true delta is about 1.5e-3
    assert result.epsilon_lower < 20  # black-box alone cannot reach e^-20 false-positive rates


def test_max_pooled_branch_passed_off_as_mean_is_caught():
    result = run_audit("maxpool", 1.0, 1e-5, trials=20_000, seed=0)
    assert result.violated
    assert result.epsilon_lower > 3.0  # far above the claimed 1


def test_audit_mechanism_with_callables_on_a_mechanism_without_privacy():
    rng = np.random.default_rng(0)
    result = audit_mechanism(lambda: rng.normal(1.0, 0.01, size=2), lambda: rng.normal(0.0, 0.01, size=2),
                             trials=2000, delta=1e-5, epsilon_claimed=1.0)
    # perfect separation on 1000 evaluation trials: eps_lb = ln((1 - delta - FNR_u) / FPR_u), FPR_u = FNR_u
    u = 1 - 0.025 ** (1 / 1000)
    assert result.epsilon_lower == pytest.approx(math.log((1 - 1e-5 - u) / u), rel=1e-9)
    assert result.violated


def test_identical_mechanisms_give_no_positive_bound_often():
    rng = np.random.default_rng(3)
    x, y = rng.normal(size=(4000, 1)), rng.normal(size=(4000, 1))
    assert audit_samples(x, y, epsilon_claimed=0.5, delta=1e-5).epsilon_lower < 0.3


@pytest.mark.parametrize(("call", "message"), [
    (lambda: audit_privatize(1.0, 1e-5, trials=5), "trials must be an int >= 10"),
    (lambda: audit_privatize(0.0, 1e-5, trials=100), "epsilon must be a finite number > 0"),
    (lambda: audit_privatize(-2.0, 1e-5, trials=100), "got -2.0"),
    (lambda: run_audit("laplace", 1.0, 1e-5, trials=100),
     "unknown audited mechanism 'laplace'; valid choices: classic, dp_gmm, maxpool, odpflhn_gradient, privatize"),
    (lambda: audit_mechanism(lambda: [0.0], lambda: [1.0], trials=9, delta=1e-5), "got 9"),
])
def test_bad_input_names_the_value(call, message):
    with pytest.raises(ValueError, match=message.replace("(", r"\(").replace(".", r"\.")):
        call()


def test_cli_prints_table_writes_json_and_rejects_bad_input(tmp_path, capsys):
    out = tmp_path / "audit.json"
    assert audit_main(["--mechanism", "maxpool", "--epsilon", "1", "--trials", "2000", "--json", str(out)]) == 0
    text = capsys.readouterr().out
    assert "maxpool" in text and "VIOLATION" in text
    payload = json.loads(out.read_text())
    assert payload["mechanism"] == "maxpool" and payload["violated"] is True
    assert audit_main(["--trials", "5"]) == 2
    err = capsys.readouterr().err
    assert "trials" in err and "5" in err and len(err.strip().splitlines()) == 1
    assert audit_main(["--epsilon", "0"]) == 2
    assert "got 0.0" in capsys.readouterr().err
    assert audit_main(["--mechanism", "nope"]) == 2


def test_mechanisms_are_a_registry_whose_entries_run_the_audit():
    assert isinstance(MECHANISMS, Registry) and MECHANISMS.kind == "audited mechanism"
    assert list(MECHANISMS) == ["privatize", "classic", "maxpool", "dp_gmm", "odpflhn_gradient"]
    with pytest.raises(ValueError, match="already registered"):
        MECHANISMS.register("privatize", MECHANISMS["privatize"])
    # run_audit is the registry's entry: the same seed gives the same bound through either door
    direct = MECHANISMS["privatize"](1.0, 1e-5, trials=2000, bound=1.0, n=20, seed=3, confidence=0.95,
                                     vectorised=True)
    assert direct.epsilon_lower == run_audit("privatize", 1.0, 1e-5, trials=2000, seed=3).epsilon_lower


def test_swapped_direction_gives_the_same_bound_as_the_mirrored_scores():
    rng = np.random.default_rng(5)
    x, y = rng.normal(0.0, 1.0, size=(20000, 1)), rng.normal(1.0, 1.0, size=(20000, 1))
    swapped = audit_samples(x, y, epsilon_claimed=1.0, delta=1e-5, statistic=[1.0])  # D scores lower than D'
    mirrored = audit_samples(-x, -y, epsilon_claimed=1.0, delta=1e-5, statistic=[1.0])
    assert swapped.epsilon_lower == pytest.approx(mirrored.epsilon_lower, abs=1e-12)
    assert 1.0 < swapped.epsilon_lower < 4.4  # the true epsilon of mu = 1 at delta = 1e-5 is about 4.4


# -- DP-FedPFT (DP-GMM) release, audited through its S1 block ------------------------------------------------------

def test_dp_gmm_worst_case_pair_moves_only_s1_by_its_sensitivity():
    from attacks.audit_mechanisms import dp_gmm_worst_case_pair
    from privfl.privacy.dp_gmm import block_sensitivities, clipped_class_sums
    x_d, x_dp, y_d, y_dp = dp_gmm_worst_case_pair(20, bound=1.5, dim=3)
    for cov in ("full", "diag", "spherical"):
        s1, s2, n = clipped_class_sums(x_d, y_d, num_classes=1, bound=1.5, covariance=cov)
        t1, t2, m = clipped_class_sums(x_dp, y_dp, num_classes=1, bound=1.5, covariance=cov)
        sens = block_sensitivities(bound=1.5, covariance=cov, relation="replace_one", counts="public")
        assert float((s1 - t1).norm()) == pytest.approx(sens.sum, rel=1e-12) == 3.0
        assert bool((s2 == t2).all()) and bool((n == m).all())  # S2 and counts identical: S1 is the only block moved


def test_dp_gmm_at_eps_4_is_consistent_with_the_block_claim_and_bound_is_positive():
    from attacks.audit import audit_dp_gmm
    result = audit_dp_gmm(4.0, 1e-5, trials=100_000, seed=0)
    # public counts: k = 2 unit-scaled blocks (S1, S2) share one Gaussian of joint sensitivity sqrt(2) calibrated at
    # (4, 1e-5); the S1 block alone is a Gaussian of sensitivity 1 and that same noise multiplier, so its own epsilon
    # at 1e-5 is the e with sigma_analytic(e, 1e-5, 1) == sigma_analytic(4, 1e-5, sqrt(2)) (2.6945, not an even 2.0)
    block_sigma = analytic_gaussian_sigma(4.0, 1e-5, math.sqrt(2))
    assert analytic_gaussian_sigma(result.epsilon_claimed, 1e-5, 1.0) == pytest.approx(block_sigma, rel=1e-6)
    assert result.epsilon_claimed == pytest.approx(2.6945, abs=1e-3) and result.delta == 1e-5
    assert result.epsilon_release == 4.0 and result.delta_release == 1e-5
    assert "S1 block" in result.audited and "k=2" in result.audited
    assert 0.5 < result.epsilon_lower < result.epsilon_claimed
    assert result.ratio == pytest.approx(result.epsilon_lower / result.epsilon_claimed)
    assert not result.violated and result.verdict == "consistent with claim"
    d = result.to_dict()
    assert d["epsilon_release"] == 4.0 and d["violated"] is False
    assert run_audit("dp_gmm", 4.0, 1e-5, trials=2000, seed=0).epsilon_release == 4.0


def test_dp_gmm_noisy_counts_split_over_three_blocks():
    from attacks.audit import audit_dp_gmm
    result = audit_dp_gmm(3.0, 3e-5, trials=2000, seed=2, counts="noisy")
    # k = 3 blocks: the S1 block's noise multiplier is sigma_analytic(3, 3e-5, sqrt(3)); its own epsilon is at 3e-5
    assert analytic_gaussian_sigma(result.epsilon_claimed, 3e-5, 1.0) == pytest.approx(
        analytic_gaussian_sigma(3.0, 3e-5, math.sqrt(3)), rel=1e-6)
    assert result.epsilon_claimed == pytest.approx(1.6076, abs=1e-3) and result.delta == pytest.approx(3e-5)
    assert "k=3" in result.audited


def test_dp_gmm_vectorised_noise_matches_real_releases():
    import torch

    from attacks.audit_mechanisms import dp_gmm_releases, dp_gmm_worst_case_pair
    from privfl.privacy.dp_gmm import release_class_gaussians
    eps, delta, n = 1.0, 1e-5, 400  # n large enough that the released mean is never projected into the B-ball
    x_d, _, y_d, _ = dp_gmm_worst_case_pair(n, 1.0, 2)
    g = torch.Generator().manual_seed(7)
    real = [release_class_gaussians(x_d, y_d, num_classes=1, epsilon=eps, delta=delta, bound=1.0,
                                    covariance="diag", counts="public", generator=g) for _ in range(300)]
    s1_real = np.stack([r.classes[0].mean.numpy() * n for r in real])  # S1~ = mean * n_c (public count)
    sigma_real = real[0].sigmas["sum"]
    # S1 moves by 2 (replace-one, B = 1); scaled to unit sensitivity beside S2 it shares one Gaussian of joint
    # sensitivity sqrt(2) calibrated at the whole (eps, delta): sigma_S1 = 2 * sigma_analytic(eps, delta, sqrt(2))
    assert sigma_real == pytest.approx(analytic_gaussian_sigma(eps, delta, 2.0 * math.sqrt(2)), rel=1e-12)
    vec, _, k, _ = dp_gmm_releases(eps, delta, 300, 1.0, n, 2, "diag", "public", "replace_one", 3)
    assert k == 2
    # 600 coordinates each: the sample sd is within ~3% of sigma (1 sd); a sigma calibrated for S1 alone (sensitivity
    # 2 instead of the joint 2 * sqrt(2)) would be ~1.4x smaller, and 15% catches it
    for draws in (s1_real, vec):
        assert (draws - np.array([1.0, 0.0])).std(ddof=1) == pytest.approx(sigma_real, rel=0.15)
        assert draws.mean(axis=0) == pytest.approx([1.0, 0.0], abs=4 * sigma_real / math.sqrt(300))
    assert vec.std(ddof=1) == pytest.approx(s1_real.std(ddof=1), rel=0.2)


def test_cli_dp_gmm_reports_block_and_release_claims(tmp_path, capsys):
    out = tmp_path / "gmm.json"
    assert audit_main(["--mechanism", "dp_gmm", "--epsilon", "4", "--trials", "2000", "--json", str(out)]) == 0
    text = capsys.readouterr().out
    assert "dp_gmm" in text and "S1 block" in text and "eps=4" in text
    payload = json.loads(out.read_text())
    assert payload["epsilon_claimed"] == pytest.approx(2.6945, abs=1e-3) and payload["epsilon_release"] == 4.0


def test_odpflhn_encoder_gradient_release_is_audited_from_the_client_code_on_an_add_remove_pair():
    from attacks.audit_mechanisms import odpflhn_gradient_pair, odpflhn_gradient_releases

    encoder, x_d, x_dp, grad = odpflhn_gradient_pair(20)
    assert (len(x_d), len(x_dp)) == (20, 21) and float(grad) == 10.0       # D' is D and one more record
    # the vectorised draws come from the client's own release: same sigma (z 2C / min_samples) on both inputs
    rd, rdp = odpflhn_gradient_releases(1.0, 1e-5, 20_000, 1.0, 20, 0, True)
    sigma = analytic_gaussian_sigma(1.0, 1e-5, 1.0) * 2 / 20
    assert rd[:, 0].std(ddof=1) == pytest.approx(sigma, rel=0.05) == rdp[:, 0].std(ddof=1)
    assert rd[:, 0].mean() - rdp[:, 0].mean() == pytest.approx(2 / 21, abs=5 * sigma / np.sqrt(20_000))
    # the release path, one call of the client's stage-2 code per trial, agrees in distribution
    slow, _ = odpflhn_gradient_releases(1.0, 1e-5, 300, 1.0, 20, 1, False)
    assert slow[:, 0].std(ddof=1) == pytest.approx(sigma, rel=0.15)
    result = run_audit("odpflhn_gradient", 1.0, 1e-5, trials=100_000, n=20, seed=0)
    assert not result.violated and 0.2 < result.epsilon_lower < 1.0
    # the trials come from the audit's seed: the same call gives the same bound (OS noise gave 0.47 or 0.0)
    again = run_audit("odpflhn_gradient", 1.0, 1e-5, trials=100_000, n=20, seed=0)
    assert again.epsilon_lower == result.epsilon_lower and again.fnr == result.fnr
