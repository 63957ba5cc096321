"""DP-FedPFT release: sensitivities pinned and checked against adversarial neighbours, PSD covariances, accuracy at
large epsilon, refusals (K > 1, NaN, public counts under add/remove), ledger order, a joint calibration that spends
exactly the requested budget (checked against an independent solution of Balle and Wang's equation), the S1/S2 noise
measured against the calibrated sigmas, no S2 block for spherical covariance on the sphere, and full covariance
without [n, d, d] intermediates."""

from __future__ import annotations

import math
import resource

import numpy as np
import pytest
import torch

from accounting import BudgetExceededError, NeighboringRelation, PrivacyBudget, PrivacyLedger, epsilon
from privfl.errors import ConfigError
from privfl.privacy.dp_gmm import (
    block_sensitivities,
    calibrate_blocks,
    clipped_class_sums,
    release_class_gaussians,
    release_event,
    sample_features,
)

EPS, DELTA = 1.0, 1e-5
COVS = ("full", "diag", "spherical")


def test_independent_sigma_matches_the_literature_value(balle_wang_sigma):
    # analytic multiplier 3.731 at (1, 1e-5), 0.500 at (10, 1e-5): benchmarks/noise_table.py (benchmarks/README.md)
    assert balle_wang_sigma(1.0, 1e-5, 1.0) == pytest.approx(3.7306, abs=2e-4)
    assert balle_wang_sigma(10.0, 1e-5, 1.0) == pytest.approx(0.500, abs=2e-3)


def data(n: int = 120, d: int = 4, num_classes: int = 3, seed: int = 0, scale: float = 0.6):
    rng = np.random.default_rng(seed)
    y = rng.integers(0, num_classes, size=n)
    centres = rng.normal(size=(num_classes, d))
    x = scale * (centres[y] + 0.5 * rng.normal(size=(n, d))) / math.sqrt(d)
    return x, y


# -- sensitivities ----------------------------------------------------------------------------------------------------

def test_sensitivity_values_pinned():
    s = block_sensitivities(bound=1.0, covariance="full", relation="replace_one", counts="public")
    assert s.per_class(50) == pytest.approx((0.04, math.sqrt(2) / 50))
    assert s.count is None
    assert block_sensitivities(bound=2.0, covariance="spherical", counts="public").per_class(50) == \
        pytest.approx((0.08, 4.0 / 50))
    ar = block_sensitivities(bound=2.0, covariance="diag", relation="add_or_remove_one", counts="noisy")
    assert (ar.sum, ar.second_moment_sum, ar.count) == pytest.approx((2.0, 4.0, 1.0))
    ro = block_sensitivities(bound=1.0, covariance="spherical", relation="replace_one", counts="noisy")
    assert (ro.sum, ro.second_moment_sum, ro.count) == pytest.approx((2.0, math.sqrt(2), math.sqrt(2)))
    # on the sphere, spherical S2 = n_c B^2 follows from the counts: no block, whatever the counts mode
    assert block_sensitivities(bound=1.0, covariance="spherical", counts="public", project="sphere").blocks() == \
        {"sum": 2.0}
    sphere_noisy = block_sensitivities(bound=1.0, covariance="spherical", counts="noisy", project="sphere")
    assert sphere_noisy.blocks() == pytest.approx({"sum": 2.0, "count": math.sqrt(2)})
    # the sphere changes no other block's sensitivity
    assert block_sensitivities(bound=1.0, covariance="diag", counts="public", project="sphere").blocks() == \
        pytest.approx({"sum": 2.0, "second_moment_sum": math.sqrt(2)})


def _blocks(x, y, cov, num_classes=3, bound=1.0):
    s1, s2, n = clipped_class_sums(x, y, num_classes=num_classes, bound=bound, covariance=cov)
    return s1, s2, n


