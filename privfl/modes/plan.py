"""What a run's releases will spend, priced by the accountant before the first of them is made.

Every noise scale of a run is a function of public quantities (invariant 10 of ``docs/invariants.md``), so each
client's whole schedule of releases is known before anything leaves it: a training client's every round (at most
the planned participations; central mode records every round for every client), a novel client's one release. The
plan prices that schedule (:func:`plan`), which refuses, as a :class:`~privfl.errors.ConfigError`, a schedule the
accountant cannot price (:data:`accounting.limits.NOISE_MULTIPLIER_FLOOR`) before a release could be made that no
command could report. Its epsilons are upper bounds on what each client spends (a client sampled in fewer rounds
spends less) and go into the run's summary beside what the ledgers recorded.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import asdict, dataclass
from typing import Any

from accounting import (
    ClientId,
    ComposedEvent,
    GaussianEvent,
    LedgerBook,
    NeighboringRelation,
    PrivacyEvent,
    SelfComposedEvent,
    UnsupportedAccountingError,
    analytic_gaussian_sigma,
    check_supported,
)
from accounting import epsilon as accounting_epsilon
from privfl.errors import ConfigError
from privfl.methods.base import ClientProcedure, MethodSpec
from privfl.modes.wrappers import PrivateClient, planned_participations
from privfl.privacy.training import (
    CENTRAL,
    DISTRIBUTED,
    LOCAL,
    RECORD,
    NovelPrivacy,
    TrainingPrivacy,
    central_noise_multiplier,
    central_round_event,
    client_level_noise,
)


@dataclass(frozen=True)
class Plan:
    """What the run will spend at ``delta``: ``training``, the most epsilon any training client's releases compose
    to over the run (``inf`` without DP, 0 for a method whose training clients send nothing); ``novel``, a novel
    client's (its one release; ``inf`` where it is sent without DP, 0 where novel clients send nothing)."""

    training: float
    novel: float
    delta: float

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


def _priced(event: PrivacyEvent, delta: float) -> float:
    check_supported(event)
    return accounting_epsilon(event, delta)


def _training(spec: MethodSpec, client: ClientProcedure, privacy: TrainingPrivacy, *, delta: float, rounds: int,
              client_fraction: float, seed: int, num_training_clients: int) -> float:
    if spec.releases_per_round == 0:
        return 0.0
    if privacy.mode is None:
        return math.inf
    if privacy.mode in (RECORD, CENTRAL):
        event = round_event(client, privacy, rounds=rounds, client_fraction=client_fraction)
        inner = client.inner if isinstance(client, PrivateClient) else client
        most = inner.participations if privacy.mode == RECORD else rounds
        return _priced(SelfComposedEvent(event, most), delta)   # type: ignore[arg-type]  # not None in these modes
    if privacy.mode in (LOCAL, DISTRIBUTED):
        participations = privacy.participations or planned_participations(num_training_clients, client_fraction,
                                                                          seed, rounds)
        noise = client_level_noise(privacy, stages=spec.releases_per_round, participations=participations)
        return _priced(SelfComposedEvent(noise.round_event(), participations), delta)
    raise ConfigError(f"privacy mode {privacy.mode!r} has no plan")   # pragma: no cover (TrainingPrivacy checks it)


def _novel(client: ClientProcedure, novel_privacy: NovelPrivacy, *, delta: float) -> float:
    inner = client.inner if isinstance(client, PrivateClient) else client
    if not inner.serves_novel_clients or type(inner).novel_query is ClientProcedure.novel_query:
        return 0.0
    if novel_privacy.epsilon is None:
        return math.inf
    # every novel release of the registry is one Gaussian calibrated to (epsilon, delta) by the analytic mechanism:
    # its noise multiplier is that of a unit sensitivity, whatever the release's own
    z = analytic_gaussian_sigma(novel_privacy.epsilon, novel_privacy.delta)
    return _priced(GaussianEvent(z, relation=NeighboringRelation.REPLACE_ONE), delta)


def round_event(client: ClientProcedure, privacy: TrainingPrivacy, *, rounds: int,
                client_fraction: float) -> PrivacyEvent | None:
    """The event one round adds to a training client's ledger when it takes part (record level: its procedure's
    round at the run's noise multiplier; central: the round's aggregate, recorded for every client every round);
    ``None`` in the other modes, whose rounds are capped by the ledger itself (``calibrated_for``)."""
    if privacy.mode == RECORD:
        inner = client.inner if isinstance(client, PrivateClient) else client
        return inner.planned_round_event()
    if privacy.mode == CENTRAL:
        z = central_noise_multiplier(privacy, sampling_probability=client_fraction, rounds=rounds)
        return central_round_event(z, client_fraction)
    return None


def projected_spend(ledgers: LedgerBook, rounds_left: Mapping[ClientId, int], event: PrivacyEvent,
                    delta: float) -> dict[ClientId, float]:
    """Each client's epsilon at ``delta`` once its ledger holds ``rounds_left[client]`` more rounds of ``event``:
    what a resumed run will have spent when it ends. Clients whose ledgers and rounds are alike are priced once."""
    priced: dict[tuple[Any, ...], float] = {}
    spend = {}
    for cid, left in rounds_left.items():
        events = [r.event for r in ledgers[cid].records if r.audience == "everyone"] if cid in ledgers else []
        if left:
            events.append(SelfComposedEvent(event, left))
        key = (tuple(sorted(ComposedEvent(tuple(events)).leaf_counts().items(), key=repr)),) if events else ()
        if key not in priced:
            priced[key] = accounting_epsilon(ComposedEvent(tuple(events)), delta) if events else 0.0
        spend[cid] = priced[key]
    return spend


def plan(spec: MethodSpec, client: ClientProcedure, privacy: TrainingPrivacy, novel_privacy: NovelPrivacy, *,
         delta: float, rounds: int, client_fraction: float, seed: int, num_training_clients: int) -> Plan:
    """The run's :class:`Plan`, priced by PLD at ``delta`` (the run's, which its privacy settings share), from the
    client procedure the run builds (``client``, under the privacy layer) and the run's public schedule. Calibrates
    the noise where a target is given (what the run would do at its first release). Refuses a schedule the
    accountant cannot price, or that cannot be calibrated, with a :class:`ConfigError` naming why."""
    try:
        return Plan(training=_training(spec, client, privacy, delta=delta, rounds=rounds,
                                       client_fraction=client_fraction, seed=seed,
                                       num_training_clients=num_training_clients),
                    novel=_novel(client, novel_privacy, delta=delta), delta=delta)
    except UnsupportedAccountingError as error:
        raise ConfigError(f"the run's releases cannot be accounted: {error}") from None


__all__ = ["Plan", "plan", "projected_spend", "round_event"]
