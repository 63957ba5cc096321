"""The reconstructor's settings and where it runs: :class:`ReconstructorConfig` (architecture and training),
:class:`SamplingSettings` (how it draws), :func:`resolve_device` and :func:`resolve_precision`.

Every setting is checked when it is made, so a bad one fails before any work, with an error that names it
(:func:`checked_int`, :func:`checked_real`). The model and its choices: docs/attacks.md, "The diffusion
reconstructor".

    >>> SamplingSettings(guidance_scale=2.0, guidance_rescale=0.7).label
    'w=2 phi=0.7'
"""

from __future__ import annotations

import math
import numbers
from dataclasses import asdict, dataclass, fields
from typing import Any

import torch

from accounting.validation import is_int_at_least, is_real
from privfl.errors import ConfigError

__all__ = ["ARCHITECTURE", "DEVICES", "PRECISIONS", "PREDICTION_TYPES", "ReconstructorConfig", "SamplingSettings",
           "checked_int", "checked_real", "resolve_device", "resolve_precision"]

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


def checked_int(name: str, value: object, minimum: int = 1) -> int:
    """``value`` as an int, else a ConfigError naming ``name``: an integer (not a bool) >= ``minimum``."""
    if isinstance(value, bool) or not isinstance(value, numbers.Integral) or value < minimum:
        raise ConfigError(f"{name} must be an integer >= {minimum}, got {value!r}")
    return int(value)


def checked_real(name: str, value: object, low: float, high: float, *, low_open: bool = False) -> float:
    """``value`` as a float, else a ConfigError naming ``name``: a finite number in ``[low, high]`` (``(low, high]``
    with ``low_open``)."""
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
        prediction_type: what the network predicts, ``"v_prediction"`` or ``"epsilon"`` (docs/attacks.md, model 1).
        cond_dropout: probability of training an example with the null (zero) condition, in [0, 1].
        learning_rate: AdamW learning rate.
        batch_size: training examples per step.
        ema_decay: decay of the weight average used for sampling, in [0, 1).
        condition_dims: principal components the feature is whitened to before the conditioning MLP (at most
            ``feature_dim``, and fewer than the training pairs); ``None``: per-dimension standardisation.
        guide_image: the UNet also reads a decoder's estimate of the image (``channels`` more input channels;
            docs/attacks.md, model 6); training and sampling then need those estimates.
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
        checked_int("feature_dim", self.feature_dim)
        checked_int("image_size", self.image_size, 8)
        checked_int("channels", self.channels)
        blocks = tuple(self.block_channels) if isinstance(self.block_channels, (list, tuple)) else None
        if not blocks or any(not is_int_at_least(c, 1) for c in blocks):
            raise ConfigError(f"block_channels must be a non-empty sequence of positive integers, "
                              f"got {self.block_channels!r}")
        object.__setattr__(self, "block_channels", tuple(int(c) for c in blocks))
        checked_int("layers_per_block", self.layers_per_block)
        groups = checked_int("norm_groups", self.norm_groups)
        if any(c % groups for c in self.block_channels):
            raise ConfigError(f"norm_groups={groups} must divide every entry of block_channels "
                              f"{self.block_channels}")
        checked_int("train_timesteps", self.train_timesteps, 2)
        if self.beta_schedule not in BETA_SCHEDULES:
            raise ConfigError(f"beta_schedule must be one of {', '.join(BETA_SCHEDULES)}, got {self.beta_schedule!r}")
        if self.prediction_type not in PREDICTION_TYPES:
            raise ConfigError(f"prediction_type must be one of {', '.join(PREDICTION_TYPES)}, got "
                              f"{self.prediction_type!r}")
        checked_real("cond_dropout", self.cond_dropout, 0.0, 1.0)
        checked_real("learning_rate", self.learning_rate, 0.0, 1.0, low_open=True)
        checked_int("batch_size", self.batch_size)
        checked_real("ema_decay", self.ema_decay, 0.0, 0.999999)
        for name in ("mid_attention", "attention", "guide_image"):
            if not isinstance(getattr(self, name), bool):
                raise ConfigError(f"{name} must be True or False, got {getattr(self, name)!r}")
        if self.condition_dims is not None:
            checked_int("condition_dims", self.condition_dims)
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


@dataclass(frozen=True)
class SamplingSettings:
    """How :meth:`~attacks.reconstructor.Reconstructor.sample` draws (docs/attacks.md, model 4 and 5).

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
        checked_real("guidance_scale", self.guidance_scale, 0.0, 1e3)
        interval = tuple(self.guidance_interval) if isinstance(self.guidance_interval, (list, tuple)) else ()
        if len(interval) != 2 or not 0 <= checked_real("guidance_interval", interval[0], 0.0, 1.0) <= \
                checked_real("guidance_interval", interval[1], 0.0, 1.0):
            raise ConfigError(f"guidance_interval must be (low, high) with 0 <= low <= high <= 1, got "
                              f"{self.guidance_interval!r}")
        object.__setattr__(self, "guidance_interval", (float(interval[0]), float(interval[1])))
        checked_real("guidance_rescale", self.guidance_rescale, 0.0, 1.0)
        checked_int("num_inference_steps", self.num_inference_steps)
        if self.init_strength is not None:
            checked_real("init_strength", self.init_strength, 0.0, 1.0, low_open=True)

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