@pytest.mark.parametrize("cov", COVS)
def test_empirical_replace_one_change_within_sensitivity(cov):
    """Random search over replacements (adversarial: large, orthogonal, opposite, other label)."""
    rng = np.random.default_rng(1)
    x, y = data(n=30, d=3, seed=2, scale=3.0)  # many features outside the ball, so clipping is exercised
    pub = block_sensitivities(bound=1.0, covariance=cov, relation="replace_one", counts="public")
    noisy = block_sensitivities(bound=1.0, covariance=cov, relation="replace_one", counts="noisy")
    s1, s2, n = _blocks(x, y, cov)
    worst = np.zeros(3)
    for trial in range(300):
        j = rng.integers(len(x))
        x2, y2 = x.copy(), y.copy()
        kind = trial % 3
        if kind == 0:
            x2[j] = rng.normal(size=3) * 10
        elif kind == 1:  # orthogonal to the old record, on the sphere
            v = rng.normal(size=3)
            v -= v.dot(x[j]) / x[j].dot(x[j]) * x[j]
            x2[j] = v / np.linalg.norm(v)
        else:
            x2[j] = -x[j] * 5
        if trial % 2:
            y2[j] = (y[j] + 1 + rng.integers(2)) % 3
        t1, t2, m = _blocks(x2, y2, cov)
        d1 = float(torch.linalg.vector_norm(t1 - s1))
        d2 = float(torch.linalg.vector_norm(t2 - s2))
        dn = float(torch.linalg.vector_norm(m - n))
        assert d1 <= noisy.sum + 1e-9 and d2 <= noisy.second_moment_sum + 1e-9 and dn <= noisy.count + 1e-9
        if y2[j] == y[j]:  # histogram preserved: the public-counts relation; per-class means and second moments
            c = int(y[j])
            nc = int(n[c])
            ms, ss = pub.per_class(nc)
            assert float(torch.linalg.vector_norm((t1[c] - s1[c]) / nc)) <= ms + 1e-9
            assert float(torch.linalg.vector_norm((t2[c] - s2[c]) / nc)) <= ss + 1e-9
        worst = np.maximum(worst, [d1, d2, dn])
    # the search gets near the bounds, so they are not loose by orders of magnitude
    assert worst[0] > 0.9 * noisy.sum and worst[1] > 0.7 * noisy.second_moment_sum


def test_add_remove_change_within_sensitivity():
    x, y = data(n=30, d=3, seed=3, scale=3.0)
    s = block_sensitivities(bound=1.0, covariance="full", relation="add_or_remove_one", counts="noisy")
    s1, s2, n = _blocks(x, y, "full")
    for j in range(len(x)):
        t1, t2, m = _blocks(np.delete(x, j, 0), np.delete(y, j), "full")
        assert float(torch.linalg.vector_norm(t1 - s1)) <= s.sum + 1e-9
        assert float(torch.linalg.vector_norm(t2 - s2)) <= s.second_moment_sum + 1e-9
        assert float(torch.linalg.vector_norm(m - n)) == pytest.approx(s.count)


# -- the release -----------------------------------------------------------------------------------------------------

@pytest.mark.parametrize("cov", COVS)
@pytest.mark.parametrize("counts", ("noisy", "public"))
@pytest.mark.parametrize("project", ("ball", "sphere"))
def test_covariance_psd_at_small_epsilon(cov, counts, project):
    x, y = data(n=60, d=5)
    r = release_class_gaussians(x, y, num_classes=3, epsilon=0.1, delta=DELTA, bound=1.0, covariance=cov,
                                counts=counts, project=project, generator=torch.Generator().manual_seed(0))
    for c in r.classes:
        m = r.covariance_matrix(c.label)
        assert torch.allclose(m, m.T)
        assert float(torch.linalg.eigvalsh(m).min()) > 0
        torch.linalg.cholesky(m)
        assert float(torch.linalg.vector_norm(c.mean)) <= 1.0 + 1e-12


