"""Per-client privacy ledgers: every release a client makes, its running (epsilon, delta), and a budget that refuses a
release before it happens.

Epsilon is natural-log and delta a probability. A ledger lives as long as its client, not as long as a round: it is
saved and loaded across rounds and runs, so epsilon only grows. Files are written atomically (temporary file in the
same directory, fsync, rename), so a crash mid-save leaves the previous ledger intact.
"""

from __future__ import annotations

import json
import math
import numbers
import os
import time
from collections import Counter
from collections.abc import Iterable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from accounting.accountants import AccountantName, PrivacySpent, _check_accountant, check_supported, epsilon
from accounting.budget import BudgetExceededError, ClientId, PrivacyBudget
from accounting.events import (
    ComposedEvent,
    NeighboringRelation,
    NonPrivateEvent,
    PrivacyEvent,
    SelfComposedEvent,
    event_from_dict,
)
from accounting.files import atomic_write
from accounting.validation import is_finite, is_int_at_least, is_real

#: Who sees a release. ``"everyone"``: the server and whoever it passes things to (what every epsilon here is about).
#: ``"trusted_aggregator"``: only the aggregator of central DP, which is trusted: the release never leaves it except
#: through the aggregate, whose own event is recorded (in every client's ledger) as a release to everyone. Such a
#: record does not count in :meth:`PrivacyLedger.spent`; against the aggregator the client has no guarantee, which
#: :meth:`PrivacyLedger.spent_against_aggregator` says.
AUDIENCES = ("everyone", "trusted_aggregator")

_LEDGER_FORMAT = "privfl.accounting.ledger"
_BOOK_FORMAT = "privfl.accounting.ledger_book"
_STATE_VERSION = 1
#: The book's state: 2 keeps each record as [kind, round, time] beside one table of kinds (version 1, every record in
#: full, still loads).
_BOOK_VERSION = 2


def _check_client_id(client_id: object) -> ClientId:
    if type(client_id) is int or type(client_id) is str:    # the usual case, without the numbers ABC's checks
        return client_id
    if isinstance(client_id, str):
        return client_id
    if not isinstance(client_id, bool) and isinstance(client_id, numbers.Integral):
        return int(client_id)
    raise ValueError(f"client_id must be an int or a str, got {client_id!r}")


def _flat_json(values: Mapping[str, Any]) -> dict[str, Any] | None:
    """A copy of ``values`` when it is its own JSON round trip (string keys; str, int, finite float, bool or None
    values), so that the round trip can be skipped; ``None`` otherwise."""
    if type(values) is not dict:
        return None
    for key, value in values.items():
        kind = type(value)
        if type(key) is not str or not (kind is str or kind is int or kind is bool or value is None
                                         or (kind is float and math.isfinite(value))):
            return None
    return dict(values)


@dataclass(frozen=True)
class ReleaseRecord:
    """One recorded release: what mechanism (``event``), why (``purpose``), when (``round``, unix ``time``).

    ``metadata`` is any JSON-able dict (bytes sent, tensor names, ...). It is stored as its JSON round-trip, so a
    record equals itself after save and load. ``audience``: who sees the release (:data:`AUDIENCES`).
    """

    event: PrivacyEvent
    purpose: str
    round: int | None
    time: float
    metadata: dict[str, Any] = field(default_factory=dict)
    audience: str = "everyone"

    def __post_init__(self) -> None:
        if not isinstance(self.event, PrivacyEvent):
            raise ValueError(f"event must be an accounting PrivacyEvent, got {self.event!r}")
        if not isinstance(self.purpose, str) or not self.purpose:
            raise ValueError(f"purpose must be a non-empty str, got {self.purpose!r}")
        r = self.round
        if r is not None and not is_int_at_least(r, 0):
            raise ValueError(f"round must be None or an integer >= 0, got {r!r}")
        t = self.time
        if not is_finite(t):
            raise ValueError(f"time must be a finite unix timestamp, got {t!r}")
        if not isinstance(self.metadata, Mapping):
            raise ValueError(f"metadata must be a dict, got {self.metadata!r}")
        if self.audience not in AUDIENCES:
            raise ValueError(f"audience must be one of {', '.join(map(repr, AUDIENCES))}, got {self.audience!r}")
        metadata = _flat_json(self.metadata)
        if metadata is None:
            try:
                metadata = json.loads(json.dumps(dict(self.metadata), allow_nan=False))
            except (TypeError, ValueError) as exc:
                raise ValueError(f"metadata of release {self.purpose!r} must be JSON-able: {exc}") from None
        object.__setattr__(self, "round", None if r is None else int(r))
        object.__setattr__(self, "time", float(t))
        object.__setattr__(self, "metadata", metadata)

    def to_dict(self) -> dict[str, Any]:
        values = {"event": self.event.to_dict(), "purpose": self.purpose, "round": self.round, "time": self.time,
                  "metadata": self.metadata}
        if self.audience != "everyone":
            values["audience"] = self.audience
        return values

    @classmethod
    def from_dict(cls, d: Mapping[str, Any]) -> ReleaseRecord:
        return cls(event=event_from_dict(d["event"]), purpose=d["purpose"], round=d["round"], time=d["time"],
                   metadata=d["metadata"], audience=d.get("audience", "everyone"))


