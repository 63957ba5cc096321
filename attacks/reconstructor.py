"""A feature-conditioned diffusion model that turns released feature vectors back into images (FedPFT paper, App. E.3).

The attacker owns in-distribution images ``D_a`` and the same frozen backbone ``E`` as the defender. It trains a
denoising diffusion model on the pairs ``(E(x), x)`` for ``x`` in ``D_a``; given a feature the defender released (or a
feature sampled from a released mixture), DDIM sampling with classifier-free guidance draws images that have that
feature.

Model (what the paper states, App. E.3, and the unstated choices, digest ``papers/fedpft.md`` 8.2 #21):

1. A diffusers ``UNet2DModel`` predicts the noise ``epsilon`` (DDPM, Ho et al. 2020, eq. 14); its residual blocks
   are conditioned by scale-and-shift group normalisation (``resnet_time_scale_shift="scale_shift"``, AdaGN of
   Dhariwal and Nichol 2021) on one embedding vector.
2. The feature is standardised with the attacker's own training features: per dimension (``condition_dims=None``,
   the default), or whitened: centred, projected onto their top ``condition_dims`` principal components and divided
   by each component's standard deviation (drops the many near-constant directions of a 1280-d feature; on MNIST /
   MobileNetV2 at 1,500 steps, 128 components reconstructed held-out attacker images worse than per-dimension
   standardisation, SSIM 0.13 against 0.22, so the attack uses the default). A two-layer MLP
   ``(condition_dims or d) -> 4 * base channels`` maps it to the embedding width, and the result is **added
   to the timestep embedding** (``class_embed_type="identity"``). The MLP's last layer starts at zero, so the
   untrained model is unconditional.
3. Condition dropout (Ho and Salimans 2022): with probability ``cond_dropout`` a training example's condition
   embedding is replaced by the null embedding, zero. The same network is then also an unconditional model.
4. Sampling: DDIM (Song et al. 2021, eq. 12, eta = 0, deterministic given the starting noise) with classifier-free
   guidance ``eps = eps_uncond + w (eps_cond - eps_uncond)`` (Ho and Salimans 2022, eq. 6 rewritten): ``w = 0`` is
   the unconditional model, ``w = 1`` the conditional one, ``w > 1`` sharpens towards the condition.
5. An exponential moving average of the weights (warm-up ``min(decay, (1 + k) / (10 + k))``) is what samples.

Sizes: the default (``block_channels=(32, 64, 64)``, one residual block per level, self-attention only in the middle
block at the lowest resolution (``mid_attention``; diffusers' ``add_attention``)) has 1,321,281 parameters for
1280-d standardised features at 16 x 16 (1,173,825 with ``condition_dims=128``); it trains at about 0.15 s per
step of 32 images on one idle CPU thread; on a GPU pass ``device="cuda"`` and wider channels.
Training is checkpointed atomically (write to a temporary file, then ``os.replace``), loads with
``torch.load(weights_only=True)`` and resumes exactly: the data sampler's random state is part of the checkpoint,
so training k steps, saving, loading and training k more gives the weights of 2k uninterrupted steps.

Example (a tiny model on random data):
    >>> import torch
    >>> config = ReconstructorConfig(feature_dim=4, image_size=16, block_channels=(8, 8), batch_size=4)
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

from privfl.errors import ConfigError

__all__ = ["CHECKPOINT_FORMAT", "FeatureConditionedUNet", "Reconstructor", "ReconstructorConfig", "data_fingerprint",
           "select_guidance_scale", "train_or_resume"]

CHECKPOINT_FORMAT = 2
BETA_SCHEDULES = ("linear", "scaled_linear", "squaredcos_cap_v2")


def _positive_int(name: str, value: object, minimum: int = 1) -> int:
    if isinstance(value, bool) or not isinstance(value, numbers.Integral) or value < minimum:
        raise ConfigError(f"{name} must be an integer >= {minimum}, got {value!r}")
    return int(value)


def _real(name: str, value: object, low: float, high: float, *, low_open: bool = False) -> float:
    if isinstance(value, bool) or not isinstance(value, numbers.Real) or not math.isfinite(value) \
            or value > high or value < low or (low_open and value == low):
        bracket = "(" if low_open else "["
        raise ConfigError(f"{name} must be a number in {bracket}{low}, {high}], got {value!r}")
    return float(value)


@dataclass(frozen=True)
class ReconstructorConfig:
    """Architecture and training settings of the reconstructor (every field is saved in the checkpoint).

    Attributes:
        feature_dim: d, the length of the feature vectors it is conditioned on.
        image_size: side of the square images it generates (pixels; divisible by 2^(levels - 1) up to rounding,
            e.g. 16 or 28 with three levels).
        channels: image channels (1 for MNIST).
        block_channels: U-Net channels per resolution level (one down-sampling between consecutive levels).
        layers_per_block: residual blocks per level.
        mid_attention: self-attention in the middle block, at the lowest resolution (diffusers' ``add_attention``).
        attention: also self-attention blocks in the deepest down and up levels.
        norm_groups: groups of the group normalisation (divides every entry of ``block_channels``).
        train_timesteps: T of the forward process.
        beta_schedule: ``"squaredcos_cap_v2"`` (cosine, Nichol and Dhariwal 2021), ``"linear"`` or
            ``"scaled_linear"``.
        cond_dropout: probability of training an example with the null (zero) condition, in [0, 1].
        learning_rate: AdamW learning rate.
        batch_size: training examples per step.
        ema_decay: decay of the weight average used for sampling, in [0, 1).
        condition_dims: principal components the feature is whitened to before the conditioning MLP (at most
            ``feature_dim``, and fewer than the training pairs); ``None``: per-dimension standardisation.
    """

    feature_dim: int
    image_size: int = 16
    channels: int = 1
    block_channels: tuple[int, ...] = (32, 64, 64)
    layers_per_block: int = 1
    mid_attention: bool = True
    attention: bool = False
    norm_groups: int = 8
    train_timesteps: int = 1000
    beta_schedule: str = "squaredcos_cap_v2"
    cond_dropout: float = 0.1
    learning_rate: float = 2e-4
    batch_size: int = 64
    ema_decay: float = 0.999
    condition_dims: int | None = None

    def __post_init__(self) -> None:
        _positive_int("feature_dim", self.feature_dim)
        _positive_int("image_size", self.image_size, 8)
        _positive_int("channels", self.channels)
        blocks = tuple(self.block_channels) if isinstance(self.block_channels, (list, tuple)) else None
        if not blocks or any(isinstance(c, bool) or not isinstance(c, numbers.Integral) or c < 1 for c in blocks):
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
        _real("cond_dropout", self.cond_dropout, 0.0, 1.0)
        _real("learning_rate", self.learning_rate, 0.0, 1.0, low_open=True)
        _positive_int("batch_size", self.batch_size)
        _real("ema_decay", self.ema_decay, 0.0, 0.999999)
        for name in ("mid_attention", "attention"):
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

    ``forward(x_t, t, features, keep)``: ``keep`` is a boolean ``[B]`` mask; where it is False the condition
    embedding is the null embedding (zero), i.e. the unconditional model.
    """

    def __init__(self, config: ReconstructorConfig) -> None:
        super().__init__()
        from diffusers import UNet2DModel

        levels = len(config.block_channels)
        down = ["DownBlock2D"] * levels
        up = ["UpBlock2D"] * levels
        if config.attention:
            down[-1], up[0] = "AttnDownBlock2D", "AttnUpBlock2D"
        self.unet = UNet2DModel(
            sample_size=config.image_size, in_channels=config.channels, out_channels=config.channels,
            block_out_channels=config.block_channels, layers_per_block=config.layers_per_block,
            down_block_types=tuple(down), up_block_types=tuple(up), norm_num_groups=config.norm_groups,
            resnet_time_scale_shift="scale_shift", class_embed_type="identity", add_attention=config.mid_attention)
        width = 4 * config.block_channels[0]  # UNet2DModel's time-embedding width
        r = config.condition_width
        self.condition = nn.Sequential(nn.Linear(r, width), nn.SiLU(), nn.Linear(width, width))
        nn.init.zeros_(self.condition[2].weight)
        nn.init.zeros_(self.condition[2].bias)
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
                keep: torch.Tensor | None = None) -> torch.Tensor:
        return self.unet(x, t, class_labels=self.condition_embedding(features, keep)).sample


