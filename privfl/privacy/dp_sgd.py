"""DP-SGD for training clients (Abadi et al. 2016), with an accountant that lives as long as the client.

A client that trains with DP-SGD releases a model update computed from ``steps`` steps of: Poisson-sample each record
with probability q, clip every per-sample gradient to L2 norm ``max_grad_norm`` (C), sum, add
N(0, (noise_multiplier * C)^2 I), divide by ``batch_size`` and take an SGD step. Under add-or-remove-one
neighbouring, one round is ``SelfComposedEvent(SubsampledGaussianEvent(noise_multiplier, q), steps)``.

Entry points: :class:`DPSGDConfig`, :class:`DPSGDTrainer` (:meth:`DPSGDTrainer.train` runs any method's local
training on a per-record loss), :func:`sampling_probability`, :func:`check_dp_compatible`.

Why q, the step count and the divisor are public, the generic training loop and the accountant's lifetime:
docs/privacy.md, "DP-SGD".
"""

from __future__ import annotations

import contextlib
import math
import numbers
import warnings
from collections.abc import Callable, Iterable, Iterator, Mapping
from dataclasses import dataclass
from typing import Any, Literal, get_args

import numpy as np
import torch
from torch import nn

import accounting
from accounting import ComposedEvent, SelfComposedEvent, SubsampledGaussianEvent
from accounting.validation import is_int_at_least
from privfl.errors import ConfigError
from privfl.privacy.mechanisms import NOISE_SOURCES, os_seeded_generator, standard_normal
from privfl.privacy.per_sample import (
    PATHS,
    ClippedGradientSum,
    PerSampleLoss,
    _check_losses,
    cross_entropy_losses,
    flat_views,
    trained_parameters,
)

#: ``(params by name) -> scalar``: a loss term whose gradient does not depend on the client's data.
ExtraLoss = Callable[[Mapping[str, torch.Tensor]], torch.Tensor]
#: ``(x_batch, y_batch, max_grad_norm, views) -> per-sample losses``: adds sum_i clip(g_i) to the views.
ClippedSum = Callable[[torch.Tensor, torch.Tensor, float, dict[int, torch.Tensor]], torch.Tensor]

#: Opacus' per-sample machinery, kept as the reference: "ghost" (fast gradient clipping, Li et al. 2022 / Bu et al.
#: 2023, two backward passes), "hooks", "functorch".
OPACUS_MODES: tuple[str, ...] = ("ghost", "hooks", "functorch")
#: grad_sample_mode values this module accepts: "auto" (the default: the fastest path of
#: :mod:`privfl.privacy.per_sample` that handles the model and loss), one of its paths by name, or an Opacus mode.
GRAD_SAMPLE_MODES: tuple[str, ...] = ("auto", *PATHS, *OPACUS_MODES)
#: Accountants that price DP-SGD here (see :mod:`accounting.accountants`).
DPSGDAccountant = Literal["pld", "prv"]
DP_SGD_ACCOUNTANTS: tuple[str, ...] = get_args(DPSGDAccountant)


class GenericPathWarning(UserWarning):
    """DP-SGD fell back from the fast per-sample path to a generic one (same privacy, slower); the text says why."""


def _config_error(name: str, value: object, valid: str) -> ConfigError:
    return ConfigError(f"DPSGDConfig.{name} must be {valid}, got {value!r}")


def _is_real(value: object) -> bool:
    return isinstance(value, numbers.Real) and not isinstance(value, bool)


