"""A DP release of the mean of clipped per-example embeddings of **labelled** records (PeFLL's descriptor).

PeFLL's client descriptor is ``v = (1/n) sum_j phi(x_j, y_j)`` with the label an input of the embedding network
(docs/papers.md, PeFLL, E4). A record is the pair ``(x, y)``; each clipped embedding depends on its record alone, so
the mean moves by ``2B/n`` under replace-one with n public (novel clients) and by ``2B/min_samples`` under
add/remove-one with n private (training clients). Entry points: :func:`certify_labelled_mean`,
:func:`release_labelled_mean`.

The argument for both relations and what it does not cover: docs/privacy.md, "Labelled means: PeFLL's descriptor".
"""

from __future__ import annotations

import dataclasses

import torch
from torch import nn

from accounting import GaussianEvent, NeighboringRelation, PrivacyLedger
from privfl.errors import ConfigError
from privfl.privacy.mechanisms import GaussianMechanism, NoiseSource, check_epsilon_delta, check_noise
from privfl.privacy.sensitivity import (
    SensitivityCertificate,
    certify_mean_of_clipped,
    check_bound,
    check_relation,
    clipped_rows,
)

PURPOSE = "descriptor"


def certify_labelled_mean(bound: float, n: int, *, delta: float | None = None,
                          relation: NeighboringRelation | str = NeighboringRelation.REPLACE_ONE
                          ) -> SensitivityCertificate:
    """The L2 sensitivity of the mean of clipped embeddings of labelled records, with the labelled-record argument
    (module docstring, steps 1-4) added to the certificate: ``2B/n`` under replace-one with ``n`` the public number
    of records, or ``2B/n`` under add/remove-one with ``n`` a public lower bound on the private number of records.

    >>> certify_labelled_mean(1.0, 32).value
    0.0625
    >>> certify_labelled_mean(1.0, 8, relation="add_or_remove_one").value
    0.25
    """
    relation = check_relation(relation)
    replace = relation is NeighboringRelation.REPLACE_ONE
    certificate = certify_mean_of_clipped(bound, n, relation, n_public=replace, delta=delta)
    labelled = ("; the record is a labelled pair (x, y) and phi reads both, but phi runs on each record alone, so "
                + ("replacing one pair (image, label or both) changes exactly one clipped embedding" if replace else
                   "adding or removing one pair adds or removes exactly one clipped embedding"))
    return dataclasses.replace(certificate, argument=certificate.argument + labelled)


@torch.no_grad()
def release_labelled_mean(embedding: nn.Module, x: torch.Tensor, y: torch.Tensor, *, epsilon: float | None = None,
                          delta: float | None = None, bound: float, num_classes: int,
                          noise: NoiseSource | None = None, generator: torch.Generator | None = None,
                          ledger: PrivacyLedger | None = None, noise_multiplier: float | None = None,
                          relation: NeighboringRelation | str = NeighboringRelation.REPLACE_ONE,
                          min_samples: int | None = None
                          ) -> tuple[torch.Tensor, GaussianEvent, SensitivityCertificate]:
    """One DP release of ``(1/n) sum_j clip_B(embedding(x_j, y_j))`` over labelled records ``(x_j, y_j)``:
    ``(noisy descriptor in x's dtype, event, certificate)``. By default (epsilon, delta)-DP under replace-one of a
    record, n public; with ``relation="add_or_remove_one"`` and ``min_samples``, under add/remove-one with n private
    (module docstring); with ``noise_multiplier`` instead of epsilon and delta, noise of that multiple of the
    certified sensitivity (one release of a schedule its caller calibrated as a whole).

    Inside a federation nothing is recorded here: the caller sends the value as a
    :class:`~privfl.federation.messages.Release` carrying ``event``, and the wire records it in the client's ledger
    before delivery (invariant 1 of ``docs/invariants.md``). Used as a library call, pass ``ledger`` (as for
    :func:`~privfl.privacy.privatize`): the release is recorded there before any noise is drawn, and one that would
    exceed the ledger's budget raises :class:`accounting.BudgetExceededError` with nothing released.

    Steps (module docstring): 1. validate epsilon, delta (or the noise multiplier), the relation, B, x (finite), y
    (labels in ``0 .. num_classes-1``); 2. certify ``2B/n`` (``2B/min_samples`` under add/remove) from public
    quantities; 3. per-record embeddings (eval mode, vmap); 4. clip each to B in float64 and average; 5. record in
    ``ledger`` if given; 6. Gaussian noise (:class:`GaussianMechanism`: analytic sigma, or the noise multiplier).

    Args:
        embedding: a module with ``forward(x, y) -> [n, d]``, e.g. :class:`privfl.models.pefll.EmbeddingNetwork`.
        x: ``[n, ...]`` inputs; y: ``[n]`` integer labels aligned with x.
        epsilon: natural-log epsilon of this release (> 0); delta: its delta, in (0, 1) (both ``None`` with
            ``noise_multiplier``).
        bound: per-record L2 clipping radius B (> 0).
        noise_multiplier: instead of epsilon and delta: sigma = noise_multiplier * sensitivity (> 0).
        relation: ``"replace_one"`` (n public, the default) or ``"add_or_remove_one"`` (n private; needs
            ``min_samples``).
        min_samples: the public lower bound on n that the add/remove-one sensitivity ``2B/min_samples`` is
            calibrated for (an int >= 2); a client with fewer records is refused without anything released.
        num_classes: C, the public label set is ``0 .. C-1``.
        noise: ``"secure"``, ``"hardened"`` (drawn against floating-point attacks) or ``"seeded"`` (reproducible,
            research only; needs ``generator``); by default seeded exactly when ``generator`` is given.
        ledger: an :class:`accounting.PrivacyLedger` to record the release in (library use; ``None`` inside a
            federation, where the wire records it).
    """
    if noise_multiplier is None:
        epsilon, delta = check_epsilon_delta(epsilon, delta)
    else:   # validated by the mechanism, which refuses epsilon or delta given beside it
        GaussianMechanism(sensitivity=1.0, noise_multiplier=noise_multiplier, epsilon=epsilon, delta=delta)
    relation = check_relation(relation)
    _check_min_samples(relation, min_samples)
    bound = check_bound(bound)
    noise = check_noise(noise, generator)
    if ledger is not None and not isinstance(ledger, PrivacyLedger):
        raise ConfigError(f"ledger must be an accounting.PrivacyLedger or None, got {ledger!r}")
    y = _checked_records(x, y, num_classes)
    n = int(x.shape[0])
    if min_samples is not None and n < min_samples:
        # n stays out of the message: it is private under add/remove-one (that a client is refused is public)
        raise ConfigError(f"the client has fewer labelled records than the public lower bound min_samples="
                          f"{min_samples} the add/remove-one guarantee is calibrated for; nothing was released")
    certificate = certify_labelled_mean(bound, n if min_samples is None else min_samples, delta=delta,
                                        relation=relation)
    # row j: embedding(x_j, y_j) on record j alone (eval mode), clipped to B
    rows = clipped_rows(embedding, lambda xj, yj: embedding(xj.unsqueeze(0), yj.unsqueeze(0)).reshape(-1),
                        (x, y), bound, name="embedding")
    mechanism = GaussianMechanism(epsilon=epsilon, delta=delta, sensitivity=certificate.value, relation=relation,
                                  noise=noise, generator=generator, noise_multiplier=noise_multiplier)
    if ledger is not None:
        size = {"n": n} if min_samples is None else {"min_samples": min_samples}   # n is private under add/remove
        ledger.record(mechanism.event, purpose=PURPOSE,
                      metadata={"noise": noise, **size, "bound": bound,
                                "relation": f"{'replace' if min_samples is None else 'add or remove'} one labelled "
                                            "record"})
    noisy = mechanism.add_noise(rows.mean(dim=0))
    return noisy.to(x.dtype), mechanism.event, certificate


