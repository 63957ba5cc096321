"""A feature-conditioned diffusion model that turns released feature vectors back into images (FedPFT paper, App. E.3).

The attacker trains a denoising diffusion model on pairs ``(E(x), x)`` of its own images; given a released feature,
DDIM sampling with classifier-free guidance draws images that have that feature. Entry points:
:class:`ReconstructorConfig`, :class:`Reconstructor` (fit, sample, export), :func:`train_or_resume`,
:func:`select_sampling`, :func:`select_one_step_guidance`, :func:`resolve_device`. The model and its unstated
choices, devices, checkpoints and exported weights: docs/attacks.md, "The diffusion reconstructor".

Example (a tiny model on random data):
    >>> import torch
    >>> config = ReconstructorConfig(feature_dim=4, image_size=16, block_channels=(8, 8), layers_per_block=1,
    ...                              batch_size=4)
    >>> r = Reconstructor(config, seed=0)
    >>> losses = r.fit(torch.randn(8, 4), torch.rand(8, 1, 16, 16), steps=2, progress=False)
    >>> r.sample(torch.randn(3, 4), guidance_scale=2.0, num_inference_steps=2).shape
    torch.Size([3, 1, 16, 16])
"""

from __future__ import annotations

import copy
import hashlib
import math
import numbers
import os
from dataclasses import asdict, dataclass, fields
from pathlib import Path
from typing import Any

import numpy as np
import torch
from torch import nn

from accounting.validation import is_int_at_least, is_real
from privfl.errors import ConfigError
from privfl.models.backbones import file_sha256

__all__ = ["ARCHITECTURE", "CHECKPOINT_FORMAT", "DEVICES", "EXPORT_FORMAT", "FEATURE_TOLERANCE", "PRECISIONS",
           "PREDICTION_TYPES", "FeatureConditionedUNet", "Reconstructor",
           "ReconstructorConfig", "SamplingSettings", "data_fingerprint", "file_sha256", "resolve_device",
           "resolve_precision", "select_one_step_guidance", "select_sampling", "train_or_resume"]

CHECKPOINT_FORMAT = 3
#: The ``format`` of :meth:`Reconstructor.export`'s file.
EXPORT_FORMAT = "ema-weights-1"
#: Largest difference allowed between the per-dimension means, and between the per-dimension standard deviations,
#: of the features exported weights were trained on and the features they are evaluated with (absolute; unit-norm
#: features of a few hundred dimensions have entries of order 0.03, a device's rounding differences are about 1e-6).
FEATURE_TOLERANCE = 1e-4
#: The :class:`ReconstructorConfig` fields a fine-tuned reconstructor must share with the weights it starts from:
#: the network's shapes and what its output means (the training-only fields, learning rate, batch size, condition
#: dropout and EMA decay, may differ).
ARCHITECTURE = ("feature_dim", "image_size", "channels", "block_channels", "layers_per_block", "mid_attention",
                "attention", "norm_groups", "train_timesteps", "beta_schedule", "prediction_type", "condition_dims",
                "guide_image")
BETA_SCHEDULES = ("linear", "scaled_linear", "squaredcos_cap_v2")
PREDICTION_TYPES = ("v_prediction", "epsilon")
DEVICES = ("auto", "cpu", "cuda", "cuda:N")
PRECISIONS = ("auto", "fp32", "bf16", "fp16")


def resolve_device(name: str | torch.device) -> torch.device:
    """The torch device for ``name``: ``"auto"`` is CUDA when a CUDA device is visible, else the CPU; ``"cpu"``;
    ``"cuda"`` or ``"cuda:N"``, which must exist (an error otherwise: never a silent fall-back to the CPU).

    >>> resolve_device("cpu")
    device(type='cpu')
    """
    if isinstance(name, torch.device):
        name = str(name)
    if not isinstance(name, str):
        raise ConfigError(f"device must be one of {', '.join(DEVICES)}, got {name!r}")
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if name == "cpu":
        return torch.device("cpu")
    if name == "cuda" or (name.startswith("cuda:") and name[5:].isdigit()):
        if not torch.cuda.is_available():
            raise ConfigError(f"device {name!r}: no CUDA device is visible here (torch.cuda.is_available() is "
                              f"False); use 'cpu', or 'auto' to take CUDA only when there is one")
        index = int(name[5:]) if ":" in name else 0
        if index >= torch.cuda.device_count():
            raise ConfigError(f"device {name!r}: only {torch.cuda.device_count()} CUDA device(s) here")
        return torch.device(name)
    raise ConfigError(f"device must be one of {', '.join(DEVICES)}, got {name!r}")


def resolve_precision(name: str, device: torch.device) -> torch.dtype | None:
    """The autocast dtype of ``precision`` ``name`` on ``device`` (``None``: float32, no autocast).

    ``"auto"``: bfloat16 on a CUDA device that supports it, float16 on one that does not, float32 on the CPU;
    ``"fp32"``; ``"bf16"`` (CUDA or CPU); ``"fp16"`` (CUDA only: CPU float16 autocast is refused).
    """
    if name not in PRECISIONS:
        raise ConfigError(f"precision must be one of {', '.join(PRECISIONS)}, got {name!r}")
    cuda = device.type == "cuda"
    if name == "auto":
        if not cuda:
            return None
        return torch.bfloat16 if torch.cuda.is_bf16_supported() else torch.float16
    if name == "fp32":
        return None
    if name == "fp16" and not cuda:
        raise ConfigError(f"precision 'fp16' needs a CUDA device, got device {str(device)!r} (use bf16 or fp32)")
    return torch.bfloat16 if name == "bf16" else torch.float16


def _positive_int(name: str, value: object, minimum: int = 1) -> int:
    if isinstance(value, bool) or not isinstance(value, numbers.Integral) or value < minimum:
        raise ConfigError(f"{name} must be an integer >= {minimum}, got {value!r}")
    return int(value)


def _real(name: str, value: object, low: float, high: float, *, low_open: bool = False) -> float:
    if not is_real(value) or not math.isfinite(value) \
            or value > high or value < low or (low_open and value == low):
        bracket = "(" if low_open else "["
        raise ConfigError(f"{name} must be a number in {bracket}{low}, {high}], got {value!r}")
    return float(value)


