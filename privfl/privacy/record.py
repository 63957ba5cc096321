"""Record-level DP for a training client: a method declares what one round releases, this module prices, calibrates
and runs it.

A method lists the releases of one round as :class:`RecordRelease` declarations, from public quantities only (its
settings and the privacy settings, never a client's data or size):

- :class:`DPSGDFit`: one DP-SGD fit, ``steps`` Poisson-subsampled Gaussian steps at the public rate q, run by
  :func:`train_dp_sgd`;
- :class:`ClippedMean`: one Gaussian release of a mean over a client's records, each clipped to an L2 ``bound``,
  under add/remove-one with n private and calibrated at the public ``min_samples`` (sensitivity
  ``2 bound / min_samples``, :func:`~privfl.privacy.sensitivity.certify_mean_of_clipped`); its
  :meth:`ClippedMean.mechanism` is the Gaussian mechanism the release runs (or the release functions of
  :mod:`privfl.privacy.privatize`, :mod:`~privfl.privacy.labelled` and :mod:`~privfl.privacy.gradient_mean`, which
  certify the same sensitivity);
- :class:`Repeated`: releases made ``times`` times in a round.

:func:`round_event` composes a round's declarations at one noise multiplier; :func:`calibrated_noise_multiplier`
finds, once per settings, the noise multiplier every client of a run uses; :func:`noise_source` is the noise of a
client's release (OS-seeded, or keyed by the privacy seed, never the run seed). The conformance tests check that
what a round records equals its declaration. The argument: docs/privacy.md, "The layer around every method".
"""

from __future__ import annotations

from collections.abc import Callable, Hashable, Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch
from torch import nn

from accounting import ComposedEvent, GaussianEvent, NeighboringRelation, PrivacyEvent, SelfComposedEvent
from accounting import epsilon as accounting_epsilon
from privfl.errors import ConfigError
from privfl.privacy.dp_sgd import DPSGDConfig, DPSGDTrainer, ExtraLoss
from privfl.privacy.mechanisms import GaussianMechanism, NoiseSource
from privfl.privacy.per_sample import PerSampleLoss
from privfl.privacy.sensitivity import SensitivityCertificate, certify_mean_of_clipped
from privfl.privacy.training import NovelPrivacy, TrainingPrivacy, dp_sgd_round_event, record_noise_multiplier

#: The neighbouring relation of every record-level release (DP-SGD's, so all of a client's releases compose).
RELATION = NeighboringRelation.ADD_OR_REMOVE_ONE


@dataclass(frozen=True)
class DPSGDFit:
    """One DP-SGD fit of ``steps`` steps at the public Poisson rate ``sampling_rate``."""

    steps: int
    sampling_rate: float

    def event(self, noise_multiplier: float) -> PrivacyEvent:
        return dp_sgd_round_event(noise_multiplier, self.sampling_rate, self.steps)


@dataclass(frozen=True)
class ClippedMean:
    """One Gaussian release of the mean of a client's per-record values, each clipped to the L2 ball of ``bound``;
    add/remove-one with n private, calibrated at the public lower bound ``min_samples``."""

    bound: float
    min_samples: int

    def certificate(self) -> SensitivityCertificate:
        """``2 bound / min_samples`` and its argument."""
        return certify_mean_of_clipped(float(self.bound), self.min_samples, RELATION, n_public=False)

    def event(self, noise_multiplier: float) -> PrivacyEvent:
        sensitivity = self.certificate().value
        return GaussianEvent(sigma=float(noise_multiplier) * sensitivity, sensitivity=sensitivity, relation=RELATION)

    def mechanism(self, noise_multiplier: float, *, noise: NoiseSource | None = None,
                  generator: torch.Generator | None = None) -> GaussianMechanism:
        """The Gaussian mechanism of this release at ``noise_multiplier`` (its event is :meth:`event`)."""
        return GaussianMechanism(sensitivity=self.certificate().value, noise_multiplier=noise_multiplier,
                                 relation=RELATION, noise=noise, generator=generator)


@dataclass(frozen=True)
class Repeated:
    """``releases`` (in order) made ``times`` times in one round."""

    releases: tuple[RecordRelease, ...]
    times: int

    def event(self, noise_multiplier: float) -> PrivacyEvent:
        return SelfComposedEvent(round_event(self.releases, noise_multiplier), self.times)


RecordRelease = DPSGDFit | ClippedMean | Repeated


def round_event(releases: Sequence[RecordRelease], noise_multiplier: float) -> PrivacyEvent:
    """The event of a round's ``releases`` (in the order they are made) when every mechanism has noise multiplier
    ``noise_multiplier``: the one release's own event, or their composition."""
    if not releases:
        raise ConfigError("a record-level round declares at least one release")
    events = tuple(release.event(noise_multiplier) for release in releases)
    return events[0] if len(events) == 1 else ComposedEvent(events)


def made_in_turn(steps: Sequence[Sequence[PrivacyEvent]]) -> PrivacyEvent:
    """The events of a loop of releases, composed: each step's events (the mechanisms one iteration ran, in order)
    composed, then the steps; the same step repeated is a :class:`~accounting.SelfComposedEvent` (how
    :class:`Repeated` prices it)."""
    if not steps or not all(steps):
        raise ConfigError("a loop of releases needs at least one step, each with at least one event")
    events = [step[0] if len(step) == 1 else ComposedEvent(tuple(step)) for step in steps]
    first = events[0]
    return SelfComposedEvent(first, len(events)) if len(set(events)) == 1 else ComposedEvent(tuple(events))


