"""The decoder baselines of the reconstruction attack and the bootstrap intervals of its tables."""

from __future__ import annotations

import sys
from pathlib import Path

_ROOT = str(Path(__file__).resolve().parents[2])
if _ROOT not in sys.path:   # see test_reconstruction.py: the real `accounting` package must win
    sys.path.insert(0, _ROOT)

import numpy as np  # noqa: E402
import pytest  # noqa: E402
import torch  # noqa: E402

from attacks.decoders import (  # noqa: E402
    ENSEMBLE_MEMBERS,
    TUNING_GRIDS,
    ClassMeanDecoder,
    ConvDecoder,
    KNNDecoder,
    MLPDecoder,
    RandomFeaturesDecoder,
    RidgeDecoder,
    TunedDecoder,
    cross_fitted,
    feature_similarity,
    fit_decoders,
    held_out_mse,
    make_decoder,
)
from attacks.statistics import bootstrap_cell, separated  # noqa: E402
from privfl.errors import ConfigError  # noqa: E402

torch.set_num_threads(1)


def linear_pairs(n: int, seed: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """2 x 2 images that are an affine function of 6-d features (inside [0, 1])."""
    g = torch.Generator().manual_seed(seed)
    features = torch.randn(n, 6, generator=g) * torch.tensor([1.0, 2.0, 0.5, 1.0, 3.0, 1.0])
    mixing = torch.randn(6, 4, generator=torch.Generator().manual_seed(99))
    images = (0.5 + 0.03 * features @ mixing).reshape(n, 1, 2, 2)
    return features, images, torch.zeros(n, dtype=torch.long)


def clustered_pairs(n_per_class: int, seed: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Three classes: features near a class direction, images a class prototype plus pixel noise."""
    g = torch.Generator().manual_seed(seed)
    labels = torch.arange(3).repeat_interleave(n_per_class)
    features = torch.eye(3)[labels] + 0.05 * torch.randn(len(labels), 3, generator=g)
    prototypes = torch.tensor([[0.2, 0.8, 0.2, 0.8], [0.9, 0.1, 0.5, 0.5], [0.5, 0.5, 0.9, 0.1]])
    images = (prototypes[labels] + 0.1 * torch.randn(len(labels), 4, generator=g)).clamp(0, 1)
    return features, images.reshape(-1, 1, 2, 2), labels


def test_ridge_recovers_an_affine_map_and_picks_the_smallest_penalty():
    f, x, y = linear_pairs(300, 0)
    hf, hx, hy = linear_pairs(50, 1)
    ridge = RidgeDecoder(alphas=(1e-6, 1e-1, 10.0)).fit(f, x, y, hf, hx, hy)
    assert ridge.alpha == 1e-6 and set(ridge.details["held_out_mse"]) == {"1e-06", "0.1", "10"}
    assert torch.allclose(ridge.decode(hf), hx, atol=1e-4)
    # a heavy penalty shrinks towards the mean image: worse held-out error
    mse = ridge.details["held_out_mse"]
    assert mse["1e-06"] < mse["0.1"] < mse["10"]


def test_mlp_learns_and_keeps_its_best_epoch():
    f, x, y = linear_pairs(256, 0)
    hf, hx, hy = linear_pairs(64, 1)
    mlp = MLPDecoder(hidden=32, epochs=15, batch_size=32, learning_rate=3e-3, seed=0).fit(f, x, y, hf, hx, hy)
    history = mlp.details["held_out_mse_per_epoch"]
    best = min(history)
    assert mlp.details["best_epoch"] == history.index(best) + 1 and len(history) <= 15
    baseline = float(((hx - x.mean(0)) ** 2).mean())   # predicting the mean image
    assert best < 0.2 * baseline
    assert float(((mlp.decode(hf) - hx) ** 2).mean()) == pytest.approx(best, rel=1e-4)
    again = MLPDecoder(hidden=32, epochs=15, batch_size=32, learning_rate=3e-3, seed=0).fit(f, x, y, hf, hx, hy)
    assert torch.equal(again.decode(hf), mlp.decode(hf))   # seeded


def test_cross_fitted_mlp_estimates_its_own_pairs_with_the_fold_model_that_never_saw_them():
    f, x, y = linear_pairs(120, 0)
    f = f + 0.3 * torch.randn(f.shape, generator=torch.Generator().manual_seed(5))  # noisy: an MLP overfits
    hf, hx, hy = linear_pairs(40, 1)
    options = dict(hidden=64, epochs=12, batch_size=16, learning_rate=3e-3, patience=12, seed=0)
    mlp = MLPDecoder(folds=3, **options).fit(f, x, y, hf, hx, hy)
    assert mlp.details["folds"] == 3 and len(mlp.fold_models) == 3
    assert sorted(torch.bincount(mlp.fold_of).tolist()) == [40, 40, 40]
    out_of_fold = mlp.decode(f, exclude=np.arange(len(f)))
    # A pair's out-of-fold estimate never depends on its own image: replace fold 0's images by noise and refit;
    # fold 0's estimates stay bit-identical, everything that trained on those images moves.
    mine = mlp.fold_of == 0
    x2 = x.clone()
    x2[mine] = torch.rand(x2[mine].shape, generator=torch.Generator().manual_seed(9))
    again = MLPDecoder(folds=3, **options).fit(f, x2, y, hf, hx, hy)
    assert torch.equal(again.fold_of, mlp.fold_of)
    moved = again.decode(f, exclude=np.arange(len(f)))
    assert torch.equal(moved[mine], out_of_fold[mine])
    assert not torch.allclose(moved[~mine], out_of_fold[~mine], atol=1e-3)
    assert not torch.allclose(again.decode(f[mine]), mlp.decode(f[mine]), atol=1e-3)
    # Rows with -1 read the full model; the full model knows its own pairs far better than the fold models do.
    mixed = mlp.decode(f[:4], exclude=[-1, 1, -1, 3])
    assert torch.allclose(mixed[[0, 2]], mlp.decode(f[[0, 2]]), atol=1e-6)
    assert torch.allclose(mixed[[1, 3]], out_of_fold[[1, 3]], atol=1e-6)
    in_sample = float(((mlp.decode(f) - x) ** 2).mean())
    assert float(((out_of_fold - x) ** 2).mean()) > 1.5 * in_sample
    with pytest.raises(ConfigError, match="cross-fitting"):
        MLPDecoder(**options).fit(f, x, y, hf, hx, hy).decode(f[:2], exclude=[0, 1])
    with pytest.raises(ConfigError, match="below the 120"):
        mlp.decode(f[:1], exclude=[120])
    with pytest.raises(ConfigError, match="folds must be 0"):
        MLPDecoder(folds=1)


def test_knn_averages_more_neighbours_when_that_lowers_held_out_error():
    f, x, y = clustered_pairs(20, 0)
    hf, hx, hy = clustered_pairs(5, 1)
    knn = KNNDecoder(ks=(1, 2, 4, 8)).fit(f, x, y, hf, hx, hy)
    assert knn.k == 8 and knn.details["held_out_mse"]["1"] > knn.details["held_out_mse"]["8"]
    similarity = feature_similarity(hf[:1], f)
    nearest8 = similarity.topk(8, dim=1).indices[0]
    assert torch.allclose(knn.decode(hf[:1])[0], x[nearest8].mean(0))
    nn = make_decoder("nn").fit(f, x, y, hf, hx, hy)
    assert nn.name == "nn" and nn.k == 1 and torch.equal(nn.decode(f[5:6]), x[5:6])


def test_knn_leave_one_out_never_returns_the_pair_itself():
    f, x, y = clustered_pairs(10, 0)
    nn = KNNDecoder(ks=(1,), name="nn").fit(f, x, y, f, x, y)
    assert torch.equal(nn.decode(f), x)   # each training feature finds its own image
    own = torch.arange(len(f))
    loo = nn.decode(f, exclude=own)
    similarity = feature_similarity(f, f)
    similarity[own, own] = -float("inf")
    assert torch.equal(loo, x[similarity.argmax(1)]) and not torch.equal(loo, x)
    partly = nn.decode(f[:2], exclude=[-1, 1], chunk=1)   # -1: nothing left out
    assert torch.equal(partly[0], x[0]) and torch.equal(partly[1], loo[1])
    with pytest.raises(ConfigError, match="one index"):
        nn.decode(f[:2], exclude=[0])


def test_class_mean_decodes_the_label():
    f, x, y = clustered_pairs(10, 0)
    decoder = ClassMeanDecoder().fit(f, x, y, f, x, y)
    out = decoder.decode(None, torch.tensor([2, 0]))
    assert torch.allclose(out[0], x[y == 2].mean(0)) and torch.allclose(out[1], x[y == 0].mean(0))
    with pytest.raises(ConfigError, match="needs the released labels"):
        decoder.decode(f)
    with pytest.raises(ConfigError, match=r"labels must lie in \[0, 3\)"):
        decoder.decode(None, torch.tensor([3]))


def test_decoder_errors_name_the_value():
    f, x, y = clustered_pairs(2, 0)
    with pytest.raises(ConfigError, match="unknown decoder 'gan'; valid decoders: ridge, mlp, knn, nn, class-mean"):
        make_decoder("gan")
    with pytest.raises(ConfigError, match="k = 8 needs at least that many"):
        KNNDecoder(ks=(8,)).fit(f, x, y, f, x, y)
    with pytest.raises(ConfigError, match="ks must be"):
        KNNDecoder(ks=(0,))
    with pytest.raises(ConfigError, match="hidden must be an integer >= 1, got 0"):
        MLPDecoder(hidden=0)
    with pytest.raises(ConfigError, match="need"):
        RidgeDecoder().fit(f, x[:2], y, f, x, y)
    fitted = fit_decoders(("class-mean", "nn"), f, x, y, f, x, y)
    assert list(fitted) == ["class-mean", "nn"]


# -- tuned decoders -------------------------------------------------------------------------------------------------

def digit_like_pairs(n: int, seed: int, shift: float = 0.0) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """28 x 28 images that are a smooth (sigmoid) function of 8-d features; ``shift`` moves the features only."""
    g = torch.Generator().manual_seed(seed)
    features = torch.randn(n, 8, generator=g)
    basis = torch.randn(8, 28 * 28, generator=torch.Generator().manual_seed(77))
    images = torch.sigmoid(features @ basis * 0.5).reshape(n, 1, 28, 28)
    return features + shift, images, torch.zeros(n, dtype=torch.long)


def test_tuned_mlp_keeps_the_epoch_with_the_lowest_held_out_error_under_dropout_and_a_cosine_schedule():
    f, x, y = linear_pairs(256, 0)
    hf, hx, hy = linear_pairs(64, 1)
    options = dict(hidden=32, epochs=12, batch_size=32, learning_rate=3e-3, seed=0, dropout=0.3, patience=12)
    mlp = MLPDecoder(schedule="cosine", **options).fit(f, x, y, hf, hx, hy)
    history = mlp.details["held_out_mse_per_epoch"]
    assert len(history) == 12 and mlp.details["best_epoch"] == history.index(min(history)) + 1
    # the kept model is the best epoch's, decoding without dropout (the same estimate twice)
    assert held_out_mse(mlp, hf, hx, hy) == pytest.approx(min(history), rel=1e-4)
    assert torch.equal(mlp.decode(hf), mlp.decode(hf))
    assert any(isinstance(m, torch.nn.Dropout) and m.p == 0.3 for m in mlp.model.modules())
    # seeded, dropout included; the schedule changes the training (a constant rate gives other weights)
    again = MLPDecoder(schedule="cosine", **options).fit(f, x, y, hf, hx, hy)
    assert torch.equal(again.decode(hf), mlp.decode(hf))
    constant = MLPDecoder(**options).fit(f, x, y, hf, hx, hy)
    assert constant.details["held_out_mse_per_epoch"] != history
    with pytest.raises(ConfigError, match="dropout must be a probability"):
        MLPDecoder(dropout=1.0)
    with pytest.raises(ConfigError, match="schedule must be constant or cosine"):
        MLPDecoder(schedule="step")


def test_the_standardiser_is_fitted_on_the_attacker_training_pairs_only():
    f, x, y = digit_like_pairs(200, 0)
    hf, hx, hy = digit_like_pairs(40, 1, shift=5.0)   # held-out features far from the training ones
    fitted = fit_decoders(("mlp-tuned", "conv", "random-features"), f, x, y, hf, hx, hy, mlp_hidden=16,
                          tuned_epochs=1, random_features=64)
    for name, decoder in fitted.items():
        inner = decoder.decoder
        assert torch.allclose(inner.standardise.mean, f.double().mean(0)), name
        assert torch.allclose(inner.standardise.std, f.double().std(0, unbiased=False)), name


def test_the_convolutional_decoder_reaches_28_px_through_a_7_by_7_grid_and_learns():
    f, x, y = digit_like_pairs(400, 0)
    hf, hx, hy = digit_like_pairs(100, 1)
    conv = ConvDecoder(hidden=64, channels=16, epochs=15, batch_size=32, learning_rate=3e-3, seed=0,
                       schedule="cosine").fit(f, x, y, hf, hx, hy)
    grid = next(m for m in conv.model if isinstance(m, torch.nn.Unflatten))
    assert grid.unflattened_size == (16, 7, 7)
    assert [m.out_channels for m in conv.model if isinstance(m, torch.nn.ConvTranspose2d)] == [8, 1]
    out = conv.decode(hf)
    assert out.shape == (100, 1, 28, 28) and float(out.min()) >= 0 and float(out.max()) <= 1
    history = conv.details["held_out_mse_per_epoch"]
    assert conv.details["best_epoch"] == history.index(min(history)) + 1
    baseline = float(((hx - x.mean(0)) ** 2).mean())   # the mean image
    assert held_out_mse(conv, hf, hx, hy) < 0.5 * baseline
    with pytest.raises(ConfigError, match="multiples of 4"):
        ConvDecoder(hidden=8).fit(f[:, :], x[:, :, :26, :26], y, hf, hx[:, :, :26, :26], hy)


def test_a_tuned_decoder_keeps_the_candidate_with_the_lowest_held_out_error_and_records_the_grid():
    f, x, y = linear_pairs(300, 0)
    hf, hx, hy = linear_pairs(50, 1)
    grid = [{"alphas": (10.0,)}, {"alphas": (1e-6,)}, {"alphas": (0.1,)}]
    tuned = TunedDecoder("ridge-grid", lambda c: RidgeDecoder(**c), grid).fit(f, x, y, hf, hx, hy)
    mse = [c["held_out_mse"] for c in tuned.details["grid"]]
    assert [c["config"] for c in tuned.details["grid"]] == grid
    assert tuned.config == {"alphas": (1e-6,)} and tuned.details["chosen"] == tuned.config
    assert mse[1] == min(mse) == tuned.held_out_mse and mse[1] < mse[2] < mse[0]
    assert all(c["cpu_s"] >= 0 for c in tuned.details["grid"])
    alone = RidgeDecoder(alphas=(1e-6,)).fit(f, x, y, hf, hx, hy)
    assert torch.equal(tuned.decode(hf), alone.decode(hf))
    with pytest.raises(ConfigError, match="at least one configuration"):
        TunedDecoder("empty", RidgeDecoder, [])


def test_the_seed_ensemble_averages_the_tuned_mlp_configuration_over_seeds_and_reuses_the_tuned_mlp():
    f, x, y = linear_pairs(200, 0)
    hf, hx, hy = linear_pairs(50, 1)
    fitted = fit_decoders(("mlp-ensemble", "mlp-tuned"), f, x, y, hf, hx, hy, mlp_hidden=16, tuned_epochs=3,
                          seed=4)
    assert list(fitted) == ["mlp-ensemble", "mlp-tuned"]
    tuned, ensemble = fitted["mlp-tuned"], fitted["mlp-ensemble"]
    assert [c["config"] for c in tuned.details["grid"]] == list(TUNING_GRIDS["mlp-tuned"])
    assert ensemble.members[0] is tuned and len(ensemble.members) == ENSEMBLE_MEMBERS
    assert ensemble.details["seeds"] == [4, 5, 6] and ensemble.details["configuration"] == tuned.config
    hidden = int(tuned.config["width"] * 16)
    assert all(m.hidden == hidden and m.dropout == tuned.config["dropout"] and m.schedule == "cosine"
               for m in ensemble.members[1:])
    assert [m.seed for m in ensemble.members[1:]] == [5, 6]
    mean = torch.stack([m.decode(hf) for m in ensemble.members]).mean(0)
    assert torch.equal(ensemble.decode(hf), mean)
    # its CPU time counts the tuned MLP it reused
    assert ensemble.details["cpu_s"] >= tuned.details["cpu_s"] > 0
    assert ensemble.details["member_cpu_s"][0] == tuned.details["cpu_s"]


def test_a_cross_fitted_copy_of_the_tuned_mlp_has_its_full_model_and_out_of_fold_estimates():
    f, x, y = linear_pairs(120, 0)
    hf, hx, hy = linear_pairs(30, 1)
    tuned = make_decoder("mlp-tuned", mlp_hidden=16, tuned_epochs=3).fit(f, x, y, hf, hx, hy)
    guide = cross_fitted(tuned.decoder, 3, name="mlp-tuned").fit(f, x, y, hf, hx, hy)
    assert guide.name == "mlp-tuned" and len(guide.fold_models) == 3
    assert (guide.hidden, guide.dropout, guide.schedule, guide.epochs) == (
        tuned.decoder.hidden, tuned.decoder.dropout, "cosine", 3)
    assert torch.equal(guide.decode(hf), tuned.decode(hf))   # the same full model, trained again
    assert not torch.equal(guide.decode(f, exclude=np.arange(len(f))), guide.decode(f))
    with pytest.raises(ConfigError, match="needs an MLP decoder"):
        cross_fitted(ConvDecoder(hidden=8), 2)


def test_random_features_approximate_a_gaussian_kernel_and_choose_the_bandwidth_on_held_out_pairs():
    f, x, y = digit_like_pairs(300, 0)
    hf, hx, hy = digit_like_pairs(60, 1)
    # the map: phi(z) . phi(z') approximates exp(-|z - z'|^2 / (2 b^2 d)) (many features, no fit needed)
    wide = RandomFeaturesDecoder(features=20000)
    g = torch.Generator().manual_seed(3)
    wide.projection, wide.phase = torch.randn(8, 20000, generator=g), 2 * torch.pi * torch.rand(20000, generator=g)
    z = torch.randn(6, 8, generator=g)
    for b in (0.5, 1.0):
        phi = wide._phi(z, b)
        kernel = torch.exp(-torch.cdist(z, z) ** 2 / (2 * b * b * z.shape[1]))
        assert torch.allclose(phi @ phi.T, kernel, atol=0.03)
    decoder = RandomFeaturesDecoder(features=512, bandwidths=(0.25, 1.0, 4.0), alphas=(1e-3, 1e-1)).fit(
        f, x, y, hf, hx, hy)
    scores = decoder.details["held_out_mse"]
    assert len(scores) == 6 and min(scores, key=scores.get) == f"{decoder.bandwidth:g}/{decoder.alpha:g}"
    assert held_out_mse(decoder, hf, hx, hy) == pytest.approx(min(scores.values()), rel=1e-5)
    ridge = RidgeDecoder().fit(f, x, y, hf, hx, hy)   # a non-linear map: the kernel beats the linear decoder
    assert held_out_mse(decoder, hf, hx, hy) < held_out_mse(ridge, hf, hx, hy)


# -- bootstrap intervals --------------------------------------------------------------------------------------------

def test_bootstrap_interval_of_a_mean_has_the_normal_width():
    values = np.random.default_rng(0).normal(3.0, 1.0, size=(400, 1))
    estimate, low, high = bootstrap_cell([(values, None)], n_boot=2000, seed=1)
    assert estimate[0] == pytest.approx(values.mean())
    assert low[0] < estimate[0] < high[0]
    assert high[0] - low[0] == pytest.approx(2 * 1.96 * values.std() / 20, rel=0.15)   # 1.96 sd / sqrt(n) each side
    constant = bootstrap_cell([(np.full((5, 2), 7.0), None)], n_boot=100)
    assert np.all(constant[1] == 7.0) and np.all(constant[2] == 7.0)


def test_bootstrap_redoes_the_top_selection_and_averages_the_seeds():
    values = np.array([[1.0], [2.0], [3.0], [10.0]])
    rank = np.array([0.1, 0.2, 0.3, 0.9])
    estimate, low, high = bootstrap_cell([(values, rank)], fraction=0.25, n_boot=500, seed=0)
    assert estimate[0] == 10.0 and high[0] == 10.0 and low[0] < 10.0   # resamples without image 3 pick another
    other = np.array([[4.0], [6.0]])
    estimate, _, _ = bootstrap_cell([(values, None), (other, None)], n_boot=100)
    assert estimate[0] == pytest.approx((4.0 + 5.0) / 2)   # the mean of the seeds' means
    with pytest.raises(ConfigError, match="one score per image"):
        bootstrap_cell([(values, rank[:2])], fraction=0.5)
    with pytest.raises(ConfigError, match="n_boot must be an integer >= 1"):
        bootstrap_cell([(values, None)], n_boot=0)
    assert separated((0.0, 1.0), (1.5, 2.0)) and not separated((0.0, 1.6), (1.5, 2.0))