@dataclass(frozen=True)
class ReconstructorConfig:
    """Architecture and training settings of the reconstructor (every field is saved in the checkpoint).

    Attributes:
        feature_dim: d, the length of the feature vectors it is conditioned on.
        image_size: side of the square images it generates (pixels; MNIST's native 28 halves to 14 and 7 in three
            levels).
        channels: image channels (1 for MNIST).
        block_channels: U-Net channels per resolution level (one down-sampling between consecutive levels).
        layers_per_block: residual blocks per level (the up path has one more, diffusers' layout).
        mid_attention: self-attention in the middle block, at the lowest resolution (diffusers' ``add_attention``).
        attention: also self-attention blocks in the deepest down and up levels.
        norm_groups: groups of the group normalisation (divides every entry of ``block_channels``).
        train_timesteps: T of the forward process.
        beta_schedule: ``"squaredcos_cap_v2"`` (cosine, Nichol and Dhariwal 2021), ``"linear"`` or
            ``"scaled_linear"``.
        prediction_type: what the network predicts, ``"v_prediction"`` or ``"epsilon"`` (module docstring, 1).
        cond_dropout: probability of training an example with the null (zero) condition, in [0, 1].
        learning_rate: AdamW learning rate.
        batch_size: training examples per step.
        ema_decay: decay of the weight average used for sampling, in [0, 1).
        condition_dims: principal components the feature is whitened to before the conditioning MLP (at most
            ``feature_dim``, and fewer than the training pairs); ``None``: per-dimension standardisation.
        guide_image: the UNet also reads a decoder's estimate of the image (``channels`` more input channels; module
            docstring, 6); training and sampling then need those estimates.
    """

    feature_dim: int
    image_size: int = 28
    channels: int = 1
    block_channels: tuple[int, ...] = (32, 64, 128)
    layers_per_block: int = 2
    mid_attention: bool = True
    attention: bool = False
    norm_groups: int = 8
    train_timesteps: int = 1000
    beta_schedule: str = "squaredcos_cap_v2"
    prediction_type: str = "v_prediction"
    cond_dropout: float = 0.1
    learning_rate: float = 2e-4
    batch_size: int = 64
    ema_decay: float = 0.999
    condition_dims: int | None = None
    guide_image: bool = False

    def __post_init__(self) -> None:
        _positive_int("feature_dim", self.feature_dim)
        _positive_int("image_size", self.image_size, 8)
        _positive_int("channels", self.channels)
        blocks = tuple(self.block_channels) if isinstance(self.block_channels, (list, tuple)) else None
        if not blocks or any(not is_int_at_least(c, 1) for c in blocks):
            raise ConfigError(f"block_channels must be a non-empty sequence of positive integers, "
                              f"got {self.block_channels!r}")
        object.__setattr__(self, "block_channels", tuple(int(c) for c in blocks))
        _positive_int("layers_per_block", self.layers_per_block)
        groups = _positive_int("norm_groups", self.norm_groups)
        if any(c % groups for c in self.block_channels):
            raise ConfigError(f"norm_groups={groups} must divide every entry of block_channels "
                              f"{self.block_channels}")
        _positive_int("train_timesteps", self.train_timesteps, 2)
        if self.beta_schedule not in BETA_SCHEDULES:
            raise ConfigError(f"beta_schedule must be one of {', '.join(BETA_SCHEDULES)}, got {self.beta_schedule!r}")
        if self.prediction_type not in PREDICTION_TYPES:
            raise ConfigError(f"prediction_type must be one of {', '.join(PREDICTION_TYPES)}, got "
                              f"{self.prediction_type!r}")
        _real("cond_dropout", self.cond_dropout, 0.0, 1.0)
        _real("learning_rate", self.learning_rate, 0.0, 1.0, low_open=True)
        _positive_int("batch_size", self.batch_size)
        _real("ema_decay", self.ema_decay, 0.0, 0.999999)
        for name in ("mid_attention", "attention", "guide_image"):
            if not isinstance(getattr(self, name), bool):
                raise ConfigError(f"{name} must be True or False, got {getattr(self, name)!r}")
        if self.condition_dims is not None:
            _positive_int("condition_dims", self.condition_dims)
            if self.condition_dims > self.feature_dim:
                raise ConfigError(f"condition_dims={self.condition_dims} must be at most feature_dim="
                                  f"{self.feature_dim} (or None for per-dimension standardisation)")

    @property
    def condition_width(self) -> int:
        """The length of the whitened feature the conditioning MLP reads."""
        return self.feature_dim if self.condition_dims is None else self.condition_dims

    def to_dict(self) -> dict[str, Any]:
        out = asdict(self)
        out["block_channels"] = list(self.block_channels)
        return out

    @classmethod
    def from_dict(cls, values: dict[str, Any]) -> ReconstructorConfig:
        known = {f.name for f in fields(cls)}
        unknown = sorted(set(values) - known)
        if unknown:
            raise ConfigError(f"unknown reconstructor settings {unknown}; valid: {sorted(known)}")
        return cls(**values)


class FeatureConditionedUNet(nn.Module):
    """``UNet2DModel`` whose timestep embedding gets ``MLP(whitened feature)`` added (the condition).

    The whitening is ``(f - feature_mean) @ feature_projection`` (buffers, saved with the weights; set by
    :meth:`Reconstructor.set_feature_statistics`).

    ``forward(x_t, t, features, keep, guide)``: ``keep`` is a boolean ``[B]`` mask; where it is False the condition
    embedding is the null embedding (zero), i.e. the unconditional model; ``guide`` the decoder's estimates on [0, 1]
    (``guide_image`` only), zeroed with the condition.
    """

    feature_mean: torch.Tensor   # buffers (register_buffer)
    feature_projection: torch.Tensor

    def __init__(self, config: ReconstructorConfig) -> None:
        super().__init__()
        from diffusers import UNet2DModel

        levels = len(config.block_channels)
        down = ["DownBlock2D"] * levels
        up = ["UpBlock2D"] * levels
        if config.attention:
            down[-1], up[0] = "AttnDownBlock2D", "AttnUpBlock2D"
        self.guide_image = config.guide_image
        self.unet = UNet2DModel(
            sample_size=config.image_size, in_channels=config.channels * (2 if config.guide_image else 1),
            out_channels=config.channels,
            block_out_channels=config.block_channels, layers_per_block=config.layers_per_block,
            down_block_types=tuple(down), up_block_types=tuple(up), norm_num_groups=config.norm_groups,
            resnet_time_scale_shift="scale_shift", class_embed_type="identity", add_attention=config.mid_attention)
        width = 4 * config.block_channels[0]  # UNet2DModel's time-embedding width
        r = config.condition_width
        first, last = nn.Linear(r, width), nn.Linear(width, width)
        self.condition = nn.Sequential(first, nn.SiLU(), last)
        nn.init.zeros_(last.weight)
        nn.init.zeros_(last.bias)
        self.register_buffer("feature_mean", torch.zeros(config.feature_dim))
        self.register_buffer("feature_projection", torch.eye(config.feature_dim, r))

    def whiten(self, features: torch.Tensor) -> torch.Tensor:
        """``[n, d]`` features -> ``[n, condition_width]`` whitened (or standardised) coordinates."""
        return (features - self.feature_mean) @ self.feature_projection

    def condition_embedding(self, features: torch.Tensor, keep: torch.Tensor | None = None) -> torch.Tensor:
        embedding = self.condition(self.whiten(features))
        if keep is not None:
            embedding = embedding * keep.to(embedding.dtype)[:, None]
        return embedding

    def forward(self, x: torch.Tensor, t: torch.Tensor, features: torch.Tensor,
                keep: torch.Tensor | None = None, guide: torch.Tensor | None = None) -> torch.Tensor:
        if self.guide_image:
            if guide is None:
                raise ConfigError("this reconstructor reads a decoder's estimate beside x_t (guide_image=True); "
                                  "pass the guide images")
            g = guide * 2.0 - 1.0   # on x_0's scale; the null input (condition dropped) is zero
            if keep is not None:
                g = g * keep.to(g.dtype)[:, None, None, None]
            x = torch.cat([x, g.to(x.dtype)], dim=1)
        return self.unet(x, t, class_labels=self.condition_embedding(features, keep)).sample