class PrivacyLedger:
    """Every release of one client, composed by one accountant, checked against an optional budget.

    Privacy assumption: the ledger is only as honest as what is recorded in it. Every release that leaves the client
    must be recorded here *before* it is sent; a release made without a mechanism is recorded as a
    :class:`~accounting.events.NonPrivateEvent` and makes epsilon infinite. All releases must be described under one
    neighbouring relation.

    >>> from accounting.events import GaussianEvent
    >>> ledger = PrivacyLedger(7, budget=PrivacyBudget(epsilon=1.0, delta=1e-5))
    >>> _ = ledger.record(GaussianEvent(sigma=5.0), purpose="descriptor", round=0)
    >>> round(ledger.spent().epsilon, 3), len(ledger)
    (0.726, 1)
    """

    def __init__(self, client_id: ClientId, *, budget: PrivacyBudget | None = None,
                 accountant: AccountantName = "pld") -> None:
        if budget is not None and not isinstance(budget, PrivacyBudget):
            raise ValueError(f"budget must be a PrivacyBudget or None, got {budget!r}")
        self._client_id = _check_client_id(client_id)
        self._budget = budget
        self._accountant = _check_accountant(accountant)
        self._records: list[ReleaseRecord] = []
        self._leaves: Counter[PrivacyEvent] = Counter()  # the grouped composition of the releases to everyone
        self._trusted = 0                                # releases seen by the trusted aggregator only
        self._relation: NeighboringRelation | None = None
        # Accounting a long composition is slow, so results are kept until the next record:
        # delta -> epsilon of the recorded composition, and the last projection (num records, event, delta, epsilon).
        self._epsilon_cache: dict[float, float] = {}
        self._projection: tuple[int, PrivacyEvent, float, float] | None = None

    # -- read-only views --------------------------------------------------------------------------------------------

    @property
    def client_id(self) -> ClientId:
        return self._client_id

    @property
    def budget(self) -> PrivacyBudget | None:
        return self._budget

    @property
    def accountant(self) -> str:
        return self._accountant

    @property
    def relation(self) -> NeighboringRelation | None:
        """The neighbouring relation of the recorded releases (``None`` until one with a relation is recorded)."""
        return self._relation

    @property
    def records(self) -> tuple[ReleaseRecord, ...]:
        return tuple(self._records)

    @property
    def events(self) -> tuple[PrivacyEvent, ...]:
        return tuple(r.event for r in self._records)

    def __len__(self) -> int:
        return len(self._records)

    def __repr__(self) -> str:
        return (f"PrivacyLedger(client_id={self._client_id!r}, releases={len(self)}, budget={self._budget!r}, "
                f"accountant={self._accountant!r})")

    # -- accounting -------------------------------------------------------------------------------------------------

    def _epsilon_of(self, leaves: Counter[PrivacyEvent], delta: float) -> float:
        grouped = ComposedEvent(tuple(SelfComposedEvent(leaf, n) for leaf, n in leaves.items()))
        return epsilon(grouped, delta, accountant=self._accountant)

    def _check_event(self, event: PrivacyEvent) -> NeighboringRelation | None:
        """The ledger's relation after recording ``event``; raises if ``event`` is not an event, composes no
        mechanism at all (it would be priced as a free release), or is under a different relation."""
        if not isinstance(event, PrivacyEvent):
            raise ValueError(f"event must be an accounting PrivacyEvent, got {event!r}")
        if not event.leaf_counts():
            raise ValueError(f"client {self._client_id!r}: {event!r} composes no mechanism, so it would be recorded "
                             "at epsilon 0; describe the release by the mechanism that made it (NonPrivateEvent for "
                             "none)")
        if event.relation is None:
            return self._relation
        if self._relation is not None and event.relation is not self._relation:
            raise ValueError(
                f"client {self._client_id!r}: the ledger holds releases under relation {self._relation.value!r}, "
                f"cannot record one under {event.relation.value!r}; a client's guarantee holds under one relation"
            )
        return event.relation

    def _projected_epsilon(self, event: PrivacyEvent, delta: float) -> float:
        """Epsilon at ``delta`` of the recorded releases plus ``event``."""
        if self._projection is not None:
            n, cached_event, cached_delta, cached_epsilon = self._projection
            if n == len(self._records) and cached_delta == delta and cached_event == event:
                return cached_epsilon
        projected = self._epsilon_of(self._leaves + event.leaf_counts(), delta)
        self._projection = (len(self._records), event, delta, projected)
        return projected

    def spent_against_aggregator(self, delta: float | None = None) -> PrivacySpent:
        """The guarantee against the trusted aggregator of central DP, which also sees the releases made to it alone:
        none (epsilon infinite) once there is one, else :meth:`spent`."""
        spent = self.spent(delta)
        if not self._trusted:
            return spent
        return PrivacySpent(epsilon=math.inf, delta=spent.delta, num_releases=spent.num_releases + self._trusted,
                            accountant=self._accountant)

    def spent(self, delta: float | None = None) -> PrivacySpent:
        """The (epsilon, delta) guarantee of the recorded releases to everyone (every release but those the trusted
        aggregator alone sees), at ``delta`` or else at the budget's delta."""
        if delta is None:
            if self._budget is None:
                raise ValueError(f"client {self._client_id!r}: give a delta; the ledger has no budget to take it from")
            delta = self._budget.delta
        if not is_real(delta) or not 0 < delta < 1:
            raise ValueError(f"delta must be a probability in (0, 1), got {delta!r}")
        delta = float(delta)
        if delta not in self._epsilon_cache:
            self._epsilon_cache[delta] = self._epsilon_of(self._leaves, delta)
        return PrivacySpent(epsilon=self._epsilon_cache[delta], delta=delta,
                            num_releases=sum(self._leaves.values()), accountant=self._accountant)

    def would_exceed(self, event: PrivacyEvent, budget: PrivacyBudget | None = None) -> bool:
        """Whether recording ``event`` would take the ledger over ``budget`` (default: the ledger's budget).

        Records nothing. A :class:`~accounting.events.NonPrivateEvent` exceeds every budget.
        """
        budget = self._budget if budget is None else budget
        if not isinstance(budget, PrivacyBudget):
            raise ValueError(f"client {self._client_id!r}: give a PrivacyBudget; the ledger has none, got {budget!r}")
        self._check_event(event)
        return not budget.allows(self._projected_epsilon(event, budget.delta))

    def record(self, event: PrivacyEvent, *, purpose: str, round: int | None = None,
               metadata: Mapping[str, Any] | None = None,
               calibrated_for: PrivacyBudget | None = None, audience: str = "everyone") -> ReleaseRecord:
        """Record a release that is about to be sent; call it before sending.

        ``audience="trusted_aggregator"`` records a message only the trusted aggregator of central DP sees (a
        client's contribution in the clear): it must carry a :class:`~accounting.events.NonPrivateEvent`, and it
        does not count in :meth:`spent` (see :data:`AUDIENCES`).

        ``calibrated_for``: the budget the release's noise was calibrated for, over the client's whole ledger (a
        mechanism calibrated for k releases over a client's life, such as client-level DP-FedAvg, states the epsilon
        its k releases compose to). A release that would take the ledger past it is refused like one over the
        ledger's own budget: a count of releases kept anywhere else (a client's state, rolled back when a run
        resumes from a checkpoint) could let a (k+1)-th release through.

        Raises (and records nothing) when the event is malformed, is under another relation than the ledger's
        releases, cannot be priced by the ledger's accountant (:class:`~accounting.UnsupportedAccountingError`), or
        would take the ledger over its budget or over ``calibrated_for`` (:class:`BudgetExceededError`).
        """
        release = ReleaseRecord(event=event, purpose=purpose, round=round, time=time.time(),
                                metadata={} if metadata is None else dict(metadata), audience=audience)
        return self.record_made(release, calibrated_for=calibrated_for)

    def record_made(self, release: ReleaseRecord, *, calibrated_for: PrivacyBudget | None = None) -> ReleaseRecord:
        """:meth:`record` of a :class:`ReleaseRecord` made already: one release made on behalf of many clients (central
        DP's aggregate) is one record object held by all their ledgers. Checked as :meth:`record` checks."""
        event, purpose = release.event, release.purpose
        if release.audience != "everyone":
            if not isinstance(event, NonPrivateEvent):
                raise ValueError(f"client {self._client_id!r}: a release to the trusted aggregator is in the clear "
                                 f"(NonPrivateEvent); the aggregate's own event is what is private, got {event!r}")
            self._append(release, self._relation)
            return release
        relation = self._check_event(event)
        check_supported(event, accountant=self._accountant)
        if calibrated_for is not None:
            if not isinstance(calibrated_for, PrivacyBudget):
                raise ValueError(f"calibrated_for must be a PrivacyBudget or None, got {calibrated_for!r}")
            after = self._projected_epsilon(event, calibrated_for.delta)
            if not calibrated_for.allows(after):
                raise BudgetExceededError(self._client_id, purpose, self.spent(calibrated_for.delta).epsilon, after,
                                          calibrated_for, self._accountant)
        projected = None
        if self._budget is not None:
            projected = self._projected_epsilon(event, self._budget.delta)
            if not self._budget.allows(projected):
                raise BudgetExceededError(self._client_id, purpose, self.spent().epsilon, projected, self._budget,
                                          self._accountant)
        self._append(release, relation)
        if projected is not None and self._budget is not None:
            self._epsilon_cache[self._budget.delta] = projected
        return release

    def _append_history(self, release: ReleaseRecord) -> None:
        """Append a record made earlier (loading, replaying a journal): its event is checked, not its budget."""
        self._append(release, self._relation if release.audience != "everyone" else self._check_event(release.event))

    def _append(self, release: ReleaseRecord, relation: NeighboringRelation | None) -> None:
        self._records.append(release)
        if release.audience != "everyone":
            self._trusted += 1
            return
        self._leaves.update(release.event.leaf_counts())
        self._relation = relation
        self._epsilon_cache = {}
        self._projection = None

    # -- persistence ------------------------------------------------------------------------------------------------

    def state_dict(self) -> dict[str, Any]:
        """The whole ledger as plain JSON-able data (client id, budget, accountant, every record)."""
        return {
            "format": _LEDGER_FORMAT,
            "version": _STATE_VERSION,
            "client_id": self._client_id,
            "budget": None if self._budget is None else self._budget.to_dict(),
            "accountant": self._accountant,
            "records": [r.to_dict() for r in self._records],
        }

    @classmethod
    def from_state_dict(cls, state: Mapping[str, Any]) -> PrivacyLedger:
        """A ledger rebuilt from :meth:`state_dict` output. Past records are history: they are not re-checked against
        the budget, but they must share one relation."""
        _check_format(state, _LEDGER_FORMAT)
        try:
            budget = None if state["budget"] is None else PrivacyBudget.from_dict(state["budget"])
            ledger = cls(state["client_id"], budget=budget, accountant=state["accountant"])
            for d in state["records"]:
                release = ReleaseRecord.from_dict(d)
                ledger._append_history(release)
        except (KeyError, TypeError) as exc:
            raise ValueError(f"malformed ledger state: {exc!r}") from None
        return ledger

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        """Replace this ledger's budget, accountant and records by those in ``state`` (same client only)."""
        loaded = PrivacyLedger.from_state_dict(state)
        if loaded.client_id != self._client_id or type(loaded.client_id) is not type(self._client_id):
            raise ValueError(f"state belongs to client {loaded.client_id!r}, not to client {self._client_id!r}")
        vars(self).update(vars(loaded))

    def save(self, path: str | os.PathLike[str]) -> None:
        """Write the ledger to ``path`` atomically: a crash mid-write leaves the previous file intact."""
        _atomic_write_json(Path(path), self.state_dict())

    @classmethod
    def load(cls, path: str | os.PathLike[str]) -> PrivacyLedger:
        """Read a ledger written by :meth:`save`."""
        return cls.from_state_dict(_read_json(Path(path)))


