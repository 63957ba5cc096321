"""DP-FedPFT release: sensitivities pinned and checked against adversarial neighbours, PSD covariances, accuracy at
large epsilon, refusals (K > 1, NaN, public counts under add/remove), ledger order and an honest budget split."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch

from accounting import BudgetExceededError, NeighboringRelation, PrivacyBudget, PrivacyLedger, epsilon
from privfl.errors import ConfigError
from privfl.privacy.dp_gmm import (
    block_sensitivities,
    clipped_class_sums,
    release_class_gaussians,
    sample_features,
)

EPS, DELTA = 1.0, 1e-5
COVS = ("full", "diag", "spherical")


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
def test_covariance_psd_at_small_epsilon(cov, counts):
    x, y = data(n=60, d=5)
    r = release_class_gaussians(x, y, num_classes=3, epsilon=0.1, delta=DELTA, bound=1.0, covariance=cov,
                                counts=counts, generator=torch.Generator().manual_seed(0))
    for c in r.classes:
        m = r.covariance_matrix(c.label)
        assert torch.allclose(m, m.T)
        assert float(torch.linalg.eigvalsh(m).min()) > 0
        torch.linalg.cholesky(m)
        assert float(torch.linalg.vector_norm(c.mean)) <= 1.0 + 1e-12


@pytest.mark.parametrize("cov", COVS)
@pytest.mark.parametrize("counts", ("noisy", "public"))
def test_large_epsilon_close_to_clipped_statistics(cov, counts):
    x, y = data(n=600, d=4, scale=2.0)
    r = release_class_gaussians(x, y, num_classes=3, epsilon=1e4, delta=DELTA, bound=1.0, covariance=cov,
                                counts=counts, generator=torch.Generator().manual_seed(1))
    s1, s2, n = clipped_class_sums(x, y, num_classes=3, bound=1.0, covariance=cov)
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
    assert "histogram" in rec_p.metadata["relation_detail"]
    assert rec_p.event == rp.event and len(rp.events) == 2
    assert rec_n.event == rn.event and len(rn.events) == 3
    true = np.bincount(y, minlength=3)
    assert [c.count for c in rp.classes] == list(true) and all(isinstance(c.count, int) for c in rp.classes)
    noisy = [c.count for c in rn.classes]
    assert noisy != list(true) and np.allclose(noisy, true, atol=10 * rn.sigmas["count"])


@pytest.mark.parametrize("cov", COVS)
@pytest.mark.parametrize("counts,relation", [("public", "replace_one"), ("noisy", "replace_one"),
                                             ("noisy", "add_or_remove_one")])
def test_split_is_honest(cov, counts, relation):
    x, y = data()
    for eps in (0.3, 1.0, 8.0):
        r = release_class_gaussians(x, y, num_classes=3, epsilon=eps, delta=DELTA, bound=1.0, covariance=cov,
                                    counts=counts, relation=relation, generator=torch.Generator().manual_seed(0))
        assert r.event.relation is NeighboringRelation(relation)
        spent = epsilon(r.event, DELTA)
        assert spent <= eps * (1 + 1e-6)
        assert spent > 0.5 * eps  # and not wastefully loose


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