def data_fingerprint(*arrays: Any) -> str:
    """sha256 of ``arrays`` in order (shapes, dtypes and bytes; ``None`` skipped), e.g. the training pairs and the
    decoder's estimates: a checkpoint is reused only on the same data."""
    hasher = hashlib.sha256()
    for array in (a for a in arrays if a is not None):
        a = np.ascontiguousarray(array.detach().cpu().numpy() if isinstance(array, torch.Tensor) else array)
        hasher.update(f"{a.dtype}{a.shape}".encode())
        hasher.update(a.tobytes())
    return hasher.hexdigest()


@dataclass(frozen=True)
class SamplingSettings:
    """How :meth:`Reconstructor.sample` draws (module docstring, 4 and 5).

    Attributes:
        guidance_scale: w >= 0 (0 unconditional, 1 conditional, > 1 guided).
        guidance_interval: ``(low, high)`` fractions of T; ``w`` applies while ``low <= t / T <= high`` and
            ``w = 1`` elsewhere (``(0, 1)``: everywhere).
        guidance_rescale: phi in [0, 1] of Lin et al. 2024, eq. 16 (0: none).
        num_inference_steps: DDIM steps over the whole range [0, T) (an initialised draw runs the ones below t = s T).
        init_strength: s in (0, 1] for decoder-guided initialisation, or ``None`` to start from pure noise.
    """

    guidance_scale: float = 1.0
    guidance_interval: tuple[float, float] = (0.0, 1.0)
    guidance_rescale: float = 0.0
    num_inference_steps: int = 20
    init_strength: float | None = None

    def __post_init__(self) -> None:
        _real("guidance_scale", self.guidance_scale, 0.0, 1e3)
        interval = tuple(self.guidance_interval) if isinstance(self.guidance_interval, (list, tuple)) else ()
        if len(interval) != 2 or not 0 <= _real("guidance_interval", interval[0], 0.0, 1.0) <= \
                _real("guidance_interval", interval[1], 0.0, 1.0):
            raise ConfigError(f"guidance_interval must be (low, high) with 0 <= low <= high <= 1, got "
                              f"{self.guidance_interval!r}")
        object.__setattr__(self, "guidance_interval", (float(interval[0]), float(interval[1])))
        _real("guidance_rescale", self.guidance_rescale, 0.0, 1.0)
        _positive_int("num_inference_steps", self.num_inference_steps)
        if self.init_strength is not None:
            _real("init_strength", self.init_strength, 0.0, 1.0, low_open=True)

    @property
    def label(self) -> str:
        """A short name, e.g. ``w=2 [0.2, 0.8] phi=0.7 init=0.6``."""
        text = f"w={self.guidance_scale:g}"
        if self.guidance_interval != (0.0, 1.0) and self.guidance_scale != 1.0:
            text += f" [{self.guidance_interval[0]:g}, {self.guidance_interval[1]:g}]"
        if self.guidance_rescale and self.guidance_scale != 1.0:
            text += f" phi={self.guidance_rescale:g}"
        if self.init_strength is not None:
            text += f" init={self.init_strength:g}"
        return text

    def to_dict(self) -> dict[str, Any]:
        out = asdict(self)
        out["guidance_interval"] = list(self.guidance_interval)
        return out