def data_fingerprint(features: Any, images: Any) -> str:
    """sha256 of the training pairs (shapes, dtypes and bytes): a checkpoint is reused only on the same data."""
    digest = hashlib.sha256()
    for array in (features, images):
        a = np.ascontiguousarray(array.detach().cpu().numpy() if isinstance(array, torch.Tensor) else array)
        digest.update(f"{a.dtype}{a.shape}".encode())
        digest.update(a.tobytes())
    return digest.hexdigest()


class Reconstructor:
    """The attacker's conditional diffusion model: :meth:`fit` on ``(E(x), x)`` pairs, :meth:`sample` from features.

    Args:
        config: architecture and training settings.
        device: ``"cpu"``, ``"cuda"``, ... (random numbers are drawn on the CPU, so a seed gives the same draws on
            every device).
        seed: initial weights and the training sampler's random stream.
    """

    def __init__(self, config: ReconstructorConfig, *, device: str | torch.device = "cpu", seed: int = 0) -> None:
        if not isinstance(config, ReconstructorConfig):
            raise ConfigError(f"config must be a ReconstructorConfig, got {type(config).__name__}")
        from diffusers import DDPMScheduler

        self.config = config
        self.device = torch.device(device)
        self.seed = _positive_int("seed", seed, 0)
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(self.seed)
            self.model = FeatureConditionedUNet(config)
        self.model.to(self.device)
        self.ema = copy.deepcopy(self.model).eval().requires_grad_(False)
        self.optimizer = torch.optim.AdamW(self.model.parameters(), lr=config.learning_rate)
        self.noise_scheduler = DDPMScheduler(num_train_timesteps=config.train_timesteps,
                                             beta_schedule=config.beta_schedule, prediction_type="epsilon")
        self.generator = torch.Generator().manual_seed(self.seed)
        self.step = 0
        self.losses: list[float] = []
        self.fingerprint: str | None = None
        self.train_seconds = 0.0

    # -- properties -------------------------------------------------------------------------------------------------

    @property
    def num_parameters(self) -> int:
        return sum(p.numel() for p in self.model.parameters())

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

    def training_loss(self, images: torch.Tensor, features: torch.Tensor) -> torch.Tensor:
        """The DDPM loss ``|| eps - eps_theta(x_t, t, c) ||^2`` on one batch, with condition dropout.

        Draws t, the noise and the dropout mask from :attr:`generator`; images are on [0, 1].
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
        # 3. x_t = sqrt(abar_t) x_0 + sqrt(1 - abar_t) eps, and the epsilon-prediction loss.
        xt = self.noise_scheduler.add_noise(x0, noise, t)
        predicted = self.model(xt, t, features.to(self.device), keep)
        return nn.functional.mse_loss(predicted, noise)

    def _ema_update(self) -> None:
        decay = min(self.config.ema_decay, (1 + self.step) / (10 + self.step))
        with torch.no_grad():
            for average, current in zip(self.ema.parameters(), self.model.parameters()):
                average.lerp_(current, 1.0 - decay)

    def fit(self, features: Any, images: Any, *, steps: int, checkpoint: str | os.PathLike | None = None,
            checkpoint_every: int = 500, progress: bool = True) -> list[float]:
        """Train until :attr:`step` reaches ``steps`` (a resumed model continues where it stopped).

        Args:
            features: ``[n, feature_dim]`` attacker features ``E(x)``.
            images: ``[n, channels, image_size, image_size]`` the matching attacker images on [0, 1].
            steps: total optimisation steps (not additional ones).
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
        fingerprint = data_fingerprint(f, x)
        if self.step == 0:
            self.set_feature_statistics(f)
            self.fingerprint = fingerprint
        elif self.fingerprint != fingerprint:
            raise ConfigError("this reconstructor was trained on other (feature, image) pairs; resume it only on the "
                              "same data, or train a new one (another checkpoint path)")
        losses: list[float] = []
        self.model.train()
        bar = tqdm(total=steps, initial=min(self.step, steps), desc="reconstructor", unit="step", disable=not progress,
                   dynamic_ncols=True)
        started = time.perf_counter()
        try:
            while self.step < steps:
                index = torch.randint(0, len(f), (self.config.batch_size,), generator=self.generator)
                loss = self.training_loss(x[index], f[index])
                self.optimizer.zero_grad(set_to_none=True)
                loss.backward()
                self.optimizer.step()
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
    def guided_noise(self, x: torch.Tensor, t: torch.Tensor, features: torch.Tensor,
                     guidance_scale: float) -> torch.Tensor:
        """``eps_u + w (eps_c - eps_u)`` with the EMA model (one network pass when ``w`` is 0 or 1)."""
        n = len(x)
        steps = t.expand(n) if t.ndim == 0 else t
        if guidance_scale == 1.0:
            return self.ema(x, steps, features, torch.ones(n, dtype=torch.bool, device=x.device))
        if guidance_scale == 0.0:
            return self.ema(x, steps, features, torch.zeros(n, dtype=torch.bool, device=x.device))
        keep = torch.cat([torch.ones(n, dtype=torch.bool), torch.zeros(n, dtype=torch.bool)]).to(x.device)
        both = self.ema(torch.cat([x, x]), torch.cat([steps, steps]), torch.cat([features, features]), keep)
        conditional, unconditional = both.chunk(2)
        return unconditional + guidance_scale * (conditional - unconditional)

    @torch.no_grad()
    def sample(self, features: Any, *, guidance_scale: float = 2.0, num_inference_steps: int = 20,
               generator: torch.Generator | None = None, batch_size: int = 256, progress: bool = False) -> torch.Tensor:
        """One image per feature by DDIM (eta = 0) with classifier-free guidance; ``[n, C, H, W]`` on [0, 1] (CPU).

        Args:
            features: ``[n, feature_dim]``.
            guidance_scale: w >= 0 (0 unconditional, 1 conditional, > 1 guided).
            num_inference_steps: DDIM steps (<= train_timesteps).
            generator: the starting noise's random stream (CPU); ``None`` uses a fresh seed-0 stream.
            batch_size: features per network batch.
        """
        from diffusers import DDIMScheduler
        from tqdm.auto import tqdm

        guidance_scale = _real("guidance_scale", guidance_scale, 0.0, 1e3)
        num_inference_steps = _positive_int("num_inference_steps", num_inference_steps)
        if num_inference_steps > self.config.train_timesteps:
            raise ConfigError(f"num_inference_steps must be <= train_timesteps={self.config.train_timesteps}, "
                              f"got {num_inference_steps}")
        batch_size = _positive_int("batch_size", batch_size)
        f = torch.as_tensor(np.asarray(features) if not isinstance(features, torch.Tensor) else features,
                            dtype=torch.float32)
        c = self.config
        if f.ndim != 2 or f.shape[1] != c.feature_dim:
            raise ConfigError(f"features must have shape [n, {c.feature_dim}], got {tuple(f.shape)}")
        if not torch.isfinite(f).all():
            raise ConfigError("features must be finite")
        generator = torch.Generator().manual_seed(0) if generator is None else generator
        scheduler = DDIMScheduler(num_train_timesteps=c.train_timesteps, beta_schedule=c.beta_schedule,
                                  prediction_type="epsilon", clip_sample=True)
        scheduler.set_timesteps(num_inference_steps)
        out = []
        for start in tqdm(range(0, len(f), batch_size), desc="sampling", unit="batch", disable=not progress,
                          dynamic_ncols=True):
            cond = f[start:start + batch_size].to(self.device)
            x = torch.randn((len(cond), c.channels, c.image_size, c.image_size), generator=generator)
            x = (x * scheduler.init_noise_sigma).to(self.device)
            for t in scheduler.timesteps:
                eps = self.guided_noise(x, t.to(self.device), cond, guidance_scale)
                x = scheduler.step(eps, t, x, eta=0.0).prev_sample  # DDIM eq. 12, sigma_t = 0
            out.append(((x.clamp(-1, 1) + 1) / 2).float().cpu())
        if not out:
            return torch.zeros(0, c.channels, c.image_size, c.image_size)
        return torch.cat(out)

    # -- state ------------------------------------------------------------------------------------------------------

    def state_dict(self) -> dict[str, Any]:
        return {"format": CHECKPOINT_FORMAT, "config": self.config.to_dict(), "seed": self.seed, "step": self.step,
                "model": self.model.state_dict(), "ema": self.ema.state_dict(),
                "optimizer": self.optimizer.state_dict(), "generator": self.generator.get_state(),
                "losses": list(self.losses), "fingerprint": self.fingerprint, "train_seconds": self.train_seconds}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        if state.get("format") != CHECKPOINT_FORMAT:
            raise ConfigError(f"unsupported reconstructor checkpoint format {state.get('format')!r} "
                              f"(this code reads {CHECKPOINT_FORMAT})")
        if ReconstructorConfig.from_dict(state["config"]) != self.config:
            raise ConfigError("the checkpoint's reconstructor settings differ from this one's")
        self.model.load_state_dict(state["model"])
        self.ema.load_state_dict(state["ema"])
        self.optimizer.load_state_dict(state["optimizer"])
        self.generator.set_state(state["generator"])
        self.step = int(state["step"])
        self.losses = [float(v) for v in state["losses"]]
        self.fingerprint = state["fingerprint"]
        self.train_seconds = float(state.get("train_seconds", 0.0))

    def save(self, path: str | os.PathLike) -> Path:
        """Write the checkpoint atomically (a temporary file in the same folder, then ``os.replace``)."""
        path = Path(path)
        path.parent.mkdir(parents=True, exist_ok=True)
        temporary = path.with_name(path.name + ".tmp")
        torch.save(self.state_dict(), temporary)
        os.replace(temporary, path)
        return path

    @classmethod
    def load(cls, path: str | os.PathLike, *, device: str | torch.device = "cpu") -> Reconstructor:
        """Rebuild a reconstructor from :meth:`save`'s file (``torch.load(weights_only=True)``)."""
        state = torch.load(Path(path), map_location="cpu", weights_only=True)
        if not isinstance(state, dict) or "config" not in state:
            raise ConfigError(f"{path} is not a reconstructor checkpoint")
        reconstructor = cls(ReconstructorConfig.from_dict(state["config"]), device=device, seed=int(state["seed"]))
        reconstructor.load_state_dict(state)
        return reconstructor