@dataclass(frozen=True)
class DPSGDConfig:
    """How a client runs DP-SGD; validated at construction.

    Exactly one of ``noise_multiplier`` and ``target_epsilon`` is set:

    - ``noise_multiplier`` (sigma / C, > 0): used as is. ``total_steps``, if given, caps the client's local steps
      over the whole run.
    - ``target_epsilon`` (natural log, > 0): the noise multiplier is calibrated once, for the client's **whole**
      planned schedule of ``total_steps`` local steps over all rounds at sampling rate q = batch_size / n, so that
      the client ends the run at (target_epsilon, delta)-DP by ``accountant``. ``total_steps`` is then required and
      is a hard cap: a round that would go beyond it raises before it runs.

    Args:
        delta: delta of the guarantee, in (0, 1); use well below 1 / n.
        max_grad_norm: C, the L2 norm every per-sample gradient is clipped to (> 0).
        grad_sample_mode: how the clipped sum of per-sample gradients is computed. "auto" (default): the "fast"
            path of :mod:`privfl.privacy.per_sample` where it handles the model and loss, else "vmap", else "loop"
            (the trainer reports which ran, :attr:`DPSGDTrainer.gradient_path`). "fast", "vmap", "loop": that path
            only (an error if it cannot handle the model). "ghost", "hooks", "functorch": Opacus' machinery, the
            reference. Every mode clips the same per-sample gradients to the same C and draws the same noise, so the
            privacy guarantee does not depend on the mode; only the speed does.
        total_steps: the client's planned local steps over the run (see above).
        accountant: "pld" (dp-accounting, tight) or "prv" (Opacus' default); used for calibration and
            :meth:`DPSGDTrainer.epsilon`.
        noise: "secure" (default): batch sampling and gradient noise from generators seeded by the OS CSPRNG, so
            no one who knows the run seed can tell which records were sampled or subtract the noise; "hardened":
            as "secure", and the gradient noise drawn as Opacus' ``secure_mode`` draws it against floating-point
            attacks (each coordinate the sum of four draws halved, :func:`privfl.privacy.mechanisms.standard_normal`;
            same distribution, so the same accounting; in every ``grad_sample_mode``); "seeded": both from the
            client's keyed generator (same seed, same numbers), for research runs only.

    >>> DPSGDConfig(noise_multiplier=1.1).grad_sample_mode
    'auto'
    """

    noise_multiplier: float | None = None
    target_epsilon: float | None = None
    delta: float = 1e-5
    max_grad_norm: float = 1.0
    grad_sample_mode: str = "auto"
    total_steps: int | None = None
    accountant: DPSGDAccountant = "pld"
    noise: str = "secure"

    def __post_init__(self) -> None:
        if (self.noise_multiplier is None) == (self.target_epsilon is None):
            raise ConfigError(
                "DPSGDConfig needs exactly one of noise_multiplier and target_epsilon, got "
                f"noise_multiplier={self.noise_multiplier!r}, target_epsilon={self.target_epsilon!r}"
            )
        for name in ("noise_multiplier", "target_epsilon"):
            value = getattr(self, name)
            if value is not None and not (_is_real(value) and math.isfinite(value) and value > 0):
                raise _config_error(name, value, "a finite number > 0")
        if not (_is_real(self.delta) and 0 < self.delta < 1):
            raise _config_error("delta", self.delta, "a probability in (0, 1)")
        if not (_is_real(self.max_grad_norm) and math.isfinite(self.max_grad_norm) and self.max_grad_norm > 0):
            raise _config_error("max_grad_norm", self.max_grad_norm, "a finite number > 0")
        if self.grad_sample_mode not in GRAD_SAMPLE_MODES:
            raise _config_error("grad_sample_mode", self.grad_sample_mode, f"one of {', '.join(GRAD_SAMPLE_MODES)}")
        if self.total_steps is not None and not is_int_at_least(self.total_steps, 1):
            raise _config_error("total_steps", self.total_steps, "an integer >= 1 or None")
        if self.target_epsilon is not None and self.total_steps is None:
            raise ConfigError(
                "DPSGDConfig.total_steps is required with target_epsilon: the noise is calibrated for the client's "
                "whole planned schedule (all local steps of all rounds), not for one round; got total_steps=None"
            )
        if self.accountant not in DP_SGD_ACCOUNTANTS:
            raise _config_error("accountant", self.accountant, f"one of {', '.join(DP_SGD_ACCOUNTANTS)}")
        if self.noise not in NOISE_SOURCES:
            raise _config_error("noise", self.noise, f"one of {', '.join(NOISE_SOURCES)}")