class Reconstructor:
    """The attacker's conditional diffusion model: :meth:`fit` on ``(E(x), x)`` pairs, :meth:`sample` from features.

    Args:
        config: architecture and training settings.
        device: ``"auto"``, ``"cpu"``, ``"cuda"`` or ``"cuda:N"`` (:func:`resolve_device`).
        precision: ``"auto"``, ``"fp32"``, ``"bf16"`` or ``"fp16"`` (:func:`resolve_precision`).
        seed: initial weights and the training sampler's random stream.
    """

    def __init__(self, config: ReconstructorConfig, *, device: str | torch.device = "cpu", precision: str = "auto",
                 seed: int = 0) -> None:
        if not isinstance(config, ReconstructorConfig):
            raise ConfigError(f"config must be a ReconstructorConfig, got {type(config).__name__}")
        from diffusers import DDPMScheduler

        self.config = config
        self.device = resolve_device(device)
        self.precision = precision
        self.autocast_dtype = resolve_precision(precision, self.device)
        self.seed = _positive_int("seed", seed, 0)
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(self.seed)
            self.model = FeatureConditionedUNet(config)
        self.model.to(self.device)
        self.ema = copy.deepcopy(self.model).eval().requires_grad_(False)
        self.optimizer = torch.optim.AdamW(self.model.parameters(), lr=config.learning_rate)
        # float16 gradients underflow without loss scaling; bfloat16 has float32's range and needs none.
        self.scaler = torch.amp.GradScaler("cuda", enabled=self.autocast_dtype == torch.float16)
        self.noise_scheduler = DDPMScheduler(num_train_timesteps=config.train_timesteps,
                                             beta_schedule=config.beta_schedule,
                                             prediction_type=config.prediction_type)
        self.generator = torch.Generator().manual_seed(self.seed)
        self.step = 0
        self.losses: list[float] = []
        self.fingerprint: str | None = None
        # What exported weights are checked against (``fit``): the training images' fingerprint, the number of
        # pairs and the training features' per-dimension mean and standard deviation (float64).
        self.data_summary: dict[str, Any] | None = None
        self.exported = False
        self.train_seconds = 0.0
        self.initialised_from: dict[str, Any] | None = None
        # The command that trained these weights (set by the caller, :func:`train_or_resume`): saved in the
        # checkpoint and the exported weights, so a run that evaluates them elsewhere can name how they were made.
        self.made_by: str | None = None

    # -- properties -------------------------------------------------------------------------------------------------

    @property
    def num_parameters(self) -> int:
        return sum(p.numel() for p in self.model.parameters())

    def weights_sha256(self) -> str:
        """sha256 of the EMA weights that sample (:func:`data_fingerprint` of their tensors): the same for a
        checkpoint and the weights exported from it, and what a fine-tuned reconstructor names its source by."""
        return data_fingerprint(*self.ema.state_dict().values())

    @property
    def precision_name(self) -> str:
        """What actually runs: ``float32``, ``bfloat16 autocast`` or ``float16 autocast``."""
        return "float32" if self.autocast_dtype is None else f"{str(self.autocast_dtype)[6:]} autocast"

    def _autocast(self) -> Any:
        return torch.autocast(self.device.type, dtype=self.autocast_dtype or torch.float32,
                              enabled=self.autocast_dtype is not None)

    # -- data -------------------------------------------------------------------------------------------------------

    def _check_pairs(self, features: Any, images: Any) -> tuple[torch.Tensor, torch.Tensor]:
        f = torch.as_tensor(np.asarray(features) if not isinstance(features, torch.Tensor) else features,
                            dtype=torch.float32)
        x = torch.as_tensor(np.asarray(images) if not isinstance(images, torch.Tensor) else images,
                            dtype=torch.float32)
        c = self.config
        if f.ndim != 2 or f.shape[1] != c.feature_dim:
            raise ConfigError(f"features must have shape [n, {c.feature_dim}], got {tuple(f.shape)}")
        if tuple(x.shape[1:]) != (c.channels, c.image_size, c.image_size):
            raise ConfigError(f"images must have shape [n, {c.channels}, {c.image_size}, {c.image_size}] in [0, 1], "
                              f"got {tuple(x.shape)}")
        if len(f) != len(x) or len(f) == 0:
            raise ConfigError(f"need as many features as images (and at least one), got {len(f)} and {len(x)}")
        if not (torch.isfinite(f).all() and torch.isfinite(x).all()):
            raise ConfigError("features and images must be finite")
        return f, x

    def _check_features(self, features: Any) -> torch.Tensor:
        """``features`` as a finite float32 ``[n, feature_dim]`` tensor (what :meth:`sample` and
        :meth:`posterior_mean` read), else a ConfigError naming what is wrong."""
        f = torch.as_tensor(np.asarray(features) if not isinstance(features, torch.Tensor) else features,
                            dtype=torch.float32)
        if f.ndim != 2 or f.shape[1] != self.config.feature_dim:
            raise ConfigError(f"features must have shape [n, {self.config.feature_dim}], got {tuple(f.shape)}")
        if not torch.isfinite(f).all():
            raise ConfigError("features must be finite")
        return f

    def _check_guides(self, guides: Any, n: int) -> torch.Tensor | None:
        c = self.config
        if not c.guide_image:
            if guides is not None:
                raise ConfigError("guide images were given to a reconstructor without guide_image")
            return None
        if guides is None:
            raise ConfigError("this reconstructor reads a decoder's estimate of each image (guide_image=True); pass "
                              "guides")
        g = torch.as_tensor(np.asarray(guides) if not isinstance(guides, torch.Tensor) else guides,
                            dtype=torch.float32)
        if tuple(g.shape) != (n, c.channels, c.image_size, c.image_size) or not torch.isfinite(g).all():
            raise ConfigError(f"guides must be finite images of shape {[n, c.channels, c.image_size, c.image_size]}, "
                              f"got {list(g.shape)}")
        return g

    def set_feature_statistics(self, features: torch.Tensor) -> None:
        """Fit the whitening on the attacker's own training features.

        With ``condition_dims = r``: the mean, the top r right singular vectors V_r of the centred features and
        their standard deviations s_r (population; floored at 1 % of their mean), projection ``V_r / s_r``. With
        ``None``: projection ``diag(1 / std)`` (per-dimension, floored likewise). Computed in float64.
        """
        f = features.double()
        mean = f.mean(0)
        r = self.config.condition_dims
        if r is None:
            std = f.std(0, unbiased=False)
            projection = torch.diag(1.0 / std.clamp_min(max(float(std.mean()) * 1e-2, 1e-8)))
        else:
            if r >= len(f):
                raise ConfigError(f"condition_dims={r} needs more than {r} training pairs to fit {r} principal "
                                  f"components, got {len(f)}")
            _, singular, vh = torch.linalg.svd(f - mean, full_matrices=False)
            scales = singular[:r] / math.sqrt(len(f))
            projection = vh[:r].T / scales.clamp_min(max(float(scales.mean()) * 1e-2, 1e-8))
        for model in (self.model, self.ema):
            model.feature_mean.copy_(mean.float().to(self.device))
            model.feature_projection.copy_(projection.float().to(self.device))

    # -- training ---------------------------------------------------------------------------------------------------

    def training_loss(self, images: torch.Tensor, features: torch.Tensor,
                      guides: torch.Tensor | None = None) -> torch.Tensor:
        """The diffusion loss ``|| target - net(x_t, t, c) ||^2`` on one batch, with condition dropout.

        ``target`` is the noise eps (``"epsilon"``) or ``v = sqrt(abar_t) eps - sqrt(1 - abar_t) x_0``
        (``"v_prediction"``). Draws t, the noise and the dropout mask from :attr:`generator`; images are on [0, 1].
        """
        c = self.config
        n = len(images)
        # 1. x_0 on [-1, 1]; t ~ U{0..T-1}; eps ~ N(0, I) (Ho et al. 2020, Algorithm 1).
        x0 = images.to(self.device) * 2.0 - 1.0
        t = torch.randint(0, c.train_timesteps, (n,), generator=self.generator)
        noise = torch.randn(x0.shape, generator=self.generator)
        # 2. Condition dropout: keep the condition with probability 1 - p.
        keep = torch.rand(n, generator=self.generator) >= c.cond_dropout
        t, noise, keep = t.to(self.device), noise.to(self.device), keep.to(self.device)
        # 3. x_t = sqrt(abar_t) x_0 + sqrt(1 - abar_t) eps, and the prediction target.
        xt = self.noise_scheduler.add_noise(x0, noise, t)
        target = noise if c.prediction_type == "epsilon" else self.noise_scheduler.get_velocity(x0, noise, t)
        with self._autocast():
            extra = {} if guides is None else {"guide": guides.to(self.device)}
            predicted = self.model(xt, t, features.to(self.device), keep, **extra)
        return nn.functional.mse_loss(predicted.float(), target)

    def _ema_update(self) -> None:
        decay = min(self.config.ema_decay, (1 + self.step) / (10 + self.step))
        with torch.no_grad():
            for average, current in zip(self.ema.parameters(), self.model.parameters()):
                average.lerp_(current, 1.0 - decay)

    def fit(self, features: Any, images: Any, *, steps: int, guides: Any = None,
            checkpoint: str | os.PathLike | None = None, checkpoint_every: int = 500,
            progress: bool = True) -> list[float]:
        """Train until :attr:`step` reaches ``steps`` (a resumed model continues where it stopped).

        Args:
            features: ``[n, feature_dim]`` attacker features ``E(x)``.
            images: ``[n, channels, image_size, image_size]`` the matching attacker images on [0, 1].
            steps: total optimisation steps (not additional ones).
            guides: ``[n, channels, image_size, image_size]`` the decoder's estimate of each training image, made
                without that pair (``guide_image`` only).
            checkpoint: a file to save to every ``checkpoint_every`` steps and at the end (atomically).
            progress: show a tqdm bar.

        Returns:
            The losses of the steps run by this call.
        """
        import time

        from tqdm.auto import tqdm

        steps = _positive_int("steps", steps, 0)
        checkpoint_every = _positive_int("checkpoint_every", checkpoint_every)
        f, x = self._check_pairs(features, images)
        g = self._check_guides(guides, len(x))
        fingerprint = data_fingerprint(f, x, g)
        if self.step == 0:
            if self.initialised_from is None:   # a fine-tuned one keeps its source's whitening (module docstring, 9)
                self.set_feature_statistics(f)
            self.fingerprint = fingerprint
            self.data_summary = _data_summary(f, x)
        elif self.exported:
            self._check_exported_data(f, x)
        elif self.fingerprint != fingerprint:
            raise ConfigError("this reconstructor was trained on other (feature, image) pairs; resume it only on the "
                              "same data, or train a new one (another checkpoint path)")
        losses: list[float] = []
        if self.step >= steps:
            return losses
        if self.exported:
            raise ConfigError(f"this reconstructor was loaded from exported weights trained for {self.step} steps, "
                              f"which hold no optimiser state: it samples but cannot train on to {steps} steps; ask "
                              f"for steps={self.step}, or resume its full checkpoint")
        f, x = f.to(self.device), x.to(self.device)   # the whole training set once, not one batch at a time
        g = None if g is None else g.to(self.device)
        self.model.train()
        bar = tqdm(total=steps, initial=min(self.step, steps), desc="reconstructor", unit="step", disable=not progress,
                   dynamic_ncols=True)
        started = time.perf_counter()
        try:
            while self.step < steps:
                index = torch.randint(0, len(f), (self.config.batch_size,), generator=self.generator).to(self.device)
                loss = self.training_loss(x[index], f[index], None if g is None else g[index])
                self.optimizer.zero_grad(set_to_none=True)
                self.scaler.scale(loss).backward()
                self.scaler.step(self.optimizer)
                self.scaler.update()
                self.step += 1
                self._ema_update()
                losses.append(float(loss.detach()))
                self.losses.append(losses[-1])
                bar.update(1)
                if self.step % 50 == 0:
                    bar.set_postfix(loss=f"{np.mean(self.losses[-50:]):.4f}")
                if checkpoint is not None and self.step % checkpoint_every == 0:
                    self.train_seconds += time.perf_counter() - started
                    started = time.perf_counter()
                    self.save(checkpoint)
        finally:
            bar.close()
            self.train_seconds += time.perf_counter() - started
            self.model.eval()
        if checkpoint is not None:
            self.save(checkpoint)
        return losses

    # -- sampling ---------------------------------------------------------------------------------------------------

    @torch.no_grad()
    def guided_output(self, x: torch.Tensor, t: torch.Tensor, features: torch.Tensor, guidance_scale: float,
                      guidance_rescale: float = 0.0, guide: torch.Tensor | None = None) -> torch.Tensor:
        """``out_u + w (out_c - out_u)`` with the EMA model (one network pass when ``w`` is 0 or 1), optionally
        rescaled towards the conditional output's standard deviation (Lin et al. 2024, eqs. 15-16)."""
        n = len(x)
        steps = t.expand(n) if t.ndim == 0 else t
        with self._autocast():
            extra = {} if guide is None else {"guide": guide}
            if guidance_scale == 1.0:
                return self.ema(x, steps, features, torch.ones(n, dtype=torch.bool, device=x.device), **extra).float()
            if guidance_scale == 0.0:
                return self.ema(x, steps, features, torch.zeros(n, dtype=torch.bool, device=x.device), **extra).float()
            keep = torch.cat([torch.ones(n, dtype=torch.bool), torch.zeros(n, dtype=torch.bool)]).to(x.device)
            if guide is not None:
                extra = {"guide": torch.cat([guide, guide])}
            both = self.ema(torch.cat([x, x]), torch.cat([steps, steps]), torch.cat([features, features]),
                            keep, **extra).float()
        conditional, unconditional = both.chunk(2)
        guided = unconditional + guidance_scale * (conditional - unconditional)
        if guidance_rescale > 0:
            dims = list(range(1, guided.ndim))
            rescaled = guided * (conditional.std(dim=dims, keepdim=True) / guided.std(dim=dims, keepdim=True)
                                 .clamp_min(1e-8))
            guided = guidance_rescale * rescaled + (1 - guidance_rescale) * guided
        return guided

    # Kept for callers of the first version: the guided network output (eps or v, per the config).
    guided_noise = guided_output

    @torch.no_grad()
    def sample(self, features: Any, *, guidance_scale: float = 1.0, num_inference_steps: int = 20,
               generator: torch.Generator | None = None, batch_size: int = 256, progress: bool = False,
               guidance_interval: tuple[float, float] = (0.0, 1.0), guidance_rescale: float = 0.0,
               init: Any = None, init_strength: float | None = None, guide: Any = None,
               settings: SamplingSettings | None = None) -> torch.Tensor:
        """One image per feature by DDIM (eta = 0) with classifier-free guidance; ``[n, C, H, W]`` on [0, 1] (CPU).

        Args:
            features: ``[n, feature_dim]``.
            guidance_scale, guidance_interval, guidance_rescale, num_inference_steps, init_strength: as in
                :class:`SamplingSettings` (or pass ``settings``, which overrides them).
            generator: the starting noise's random stream (CPU); ``None`` uses a fresh seed-0 stream.
            batch_size: features per network batch.
            init: ``[n, C, H, W]`` images on [0, 1] to start from (decoder-guided initialisation); needs
                ``init_strength``.
            guide: ``[n, C, H, W]`` the decoder's estimates the network reads (``guide_image`` only).
        """
        from diffusers import DDIMScheduler
        from tqdm.auto import tqdm

        if settings is None:
            settings = SamplingSettings(guidance_scale=guidance_scale, guidance_interval=guidance_interval,
                                        guidance_rescale=guidance_rescale, num_inference_steps=num_inference_steps,
                                        init_strength=init_strength)
        if settings.num_inference_steps > self.config.train_timesteps:
            raise ConfigError(f"num_inference_steps must be <= train_timesteps={self.config.train_timesteps}, "
                              f"got {settings.num_inference_steps}")
        batch_size = _positive_int("batch_size", batch_size)
        f = self._check_features(features)
        c = self.config
        if (init is None) != (settings.init_strength is None):
            raise ConfigError("decoder-guided initialisation needs both init images and init_strength (or neither)")
        start_images = None
        if init is not None:
            start_images = torch.as_tensor(np.asarray(init) if not isinstance(init, torch.Tensor) else init,
                                           dtype=torch.float32)
            if tuple(start_images.shape) != (len(f), c.channels, c.image_size, c.image_size):
                raise ConfigError(f"init must have shape {[len(f), c.channels, c.image_size, c.image_size]}, got "
                                  f"{list(start_images.shape)}")
        guides = self._check_guides(guide, len(f))
        generator = torch.Generator().manual_seed(0) if generator is None else generator
        scheduler = DDIMScheduler(num_train_timesteps=c.train_timesteps, beta_schedule=c.beta_schedule,
                                  prediction_type=c.prediction_type, clip_sample=True, timestep_spacing="trailing")
        scheduler.set_timesteps(settings.num_inference_steps)
        timesteps = scheduler.timesteps
        if settings.init_strength is not None:
            # SDEdit: run only the steps at or below t = s T (at least the last one).
            below = timesteps[timesteps <= settings.init_strength * (c.train_timesteps - 1) + 1e-6]
            timesteps = below if len(below) else timesteps[-1:]
        low, high = settings.guidance_interval
        out = []
        for start in tqdm(range(0, len(f), batch_size), desc="sampling", unit="batch", disable=not progress,
                          dynamic_ncols=True):
            cond = f[start:start + batch_size].to(self.device)
            guide_batch = None if guides is None else guides[start:start + batch_size].to(self.device)
            x = torch.randn((len(cond), c.channels, c.image_size, c.image_size), generator=generator)
            if start_images is not None:
                x0 = start_images[start:start + batch_size] * 2.0 - 1.0
                x = self.noise_scheduler.add_noise(x0, x, timesteps[:1].expand(len(x0)))
            x = x.to(self.device)
            for t in timesteps:
                fraction = float(t) / (c.train_timesteps - 1)
                w = settings.guidance_scale if low <= fraction <= high else 1.0
                out_t = self.guided_output(x, t.to(self.device), cond, w, settings.guidance_rescale, guide_batch)
                x = scheduler.step(out_t, t, x, eta=0.0).prev_sample  # DDIM eq. 12, sigma_t = 0
            out.append(((x.clamp(-1, 1) + 1) / 2).float().cpu())
        if not out:
            return torch.zeros(0, c.channels, c.image_size, c.image_size)
        return torch.cat(out)

    @torch.no_grad()
    def posterior_mean(self, features: Any, *, draws: int = 4, guide: Any = None,
                       generator: torch.Generator | None = None, batch_size: int = 256,
                       guidance_scale: float = 1.0) -> torch.Tensor:
        """The network's one-step estimate of the posterior mean ``E[x_0 | feature]``; ``[n, C, H, W]`` on [0, 1]
        (CPU).

        Trained with the squared denoising loss, the network's x_0 prediction at timestep t is an estimate of
        ``E[x_0 | x_t, c]``. At the last timestep t = T - 1, ``x_T = sqrt(abar_T) x_0 + sqrt(1 - abar_T) eps`` carries
        almost nothing of x_0 (cosine schedule: abar_T about 2e-9 at T = 1000), so one pass from ``x_T ~ N(0, I)``
        estimates ``E[x_0 | c]`` itself; averaging over ``draws`` draws of x_T removes what is left of its
        dependence on x_T (``E[E[x_0 | x_T, c] | c] = E[x_0 | c]``). Unlike the mean of N samples, whose expected
        squared error is ``V (1 + 1/N)`` for posterior variance V, this estimates the posterior mean directly (error
        V for an exact network), in ``draws`` network passes and no sampling chain.

        The draws come in antithetic pairs (Owen, *Monte Carlo theory, methods and examples*, 2013, sec. 8.2): draw
        2j + 1 is the negation of draw 2j (an odd ``draws`` ends with an unpaired one). ``-x_T`` has the law of
        ``x_T``, so every draw's prediction is still an unbiased term of the average, and the part of the
        network's response that is odd in x_T cancels within a pair. On MNIST (the 28 px benchmark
        reconstructor, 400 held-out attacker pairs) 4 antithetic draws gave the SSIM of 16 independent ones
        (0.707), 16 antithetic 0.709.

        With v-prediction, ``x_0 = sqrt(abar) x_t - sqrt(1 - abar) v`` (Salimans and Ho 2022, sec. 4), stable at
        any abar. An eps-prediction network gives ``x_0 = (x_t - sqrt(1 - abar) eps) / sqrt(abar)``: at T - 1 that
        divides the network's error by sqrt(abar_T) (about 5e-5 with the cosine schedule, 6e-3 with the linear one),
        and the eps loss weighs x_0 errors there by abar / (1 - abar), almost nothing, so the estimate would be
        noise; it is refused (:class:`~privfl.errors.ConfigError`) rather than computed.

        The predictions of the draws are averaged, then clamped to [-1, 1] (a projection onto the pixel range, which
        never moves an estimate away from an image in it) and mapped to [0, 1] as :meth:`sample` does.

        Args:
            features: ``[n, feature_dim]``.
            draws: x_T per feature (in antithetic pairs) whose predictions are averaged (>= 1).
            guide: ``[n, C, H, W]`` the decoder's estimates the network reads (``guide_image`` only).
            generator: the x_T noise's random stream (CPU); ``None`` uses a fresh seed-0 stream. Per batch of
                features, each pair of draws takes ``randn([batch, C, H, W])`` from it in turn.
            batch_size: features per network batch.
            guidance_scale: w of :meth:`guided_output`; 1 (the conditional model) is the network's estimate of
                the posterior mean, other values move it along the conditional - unconditional direction
                (:func:`select_one_step_guidance` chooses w on held-out pairs).
        """
        c = self.config
        if c.prediction_type != "v_prediction":
            abar = float(self.noise_scheduler.alphas_cumprod[c.train_timesteps - 1])
            raise ConfigError(f"posterior_mean needs prediction_type 'v_prediction', got {c.prediction_type!r}: an "
                              f"eps-prediction gives x_0 at t = T - 1 only by dividing by sqrt(abar_T) = "
                              f"{math.sqrt(abar):.2g}; train the reconstructor with v_prediction "
                              f"(--prediction-type v_prediction)")
        draws = _positive_int("draws", draws)
        batch_size = _positive_int("batch_size", batch_size)
        guidance_scale = _real("guidance_scale", guidance_scale, 0.0, 1e3)
        f = self._check_features(features)
        guides = self._check_guides(guide, len(f))
        generator = torch.Generator().manual_seed(0) if generator is None else generator
        last = c.train_timesteps - 1
        abar = self.noise_scheduler.alphas_cumprod[last].double()
        a, s = float(abar.sqrt()), float((1 - abar).sqrt())
        t = torch.tensor(last, device=self.device)
        out = []
        for start in range(0, len(f), batch_size):
            cond = f[start:start + batch_size].to(self.device)
            guide_batch = None if guides is None else guides[start:start + batch_size].to(self.device)
            total = torch.zeros((len(cond), c.channels, c.image_size, c.image_size), device=self.device)
            for d in range(draws):
                if d % 2 == 0:
                    x = torch.randn((len(cond), c.channels, c.image_size, c.image_size), generator=generator)
                    x = x.to(self.device)
                else:
                    x = -x   # the antithetic twin of the previous draw
                v = self.guided_output(x, t, cond, guidance_scale, guide=guide_batch)
                total += a * x - s * v
            out.append(((total / draws).clamp(-1, 1) + 1) / 2)
        if not out:
            return torch.zeros(0, c.channels, c.image_size, c.image_size)
        return torch.cat(out).float().cpu()

    # -- state ------------------------------------------------------------------------------------------------------

    def initialise_from(self, path: str | os.PathLike) -> None:
        """Start this untrained reconstructor from the EMA weights in ``path`` (a checkpoint or exported weights),
        to fine-tune them with a fresh optimiser (module docstring, 9).

        Raises:
            ConfigError: this one has trained already, the file is no reconstructor, or its architecture differs
                (the differing :data:`ARCHITECTURE` fields are named).
        """
        if self.step or self.exported:
            raise ConfigError("initialise_from starts a new reconstructor; this one has trained or was loaded already")
        state = _read_state(path)
        source = ReconstructorConfig.from_dict(state["config"])
        differ = {name: (getattr(source, name), getattr(self.config, name)) for name in ARCHITECTURE
                  if getattr(source, name) != getattr(self.config, name)}
        if differ:
            raise ConfigError(f"{path} holds another architecture; (its value, this one's) per differing setting: "
                              f"{differ}")
        self.model.load_state_dict(state["ema"])
        self.ema.load_state_dict(state["ema"])
        self.initialised_from = {
            "file": Path(path).name, "file_sha256": file_sha256(path), "weights_sha256": _weights_sha256(state),
            "step": int(state["step"]), "train_seconds": float(state.get("train_seconds", 0.0)),
            "fingerprint": state.get("fingerprint"), "config": state["config"], "made_by": state.get("made_by")}

    def _check_exported_data(self, f: torch.Tensor, x: torch.Tensor) -> None:
        """Refuse data other than the exported weights' training data (module docstring, "Exported weights")."""
        trained = self.data_summary
        if trained is None:
            raise ConfigError("these exported weights carry no summary of their training data to check against")
        given = _data_summary(f, x)
        if given["pairs"] != trained["pairs"] or given["images"] != trained["images"]:
            raise ConfigError(f"these exported weights were trained on {trained['pairs']} other images than the "
                              f"{given['pairs']} given (the images must be bit-identical); evaluate them on their "
                              "training data's attacker split")
        gap = max(float((given[k] - trained[k]).abs().max()) for k in ("feature_mean", "feature_std"))
        if gap > FEATURE_TOLERANCE:
            raise ConfigError(f"the features given differ from the exported weights' training features by {gap:.3g} "
                              f"in a per-dimension mean or standard deviation (at most {FEATURE_TOLERANCE:g} is a "
                              "device's rounding): another backbone, input size or feature cache")

    def state_dict(self) -> dict[str, Any]:
        if self.exported:
            raise ConfigError("a reconstructor loaded from exported weights has no optimiser state to checkpoint")
        return {**self._sampling_state(), "format": CHECKPOINT_FORMAT, "model": self.model.state_dict(),
                "optimizer": self.optimizer.state_dict(), "scaler": self.scaler.state_dict(),
                "generator": self.generator.get_state()}

    def _sampling_state(self) -> dict[str, Any]:
        """What a checkpoint and exported weights both hold: the settings, the EMA weights, the step, the losses and
        the training data's fingerprint and summary."""
        return {"config": self.config.to_dict(), "seed": self.seed, "step": self.step, "ema": self.ema.state_dict(),
                "losses": list(self.losses), "fingerprint": self.fingerprint, "data_summary": self.data_summary,
                "train_seconds": self.train_seconds, "initialised_from": self.initialised_from,
                "made_by": self.made_by}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        _check_format(state)
        if ReconstructorConfig.from_dict(state["config"]) != self.config:
            raise ConfigError("the checkpoint's reconstructor settings differ from this one's")
        self.exported = state["format"] == EXPORT_FORMAT
        self.model.load_state_dict(state["ema" if self.exported else "model"])
        self.ema.load_state_dict(state["ema"])
        if not self.exported:
            self.optimizer.load_state_dict(state["optimizer"])
            if state.get("scaler"):
                self.scaler.load_state_dict(state["scaler"])
            self.generator.set_state(state["generator"])
        self.step = int(state["step"])
        self.losses = [float(v) for v in state["losses"]]
        self.fingerprint = state["fingerprint"]
        self.data_summary = state.get("data_summary")
        self.train_seconds = float(state.get("train_seconds", 0.0))
        self.initialised_from = state.get("initialised_from")
        self.made_by = state.get("made_by")

    def save(self, path: str | os.PathLike) -> Path:
        """Write the checkpoint atomically (a temporary file in the same folder, then ``os.replace``)."""
        return _atomic_save(self.state_dict(), path)

    def export(self, path: str | os.PathLike) -> Path:
        """Write the exported weights (module docstring, "Exported weights") atomically; :meth:`load` reads them.

        Refused for a reconstructor whose checkpoint predates the training-data summary the file is checked with.
        """
        if self.data_summary is None:
            raise ConfigError("this reconstructor has no summary of its training data (trained before it was kept, or "
                              "not trained): train it, or resume it for one step, before exporting")
        return _atomic_save({**self._sampling_state(), "format": EXPORT_FORMAT}, path)

    @classmethod
    def load(cls, path: str | os.PathLike, *, device: str | torch.device = "cpu",
             precision: str = "auto") -> Reconstructor:
        """Rebuild a reconstructor from :meth:`save`'s or :meth:`export`'s file (``torch.load(weights_only=True)``),
        on any device."""
        state = _read_state(path)
        reconstructor = cls(ReconstructorConfig.from_dict(state["config"]), device=device, precision=precision,
                            seed=int(state["seed"]))
        reconstructor.load_state_dict(state)
        return reconstructor


