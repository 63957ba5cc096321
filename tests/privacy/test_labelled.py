"""The labelled-record descriptor release: sensitivity 2B/n with the label part of the record, analytic sigma."""

import pytest
import torch
from torch import nn

from privfl.errors import ConfigError
from privfl.models.pefll import EmbeddingNetwork
from privfl.privacy.labelled import certify_labelled_mean, release_labelled_mean

from accounting import NeighboringRelation, analytic_gaussian_sigma  # noqa: E402  (after privfl, see test_pefll)

torch.set_num_threads(1)


def test_the_certificate_is_2b_over_n_replace_one_and_names_the_labelled_record():
    cert = certify_labelled_mean(0.5, 20)
    assert cert.value == pytest.approx(0.05) and cert.n == 20 and cert.n_public
    assert cert.relation is NeighboringRelation.REPLACE_ONE
    assert "labelled pair (x, y)" in cert.argument


def test_replacing_one_record_label_or_image_moves_the_clipped_mean_by_at_most_2b_over_n_and_nearly_attains_it():
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
    assert 0 < worst <= 2 * bound / 10 + 1e-7


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