def check_dp_compatible(model: nn.Module) -> None:
    """Raise :class:`ConfigError` if ``model`` has layers DP-SGD cannot train (BatchNorm, ...), naming them.

    Per-sample gradients and the per-record sensitivity both break when a layer mixes samples of a batch.
    """
    from opacus.validators import ModuleValidator

    errors = ModuleValidator.validate(model, strict=False)
    if errors:
        listed = "; ".join(str(e) for e in errors)
        raise ConfigError(
            f"the model has layers DP-SGD cannot train: {listed}. Replace them with "
            "`model = opacus.validators.ModuleValidator.fix(model)` (BatchNorm becomes GroupNorm) before training"
        )


@contextlib.contextmanager
def _only_trained_require_grad(model: nn.Module, trained: dict[str, nn.Parameter]) -> Iterator[None]:
    """Within the block exactly the ``trained`` parameters require gradients (the model's others are frozen, and a
    trained one that did not require them does); every flag is restored afterwards."""
    trained_ids = {id(p) for p in trained.values()}
    frozen = [p for p in model.parameters() if p.requires_grad and id(p) not in trained_ids]
    untrained = [p for p in trained.values() if not p.requires_grad]
    for p in frozen:
        p.requires_grad_(False)
    for p in untrained:
        p.requires_grad_(True)
    try:
        yield
    finally:
        for p in frozen:
            p.requires_grad_(True)
        for p in untrained:
            p.requires_grad_(False)