class LedgerBook(Mapping[ClientId, PrivacyLedger]):
    """The ledgers of all clients: ``book[client_id]`` returns that client's ledger, creating it on first use with
    ``default_budget`` and ``accountant``.

    ``in``, ``get``, ``len`` and iteration see only ledgers that exist. Client ids are ints or strs and keep their
    type through save and load.
    """

    def __init__(self, *, default_budget: PrivacyBudget | None = None, accountant: AccountantName = "pld") -> None:
        if default_budget is not None and not isinstance(default_budget, PrivacyBudget):
            raise ValueError(f"default_budget must be a PrivacyBudget or None, got {default_budget!r}")
        self._default_budget = default_budget
        self._accountant = _check_accountant(accountant)
        self._ledgers: dict[ClientId, PrivacyLedger] = {}
        # compositions of releases to everyone priced within / over a budget (record_for prices few: _check_within)
        self._approved: dict[tuple[PrivacyBudget, str], list[Counter[PrivacyEvent]]] = {}
        self._refused: dict[tuple[PrivacyBudget, str], list[Counter[PrivacyEvent]]] = {}

    @property
    def default_budget(self) -> PrivacyBudget | None:
        return self._default_budget

    @property
    def accountant(self) -> str:
        return self._accountant

    def __getitem__(self, client_id: ClientId) -> PrivacyLedger:
        client_id = _check_client_id(client_id)
        if client_id not in self._ledgers:
            self._ledgers[client_id] = PrivacyLedger(client_id, budget=self._default_budget,
                                                     accountant=self._accountant)
        return self._ledgers[client_id]

    def __contains__(self, client_id: object) -> bool:
        return client_id in self._ledgers

    def get(self, client_id: ClientId, default: Any = None) -> Any:
        return self._ledgers.get(client_id, default)

    def __iter__(self) -> Iterator[ClientId]:
        return iter(self._ledgers)

    def __len__(self) -> int:
        return len(self._ledgers)

    def __repr__(self) -> str:
        return (f"LedgerBook(clients={len(self)}, default_budget={self._default_budget!r}, "
                f"accountant={self._accountant!r})")

    def add(self, ledger: PrivacyLedger) -> PrivacyLedger:
        """Add a ledger made elsewhere (for a client with its own budget); its client must not have one yet."""
        if not isinstance(ledger, PrivacyLedger):
            raise ValueError(f"ledger must be a PrivacyLedger, got {ledger!r}")
        if ledger.client_id in self._ledgers:
            raise ValueError(f"client {ledger.client_id!r} already has a ledger")
        self._ledgers[ledger.client_id] = ledger
        return ledger

    def epsilons(self, delta: float) -> dict[ClientId, float]:
        """Each client's epsilon (natural log) at ``delta``; ``inf`` for a client with a non-private release."""
        return {client_id: ledger.spent(delta).epsilon for client_id, ledger in self._ledgers.items()}

    def epsilons_against_aggregator(self, delta: float) -> dict[ClientId, float]:
        """Each client's epsilon against the trusted aggregator of central DP (``inf`` where it saw a contribution in
        the clear; see :data:`AUDIENCES`)."""
        return {client_id: ledger.spent_against_aggregator(delta).epsilon
                for client_id, ledger in self._ledgers.items()}

    def relations(self, clients: Iterable[ClientId] | None = None) -> list[str]:
        """The neighbouring relations the recorded guarantees hold under, each distinct one once, sorted: a record's
        ``metadata["relation"]`` where the release described its neighbours in words (for example "replace one
        sample; n public", or a relation narrower than the event's, as DP-GMM with public class counts), else its
        event's relation. Releases made without privacy (no relation) are left out. ``clients``: only these
        clients' ledgers (default: every ledger)."""
        found = set()
        chosen = self._ledgers if clients is None else {c: self._ledgers[c] for c in clients if c in self._ledgers}
        for ledger in chosen.values():
            for record in ledger.records:
                if record.event.relation is not None:
                    words = record.metadata.get("relation")
                    found.add(words if isinstance(words, str) and words else record.event.relation.value)
        return sorted(found)

    def private_metadata_counts(self, key: str) -> dict[str, int]:
        """How many private releases (records with a relation) give each value of ``metadata[key]``, sorted by
        value; a release without the key counts under ``"unstated"``. For example ``"noise"``: how many releases
        drew their noise from a secure source and how many from a seeded generator."""
        counts: Counter[str] = Counter()
        for ledger in self._ledgers.values():
            for record in ledger.records:
                if record.event.relation is not None:
                    counts[str(record.metadata.get(key, "unstated"))] += 1
        return dict(sorted(counts.items()))

    def record_for(self, client_ids: Sequence[ClientId], event: PrivacyEvent, *, purpose: str, round: int | None = None,
                   metadata: Mapping[str, Any] | None = None,
                   calibrated_for: PrivacyBudget | None = None, planned: int | None = None) -> ReleaseRecord:
        """Record one release made on behalf of every client of ``client_ids`` (central DP's noisy aggregate, which
        every training client's guarantee composes each round) in each of their ledgers, as one record object.
        Every ledger is checked before any records it, so a refusal records nothing for anyone (an event the book's
        accountant cannot price, :func:`~accounting.check_supported`, included). ``planned``: how many times in all
        such a release is planned (a run's rounds), which the check prices first (:meth:`_check_within`): a hint
        of what to price, never a reason to allow."""
        release = ReleaseRecord(event=event, purpose=purpose, round=round, time=time.time(),
                                metadata={} if metadata is None else dict(metadata))
        check_supported(event, accountant=self._accountant)
        checked: set[tuple[Any, ...]] = set()
        for client_id in client_ids:   # clients with the same public releases and budget have one answer: ask once
            ledger = self[client_id]
            key = (frozenset(ledger._leaves.items()), ledger._relation, ledger.budget)
            if key in checked:
                continue
            budgets = [b for b in (calibrated_for, ledger.budget) if b is not None]
            ledger._check_event(event)
            for budget in dict.fromkeys(budgets):
                self._check_within(ledger, event, budget, client_id, purpose, planned=planned)
            checked.add(key)
        relations: dict[Any, Any] = {}     # the relation after the event, by the ledger's relation before it
        for client_id in client_ids:
            ledger = self[client_id]
            if ledger._relation not in relations:
                relations[ledger._relation] = ledger._check_event(event)
            ledger._append(release, relations[ledger._relation])
        return release

    def _check_within(self, ledger: PrivacyLedger, event: PrivacyEvent, budget: PrivacyBudget, client_id: ClientId,
                      purpose: str, *, planned: int | None = None) -> None:
        """Raise :class:`BudgetExceededError` unless ``ledger``'s releases to everyone plus ``event`` stay within
        ``budget``.

        A composition is priced once for many rounds: adding releases never lowers epsilon, so a composition that
        another one within the budget holds (each of its releases at most as often) is within it too. When the
        projection is held by no composition priced so far, a larger one is priced first, the projection plus as many
        copies of ``event`` again as it holds (fewer, halving, where that would hold a composition found over the
        budget): within the budget, it approves this round and the rounds up to it; over it, the projection itself
        is priced, as it always was. A run of R rounds of central DP prices about 2 log2 R compositions instead of
        R, or one when it says it plans R (``planned``: the projection plus the copies of ``event`` still to come is
        tried first); a refusal always comes from the projection's own epsilon."""
        step = event.leaf_counts()
        projected = ledger._leaves + step
        approved = self._approved.setdefault((budget, ledger.accountant), [])
        if any(_holds(bigger, projected) for bigger in approved):
            return
        refused = self._refused.setdefault((budget, ledger.accountant), [])
        copies = min(projected[leaf] // n for leaf, n in step.items())

        def within_ahead(more: int) -> bool:
            """Price the projection plus ``more`` copies of ``event`` (unless it holds a composition found over the
            budget), remember the verdict, and say whether it is within the budget."""
            ahead = projected + Counter({leaf: n * more for leaf, n in step.items()})
            if any(_holds(ahead, over) for over in refused):
                return False
            within = budget.allows(ledger._epsilon_of(ahead, budget.delta))
            _keep(approved if within else refused, ahead)
            return within

        if planned is not None and planned > copies and within_ahead(planned - copies):
            return
        if planned is not None and copies >= planned:
            copies = 0                           # past the plan: only the projection itself is worth pricing
        while copies >= 1:
            if within_ahead(copies):
                return
            copies //= 2
        after = ledger._projected_epsilon(event, budget.delta)
        if not budget.allows(after):
            raise BudgetExceededError(client_id, purpose, ledger.spent(budget.delta).epsilon, after, budget,
                                      ledger.accountant)
        _keep(approved, projected)

    def state_dict(self) -> dict[str, Any]:
        """All ledgers as plain JSON-able data, as a list of entries so that int and str client ids survive JSON.

        Compact (version 2): every record object is written once, as ``[kind, round, time]``, where ``kind`` indexes
        a table of what records share (event, purpose, metadata, audience), and each ledger lists the indices of its
        records. A record several ledgers hold (one release made on behalf of many clients, :meth:`record_for`) is
        one index in each of them, and a round of a thousand clients' releases of one kind is a thousand short
        entries: ten thousand clients' ledgers over hundreds of rounds stay a few bytes per release."""
        kinds: dict[str, int] = {}
        kind_table: list[dict[str, Any]] = []
        index: dict[int, int] = {}
        table: list[list[Any]] = []
        ledgers = []
        for ledger in self._ledgers.values():
            refs = []
            for record in ledger._records:
                at = index.get(id(record))
                if at is None:
                    values = record.to_dict()
                    round_, time_ = values.pop("round"), values.pop("time")
                    key = json.dumps(values, allow_nan=False)
                    kind = kinds.get(key)
                    if kind is None:
                        kind = kinds[key] = len(kind_table)
                        kind_table.append(values)
                    at = index[id(record)] = len(table)
                    table.append([kind, round_, time_])
                refs.append(at)
            ledgers.append({"client_id": ledger.client_id,
                            "budget": None if ledger.budget is None else ledger.budget.to_dict(),
                            "accountant": ledger.accountant, "records": refs})
        return {
            "format": _BOOK_FORMAT,
            "version": _BOOK_VERSION,
            "default_budget": None if self._default_budget is None else self._default_budget.to_dict(),
            "accountant": self._accountant,
            "kinds": kind_table,
            "records": table,
            "ledgers": ledgers,
        }

    @classmethod
    def from_state_dict(cls, state: Mapping[str, Any]) -> LedgerBook:
        """A book rebuilt from :meth:`state_dict` output (version 2, or version 1: every record in full, a record
        several ledgers hold under ``"shared"``)."""
        _check_format(state, _BOOK_FORMAT, versions=(_STATE_VERSION, _BOOK_VERSION))
        try:
            budget = state["default_budget"]
            book = cls(default_budget=None if budget is None else PrivacyBudget.from_dict(budget),
                       accountant=state["accountant"])
            if state["version"] == _BOOK_VERSION:
                table = _records_of(state["kinds"], state["records"])
            else:
                table = [ReleaseRecord.from_dict(d) for d in state.get("shared", [])]
            for ledger_state in state["ledgers"]:
                records = ledger_state["records"]
                ledger = PrivacyLedger.from_state_dict({"format": _LEDGER_FORMAT, "version": _STATE_VERSION,
                                                        **ledger_state, "records": []})
                if state["version"] == _BOOK_VERSION:
                    for at in records:
                        if isinstance(at, bool) or not isinstance(at, int) or at < 0:
                            raise ValueError(f"a ledger's record is an index into the book's records, got {at!r}")
                        ledger._append_history(table[at])
                else:
                    own = iter([d for d in records if "shared" not in d])
                    for d in records:
                        ledger._append_history(table[d["shared"]] if "shared" in d else
                                               ReleaseRecord.from_dict(next(own)))
                book.add(ledger)
        except (KeyError, TypeError, IndexError) as exc:
            raise ValueError(f"malformed ledger book state: {exc!r}") from None
        return book

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        """Replace every ledger (and the defaults) by those in ``state``."""
        vars(self).update(vars(LedgerBook.from_state_dict(state)))

    def save(self, path: str | os.PathLike[str]) -> None:
        """Write all ledgers to ``path`` atomically (compact JSON): a crash mid-write leaves the previous file
        intact."""
        _atomic_write_json(Path(path), self.state_dict(), compact=True)

    @classmethod
    def load(cls, path: str | os.PathLike[str]) -> LedgerBook:
        """Read a book written by :meth:`save`."""
        return cls.from_state_dict(_read_json(Path(path)))


def _holds(bigger: Counter[PrivacyEvent], smaller: Counter[PrivacyEvent]) -> bool:
    """Whether composition ``bigger`` holds composition ``smaller``: each release of it, at least as often."""
    return all(bigger[leaf] >= n for leaf, n in smaller.items())


def _keep(compositions: list[Counter[PrivacyEvent]], composition: Counter[PrivacyEvent], most: int = 8) -> None:
    compositions.append(composition)
    del compositions[:-most]


def _check_format(state: object, expected: str, *, versions: tuple[int, ...] = (_STATE_VERSION,)) -> None:
    if not isinstance(state, Mapping) or state.get("format") != expected:
        found = state.get("format") if isinstance(state, Mapping) else type(state).__name__
        raise ValueError(f"expected a state with format {expected!r}, got {found!r}")
    version = state.get("version")
    if isinstance(version, bool) or version not in versions:
        raise ValueError(f"unsupported {expected} state version {version!r}; this code reads version"
                         f"{'s' if len(versions) > 1 else ''} {', '.join(map(str, versions))}")


def _records_of(kinds: Any, rows: Any) -> list[ReleaseRecord]:
    """The records of a version-2 book state: each row ``[kind, round, time]`` with the fields of ``kinds[kind]``."""
    if not isinstance(kinds, list) or not isinstance(rows, list):
        raise TypeError("a book's kinds and records are lists")
    parsed = [(event_from_dict(k["event"]), k["purpose"], k["metadata"], k.get("audience", "everyone"))
              for k in kinds]
    records = []
    for row in rows:
        if not isinstance(row, list) or len(row) != 3 or isinstance(row[0], bool) or not isinstance(row[0], int) \
                or row[0] < 0:
            raise ValueError(f"a book's record is [kind, round, time], got {row!r}")
        event, purpose, metadata, audience = parsed[row[0]]
        records.append(ReleaseRecord(event=event, purpose=purpose, round=row[1], time=row[2], metadata=metadata,
                                     audience=audience))
    return records


def _atomic_write_json(path: Path, state: Mapping[str, Any], *, compact: bool = False) -> None:
    """``state`` as JSON in ``path``, written atomically and durably (:func:`accounting.files.atomic_write`)."""
    text = (json.dumps(state, separators=(",", ":"), allow_nan=False) if compact
            else json.dumps(state, indent=1, allow_nan=False))
    atomic_write(path, text.encode("utf-8"))


def _read_json(path: Path) -> Any:
    with open(path, encoding="utf-8") as f:
        return json.load(f)