@pytest.mark.parametrize("cov", COVS)
@pytest.mark.parametrize("counts", ("noisy", "public"))
@pytest.mark.parametrize("project", ("ball", "sphere"))
def test_large_epsilon_close_to_clipped_statistics(cov, counts, project):
    x, y = data(n=600, d=4, scale=2.0)
    r = release_class_gaussians(x, y, num_classes=3, epsilon=1e4, delta=DELTA, bound=1.0, covariance=cov,
                                counts=counts, project=project, generator=torch.Generator().manual_seed(1))
    s1, s2, n = clipped_class_sums(x, y, num_classes=3, bound=1.0, covariance=cov, project=project)
    for c in r.classes:
        mean = s1[c.label] / n[c.label]
        assert torch.allclose(c.mean, mean, atol=1e-3)
        if cov == "full":
            true = s2[c.label] / n[c.label] - torch.outer(mean, mean)
        elif cov == "diag":
            true = torch.diag(s2[c.label] / n[c.label] - mean * mean)
        else:
            true = (s2[c.label] / n[c.label] - mean.dot(mean)) / 4 * torch.eye(4, dtype=torch.float64)
        assert torch.allclose(r.covariance_matrix(c.label), true, atol=1e-3)
        assert float(c.count) == pytest.approx(float(n[c.label]), abs=0.05)


def test_components_greater_than_one_refused():
    x, y = data()
    with pytest.raises(ConfigError, match="not differentially private"):
        release_class_gaussians(x, y, num_classes=3, epsilon=EPS, delta=DELTA, bound=1.0, components=2)


def test_nan_refused_and_nothing_recorded():
    x, y = data()
    x[3, 1] = np.nan
    ledger = PrivacyLedger("c0")
    with pytest.raises(ConfigError, match="NaN"):
        release_class_gaussians(x, y, num_classes=3, epsilon=EPS, delta=DELTA, bound=1.0, ledger=ledger)
    x[3, 1] = np.inf
    with pytest.raises(ConfigError, match="NaN or inf"):
        release_class_gaussians(x, y, num_classes=3, epsilon=EPS, delta=DELTA, bound=1.0, ledger=ledger)
    assert len(ledger) == 0


def test_public_counts_under_add_remove_refused():
    x, y = data()
    with pytest.raises(ConfigError, match="add_or_remove_one"):
        release_class_gaussians(x, y, num_classes=3, epsilon=EPS, delta=DELTA, bound=1.0, counts="public",
                                relation="add_or_remove_one")


def test_budget_refusal_records_and_releases_nothing():
    x, y = data()
    ledger = PrivacyLedger("c0", budget=PrivacyBudget(epsilon=0.5, delta=DELTA))
    g = torch.Generator().manual_seed(0)
    state = g.get_state()
    with pytest.raises(BudgetExceededError):
        release_class_gaussians(x, y, num_classes=3, epsilon=EPS, delta=DELTA, bound=1.0, ledger=ledger, generator=g)
    assert len(ledger) == 0
    assert torch.equal(g.get_state(), state)  # no noise was drawn


def test_counts_public_vs_noisy_recorded():
    x, y = data()
    ledger_pub, ledger_noisy = PrivacyLedger("p"), PrivacyLedger("n")
    rp = release_class_gaussians(x, y, num_classes=3, epsilon=EPS, delta=DELTA, bound=1.0, counts="public",
                                 ledger=ledger_pub, generator=torch.Generator().manual_seed(0), round=2)
    rn = release_class_gaussians(x, y, num_classes=3, epsilon=EPS, delta=DELTA, bound=1.0, counts="noisy",
                                 ledger=ledger_noisy, generator=torch.Generator().manual_seed(0))
    (rec_p,), (rec_n,) = ledger_pub.records, ledger_noisy.records
    assert rec_p.purpose == rec_n.purpose == "dp_gmm" and rec_p.round == 2
    assert rec_p.metadata["counts_public"] is True and rec_n.metadata["counts_public"] is False
    assert "histogram" in rec_p.metadata["relation"] and "histogram" not in rec_n.metadata["relation"]
    # one Gaussian event per message, over sqrt(k) unit-scaled blocks: k = 2 (S1, S2) public, 3 (S1, S2, n) noisy
    assert rec_p.event == rp.event and rp.event.sensitivity == pytest.approx(math.sqrt(2))
    assert rec_n.event == rn.event and rn.event.sensitivity == pytest.approx(math.sqrt(3))
    assert rec_p.metadata["blocks"] == ["sum", "second_moment_sum"]
    assert rec_n.metadata["blocks"] == ["sum", "second_moment_sum", "count"]
    true = np.bincount(y, minlength=3)
    assert [c.count for c in rp.classes] == list(true) and all(isinstance(c.count, int) for c in rp.classes)
    noisy = [c.count for c in rn.classes]
    assert noisy != list(true) and np.allclose(noisy, true, atol=10 * rn.sigmas["count"])