_CALIBRATIONS: dict[tuple[TrainingPrivacy, int], dict[Hashable, float]] = {}


def calibrated_noise_multiplier(privacy: TrainingPrivacy, participations: int, settings_key: Callable[[], Hashable],
                                event_at: Callable[[float], PrivacyEvent]) -> float:
    """The noise multiplier of every client of a run: ``privacy.noise_multiplier``, or the least z for which
    ``participations`` rounds of ``event_at(z)`` meet the target (:func:`~privfl.privacy.training.
    record_noise_multiplier`), computed once per (privacy, participations, ``settings_key()``) and reused. The key
    names the method's settings only (no client's size or data enters the calibration); it is asked for only when
    there is a calibration to look up, so a run with a fixed noise multiplier pays nothing a release."""
    if privacy.noise_multiplier is not None:
        return float(privacy.noise_multiplier)
    cache = _CALIBRATIONS.setdefault((privacy, participations), {})
    key = settings_key()
    if key not in cache:
        cache[key] = record_noise_multiplier(privacy, event_at, participations)
    return cache[key]


def clear_calibrations() -> None:
    """Forget every calibration (tests that change the accountant between runs)."""
    _CALIBRATIONS.clear()


def noise_source(privacy: TrainingPrivacy | NovelPrivacy, keyed_seed: Callable[[int], int]) -> dict[str, Any]:
    """Keyword arguments ``noise`` and ``generator`` for a mechanism a client runs (a training client under
    record-level DP, or a novel client's release): OS-seeded noise (``"secure"``, ``"hardened"``), or (``"seeded"``) a
    generator seeded by ``keyed_seed`` of the privacy seed, which the caller keys by the release's purpose, the round
    and the client (never by the run seed, which the server knows)."""
    if privacy.noise != "seeded":
        return {"noise": privacy.noise, "generator": None}
    return {"noise": "seeded", "generator": torch.Generator().manual_seed(keyed_seed(privacy.noise_seed))}


def whole_release_epsilon(privacy: TrainingPrivacy) -> float:
    """The epsilon of a release calibrated as a whole, as one Gaussian (DP-FedPFT's one message): the run's
    ``epsilon``; with a ``noise_multiplier`` z instead, the epsilon a Gaussian release of noise multiplier z spends
    at the run's delta.

    >>> round(whole_release_epsilon(TrainingPrivacy(mode="record", noise_multiplier=5.0)), 4)
    0.7255
    """
    if privacy.epsilon is not None:
        return privacy.epsilon
    if privacy.noise_multiplier is None:
        raise ConfigError("a record-level release needs the run's epsilon or noise_multiplier; neither is set")
    return accounting_epsilon(GaussianEvent(sigma=float(privacy.noise_multiplier)), privacy.delta)


def train_dp_sgd(model: nn.Module, x: torch.Tensor, y: torch.Tensor, privacy: TrainingPrivacy, plan: DPSGDFit, *,
                 batch_size: int, noise_multiplier: float, settings: Mapping[str, Any], rng: np.random.Generator,
                 per_sample_loss: PerSampleLoss | None = None, extra_loss: ExtraLoss | None = None,
                 params: Iterable[str | nn.Parameter] | None = None) -> tuple[float, PrivacyEvent]:
    """One DP-SGD fit of the client's records by its own ``plan`` (per-sample clip ``privacy.clip``, expected batch
    ``batch_size``), with the server's ``settings`` (``lr``, ``steps``, ``batch_size``, optional ``momentum`` and
    ``weight_decay``). Returns the mean loss and the event. Settings that ask for other steps or another batch size
    than the plan the noise is calibrated for (a faulty or hostile server), or for a batch-gradient clip, are refused
    before anything is trained."""
    if settings.get("grad_clip"):
        raise ConfigError(f"grad_clip={settings['grad_clip']!r} clips each step's batch gradient, a stabiliser "
                          "DP-SGD replaces with its per-sample clip (privacy clip); leave grad_clip unset with "
                          "record-level DP")
    if (settings["steps"], settings["batch_size"]) != (plan.steps, batch_size):
        raise ConfigError(f"the server asked for {settings['steps']!r} DP-SGD steps at batch size "
                          f"{settings['batch_size']!r}, but this client's record-level plan, which its noise is "
                          f"calibrated for, is {plan.steps} steps at batch size {batch_size}; nothing was trained")
    trainer = DPSGDTrainer(DPSGDConfig(noise_multiplier=noise_multiplier, max_grad_norm=float(privacy.clip),
                                       noise=privacy.noise))
    return trainer.train(model, x, y, lr=settings["lr"], steps=plan.steps, batch_size=batch_size, rng=rng,
                         per_sample_loss=per_sample_loss, extra_loss=extra_loss,
                         weight_decay=settings.get("weight_decay", 0.0), momentum=settings.get("momentum", 0.0),
                         params=params, sampling_rate=plan.sampling_rate)


__all__ = ["RELATION", "ClippedMean", "DPSGDFit", "RecordRelease", "Repeated", "calibrated_noise_multiplier",
           "clear_calibrations", "made_in_turn", "noise_source", "round_event", "train_dp_sgd",
           "whole_release_epsilon"]
