"""The frozen feature stage (``RunConfig.features``): ScatterNet's shape, its per-record normalisation, the federation
mapped through it once (cached), and a run on features end to end."""

from __future__ import annotations

import pytest
import torch

from privfl.config import RunConfig, run_federation
from privfl.data import FederationSpec, build_federation
from privfl.errors import ConfigError
from privfl.evaluation.novel_pool import held_out_pool
from privfl.experiment import train
from privfl.models.features import ScatterNet, featurize, load_stage
from privfl.privacy.training import TrainingPrivacy

DIGITS = FederationSpec(source="digits", num_clients=6, partition="iid", novel_fraction=0.34, val_fraction=0.2)


def test_scatternet_has_tramer_and_boneh_s_shape_and_normalises_each_record_by_itself():
    stage = ScatterNet()
    x = torch.rand(5, 1, 28, 28)
    features = stage(x)
    assert features.shape == (5, 81 * 7 * 7) and stage.feature_dim == 3969
    # GroupNorm without affine, per record: each of the 27 groups of 3 maps is centred and scaled by its own
    # statistics, var / (var + 1e-5) after it (GroupNorm's epsilon)
    groups = features.reshape(5, 27, 3 * 49)
    raw = stage.scattering(x).reshape(5, 27, 3 * 49)
    assert torch.allclose(groups.mean(dim=2), torch.zeros(5, 27), atol=1e-5)
    expected = raw.var(dim=2, unbiased=False) / (raw.var(dim=2, unbiased=False) + 1e-5)
    assert torch.allclose(groups.var(dim=2, unbiased=False), expected, atol=1e-4)
    # a record's features do not depend on the other records of its batch (the stage spends no privacy)
    alone = stage(x[2:3])
    assert torch.allclose(alone[0], features[2], atol=1e-5)
    other = x.clone()
    other[0] = torch.rand(1, 28, 28)
    assert torch.allclose(stage(other)[2], features[2], atol=1e-5)
    # a different image gives different features
    assert not torch.allclose(stage(other)[0], features[0])


def test_scatternet_refuses_what_it_cannot_map_by_name():
    with pytest.raises(ConfigError, match=r"takes images of shape \[N, 1, 28, 28\], got \(2, 1, 14, 14\)"):
        ScatterNet()(torch.rand(2, 1, 14, 14))
    with pytest.raises(ConfigError, match="groups=10 must divide the 81 coefficient maps"):
        ScatterNet(groups=10)
    with pytest.raises(ConfigError, match="cannot be subsampled by 2\\^J = 4"):
        ScatterNet(shape=(30, 30))
    with pytest.raises(ConfigError, match="the data are vectors of shape \\(8,\\)"):
        load_stage("scatter", (8,))
    with pytest.raises(ConfigError, match="unknown feature stage 'sift'; valid: scatter, mobilenet_v2"):
        load_stage("sift", (1, 28, 28))


def test_a_run_config_names_its_feature_stage_or_none():
    with pytest.raises(ConfigError, match="features must be None .* or one of scatter, mobilenet_v2, got 'sift'"):
        RunConfig(federation=DIGITS, features="sift")
    with pytest.raises(ConfigError, match="features_options .* need a feature stage"):
        RunConfig(federation=DIGITS, features_options={"J": 1})
    config = RunConfig(federation=DIGITS, features="scatter", features_options={"groups": 9}, model="linear")
    assert RunConfig.from_dict(config.to_dict()) == config


def test_featurize_maps_every_client_once_and_keeps_labels_ids_and_splits(tmp_path):
    federation = build_federation(DIGITS, seed=0)
    mapped = featurize(federation, "scatter", {"groups": 9}, cache_dir=str(tmp_path))
    stage = load_stage("scatter", tuple(federation.input_shape), groups=9)
    assert mapped.input_shape == (81 * 2 * 2,)                      # 8x8 digits, J = 2
    for before, after in zip(federation.training_clients, mapped.training_clients, strict=True):
        assert after.client_id == before.client_id and torch.equal(after.y_train, before.y_train)
        assert torch.equal(after.y_val, before.y_val) and len(after.x_val) == len(before.x_val)
        assert torch.allclose(after.x_train, stage(before.x_train), atol=1e-5)
    for before, after in zip(federation.novel_clients, mapped.novel_clients, strict=True):
        assert after.client_id == before.client_id and torch.allclose(after.x, stage(before.x), atol=1e-5)
    assert len(list((tmp_path / "features").iterdir())) == 1      # all clients' inputs in one cached call
    again = featurize(federation, "scatter", {"groups": 9}, cache_dir=str(tmp_path))
    assert torch.equal(again.training_clients[0].x_train, mapped.training_clients[0].x_train)


def test_a_private_run_on_scatter_features_trains_a_linear_head_end_to_end(tmp_path, monkeypatch):
    monkeypatch.setenv("PRIVFL_CACHE_DIR", str(tmp_path / "cache"))
    config = RunConfig(federation=DIGITS, method="fedavg", model="linear", features="scatter",
                       features_options={"groups": 9}, rounds=3, eval_every=3, select="last",
                       method_config={"lr": 1.0, "local_steps": 2, "batch_size": 32},
                       privacy=TrainingPrivacy(mode="record", epsilon=8.0, clip=0.5, min_samples=150))
    assert run_federation(config).input_shape == (324,)
    summary = train(config, str(tmp_path / "run"), progress=False)
    assert summary["model"] == "linear"
    assert 0 < summary["privacy"]["epsilon_max_training"] <= 8.0 + 1e-6
    assert summary["novel"]["accuracy_mean"] > 30       # 10 classes: far above chance after three private rounds


def test_with_every_training_image_used_the_held_out_pool_is_the_test_split():
    spec = FederationSpec(source="digits", num_clients=4, partition="iid", split="train_test", novel_clients=2)
    x, y = held_out_pool(spec, seed=0)
    assert len(y) == 360 and x.shape[1:] == (1, 8, 8)                # digits' test split


def test_two_runs_computing_the_same_features_at_once_both_get_them(tmp_path, monkeypatch):
    # two processes (here threads) that miss the cache together each write the file: each through a temporary name
    # of its own, so neither moves the other's half-written file into place
    import threading

    import numpy as np

    from privfl.models import backbones

    stage = ScatterNet(shape=(8, 8), groups=9)
    x = torch.rand(6, 1, 8, 8)
    both_written = threading.Barrier(2)
    savez = np.savez

    def slow_savez(path, **arrays):
        savez(path, **arrays)
        both_written.wait(timeout=10)          # both temporaries exist before either is moved

    monkeypatch.setattr(backbones.np, "savez", slow_savez)
    results, errors = [], []

    def work():
        try:
            results.append(backbones.extract_features(stage, x, cache_dir=tmp_path, progress=False))
        except Exception as error:   # noqa: BLE001 - the test reports any failure of either
            errors.append(error)

    threads = [threading.Thread(target=work) for _ in range(2)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert not errors and len(results) == 2 and np.array_equal(results[0], results[1])
    assert [p.name for p in (tmp_path / "features").iterdir() if "tmp" in p.name] == []