@pytest.mark.parametrize("cov,project", [("full", "ball"), ("diag", "ball"), ("spherical", "ball"),
                                         ("spherical", "sphere")])
@pytest.mark.parametrize("counts,relation", [("public", "replace_one"), ("noisy", "replace_one"),
                                             ("noisy", "add_or_remove_one")])
def test_joint_calibration_spends_exactly_the_budget(cov, project, counts, relation, balle_wang_sigma):
    """The accountant gives back the requested epsilon (the equal split spent ~0.7 of it), and every block's sigma is
    its sensitivity times the Balle-Wang sigma at sqrt(k), solved here without the package."""
    x, y = data()
    sens = block_sensitivities(bound=1.0, covariance=cov, relation=relation, counts=counts, project=project).blocks()
    for eps in (0.3, 1.0, 8.0):
        r = release_class_gaussians(x, y, num_classes=3, epsilon=eps, delta=DELTA, bound=1.0, covariance=cov,
                                    counts=counts, relation=relation, project=project,
                                    generator=torch.Generator().manual_seed(0))
        assert r.event.relation is NeighboringRelation(relation)
        assert epsilon(r.event, DELTA) == pytest.approx(eps, rel=1e-6)
        joint = balle_wang_sigma(eps, DELTA, math.sqrt(len(sens)))
        for name, value in sens.items():
            assert r.sigmas[name] == pytest.approx(value * joint, rel=1e-6)
    if cov == "spherical" and project == "sphere":
        assert r.sigmas["second_moment_sum"] == 0.0 and "second_moment_sum" not in sens


def test_pinned_sigmas_public_diag_and_spherical_sphere():
    """Exact values at (1, 1e-5), B = 1: diag with public counts has k = 2 blocks (2, sqrt2): joint sigma
    3.7306 * sqrt2 = 5.2759, so S1 gets 10.552 and S2 7.4613; spherical on the sphere has only S1: 2 * 3.7306."""
    x, y = data()
    diag = release_class_gaussians(x, y, num_classes=3, epsilon=1.0, delta=1e-5, bound=1.0, covariance="diag",
                                   counts="public", generator=torch.Generator().manual_seed(0))
    assert diag.sigmas["sum"] == pytest.approx(10.5518, abs=2e-3)
    assert diag.sigmas["second_moment_sum"] == pytest.approx(7.4613, abs=2e-3)
    sph = release_class_gaussians(x, y, num_classes=3, epsilon=1.0, delta=1e-5, bound=1.0, covariance="spherical",
                                  counts="public", project="sphere", generator=torch.Generator().manual_seed(0))
    assert sph.sigmas == pytest.approx({"sum": 7.4612, "second_moment_sum": 0.0}, abs=2e-3)


def _noise_draws(cov: str, reps: int = 150, n: int = 3000, d: int = 6, eps: float = 1.0):
    """Recover the noisy S1 and S2 of ``reps`` releases (large n: no projection or flooring binds) minus the truth."""
    x, y = data(n=n, d=d, num_classes=2, seed=5)
    s1, s2, counts = clipped_class_sums(x, y, num_classes=2, bound=1.0, covariance=cov)
    g = torch.Generator().manual_seed(11)
    e1, e2, sigmas = [], [], None
    for _ in range(reps):
        r = release_class_gaussians(x, y, num_classes=2, epsilon=eps, delta=DELTA, bound=1.0, covariance=cov,
                                    counts="public", generator=g)
        sigmas = r.sigmas
        for c in r.classes:
            n_c = counts[c.label]
            e1.append(c.mean * n_c - s1[c.label])
            moment = c.covariance + (torch.outer(c.mean, c.mean) if cov == "full" else c.mean * c.mean)
            e2.append(moment * n_c - s2[c.label])
    return torch.stack(e1), torch.stack(e2), sigmas


