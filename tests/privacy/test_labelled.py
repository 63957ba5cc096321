"""The labelled-record descriptor release: sensitivity 2B/n with the label part of the record, analytic sigma."""

import pytest
import torch
from torch import nn

from accounting import NeighboringRelation, analytic_gaussian_sigma  # noqa: E402  (after privfl, see test_pefll)
from privfl.errors import ConfigError
from privfl.models.pefll import EmbeddingNetwork
from privfl.privacy.labelled import certify_labelled_mean, release_labelled_mean

torch.set_num_threads(1)


def test_the_certificate_is_2b_over_n_replace_one_and_names_the_labelled_record():
    cert = certify_labelled_mean(0.5, 20)
    assert cert.value == pytest.approx(0.05) and cert.n == 20 and cert.n_public
    assert cert.relation is NeighboringRelation.REPLACE_ONE
    assert "labelled pair (x, y)" in cert.argument


def test_replacing_one_record_label_or_image_moves_the_clipped_mean_by_at_most_2b_over_n_and_a_real_share_of_it():
    torch.manual_seed(0)
    net = EmbeddingNetwork((1, 16, 16), 4, embed_dim=3, kind="cnn")
    x, y = torch.randn(10, 1, 16, 16), torch.randint(0, 4, (10,))
    bound = 0.05  # below the embeddings' norms, so every row is clipped onto the sphere
    with torch.no_grad():
        base = net.descriptor(x, y, bound=bound)
        worst = 0.0
        for label in range(4):              # replace record 0's label only, then its image and label
            y2 = y.clone()
            y2[0] = label
            worst = max(worst, float((net.descriptor(x, y2, bound=bound) - base).norm()))
            x2 = x.clone()
            x2[0] = -5 * x[0]
            worst = max(worst, float((net.descriptor(x2, y2, bound=bound) - base).norm()))
    # the bound holds, and is not loose by orders of magnitude: these few replacements already reach 45% of it
    assert 0.3 * 2 * bound / 10 <= worst <= 2 * bound / 10 + 1e-7