def _read_state(path: str | os.PathLike) -> dict[str, Any]:
    """A checkpoint's or exported weights' contents (``torch.load(weights_only=True)``), else a ConfigError."""
    state = torch.load(Path(path), map_location="cpu", weights_only=True)
    if not isinstance(state, dict) or "config" not in state:
        raise ConfigError(f"{path} is not a reconstructor checkpoint or exported weights")
    _check_format(state)
    return state


def _check_format(state: dict[str, Any]) -> None:
    """Refuse a checkpoint or exported weights of a format this code does not read."""
    if state.get("format") not in (CHECKPOINT_FORMAT, EXPORT_FORMAT):
        raise ConfigError(f"unsupported reconstructor checkpoint format {state.get('format')!r} (this code reads "
                          f"{CHECKPOINT_FORMAT} and {EXPORT_FORMAT!r}; train a new reconstructor)")


def _weights_sha256(state: dict[str, Any]) -> str:
    """The sha256 of a state's EMA weights (what a fine-tuned reconstructor names its source by)."""
    return data_fingerprint(*state["ema"].values())


def _data_summary(features: torch.Tensor, images: torch.Tensor) -> dict[str, Any]:
    """What exported weights are checked against: the images' fingerprint, the pair count and the features'
    per-dimension mean and (population) standard deviation in float64."""
    f = features.double()
    return {"pairs": len(features), "images": data_fingerprint(images),
            "feature_mean": f.mean(0), "feature_std": f.std(0, unbiased=False)}