@pytest.mark.parametrize("cov", ["diag", "full"])
def test_s1_s2_noise_matches_the_calibrated_sigmas(cov, balle_wang_sigma):
    """The released sums carry noise of exactly the calibrated standard deviation: a release without noise (0), with
    the old equal split (S1 sigma 1.33x larger) or with noise on S1 only would all fail."""
    e1, e2, sigmas = _noise_draws(cov)
    joint = balle_wang_sigma(1.0, DELTA, math.sqrt(2))
    assert sigmas["sum"] == pytest.approx(2.0 * joint, rel=1e-6)
    assert sigmas["second_moment_sum"] == pytest.approx(math.sqrt(2) * joint, rel=1e-6)
    assert float(e1.std()) == pytest.approx(sigmas["sum"], rel=0.06)  # 1800 draws: sd of the estimate ~1.7%
    assert float(e1.mean()) == pytest.approx(0.0, abs=4 * sigmas["sum"] / math.sqrt(e1.numel()))
    if cov == "diag":
        assert float(e2.std()) == pytest.approx(sigmas["second_moment_sum"], rel=0.06)
    else:  # i.i.d. noise on all d^2 entries, then symmetrised: sigma on the diagonal, sigma/sqrt2 off it
        diagonal = torch.diagonal(e2, dim1=1, dim2=2)
        rows, cols = torch.triu_indices(6, 6, offset=1)
        assert float(diagonal.std()) == pytest.approx(sigmas["second_moment_sum"], rel=0.08)
        assert float(e2[:, rows, cols].std()) == pytest.approx(sigmas["second_moment_sum"] / math.sqrt(2), rel=0.06)


def test_spherical_on_the_sphere_spends_nothing_on_s2(balle_wang_sigma):
    """Unit-norm features, public counts: the variance released is (B^2 - ||mean~||^2)/d, a function of the noisy mean
    alone (no S2 noise), and the whole budget goes to S1."""
    x, y = data(n=600, d=5)
    x = x / np.linalg.norm(x, axis=1, keepdims=True)
    r = release_class_gaussians(x, y, num_classes=3, epsilon=2.0, delta=DELTA, bound=1.0, covariance="spherical",
                                counts="public", project="sphere", generator=torch.Generator().manual_seed(4))
    assert r.event.sensitivity == 1.0 ** 0.5 and r.event.sigma == pytest.approx(balle_wang_sigma(2.0, DELTA, 1.0))
    for c in r.classes:
        assert float(c.covariance) == pytest.approx((1.0 - float(c.mean @ c.mean)) / 5, rel=1e-12)
    # "ball" on the same unit-norm data releases S2 and pays for it: a larger S1 sigma
    ball = release_class_gaussians(x, y, num_classes=3, epsilon=2.0, delta=DELTA, bound=1.0, covariance="spherical",
                                   counts="public", generator=torch.Generator().manual_seed(4))
    assert ball.sigmas["sum"] == pytest.approx(math.sqrt(2) * r.sigmas["sum"], rel=1e-9)


def test_sphere_projection_puts_every_feature_on_the_sphere():
    x = np.array([[3.0, 4.0], [0.0, 0.0], [0.1, 0.0]])
    s1, s2, n = clipped_class_sums(x, np.array([0, 0, 0]), num_classes=1, bound=2.0, covariance="spherical",
                                   project="sphere")
    assert torch.allclose(s1[0], torch.tensor([1.2 + 2.0 + 2.0, 1.6], dtype=torch.float64))  # zero -> B e_1
    assert float(s2[0]) == pytest.approx(3 * 4.0)  # n_c B^2