class DPSGDTrainer:
    """One client's DP-SGD: trains a model round after round and composes the privacy of every round it ran.

    Create one per client and keep it as long as the client (checkpoint it with :meth:`state_dict`); never one per
    round, or the client's epsilon would be reset every round.

    The privacy claim (``epsilon(delta)``) assumes: each record is one individual (add-or-remove-one neighbouring
    on the client's dataset), the dataset size n used for q = batch_size / n is the one the trainer sees, and the
    updates are the only use of the data. Sampling is true Poisson sampling (batches have random size, possibly 0).
    The accountants analyse Poisson sampling at a fixed q; q = batch_size / n is set from n, as in Opacus, so n is
    taken as known for the sampling rate; nothing else released depends on n: the noisy sum is divided by
    ``batch_size``, not by n.

    >>> trainer = DPSGDTrainer(DPSGDConfig(noise_multiplier=1.0))
    >>> trainer.total_steps, trainer.epsilon()
    (0, 0.0)
    """

    def __init__(self, config: DPSGDConfig) -> None:
        if not isinstance(config, DPSGDConfig):
            raise ConfigError(f"DPSGDTrainer needs a DPSGDConfig, got {config!r}")
        self.config = config
        # Run-length compressed [(noise_multiplier, sampling_probability, steps)], as Opacus' accountants keep it.
        self._history: list[tuple[float, float, int]] = []
        # Calibrated noise multiplier and the sampling rate it was calibrated for (target-epsilon mode only).
        self._calibrated: tuple[float, float] | None = None
        #: The per-sample gradient path of the last round ("fast", "vmap", "loop" or an Opacus mode), None before.
        self.gradient_path: str | None = None
        #: Why the last round's path was not "fast" (with grad_sample_mode="auto"), else None.
        self.gradient_path_reason: str | None = None

    # --- privacy bookkeeping -------------------------------------------------------------------------------------

    @property
    def total_steps(self) -> int:
        """DP-SGD steps run so far over all rounds."""
        return sum(steps for _, _, steps in self._history)

    @property
    def history(self) -> list[tuple[float, float, int]]:
        """``[(noise_multiplier, sampling_probability, steps)]`` over all rounds, run-length compressed."""
        return list(self._history)

    def cumulative_event(self) -> ComposedEvent:
        """Every DP-SGD step this client has run, as one accounting event."""
        return ComposedEvent(tuple(
            SelfComposedEvent(SubsampledGaussianEvent(sigma, q), steps) for sigma, q, steps in self._history
        ))

    def epsilon(self, delta: float | None = None, *, accountant: DPSGDAccountant | None = None) -> float:
        """Epsilon (natural log) spent so far at ``delta`` (default: the config's) over all rounds; 0.0 before any.

        ``accountant`` is "pld" or "prv" (default: the config's); it never decreases as rounds are added.
        """
        if not self._history:
            return 0.0
        return accounting.epsilon(self.cumulative_event(), self.config.delta if delta is None else delta,
                                  accountant=accountant or self.config.accountant)

    def opacus_epsilon(self, delta: float | None = None) -> float:
        """The same epsilon from an Opacus ``PRVAccountant`` holding this trainer's history (a cross-check)."""
        from opacus.accountants import PRVAccountant

        if not self._history:
            return 0.0
        prv = PRVAccountant()
        prv.history = list(self._history)
        return float(prv.get_epsilon(self.config.delta if delta is None else delta))

    def noise_multiplier_for(self, num_samples: int, batch_size: int, sampling_rate: float | None = None) -> float:
        """The noise multiplier used at sampling rate ``sampling_rate`` (default ``batch_size / num_samples``),
        calibrating it once if needed."""
        q = sampling_probability(num_samples, batch_size)
        if sampling_rate is not None:
            q = _check_rate(sampling_rate)
        config = self.config
        if config.noise_multiplier is not None:
            return float(config.noise_multiplier)
        if self._calibrated is None:
            if config.target_epsilon is None or config.total_steps is None:   # refused by DPSGDConfig already
                raise ConfigError(
                    "calibrating the noise multiplier needs DPSGDConfig.target_epsilon and total_steps, got "
                    f"target_epsilon={config.target_epsilon!r}, total_steps={config.total_steps!r}"
                )
            sigma = accounting.noise_multiplier_for_epsilon(
                config.target_epsilon, config.delta, sampling_probability=q, steps=config.total_steps,
                accountant=config.accountant,
            )
            self._calibrated = (float(sigma), q)
        sigma, calibrated_q = self._calibrated
        if not math.isclose(q, calibrated_q, rel_tol=1e-12):
            raise ConfigError(
                f"the noise multiplier was calibrated for target_epsilon={config.target_epsilon!r} at sampling rate "
                f"q={calibrated_q!r}, but this round has q={q!r}; keep the sampling rate (or batch_size and the "
                "client's dataset) fixed across rounds, or set noise_multiplier instead"
            )
        return sigma

    # --- training ------------------------------------------------------------------------------------------------

    def train(
        self,
        model: nn.Module,
        x: torch.Tensor,
        y: torch.Tensor,
        *,
        lr: float,
        steps: int,
        batch_size: int,
        rng: np.random.Generator,
        per_sample_loss: PerSampleLoss | None = None,
        extra_loss: ExtraLoss | None = None,
        weight_decay: float = 0.0,
        momentum: float = 0.0,
        params: Iterable[str | nn.Parameter] | None = None,
        sampling_rate: float | None = None,
    ) -> tuple[float, SelfComposedEvent]:
        """Run ``steps`` DP-SGD steps on ``(x, y)`` in place on ``model``; record them.

        Each step: Poisson-sample the records (probability q: ``sampling_rate``, else min(1, batch_size / n)),
        clip each sampled record's gradient of ``per_sample_loss`` (over all trained parameters jointly) to
        ``max_grad_norm``, sum, add N(0, (noise_multiplier * max_grad_norm)^2) per coordinate, divide by
        ``batch_size``, add the gradient of ``extra_loss`` and take an SGD step with ``weight_decay`` and ``momentum``.

        Privacy assumption: the loss of record i depends only on record i (docs/privacy.md, "DP-SGD"); BatchNorm is
        refused, a loss that mixes records otherwise is the caller's responsibility.

        Args:
            model: the client's model, weights already loaded for this round; put in train mode; returned without
                any hooks.
            x, y: the client's training records (n = len(y)) and their targets (integer labels for the default
                loss).
            lr: SGD learning rate (>= 0).
            steps: DP-SGD steps this round (>= 1).
            batch_size: the noisy sum of clipped gradients is divided by ``batch_size`` (public); without
                ``sampling_rate`` each record is sampled with probability q = min(1, batch_size / n).
            rng: the client's keyed generator; with ``noise="seeded"`` sampling and noise are drawn from it (same
                seed, same numbers); with ``"secure"`` or ``"hardened"`` from generators seeded by the OS CSPRNG.
            per_sample_loss: ``(model, x_batch, y_batch) -> losses`` of shape (B,), one per record (default:
                cross-entropy of ``model(x_batch)``, nats). It may call any method of ``model`` and draw random
                numbers (FedSR's sampled representation).
            extra_loss: ``(trained params by name) -> scalar``, a term whose gradient does not depend on the
                client's data (FedProx's ``mu/2 ||w - w_global||^2``, SCAFFOLD's ``<c - c_i, w>``), added after the
                division by ``batch_size``, unclipped and un-noised: post-processing (docs/privacy.md, "DP-SGD").
                A term that reads the client's records belongs in ``per_sample_loss``; this is not checked.
            weight_decay: SGD's L2 coefficient (>= 0), applied by the optimizer to the iterate.
            momentum: SGD's heavy-ball coefficient in [0, 1), a running sum of past noisy gradients.
            params: the parameters to train, as names or the model's own parameters (default: every parameter with
                ``requires_grad``); the others are frozen (not clipped, not noised, not changed).
            sampling_rate: the public Poisson rate q in (0, 1]; ``None``: min(1, batch_size / n), which treats n as
                public (see the module docstring).

        Returns:
            ``(mean_loss, event)``: the mean per-sample loss over the non-empty batches (nan if all were empty) and
            ``SelfComposedEvent(SubsampledGaussianEvent(noise_multiplier, q), steps)`` for this round. Which gradient
            path ran is in :attr:`gradient_path` (and why not "fast", in :attr:`gradient_path_reason`).

        Raises:
            ConfigError: a bad argument (named), the model has layers DP-SGD cannot train, the chosen
                grad_sample_mode cannot handle the model, or the round would go beyond ``config.total_steps``.
        """
        q = self._check_round(x, y, lr=lr, steps=steps, batch_size=batch_size, weight_decay=weight_decay,
                              momentum=momentum, per_sample_loss=per_sample_loss, extra_loss=extra_loss,
                              sampling_rate=sampling_rate)
        sigma = self.noise_multiplier_for(len(y), batch_size, q)
        check_dp_compatible(model)
        trained = trained_parameters(model, params)
        losses = self._run_steps(model, x, y, trained, per_sample_loss, lr=lr, steps=steps, q=q, sigma=sigma,
                                 batch_size=batch_size, rng=rng, extra_loss=extra_loss, weight_decay=weight_decay,
                                 momentum=momentum)
        event = SelfComposedEvent(SubsampledGaussianEvent(sigma, q), steps)
        mean_loss = float(np.mean(losses)) if losses else math.nan
        return mean_loss, event

    def _check_round(
        self, x: torch.Tensor, y: torch.Tensor, *, lr: float, steps: int, batch_size: int, weight_decay: float,
        momentum: float, per_sample_loss: PerSampleLoss | None, extra_loss: ExtraLoss | None,
        sampling_rate: float | None,
    ) -> float:
        """Refuse a bad argument of :meth:`train`, or a round beyond the planned total, before anything changes;
        return the round's sampling rate q."""
        if not is_int_at_least(steps, 1):
            raise ConfigError(f"steps must be an integer >= 1, got {steps!r}")
        for name, value, low, high in (("lr", lr, 0.0, math.inf), ("weight_decay", weight_decay, 0.0, math.inf),
                                       ("momentum", momentum, 0.0, 1.0)):
            if not (_is_real(value) and math.isfinite(value) and low <= value and (value < high)):
                valid = "a number in [0, 1)" if name == "momentum" else "a finite number >= 0"
                raise ConfigError(f"{name} must be {valid}, got {value!r}")
        for name, function in (("per_sample_loss", per_sample_loss), ("extra_loss", extra_loss)):
            if function is not None and not callable(function):
                raise ConfigError(f"{name} must be a callable or None, got {function!r:.80}")
        n = len(y)
        q = sampling_probability(n, batch_size)       # validates n and batch_size either way
        if sampling_rate is not None:
            q = _check_rate(sampling_rate)
        if len(x) != n:
            raise ConfigError(f"x and y must hold the same records, got {len(x)} inputs and {n} targets")
        planned = self.config.total_steps
        if planned is not None and self.total_steps + steps > planned:
            raise ConfigError(
                f"this round's {steps} steps would bring the client to {self.total_steps + steps} DP-SGD steps, "
                f"beyond its planned total_steps={planned} (the budget the noise was calibrated for); "
                "nothing was trained"
            )
        return q

    def _run_steps(
        self, model: nn.Module, x: torch.Tensor, y: torch.Tensor, trained: dict[str, nn.Parameter],
        per_sample_loss: PerSampleLoss | None, *, lr: float, steps: int, q: float, sigma: float, batch_size: int,
        rng: np.random.Generator, extra_loss: ExtraLoss | None, weight_decay: float, momentum: float,
    ) -> list[float]:
        """The round's DP-SGD steps on ``trained`` alone (every other parameter frozen meanwhile); the steps taken
        are recorded even when a later one fails. Returns the per-step mean losses."""
        loss = cross_entropy_losses if per_sample_loss is None else per_sample_loss
        mode = self.config.grad_sample_mode
        opacus = None
        clipped_sum: _OpacusClippedSum | ClippedGradientSum
        done = [0]   # steps taken so far, counted by _dp_sgd_steps
        with _only_trained_require_grad(model, trained):
            model.train()
            try:
                if mode in OPACUS_MODES:
                    clipped_sum = opacus = _OpacusClippedSum(model, trained, loss, mode, self.config.max_grad_norm)
                else:
                    clipped_sum = ClippedGradientSum(model, trained, loss, path=mode)
                losses = _dp_sgd_steps(
                    model, x, y, params=trained, clipped_sum=clipped_sum, lr=lr, steps=steps, q=q,
                    batch_size=batch_size, noise_multiplier=sigma, max_grad_norm=self.config.max_grad_norm, rng=rng,
                    noise=self.config.noise, extra_loss=extra_loss, weight_decay=weight_decay, momentum=momentum,
                    done=done,
                )
            finally:
                # Every step that changed the model is accounted, also when a later step failed: the model holds it.
                if done[0] > 0:
                    self._record(sigma, q, done[0])
                for p in trained.values():
                    p.grad = None
                if opacus is not None:
                    opacus.close()
        if isinstance(clipped_sum, ClippedGradientSum):
            self._report_path(clipped_sum.path, clipped_sum.reason)
        else:
            self._report_path(mode, None)
        return losses

    def _report_path(self, path: str, reason: str | None) -> None:
        self.gradient_path, self.gradient_path_reason = path, reason
        if reason is not None:
            warnings.warn(f"DP-SGD took the {path!r} per-sample gradient path, slower than 'fast' but with the same "
                          f"clipping and noise: {reason}", GenericPathWarning, stacklevel=3)

    def _record(self, sigma: float, q: float, steps: int) -> None:
        if self._history and self._history[-1][:2] == (sigma, q):
            self._history[-1] = (sigma, q, self._history[-1][2] + steps)
        else:
            self._history.append((sigma, q, steps))

    # --- checkpointing -------------------------------------------------------------------------------------------

    def state_dict(self) -> dict[str, Any]:
        """Plain values only (lists of floats and ints): the cumulative history and any calibrated noise."""
        return {
            "history": [[float(s), float(q), int(k)] for s, q, k in self._history],
            "calibrated": None if self._calibrated is None else [float(v) for v in self._calibrated],
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Restore what :meth:`state_dict` returned (the config is not part of the state: build the same one)."""
        self._history = [(float(s), float(q), int(k)) for s, q, k in state["history"]]
        calibrated = state.get("calibrated")
        self._calibrated = None if calibrated is None else (float(calibrated[0]), float(calibrated[1]))


def sampling_probability(num_samples: int, batch_size: int) -> float:
    """q = min(1, batch_size / num_samples), validated."""
    if not is_int_at_least(num_samples, 1):
        raise ConfigError(f"DP-SGD needs at least one training sample, got n={num_samples!r}")
    if not is_int_at_least(batch_size, 1):
        raise ConfigError(f"batch_size must be an integer >= 1, got {batch_size!r}")
    return min(1.0, batch_size / num_samples)


def _check_rate(sampling_rate: object) -> float:
    if isinstance(sampling_rate, bool) or not isinstance(sampling_rate, numbers.Real) \
            or not 0 < float(sampling_rate) <= 1:
        raise ConfigError(f"sampling_rate must be a probability in (0, 1], got {sampling_rate!r}")
    return float(sampling_rate)


def _gaussian_noise(out: torch.Tensor, std: float, generator: torch.Generator, *, hardened: bool) -> torch.Tensor:
    """Fill ``out`` with independent N(0, std^2) draws from ``generator``; return it.

    Every noise number of DP-SGD is drawn here: one draw per step for the flat vector of all trained parameters.
    ``hardened``: each coordinate drawn as Opacus' ``secure_mode`` draws it
    (:func:`privfl.privacy.mechanisms.standard_normal`), the same distribution.
    """
    if hardened:
        return out.copy_(standard_normal(out.shape, generator=generator, hardened=True, dtype=out.dtype)).mul_(std)
    return out.normal_(0.0, std, generator=generator)


def _dp_sgd_steps(
    model: nn.Module, x: torch.Tensor, y: torch.Tensor, *, params: dict[str, nn.Parameter], clipped_sum: ClippedSum,
    lr: float, steps: int, q: float, batch_size: int, noise_multiplier: float, max_grad_norm: float,
    rng: np.random.Generator, noise: str = "secure", extra_loss: ExtraLoss | None = None, weight_decay: float = 0.0,
    momentum: float = 0.0, done: list[int] | None = None,
) -> list[float]:
    """The DP-SGD loop; returns the mean loss of each non-empty batch (``done[0]`` counts the steps taken).

    Steps (Abadi et al. 2016, Algorithm 1, with Poisson sampling as analysed by the accountants):
    1. sample each record independently with probability q;
    2. draw N(0, (noise_multiplier * max_grad_norm)^2) for every coordinate of the flat trained-parameter vector and
       add the sum of the per-sample gradients, each clipped to ``max_grad_norm`` (``clipped_sum``);
    3. divide by ``batch_size`` (public; see the module docstring);
    4. add the gradient of ``extra_loss(params)`` (data-independent: post-processing, outside the clipped and
       noised sum);
    5. SGD step (``weight_decay`` and ``momentum`` act on the iterate and on past noisy gradients only).
    An empty batch still takes steps 2 to 5 (noise only), as the analysis assumes.
    """
    n = len(y)
    sampling_seed, noise_seed = int(rng.integers(2**62)), int(rng.integers(2**62))   # drawn either way: same stream
    if noise == "seeded":
        sampling_gen = torch.Generator().manual_seed(sampling_seed)
        noise_gen = torch.Generator().manual_seed(noise_seed)
    else:
        sampling_gen, noise_gen = os_seeded_generator(), os_seeded_generator()
    hardened = noise == "hardened"
    tensors = list(params.values())
    first = tensors[0]
    flat = torch.empty(sum(p.numel() for p in tensors), dtype=first.dtype, device=first.device)
    # the noise is drawn on the CPU generator wherever the model computes (the same numbers), then copied over
    drawn = flat if flat.device.type == "cpu" else torch.empty(flat.shape, dtype=flat.dtype)
    views = flat_views(params, flat)
    optimizer = torch.optim.SGD(tensors, lr=lr, weight_decay=weight_decay, momentum=momentum)
    std = noise_multiplier * max_grad_norm
    losses: list[float] = []
    for _ in range(steps):
        # 1. Poisson sampling.
        index = torch.nonzero(torch.rand(n, generator=sampling_gen) < q).flatten()
        # 2. noise, plus the clipped per-sample gradients of the sampled records.
        _gaussian_noise(drawn, std, noise_gen, hardened=hardened)
        if drawn is not flat:
            flat.copy_(drawn)
        if index.numel() > 0:
            batch_x, batch_y = x[index].to(first.device), y[index].to(first.device)
            losses.append(clipped_sum(batch_x, batch_y, max_grad_norm, views).mean().item())
        # 3. the public divisor.
        flat.div_(batch_size)
        # 4. the data-independent term, unclipped and un-noised.
        if extra_loss is not None:
            extra = extra_loss(params)
            for p, g in zip(tensors, torch.autograd.grad(extra, tensors, allow_unused=True), strict=True):
                if g is not None:
                    views[id(p)].add_(g)
        # 5. the SGD step.
        for p in tensors:
            p.grad = views[id(p)]
        optimizer.step()
        if done is not None:
            done[0] += 1
    for p in tensors:
        p.grad = None
    return losses


class _OpacusClippedSum:
    """The clipped sum from Opacus' per-sample machinery (``grad_sample_mode`` "ghost", "hooks" or "functorch").

    Opacus' optimizer is used only to clip and sum (``clip_and_accumulate``); noise, scaling and the step are
    :func:`_dp_sgd_steps`'s, so every mode draws noise the same way. Kept as the reference the tests compare the
    own paths against.
    """

    def __init__(self, model: nn.Module, params: dict[str, nn.Parameter], loss: PerSampleLoss, mode: str,
                 max_grad_norm: float) -> None:
        from opacus.grad_sample.utils import prepare_module
        from opacus.optimizers import get_optimizer_class

        self.model, self.params, self.loss, self.mode = model, params, loss, mode
        self.ghost = mode == "ghost"
        try:
            with warnings.catch_warnings():
                # Opacus warns that secure_mode is off (it needs torchcsprng); its optimizer draws no noise here.
                warnings.simplefilter("ignore", UserWarning)
                kwargs = {"max_grad_norm": max_grad_norm} if self.ghost else {}
                self.gsm = prepare_module(model, mode, True, batch_first=True, loss_reduction="mean", **kwargs)
                self.optimizer = get_optimizer_class("flat", False, mode)(
                    torch.optim.SGD(list(params.values()), lr=0.0), noise_multiplier=0.0,
                    max_grad_norm=max_grad_norm, expected_batch_size=1, loss_reduction="mean",
                )
        except Exception as exc:  # noqa: BLE001 - any Opacus failure here means this mode cannot wrap this model
            raise _mode_error(mode, model, exc) from exc
        self.worked = False

    def __call__(self, x: torch.Tensor, y: torch.Tensor, max_grad_norm: float,
                 views: dict[int, torch.Tensor]) -> torch.Tensor:
        from opacus.utils.fast_gradient_clipping_utils import DPTensorFastGradientClipping

        self.optimizer.zero_grad(set_to_none=True)
        try:
            with warnings.catch_warnings():
                # Opacus' backward hooks fire on the first layer although the input needs no gradient; expected.
                warnings.filterwarnings("ignore", message="Full backward hook is firing")
                losses = self.loss(self.model, x, y)
                _check_losses(losses, len(x))
                if self.ghost:
                    DPTensorFastGradientClipping(self.gsm, self.optimizer, losses, "mean").backward()
                    sums = [p.grad for p in self.params.values()]
                else:
                    losses.mean().backward()  # type: ignore[no-untyped-call]  # Tensor.backward is not annotated
                    self.optimizer.clip_and_accumulate()
                    sums = [p.summed_grad for p in self.params.values()]  # type: ignore[attr-defined]  # Opacus sets it
        except ConfigError:
            raise
        except Exception as exc:  # noqa: BLE001
            if self.worked:  # it worked before on this model: a real error, not an unsupported mode
                raise
            raise _mode_error(self.mode, self.model, exc) from exc
        self.worked = True
        for p, summed in zip(self.params.values(), sums, strict=True):
            if summed is not None:
                views[id(p)].add_(summed.view_as(p))
        return losses.detach()

    def close(self) -> None:
        """Remove Opacus' hooks and per-sample attributes: the caller gets a plain module back."""
        self.optimizer.zero_grad(set_to_none=True)
        self.gsm._close()


def _mode_error(mode: str, model: nn.Module, exc: BaseException) -> ConfigError:
    others = ", ".join(repr(m) for m in GRAD_SAMPLE_MODES if m != mode)
    return ConfigError(
        f"grad_sample_mode={mode!r} failed on {type(model).__name__}: {type(exc).__name__}: {exc}. "
        f"No other mode is tried silently; set DPSGDConfig(grad_sample_mode=...) to one of {others}"
    )
