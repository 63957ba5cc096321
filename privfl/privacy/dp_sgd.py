"""DP-SGD for training clients (Abadi et al. 2016) through Opacus, with an accountant that lives as long as the client.

A client that trains with DP-SGD releases a model update computed from ``steps`` steps of: Poisson-sample each record
with probability q = min(1, batch_size / n), clip every per-sample gradient to L2 norm ``max_grad_norm`` (C), sum,
add N(0, (noise_multiplier * C)^2 I), divide by ``batch_size`` and take an SGD step. Under add-or-remove-one
neighbouring, one round is ``SelfComposedEvent(SubsampledGaussianEvent(noise_multiplier, q), steps)``.

The divisor is ``batch_size``, a public setting, never a quantity of the data. For q < 1 it equals the expected batch
size q * n. For q = 1 (a client with no more records than ``batch_size``) the expected batch size would be n itself,
which add-or-remove-one keeps private: dividing by it scales the released noise by 1/n, so the update's norm tells n
from n + 1 whatever the gradients, and the Gaussian event recorded for the step would not cover the release.

Invariant 5 of ``docs/invariants.md``: the privacy of a client composes over **all** its rounds. Flower's Opacus example
builds a new ``PrivacyEngine`` every round, so its epsilon never grows; here one :class:`DPSGDTrainer` per client keeps
the cumulative history (run-length compressed ``(noise_multiplier, q, steps)``, the format of Opacus' accountants) and
is checkpointed with the client through :meth:`DPSGDTrainer.state_dict`. The per-round Opacus objects
(``GradSampleModule`` / ``DPOptimizer``) are built around the model each round and removed afterwards, because the
model's weights are reloaded from the server every round; no Opacus accountant is created per round.

Units: epsilon is natural-log, delta a probability, ``max_grad_norm`` an L2 norm, ``noise_multiplier`` is
sigma / max_grad_norm (dimensionless).
"""

from __future__ import annotations

import math
import numbers
import warnings
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch
from torch import nn

import accounting
from accounting import ComposedEvent, SelfComposedEvent, SubsampledGaussianEvent
from privfl.errors import ConfigError
from privfl.privacy.mechanisms import NOISE_SOURCES, os_seeded_generator, standard_normal