def test_full_covariance_sums_without_n_d_d_intermediates():
    """[n, d, d] outer products here would be 200000 * 64 * 64 * 8 bytes = 6.6 GB; V_c^T V_c per class needs ~0.1 GB."""
    rng = np.random.default_rng(0)
    x, y = rng.normal(size=(200_000, 64)), rng.integers(0, 3, size=200_000)
    before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    s1, s2, n = clipped_class_sums(x, y, num_classes=3, bound=1.0, covariance="full")
    grown_mib = (resource.getrusage(resource.RUSAGE_SELF).ru_maxrss - before) / 1024
    assert grown_mib < 1500
    v = x / np.maximum(np.linalg.norm(x, axis=1, keepdims=True), 1.0)
    np.testing.assert_allclose(s2[1].numpy(), v[y == 1].T @ v[y == 1], rtol=1e-10)


def test_calibrate_blocks_refuses_bad_sensitivities():
    with pytest.raises(ConfigError, match="'count'"):
        calibrate_blocks(epsilon=1.0, delta=DELTA, sensitivities={"sum": 1.0, "count": 0.0})
    with pytest.raises(ConfigError, match="at least one"):
        calibrate_blocks(epsilon=1.0, delta=DELTA, sensitivities={})


def test_empty_class_public_absent_noisy_released():
    x, y = data()
    y = np.where(y == 2, 0, y)  # class 2 empty
    rp = release_class_gaussians(x, y, num_classes=3, epsilon=EPS, delta=DELTA, bound=1.0, counts="public",
                                 generator=torch.Generator().manual_seed(0))
    assert rp.classes[2].count == 0 and not rp.classes[2].released
    rn = release_class_gaussians(x, y, num_classes=3, epsilon=EPS, delta=DELTA, bound=1.0, counts="noisy",
                                 generator=torch.Generator().manual_seed(0))
    assert all(c.released for c in rn.classes)  # presence of a class is not revealed


def test_sample_features_counts_and_moments():
    x, y = data(n=300, d=3, scale=2.0)
    r = release_class_gaussians(x, y, num_classes=3, epsilon=1e4, delta=DELTA, bound=1.0, counts="public",
                                generator=torch.Generator().manual_seed(0))
    fx, fy = sample_features(r, generator=torch.Generator().manual_seed(1))
    assert torch.equal(torch.bincount(fy, minlength=3), torch.as_tensor(np.bincount(y, minlength=3)))
    big_x, big_y = sample_features(r, 20000, generator=torch.Generator().manual_seed(2))
    for c in r.classes:
        sel = big_x[big_y == c.label]
        assert torch.allclose(sel.mean(0), c.mean, atol=0.02)
        assert torch.allclose(torch.cov(sel.T, correction=0), r.covariance_matrix(c.label), atol=0.02)
    same = sample_features(r, 5, generator=torch.Generator().manual_seed(3))[0]
    assert torch.equal(same, sample_features(r, 5, generator=torch.Generator().manual_seed(3))[0])


def test_seeded_release_reproducible():
    x, y = data()
    a = release_class_gaussians(x, y, num_classes=3, epsilon=EPS, delta=DELTA, bound=1.0,
                                generator=torch.Generator().manual_seed(7))
    b = release_class_gaussians(x, y, num_classes=3, epsilon=EPS, delta=DELTA, bound=1.0,
                                generator=torch.Generator().manual_seed(7))
    assert all(torch.equal(p.mean, q.mean) and torch.equal(p.covariance, q.covariance)
               for p, q in zip(a.classes, b.classes))


@pytest.mark.parametrize("covariance,relation,counts,project", [
    ("full", "replace_one", "noisy", "ball"), ("diag", "add_or_remove_one", "noisy", "sphere"),
    ("spherical", "replace_one", "noisy", "sphere")])
def test_the_event_priced_from_the_settings_is_the_event_the_release_records(covariance, relation, counts, project):
    g = torch.Generator().manual_seed(3)
    x, y = torch.randn(60, 5, generator=g), torch.arange(60) % 3
    settings = {"epsilon": 2.0, "delta": 1e-5, "bound": 1.5, "covariance": covariance, "relation": relation,
                "counts": counts, "project": project}
    released = release_class_gaussians(x, y, num_classes=3, generator=g, **settings)
    assert release_event(**settings) == released.event
    assert release_event(**{**settings, "epsilon": 1.0}) != released.event
