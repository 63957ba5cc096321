"""The settings of one run of ``privfl attack reconstruct``: :class:`AttackSettings` (every setting, checked by
:meth:`AttackSettings.validate` before any work), the :data:`PRESETS`, and :func:`reconstructor_config` (the
reconstructor's configuration the settings give).

The command line that fills them: :mod:`attacks.reconstruct_cli`; what each setting does in the protocol:
docs/attacks.md, "privfl attack reconstruct".
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from attacks.decoders import DECODERS
from privfl.errors import ConfigError

__all__ = ["GUIDE_DECODERS", "PRESETS", "READINGS", "AttackSettings", "reconstructor_config"]

#: What ``--readings`` accepts: how mixture releases are read.
READINGS = ("post", "naive", "both")
#: What ``--guide-decoder`` accepts (``None``: no estimate read).
GUIDE_DECODERS = (None, "knn", "nn", "mlp", "mlp-tuned")


@dataclass
class AttackSettings:
    """Every setting of one attack run (all saved in ``attack_results.json``).

    ``seed`` seeds everything the attacker trains (held-out split, reconstructor, decoders, sampling selection);
    ``seeds`` are the evaluation replicates: each draws its own disjoint defender set, release noise and samples.
    """

    out: str
    preset: str | None = None
    dataset: str = "mnist"
    data_root: str | None = None
    backbone: str = "mobilenet_v2"
    input_size: int = 64
    schemes: tuple[str, ...] = ("raw", "fedpft", "dp-fedpft")
    eps: tuple[float, ...] = (1.0, 4.0, 10.0)
    delta: float = 1e-5
    components: int = 10
    covariance: str = "diag"
    readings: str = "post"
    prior_covariance: str = "full"
    attacker_images: int | None = None
    defender_images: int = 500
    validation_images: int = 1000
    image_size: int = 28
    block_channels: tuple[int, ...] = (32, 64, 128)
    layers_per_block: int = 2
    mid_attention: bool = True
    condition_dims: int | None = None
    prediction_type: str = "v_prediction"
    steps: int = 8000
    batch_size: int = 32
    learning_rate: float = 3e-4
    cond_dropout: float = 0.1
    guidance: tuple[float, ...] = (1.0, 1.5, 2.0, 3.0)
    guidance_intervals: tuple[tuple[float, float], ...] = ((0.0, 1.0), (0.0, 0.5), (0.5, 1.0))
    guidance_rescales: tuple[float, ...] = (0.0, 0.7)
    init_strengths: tuple[float, ...] = (0.5, 0.8)
    selection_images: int = 256
    ddim_steps: int = 10
    samples_per_feature: int = 8
    set_samples_per_feature: int = 4
    one_step_draws: int = 8
    one_step_guidance: tuple[float, ...] = (1.0, 1.1, 1.25, 1.5)
    baselines: tuple[str, ...] = DECODERS
    guide_decoder: str | None = "knn"
    guide_folds: int = 5
    mlp_hidden: int = 1024
    mlp_epochs: int = 30
    tuned_epochs: int = 10
    random_features: int = 4096
    decoders_only: bool = False
    top_fractions: tuple[float, ...] = (0.05,)
    near_duplicate_fraction: float = 0.1
    bootstrap: int = 1000
    checkpoint: str | None = None
    init_weights: str | None = None
    checkpoint_every: int = 250
    train_only: bool = False
    device: str = "auto"
    precision: str = "auto"
    dp_noise: str = "seeded"
    seed: int = 0
    seeds: tuple[int, ...] = (0,)
    progress: bool = True
    extra: dict[str, Any] = field(default_factory=dict)

    def validate(self) -> None:
        """Refuse a bad setting before any work, with an error that names its option (the checks below, in turn)."""
        from attacks.reconstructor_config import ReconstructorConfig

        self._check_releases()
        self._check_hardware()
        self._check_counts()
        self._check_sampling()
        self._check_attacker()
        self._check_evaluation()
        ReconstructorConfig(feature_dim=max(1, self.condition_dims or 1), image_size=self.image_size,
                            block_channels=self.block_channels, layers_per_block=self.layers_per_block,
                            batch_size=self.batch_size, learning_rate=self.learning_rate,
                            cond_dropout=self.cond_dropout, mid_attention=self.mid_attention,
                            condition_dims=self.condition_dims, prediction_type=self.prediction_type,
                            guide_image=self.guide_decoder is not None)
        # (its errors name the setting, before any work)

    def _check_releases(self) -> None:
        """The schemes, their epsilons and how the attacker reads mixture releases."""
        from attacks.schemes import SCHEMES

        bad = [s for s in self.schemes if s not in SCHEMES]
        if not self.schemes or bad:
            raise ConfigError(f"--schemes: unknown scheme(s) {bad or '(none given)'}; valid: {', '.join(SCHEMES)}")
        if "dp-fedpft" in self.schemes and not self.eps:
            raise ConfigError("--eps: scheme dp-fedpft needs at least one epsilon, e.g. --eps 1,4,10")
        if any(not math.isfinite(e) or e <= 0 for e in self.eps):
            raise ConfigError(f"--eps: every epsilon must be a finite number > 0, got {list(self.eps)}")
        if self.covariance not in ("full", "diag", "spherical"):
            raise ConfigError(f"--covariance must be full, diag or spherical, got {self.covariance!r}")
        if self.readings not in READINGS:
            raise ConfigError(f"--readings must be one of {', '.join(READINGS)}, got {self.readings!r}")
        if self.prior_covariance not in ("full", "diag"):
            raise ConfigError(f"--prior-covariance must be full or diag, got {self.prior_covariance!r}")

    def _check_hardware(self) -> None:
        """The device (CUDA asked for where there is none is an error here) and the precision."""
        from attacks.reconstructor_config import PRECISIONS, resolve_device

        resolve_device(self.device)  # cuda without CUDA is an error here, before any work
        if self.precision not in PRECISIONS:
            raise ConfigError(f"--precision must be one of {', '.join(PRECISIONS)}, got {self.precision!r}")

    def _check_counts(self) -> None:
        """Delta and every count, size and fraction."""
        if not 0 < self.delta < 1:
            raise ConfigError(f"--delta must be in (0, 1), got {self.delta}")
        for name in ("defender_images", "steps", "batch_size", "ddim_steps", "components", "checkpoint_every",
                     "input_size", "selection_images", "mlp_hidden", "mlp_epochs", "layers_per_block",
                     "tuned_epochs", "random_features"):
            if getattr(self, name) < 1:
                raise ConfigError(f"--{name.replace('_', '-')} must be an integer >= 1, got {getattr(self, name)}")
        if self.attacker_images is not None and self.attacker_images < 2:
            raise ConfigError(f"--attacker-images must be an integer >= 2 or 'all', got {self.attacker_images}")
        if isinstance(self.one_step_draws, bool) or not isinstance(self.one_step_draws, int) \
                or self.one_step_draws < 0:
            raise ConfigError(f"--one-step-draws must be an integer >= 0 (noise draws the one-step posterior mean "
                              f"averages; 0: not scored), got {self.one_step_draws!r}")
        if self.one_step_draws and self.prediction_type == "epsilon":
            raise ConfigError("--one-step-draws needs --prediction-type v_prediction (an eps-prediction gives the "
                              "one-step x_0 only by dividing by sqrt(abar_T), about 0); use v_prediction or "
                              "--one-step-draws 0")
        for name in ("samples_per_feature", "set_samples_per_feature"):
            if getattr(self, name) < 2:
                raise ConfigError(f"--{name.replace('_', '-')} must be >= 2 (the attacker selection and the medoid "
                                  f"compare samples), got {getattr(self, name)}")
        if self.image_size < 11:
            raise ConfigError(f"--image-size must be >= 11 (SSIM's 11 x 11 window), got {self.image_size}")
        if not self.top_fractions or any(not 0 < f <= 1 for f in self.top_fractions):
            raise ConfigError(f"--top-fractions must be fractions in (0, 1], got {list(self.top_fractions)}")
        if not 0 <= self.near_duplicate_fraction < 1:
            raise ConfigError(f"--near-duplicate-fraction must be in [0, 1), got {self.near_duplicate_fraction}")

    def _check_sampling(self) -> None:
        """The guidance scales, intervals and rescales and the initialisation strengths to choose from."""
        from attacks.reconstructor_config import SamplingSettings

        if not self.guidance or any(not math.isfinite(w) or w < 0 for w in self.guidance):
            raise ConfigError(f"--guidance must be one or more finite scales >= 0, got {list(self.guidance)}")
        if not self.one_step_guidance or any(not math.isfinite(w) or w < 0 for w in self.one_step_guidance):
            raise ConfigError(f"--one-step-guidance must be one or more finite scales >= 0, got "
                              f"{list(self.one_step_guidance)}")
        for interval in self.guidance_intervals:
            SamplingSettings(guidance_interval=interval)   # its error names the bad interval
        for phi in self.guidance_rescales:
            SamplingSettings(guidance_rescale=phi)
        for s in self.init_strengths:
            SamplingSettings(init_strength=s)

    def _check_attacker(self) -> None:
        """The held-out pairs, the decoder baselines, the guide decoder and the reconstructor's starting weights."""
        if self.validation_images < 1:
            raise ConfigError(f"--validation-images must be >= 1 (held-out attacker pairs choose the sampling "
                              f"settings and the decoders' hyperparameters), got {self.validation_images}")
        if self.attacker_images is not None and self.validation_images >= self.attacker_images:
            raise ConfigError(f"--validation-images ({self.validation_images}) must leave training pairs out of "
                              f"--attacker-images ({self.attacker_images})")
        bad = [b for b in self.baselines if b not in DECODERS]
        if bad:
            raise ConfigError(f"--baselines: unknown baseline(s) {bad}; valid: {', '.join(DECODERS)}")
        if self.decoders_only and not self.baselines:
            raise ConfigError("--decoders-only needs at least one decoder in --baselines")
        if self.guide_decoder not in GUIDE_DECODERS:
            raise ConfigError(f"--guide-decoder must be knn, nn, mlp, mlp-tuned or none (decoders with a "
                              f"leave-one-out or out-of-fold estimate for the training pairs), got "
                              f"{self.guide_decoder!r}")
        if self.guide_folds < 2:
            raise ConfigError(f"--guide-folds must be >= 2 (the cross-fitted MLPs of --guide-decoder mlp), got "
                              f"{self.guide_folds}")
        if self.init_weights is not None and not Path(self.init_weights).is_file():
            raise ConfigError(f"--init-weights {self.init_weights!r} is not a file (a reconstructor checkpoint or "
                              f"exported weights)")

    def _check_evaluation(self) -> None:
        """The bootstrap, the defender's noise source, the conditioning and the evaluation seeds."""
        from privfl.privacy.mechanisms import NOISE_SOURCES

        if self.bootstrap < 100:
            raise ConfigError(f"--bootstrap must be >= 100 resamples, got {self.bootstrap}")
        if self.dp_noise not in NOISE_SOURCES:
            raise ConfigError(f"--dp-noise must be one of {', '.join(NOISE_SOURCES)}, got {self.dp_noise!r}")
        if self.condition_dims is not None and self.condition_dims < 1:
            raise ConfigError(f"--condition-dims must be an integer >= 1 or none, got {self.condition_dims}")
        if not self.seeds or any(s < 0 for s in self.seeds) or len(set(self.seeds)) != len(self.seeds):
            raise ConfigError(f"--seeds must be distinct integers >= 0, got {list(self.seeds)}")