class _Huge(nn.Module):
    """An embedding far outside the ball: [1000 * x, 1000 * one_hot(y)] (what a hostile server could send)."""

    def forward(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        return 1000 * torch.cat([x.flatten(1), nn.functional.one_hot(y, 3).to(x.dtype)], dim=1)


def test_the_release_clips_each_record_outside_the_network_then_adds_exactly_the_calibrated_noise():
    x, y = torch.randn(8, 4, dtype=torch.float64), torch.tensor([0, 1, 2, 0, 1, 2, 0, 1])
    noisy, event, cert = release_labelled_mean(_Huge(), x, y, epsilon=1.0, delta=1e-5, bound=0.5, num_classes=3,
                                               generator=torch.Generator().manual_seed(5))
    rows = _Huge()(x, y)
    clipped_mean = (rows * torch.clamp(0.5 / rows.norm(dim=1, keepdim=True), max=1.0)).mean(dim=0)
    z = torch.randn(clipped_mean.shape, generator=torch.Generator().manual_seed(5), dtype=torch.float64)
    assert event.sigma == pytest.approx(analytic_gaussian_sigma(1.0, 1e-5, 2 * 0.5 / 8), rel=1e-12)
    assert cert.value == pytest.approx(2 * 0.5 / 8)
    assert torch.allclose(noisy, clipped_mean + event.sigma * z, atol=1e-12)


class _Remembering(nn.Module):
    """Adds each record to a buffer and returns the running sum: record j's row depends on records 1..j."""

    def __init__(self) -> None:
        super().__init__()
        self.register_buffer("seen", torch.zeros(4, dtype=torch.float64))

    def forward(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        self.seen.add_(x.flatten(1).sum(0))
        return self.seen.unsqueeze(0).clone()


def test_an_embedding_that_keeps_state_from_record_to_record_is_refused_and_restored():
    from accounting import PrivacyLedger

    embedding, ledger = _Remembering(), PrivacyLedger(0)
    x, y = torch.randn(8, 4, dtype=torch.float64), torch.zeros(8, dtype=torch.long)
    with pytest.raises(ConfigError, match=r"embedding changed its state while it ran \(seen\)"):
        release_labelled_mean(embedding, x, y, epsilon=1.0, delta=1e-5, bound=0.5, num_classes=3, ledger=ledger)
    assert len(ledger) == 0 and torch.equal(embedding.seen, torch.zeros(4, dtype=torch.float64))


def test_with_a_ledger_the_release_is_recorded_first_and_refused_over_budget():
    from accounting import BudgetExceededError, PrivacyBudget, PrivacyLedger

    ledger = PrivacyLedger("c", budget=PrivacyBudget(epsilon=1.2, delta=1e-5))   # two such releases compose to ~1.45
    x, y = torch.randn(8, 4), torch.tensor([0, 1, 2, 0, 1, 2, 0, 1])
    release_labelled_mean(_Huge(), x, y, epsilon=1.0, delta=1e-5, bound=0.5, num_classes=3, ledger=ledger)
    (record,) = ledger.records
    assert record.purpose == "descriptor" and record.metadata["noise"] == "secure" and record.metadata["n"] == 8
    assert ledger.spent(1e-5).epsilon == pytest.approx(1.0, rel=1e-3)
    with pytest.raises(BudgetExceededError):
        release_labelled_mean(_Huge(), x, y, epsilon=1.0, delta=1e-5, bound=0.5, num_classes=3, ledger=ledger)
    assert len(ledger) == 1


def test_release_uses_the_analytic_sigma_for_2b_over_n_and_adds_that_much_noise():
    net = EmbeddingNetwork((3,), 2, embed_dim=4, kind="mlp")
    x, y = torch.randn(25, 3), torch.randint(0, 2, (25,))
    value, event, cert = release_labelled_mean(net, x, y, epsilon=1.5, delta=1e-6, bound=2.0, num_classes=2,
                                               generator=torch.Generator().manual_seed(1))
    assert cert.value == pytest.approx(4.0 / 25)
    assert event.sensitivity == pytest.approx(4.0 / 25)
    assert event.sigma == pytest.approx(analytic_gaussian_sigma(1.5, 1e-6, 4.0 / 25), rel=1e-12)
    with torch.no_grad():
        clean = net.descriptor(x, y, bound=2.0)
    expected_noise = event.sigma * torch.randn(4, generator=torch.Generator().manual_seed(1), dtype=torch.float64)
    assert torch.allclose(value.double(), clean.double() + expected_noise, atol=1e-5)


def test_the_clip_is_applied_outside_the_network_so_a_huge_embedding_cannot_void_the_bound():
    class Huge(nn.Module):
        def forward(self, x, y):
            return 1e6 * torch.ones(len(y), 2) * (1 + y[:, None].float())

    x, y = torch.zeros(4, 1), torch.tensor([0, 1, 1, 0])
    # a tiny sigma (huge epsilon): the release stays within the ball of radius B, not at 1e6
    value, event, _ = release_labelled_mean(Huge(), x, y, epsilon=1000.0, delta=1e-5, bound=1.0, num_classes=2,
                                            generator=torch.Generator().manual_seed(0))
    assert event.sigma < 0.05 and float(value.norm()) <= 1.0 + 8 * event.sigma  # unclipped it would be ~2e6


def test_bad_inputs_release_nothing_and_say_why():
    net = EmbeddingNetwork((3,), 2, embed_dim=2, kind="mlp")
    x = torch.randn(5, 3)
    with pytest.raises(ConfigError, match="public label set 0..1, got range \\[0, 2\\]"):
        release_labelled_mean(net, x, torch.tensor([0, 1, 2, 0, 1]), epsilon=1.0, delta=1e-5, bound=1.0,
                              num_classes=2)
    bad = x.clone()
    bad[0, 0] = float("nan")
    with pytest.raises(ConfigError, match="NaN"):
        release_labelled_mean(net, bad, torch.zeros(5, dtype=torch.int64), epsilon=1.0, delta=1e-5, bound=1.0,
                              num_classes=2)
    with pytest.raises(ConfigError, match="epsilon must be a finite number > 0"):
        release_labelled_mean(net, x, torch.zeros(5, dtype=torch.int64), epsilon=0.0, delta=1e-5, bound=1.0,
                              num_classes=2)
    with pytest.raises(ConfigError, match="bound"):
        release_labelled_mean(net, x, torch.zeros(5, dtype=torch.int64), epsilon=1.0, delta=1e-5, bound=-1.0,
                              num_classes=2)
    with pytest.raises(ConfigError, match="y must be an integer tensor of shape \\[5\\] aligned with x, got shape "
                                          "\\(5,\\), dtype torch.bool"):
        release_labelled_mean(net, x, torch.zeros(5, dtype=torch.bool), epsilon=1.0, delta=1e-5, bound=1.0,
                              num_classes=2)
    with pytest.raises(ConfigError, match="num_classes must be an integer >= 1 \\(the public label set\\), got None"):
        release_labelled_mean(net, x, torch.zeros(5, dtype=torch.int64), epsilon=1.0, delta=1e-5, bound=1.0,
                              num_classes=None)
    # uint8 labels are integers too
    value, _, _ = release_labelled_mean(net, x, torch.zeros(5, dtype=torch.uint8), epsilon=1.0, delta=1e-5, bound=1.0,
                                        num_classes=2)
    assert value.shape == (2,)


def test_add_or_remove_one_with_a_noise_multiplier_calibrates_to_2b_over_min_samples_and_keeps_n_private():
    x, y = torch.randn(12, 4, dtype=torch.float64), torch.tensor([0, 1, 2] * 4)
    noisy, event, cert = release_labelled_mean(_Huge(), x, y, bound=0.5, num_classes=3, noise_multiplier=1.5,
                                               relation="add_or_remove_one", min_samples=8,
                                               generator=torch.Generator().manual_seed(3))
    # 2B / min_samples, not 2B / n: n = 12 is private and must not set the noise
    assert cert.value == pytest.approx(2 * 0.5 / 8) and not cert.n_public and cert.n == 8
    assert event.relation is NeighboringRelation.ADD_OR_REMOVE_ONE
    assert event.sensitivity == pytest.approx(0.125) and event.sigma == pytest.approx(1.5 * 0.125)
    assert "adds or removes exactly one clipped embedding" in cert.argument
    rows = _Huge()(x, y)
    clipped_mean = (rows * torch.clamp(0.5 / rows.norm(dim=1, keepdim=True), max=1.0)).mean(dim=0)
    z = torch.randn(clipped_mean.shape, generator=torch.Generator().manual_seed(3), dtype=torch.float64)
    assert torch.allclose(noisy, clipped_mean + 1.5 * 0.125 * z, atol=1e-12)


def test_removing_one_record_moves_the_clipped_mean_by_at_most_2b_over_the_larger_size():
    torch.manual_seed(1)
    net = EmbeddingNetwork((3,), 3, embed_dim=2, kind="mlp")
    x, y = torch.randn(9, 3), torch.randint(0, 3, (9,))
    with torch.no_grad():
        full = net.descriptor(x, y, bound=0.01)          # every row clipped onto the sphere of radius 0.01
        worst = max(float((net.descriptor(torch.cat([x[:j], x[j + 1:]]), torch.cat([y[:j], y[j + 1:]]), bound=0.01)
                           - full).norm()) for j in range(9))
    assert 0.2 * 2 * 0.01 / 9 <= worst <= 2 * 0.01 / 9 + 1e-9


def test_a_client_below_min_samples_is_refused_without_its_size_in_the_message():
    x, y = torch.randn(5, 4), torch.zeros(5, dtype=torch.int64)
    with pytest.raises(ConfigError, match="fewer labelled records than the public lower bound min_samples=8") as err:
        release_labelled_mean(_Huge(), x, y, bound=0.5, num_classes=3, noise_multiplier=1.0,
                              relation="add_or_remove_one", min_samples=8)
    assert "5" not in str(err.value)
    with pytest.raises(ConfigError, match="give min_samples as an int >= 2, got min_samples=None"):
        release_labelled_mean(_Huge(), x, y, bound=0.5, num_classes=3, noise_multiplier=1.0,
                              relation="add_or_remove_one")
    with pytest.raises(ConfigError, match="min_samples is used only with relation='add_or_remove_one'"):
        release_labelled_mean(_Huge(), x, y, epsilon=1.0, delta=1e-5, bound=0.5, num_classes=3, min_samples=4)
    with pytest.raises(ConfigError, match="give either epsilon and delta or noise_multiplier"):
        release_labelled_mean(_Huge(), x, y, epsilon=1.0, delta=1e-5, bound=0.5, num_classes=3, noise_multiplier=1.0)