#: grad_sample_mode values this module accepts. "ghost" (fast gradient clipping, Li et al. 2022 / Bu et al. 2023)
#: never materialises per-sample gradients of linear layers and is about 9x faster than "hooks" on the MNIST 2NN.
GRAD_SAMPLE_MODES: tuple[str, ...] = ("ghost", "hooks", "functorch")
#: Accountants that price DP-SGD here (see :mod:`accounting.accountants`).
DP_SGD_ACCOUNTANTS: tuple[str, ...] = ("pld", "prv")


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
        grad_sample_mode: how Opacus gets per-sample gradient norms: "ghost" (default, fastest), "hooks",
            "functorch".
        total_steps: the client's planned local steps over the run (see above).
        accountant: "pld" (dp-accounting, tight) or "prv" (Opacus' default); used for calibration and
            :meth:`DPSGDTrainer.epsilon`.
        noise: "secure" (default): batch sampling and gradient noise from generators seeded by the OS CSPRNG, so
            no one who knows the run seed can tell which records were sampled or subtract the noise; "hardened":
            as "secure", and the gradient noise drawn as Opacus' ``secure_mode`` draws it against floating-point
            attacks (each coordinate the sum of four draws halved, :func:`privfl.privacy.mechanisms.standard_normal`;
            same distribution, so the same accounting); "seeded": both from the client's keyed generator (same seed,
            same numbers), for research runs only.

    >>> DPSGDConfig(noise_multiplier=1.1).grad_sample_mode
    'ghost'
    """

    noise_multiplier: float | None = None
    target_epsilon: float | None = None
    delta: float = 1e-5
    max_grad_norm: float = 1.0
    grad_sample_mode: str = "ghost"
    total_steps: int | None = None
    accountant: str = "pld"
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
        if self.total_steps is not None and (
            not isinstance(self.total_steps, numbers.Integral) or isinstance(self.total_steps, bool)
            or self.total_steps < 1
        ):
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

    def epsilon(self, delta: float | None = None, *, accountant: str | None = None) -> float:
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

    def noise_multiplier_for(self, num_samples: int, batch_size: int) -> float:
        """The noise multiplier used at sampling rate ``batch_size / num_samples`` (calibrating it once if needed)."""
        q = sampling_probability(num_samples, batch_size)
        config = self.config
        if config.noise_multiplier is not None:
            return float(config.noise_multiplier)
        if self._calibrated is None:
            sigma = accounting.noise_multiplier_for_epsilon(
                config.target_epsilon, config.delta, sampling_probability=q, steps=config.total_steps,
                accountant=config.accountant,
            )
            self._calibrated = (float(sigma), q)
        sigma, calibrated_q = self._calibrated
        if not math.isclose(q, calibrated_q, rel_tol=1e-12):
            raise ConfigError(
                f"the noise multiplier was calibrated for target_epsilon={config.target_epsilon!r} at sampling rate "
                f"q={calibrated_q!r}, but this round has q = batch_size / n = {batch_size}/{num_samples} = {q!r}; "
                "keep batch_size and the client's dataset fixed across rounds, or set noise_multiplier instead"
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
    ) -> tuple[float, SelfComposedEvent]:
        """Run ``steps`` DP-SGD steps of cross-entropy on ``(x, y)`` in place on ``model``; record them.

        Args:
            model: the client's model, weights already loaded for this round; left without Opacus hooks.
            x, y: the client's training records (n = len(y)) and integer labels.
            lr: SGD learning rate.
            steps: DP-SGD steps this round (>= 1).
            batch_size: each record is sampled with probability q = min(1, batch_size / n), and the noisy sum of
                clipped gradients is divided by ``batch_size`` (the expected batch size when q < 1).
            rng: the client's keyed generator; with ``noise="seeded"`` sampling and noise are drawn from it (same
                seed, same numbers); with ``"secure"`` or ``"hardened"`` from generators seeded by the OS CSPRNG.

        Returns:
            ``(mean_loss, event)``: the mean batch loss over the non-empty batches (nan if all were empty) and
            ``SelfComposedEvent(SubsampledGaussianEvent(noise_multiplier, q), steps)`` for this round.

        Raises:
            ConfigError: the model has layers DP-SGD cannot train, the grad_sample_mode fails on this model, or the
                round would go beyond ``config.total_steps``.
        """
        if isinstance(steps, bool) or not isinstance(steps, numbers.Integral) or steps < 1:
            raise ConfigError(f"steps must be an integer >= 1, got {steps!r}")
        n = len(y)
        q = sampling_probability(n, batch_size)
        planned = self.config.total_steps
        if planned is not None and self.total_steps + steps > planned:
            raise ConfigError(
                f"this round's {steps} steps would bring the client to {self.total_steps + steps} DP-SGD steps, "
                f"beyond its planned total_steps={planned} (the budget the noise was calibrated for); "
                "nothing was trained"
            )
        sigma = self.noise_multiplier_for(n, batch_size)
        check_dp_compatible(model)

        losses = _dp_sgd_steps(
            model, x, y, lr=lr, steps=steps, q=q, batch_size=batch_size, noise_multiplier=sigma,
            max_grad_norm=self.config.max_grad_norm, grad_sample_mode=self.config.grad_sample_mode, rng=rng,
            noise=self.config.noise,
        )
        self._record(sigma, q, steps)
        event = SelfComposedEvent(SubsampledGaussianEvent(sigma, q), steps)
        mean_loss = float(np.mean(losses)) if losses else math.nan
        return mean_loss, event

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
    if isinstance(num_samples, bool) or not isinstance(num_samples, numbers.Integral) or num_samples < 1:
        raise ConfigError(f"DP-SGD needs at least one training sample, got n={num_samples!r}")
    if isinstance(batch_size, bool) or not isinstance(batch_size, numbers.Integral) or batch_size < 1:
        raise ConfigError(f"batch_size must be an integer >= 1, got {batch_size!r}")
    return min(1.0, batch_size / num_samples)


def _dp_sgd_steps(
    model: nn.Module, x: torch.Tensor, y: torch.Tensor, *, lr: float, steps: int, q: float, batch_size: int,
    noise_multiplier: float, max_grad_norm: float, grad_sample_mode: str, rng: np.random.Generator,
    noise: str = "secure",
) -> list[float]:
    """The DP-SGD loop with Opacus' per-sample machinery; returns the losses of the non-empty batches.

    Steps (Abadi et al. 2016, Algorithm 1, with Poisson sampling as analysed by the accountants):
    1. sample each record independently with probability q;
    2. per-sample gradients clipped to ``max_grad_norm`` and summed (Opacus: hooks / functorch / ghost clipping);
    3. add N(0, (noise_multiplier * max_grad_norm)^2) per coordinate, divide by ``batch_size`` (public; see the
       module docstring);
    4. SGD step. An empty batch still takes steps 3 and 4 (pure noise), as the analysis assumes.

    ``noise="hardened"`` reaches Opacus as ``secure_mode=True`` of its DP optimizer, which accepts it without
    torchcsprng (only ``PrivacyEngine(secure_mode=True)`` imports that package, and it does not install with torch 2):
    the optimizer then draws each noise coordinate as four draws summed and halved from ``generator``, here seeded by
    the OS CSPRNG; the noise-only step of an empty batch draws the same way
    (:func:`privfl.privacy.mechanisms.standard_normal`).
    """
    from opacus.grad_sample.utils import prepare_module
    from opacus.optimizers import get_optimizer_class
    from opacus.utils.fast_gradient_clipping_utils import DPLossFastGradientClipping

    n = len(y)
    sampling_seed, noise_seed = int(rng.integers(2**62)), int(rng.integers(2**62))   # drawn either way: same stream
    if noise == "seeded":
        sampling_gen = torch.Generator().manual_seed(sampling_seed)
        noise_gen = torch.Generator().manual_seed(noise_seed)
    else:
        sampling_gen, noise_gen = os_seeded_generator(), os_seeded_generator()
    hardened = noise == "hardened"
    ghost = grad_sample_mode == "ghost"
    params = [p for p in model.parameters() if p.requires_grad]
    base_optimizer = torch.optim.SGD(params, lr=lr)
    try:
        with warnings.catch_warnings():
            # Opacus warns that secure_mode is off (it needs torchcsprng); our generators are seeded as `noise` says.
            warnings.simplefilter("ignore", UserWarning)
            kwargs = {"max_grad_norm": max_grad_norm} if ghost else {}
            gsm = prepare_module(model, grad_sample_mode, True, batch_first=True, loss_reduction="mean", **kwargs)
            optimizer = get_optimizer_class("flat", False, grad_sample_mode)(
                base_optimizer, noise_multiplier=noise_multiplier, max_grad_norm=max_grad_norm,
                expected_batch_size=batch_size, loss_reduction="mean", generator=noise_gen, secure_mode=hardened,
            )
    except Exception as exc:  # noqa: BLE001 - any Opacus failure here means this mode cannot wrap this model
        raise _mode_error(grad_sample_mode, model, exc) from exc
    criterion = nn.CrossEntropyLoss()
    dp_loss = DPLossFastGradientClipping(gsm, optimizer, criterion, "mean") if ghost else None
    losses: list[float] = []
    try:
        with warnings.catch_warnings():
            # Opacus' backward hooks fire on the first layer although the input needs no gradient; that is expected.
            warnings.filterwarnings("ignore", message="Full backward hook is firing")
            model.train()
            for _ in range(steps):
                # 1. Poisson sampling.
                index = torch.nonzero(torch.rand(n, generator=sampling_gen) < q).flatten()
                if index.numel() == 0:
                    _noise_only_step(params, base_optimizer, noise_multiplier * max_grad_norm, batch_size, noise_gen,
                                     hardened=hardened)
                    continue
                optimizer.zero_grad(set_to_none=True)
                # 2. clipped per-sample gradients, summed.
                try:
                    output = gsm(x[index])
                    loss = dp_loss(output, y[index]) if ghost else criterion(output, y[index])
                    loss.backward()
                except Exception as exc:  # noqa: BLE001
                    if losses:  # it worked before on this model: a real error, not an unsupported mode
                        raise
                    raise _mode_error(grad_sample_mode, model, exc) from exc
                losses.append(loss.item())
                # 3.-4. noise, scaling by batch_size, SGD step.
                optimizer.step()
    finally:
        optimizer.zero_grad(set_to_none=True)
        gsm._close()  # remove Opacus' hooks and per-sample attributes: the caller gets a plain module back
    return losses


def _noise_only_step(params: list[nn.Parameter], optimizer: torch.optim.Optimizer, std: float,
                     batch_size: int, generator: torch.Generator, *, hardened: bool) -> None:
    """A step on an empty Poisson batch: the clipped sum is 0, the update is noise / batch_size."""
    for p in params:
        noise = (std * standard_normal(p.shape, generator=generator, hardened=True, dtype=p.dtype) if hardened
                 else torch.normal(0.0, std, p.shape, generator=generator, dtype=p.dtype))
        p.grad = noise / batch_size
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)


def _mode_error(mode: str, model: nn.Module, exc: BaseException) -> ConfigError:
    others = ", ".join(repr(m) for m in GRAD_SAMPLE_MODES if m != mode)
    return ConfigError(
        f"grad_sample_mode={mode!r} failed on {type(model).__name__}: {type(exc).__name__}: {exc}. "
        f"No other mode is tried silently; set DPSGDConfig(grad_sample_mode=...) to one of {others}"
    )