#: Settings each preset changes (everything else keeps the defaults of :class:`AttackSettings`).
PRESETS: dict[str, dict[str, Any]] = {
    # A small end-to-end run: every row, table, CSV and figure, a few minutes on one CPU thread; the numbers show
    # the protocol works, not what the attack can do.
    "quick": dict(attacker_images=2000, validation_images=100, defender_images=150, seeds=(0,),
                  block_channels=(16, 32, 32), layers_per_block=1, steps=200, batch_size=32, learning_rate=1e-3,
                  guidance=(1.0, 2.0), guidance_intervals=((0.0, 1.0),), guidance_rescales=(0.0,),
                  init_strengths=(0.6,), selection_images=50, ddim_steps=4, samples_per_feature=4,
                  set_samples_per_feature=2, mlp_hidden=256, mlp_epochs=5, tuned_epochs=3, random_features=512,
                  top_fractions=(0.15,), bootstrap=200),
    # benchmarks/attack_mnist.py: all 60,000 MNIST training images for the attacker (1,000 held out), three
    # disjoint defender sets of 500 test images, the 28 px UNet (32-64-128, two blocks per level) for 8,000 steps
    # (about two hours on one CPU thread in bfloat16 autocast; minutes on a GPU).
    "benchmark": dict(attacker_images=None, validation_images=1000, defender_images=500, seeds=(0, 1, 2),
                      precision="bf16"),
    # The benchmark's attacker, reconstructor and checkpoint (the same training data and model: a trained
    # benchmark checkpoint is reused) with an evaluation about five times cheaper: three disjoint defender sets of
    # 250 images, 4 / 2 samples per raw / mixture feature, three sampling candidates on 128 held-out pairs, the MLP
    # decoder for at most 15 epochs; about 25 minutes of one CPU thread once the reconstructor is trained.
    "reduced": dict(attacker_images=None, validation_images=1000, defender_images=250, seeds=(0, 1, 2),
                    precision="bf16", samples_per_feature=4, set_samples_per_feature=2, guidance=(1.0, 1.5),
                    guidance_intervals=((0.5, 1.0),), guidance_rescales=(0.0,), init_strengths=(0.5,),
                    selection_images=128, mlp_epochs=15, top_fractions=(0.05, 0.1)),
}


def reconstructor_config(settings: AttackSettings, feature_dim: int, channels: int) -> Any:
    """The reconstructor's configuration under ``settings``, for features of ``feature_dim`` and ``channels``-channel
    images."""
    from attacks.reconstructor_config import ReconstructorConfig

    return ReconstructorConfig(feature_dim=feature_dim, image_size=settings.image_size, channels=channels,
                               block_channels=settings.block_channels, layers_per_block=settings.layers_per_block,
                               mid_attention=settings.mid_attention, condition_dims=settings.condition_dims,
                               prediction_type=settings.prediction_type, batch_size=settings.batch_size,
                               learning_rate=settings.learning_rate, cond_dropout=settings.cond_dropout,
                               guide_image=settings.guide_decoder is not None)