def train_or_resume(config: ReconstructorConfig, features: Any, images: Any, *, steps: int,
                    checkpoint: str | os.PathLike | None, device: str | torch.device = "cpu", seed: int = 0,
                    checkpoint_every: int = 500, progress: bool = True) -> Reconstructor:
    """Load ``checkpoint`` if it exists (same settings and data) and train it on to ``steps``; else train anew."""
    if checkpoint is not None and Path(checkpoint).is_file():
        reconstructor = Reconstructor.load(checkpoint, device=device)
        if reconstructor.config != config:
            raise ConfigError(f"{checkpoint} holds a reconstructor with other settings ({reconstructor.config}); "
                              "use another checkpoint path or delete it")
    else:
        reconstructor = Reconstructor(config, device=device, seed=seed)
    reconstructor.fit(features, images, steps=steps, checkpoint=checkpoint, checkpoint_every=checkpoint_every,
                      progress=progress)
    return reconstructor


def select_guidance_scale(reconstructor: Reconstructor, features: Any, images: Any, scales: Any, *,
                          num_inference_steps: int = 20, seed: int = 0,
                          progress: bool = False) -> tuple[float, dict[float, float]]:
    """The guidance scale w whose reconstructions of held-out attacker pairs have the highest mean SSIM.

    The attacker holds these pairs out of training, so the choice uses no defender data. Every scale starts from the
    same noise (one sample per feature), so the scores differ only by w; ties go to the smaller w.

    Args:
        reconstructor: a trained reconstructor (anything with its ``sample`` method).
        features, images: ``[n, d]`` held-out attacker features and their images ``[n, C, H, W]`` on [0, 1].
        scales: candidate scales w >= 0.

    Returns:
        ``(best w, {w: mean SSIM})``.
    """
    from attacks.metrics import ssim_pairs

    values = [_real("guidance scale", w, 0.0, 1e3) for w in scales]
    if not values:
        raise ConfigError("select_guidance_scale needs at least one candidate scale")
    x = torch.as_tensor(np.asarray(images) if not isinstance(images, torch.Tensor) else images, dtype=torch.float32)
    f = torch.as_tensor(np.asarray(features) if not isinstance(features, torch.Tensor) else features,
                        dtype=torch.float32)
    if len(f) == 0 or len(f) != len(x):
        raise ConfigError(f"need as many held-out features as images (and at least one), got {len(f)} and {len(x)}")
    scores: dict[float, float] = {}
    for w in values:
        generator = torch.Generator().manual_seed(seed)
        recon = reconstructor.sample(f, guidance_scale=w, num_inference_steps=num_inference_steps,
                                     generator=generator, progress=progress)
        scores[w] = float(ssim_pairs(x, recon).mean())
    best = max(scores, key=lambda w: (scores[w], -w))
    return best, scores
