"""A feature-conditioned diffusion model that turns released feature vectors back into images (FedPFT paper, App. E.3).

The attacker trains a denoising diffusion model on pairs ``(E(x), x)`` of its own images; given a released feature,
DDIM sampling with classifier-free guidance draws images that have that feature. Entry points:
:class:`Reconstructor` (fit, sample, posterior_mean, export, load) and :func:`train_or_resume`. Its settings and
devices are in :mod:`attacks.reconstructor_config`, its network in :mod:`attacks.conditioned_unet`, its files in
:mod:`attacks.reconstructor_files`, the choice of its sampling settings in :mod:`attacks.sampling_choice`. The model
and its unstated choices, devices, checkpoints and exported weights: docs/attacks.md, "The diffusion reconstructor".

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
import math
import os
from pathlib import Path
from typing import Any

import numpy as np
import torch
from torch import nn

from attacks.conditioned_unet import FeatureConditionedUNet
from attacks.reconstructor_config import (
    ARCHITECTURE,
    ReconstructorConfig,
    SamplingSettings,
    checked_int,
    checked_real,
    resolve_device,
    resolve_precision,
)
from attacks.reconstructor_files import (
    CHECKPOINT_FORMAT,
    EXPORT_FORMAT,
    FEATURE_TOLERANCE,
    check_format,
    data_fingerprint,
    read_state,
    save_atomically,
    state_weights_sha256,
    summarise_training_data,
)
from privfl.errors import ConfigError
from privfl.models.backbones import file_sha256

__all__ = ["Reconstructor", "file_sha256", "train_or_resume"]


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
        self.seed = checked_int("seed", seed, 0)
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

        steps = checked_int("steps", steps, 0)
        checkpoint_every = checked_int("checkpoint_every", checkpoint_every)
        f, x = self._check_pairs(features, images)
        g = self._check_guides(guides, len(x))
        fingerprint = data_fingerprint(f, x, g)
        if self.step == 0:
            if self.initialised_from is None:   # a fine-tuned one keeps its source's whitening (module docstring, 9)
                self.set_feature_statistics(f)
            self.fingerprint = fingerprint
            self.data_summary = summarise_training_data(f, x)
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
        batch_size = checked_int("batch_size", batch_size)
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
        draws = checked_int("draws", draws)
        batch_size = checked_int("batch_size", batch_size)
        guidance_scale = checked_real("guidance_scale", guidance_scale, 0.0, 1e3)
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
        state = read_state(path)
        source = ReconstructorConfig.from_dict(state["config"])
        differ = {name: (getattr(source, name), getattr(self.config, name)) for name in ARCHITECTURE
                  if getattr(source, name) != getattr(self.config, name)}
        if differ:
            raise ConfigError(f"{path} holds another architecture; (its value, this one's) per differing setting: "
                              f"{differ}")
        self.model.load_state_dict(state["ema"])
        self.ema.load_state_dict(state["ema"])
        self.initialised_from = {
            "file": Path(path).name, "file_sha256": file_sha256(path), "weights_sha256": state_weights_sha256(state),
            "step": int(state["step"]), "train_seconds": float(state.get("train_seconds", 0.0)),
            "fingerprint": state.get("fingerprint"), "config": state["config"], "made_by": state.get("made_by")}

    def _check_exported_data(self, f: torch.Tensor, x: torch.Tensor) -> None:
        """Refuse data other than the exported weights' training data (module docstring, "Exported weights")."""
        trained = self.data_summary
        if trained is None:
            raise ConfigError("these exported weights carry no summary of their training data to check against")
        given = summarise_training_data(f, x)
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
        check_format(state)
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
        return save_atomically(self.state_dict(), path)

    def export(self, path: str | os.PathLike) -> Path:
        """Write the exported weights (module docstring, "Exported weights") atomically; :meth:`load` reads them.

        Refused for a reconstructor whose checkpoint predates the training-data summary the file is checked with.
        """
        if self.data_summary is None:
            raise ConfigError("this reconstructor has no summary of its training data (trained before it was kept, or "
                              "not trained): train it, or resume it for one step, before exporting")
        return save_atomically({**self._sampling_state(), "format": EXPORT_FORMAT}, path)

    @classmethod
    def load(cls, path: str | os.PathLike, *, device: str | torch.device = "cpu",
             precision: str = "auto") -> Reconstructor:
        """Rebuild a reconstructor from :meth:`save`'s or :meth:`export`'s file (``torch.load(weights_only=True)``),
        on any device."""
        state = read_state(path)
        reconstructor = cls(ReconstructorConfig.from_dict(state["config"]), device=device, precision=precision,
                            seed=int(state["seed"]))
        reconstructor.load_state_dict(state)
        return reconstructor


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
            if mine != state_weights_sha256(read_state(init_weights)):
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