def _atomic_save(state: dict[str, Any], path: str | os.PathLike) -> Path:
    """``torch.save`` to a temporary file in the same folder, then ``os.replace``."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    temporary = path.with_name(path.name + ".tmp")
    torch.save(state, temporary)
    os.replace(temporary, path)
    return path


def train_or_resume(config: ReconstructorConfig, features: Any, images: Any, *, steps: int,
                    checkpoint: str | os.PathLike | None, guides: Any = None, device: str | torch.device = "cpu",
                    precision: str = "auto", seed: int = 0, checkpoint_every: int = 500,
                    init_weights: str | os.PathLike | None = None, made_by: str | None = None,
                    progress: bool = True) -> Reconstructor:
    """Load ``checkpoint`` if it exists (same settings and data) and train it on to ``steps``; else train anew,
    from ``init_weights`` when given (:meth:`Reconstructor.initialise_from`). ``made_by`` (the command of this
    call) is recorded in the reconstructor and its checkpoints when this call trains it.

    An interrupted run (killed, Ctrl-C) resumes from its last checkpoint: run the same call again (a fine-tuning
    checkpoint resumes only with the same ``init_weights``).
    """
    if checkpoint is not None and Path(checkpoint).is_file():
        reconstructor = Reconstructor.load(checkpoint, device=device, precision=precision)
        if reconstructor.config != config:
            raise ConfigError(f"{checkpoint} holds a reconstructor with other settings ({reconstructor.config}); "
                              "use another checkpoint path or delete it")
        if init_weights is not None:
            mine = (reconstructor.initialised_from or {}).get("weights_sha256")
            if mine != _weights_sha256(_read_state(init_weights)):
                raise ConfigError(f"{checkpoint} was not fine-tuned from {init_weights}; use another checkpoint path")
    else:
        reconstructor = Reconstructor(config, device=device, precision=precision, seed=seed)
        if init_weights is not None:
            reconstructor.initialise_from(init_weights)
    if made_by is not None and not reconstructor.exported and reconstructor.step < steps:
        reconstructor.made_by = made_by       # before fit: its checkpoints carry it
    reconstructor.fit(features, images, steps=steps, guides=guides, checkpoint=checkpoint,
                      checkpoint_every=checkpoint_every, progress=progress)
    return reconstructor


def select_sampling(reconstructor: Any, features: Any, images: Any, candidates: Any, *, init: Any = None,
                    guide: Any = None, seed: int = 0,
                    progress: bool = False) -> tuple[SamplingSettings, list[dict[str, Any]]]:
    """The sampling settings whose reconstructions of held-out attacker pairs have the highest mean SSIM.

    The attacker holds these pairs out of training, so the choice uses no defender data. Every candidate starts from
    the same noise (one sample per feature), so the scores differ only by the settings; ties go to the earlier
    candidate. Mean PSNR is recorded beside SSIM for the report.

    Args:
        reconstructor: a trained reconstructor (anything with its ``sample`` method).
        features, images: ``[n, d]`` held-out attacker features and their images ``[n, C, H, W]`` on [0, 1].
        candidates: :class:`SamplingSettings` to compare.
        init: ``[n, C, H, W]`` decoder estimates for the candidates with ``init_strength`` (required if any has).
        guide: ``[n, C, H, W]`` the estimates a ``guide_image`` reconstructor reads.

    Returns:
        ``(best settings, [{"settings": ..., "label": ..., "ssim": ..., "psnr": ...} per candidate])``.
    """
    candidates = list(candidates)
    if not candidates or not all(isinstance(c, SamplingSettings) for c in candidates):
        raise ConfigError("select_sampling needs one or more SamplingSettings candidates")
    f, x = _held_out_pairs(features, images)
    if init is None and any(c.init_strength is not None for c in candidates):
        raise ConfigError("a candidate with init_strength needs the decoder's estimates (init)")
    scores = []
    for candidate in candidates:
        generator = torch.Generator().manual_seed(seed)
        extra = {} if guide is None else {"guide": guide}
        recon = reconstructor.sample(f, settings=candidate, generator=generator, progress=progress,
                                     init=init if candidate.init_strength is not None else None, **extra)
        scores.append({"settings": candidate.to_dict(), "label": candidate.label, **_held_out_scores(x, recon)})
    best = max(range(len(candidates)), key=lambda i: (scores[i]["ssim"], -i))
    return candidates[best], scores


def select_one_step_guidance(reconstructor: Any, features: Any, images: Any, scales: Any, *, draws: int,
                             guide: Any = None, seed: int = 0) -> tuple[float, list[dict[str, Any]]]:
    """The guidance scale w of the one-step estimate (:meth:`Reconstructor.posterior_mean`) whose estimates of
    held-out attacker pairs have the highest mean PSNR.

    The one-step estimate stands for the posterior mean, the estimate of least squared error, so w is chosen on
    squared error (PSNR); SSIM is recorded beside it. At w = 1 it is the conditional network's estimate; a w a
    little above 1 moves it away from the unconditional one (the attacker's data mean), which lowers the held-out
    squared error when the conditional estimate is shrunk towards that mean more than the true posterior mean is
    (MNIST, the 28 px benchmark reconstructor, 8 draws on 400 held-out pairs: PSNR 17.46 / 17.48 / 17.32 and SSIM
    0.708 / 0.723 / 0.734 at w = 1 / 1.05 / 1.25). The pairs are held out of training, so the choice uses no
    defender data; every scale reads the same noise draws; ties go to the earlier scale.

    Returns:
        ``(best w, [{"guidance_scale": w, "ssim": ..., "psnr": ...} per scale])``.
    """
    scales = [_real("guidance scale", w, 0.0, 1e3) for w in scales]
    if not scales:
        raise ConfigError("select_one_step_guidance needs one or more guidance scales")
    f, x = _held_out_pairs(features, images)
    extra = {} if guide is None else {"guide": guide}
    scores = [{"guidance_scale": w, **_held_out_scores(x, reconstructor.posterior_mean(
        f, draws=draws, guidance_scale=w, generator=torch.Generator().manual_seed(seed), **extra))}
        for w in scales]
    best = max(range(len(scales)), key=lambda i: (scores[i]["psnr"], -i))
    return scales[best], scores


def _held_out_pairs(features: Any, images: Any) -> tuple[torch.Tensor, torch.Tensor]:
    """Held-out attacker features and their images as float32 tensors; a ConfigError unless they pair up."""
    f, x = (torch.as_tensor(np.asarray(v) if not isinstance(v, torch.Tensor) else v, dtype=torch.float32)
            for v in (features, images))
    if len(f) == 0 or len(f) != len(x):
        raise ConfigError(f"need as many held-out features as images (and at least one), got {len(f)} and {len(x)}")
    return f, x


def _held_out_scores(x: torch.Tensor, recon: torch.Tensor) -> dict[str, float]:
    """Mean SSIM and mean PSNR (an exact copy counted at 100 dB) of reconstructions of held-out images."""
    from attacks.metrics import psnr_pairs, ssim_pairs

    p = psnr_pairs(x, recon)
    return {"ssim": float(ssim_pairs(x, recon).mean()), "psnr": float(np.where(np.isinf(p), 100.0, p).mean())}