def _check_min_samples(relation: NeighboringRelation, min_samples: int | None) -> None:
    """Refuse a ``min_samples`` that does not go with ``relation`` (needed under add/remove-one, unused otherwise)."""
    if relation is NeighboringRelation.ADD_OR_REMOVE_ONE:
        if isinstance(min_samples, bool) or not isinstance(min_samples, int) or min_samples < 2:
            raise ConfigError("relation='add_or_remove_one' keeps n private, so the noise is calibrated to a public "
                              f"lower bound on n: give min_samples as an int >= 2, got min_samples={min_samples!r}")
    elif min_samples is not None:
        raise ConfigError(f"min_samples is used only with relation='add_or_remove_one' (under replace_one n is public "
                          f"and sets the noise), got min_samples={min_samples!r}")


def _checked_records(x: torch.Tensor, y: torch.Tensor, num_classes: int) -> torch.Tensor:
    """Refuse inputs that are not finite floating-point rows, or labels outside the public set ``0 .. C-1``; return
    the labels as int64 (what the embedding networks take)."""
    if not isinstance(x, torch.Tensor) or x.ndim < 2 or x.shape[0] < 1 or not x.is_floating_point():
        raise ConfigError(f"x must be a floating-point tensor [n >= 1, ...] of one client's inputs, got "
                          f"{tuple(x.shape) if isinstance(x, torch.Tensor) else type(x).__name__}")
    if not bool(torch.isfinite(x).all()):
        raise ConfigError("x contains NaN/inf values; nothing was released")
    if isinstance(num_classes, bool) or not isinstance(num_classes, int) or num_classes < 1:
        raise ConfigError(f"num_classes must be an integer >= 1 (the public label set), got {num_classes!r}")
    integer = (torch.uint8, torch.int8, torch.int16, torch.int32, torch.int64)
    if not isinstance(y, torch.Tensor) or y.shape != (x.shape[0],) or y.dtype not in integer:
        raise ConfigError(f"y must be an integer tensor of shape [{x.shape[0]}] aligned with x, got "
                          + (f"shape {tuple(y.shape)}, dtype {y.dtype}" if isinstance(y, torch.Tensor)
                             else type(y).__name__))
    y = y.long()
    if int(y.min()) < 0 or int(y.max()) >= num_classes:
        raise ConfigError(f"labels must lie in the public label set 0..{num_classes - 1}, got range "
                          f"[{int(y.min())}, {int(y.max())}]; nothing was released")
    return y


__all__ = ["PURPOSE", "certify_labelled_mean", "release_labelled_mean"]
