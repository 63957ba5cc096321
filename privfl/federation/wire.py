"""The one choke point every client-to-server message passes.

A client procedure never hands a tensor to the server itself: it returns a :class:`~privfl.federation.messages.Release`
and the runtime passes it through :meth:`Wire.client_to_server`, which records the release in that client's
:class:`accounting.PrivacyLedger` **before** anything is delivered. If the release would exceed the client's budget the
ledger raises :class:`accounting.BudgetExceededError` and nothing is sent (invariant 4 of docs/invariants.md).
The wire also counts the bytes that move each way, per client.
"""

from __future__ import annotations

from collections import defaultdict
from typing import TYPE_CHECKING, Any

from accounting import LedgerBook, ReleaseJournal
from privfl.federation.messages import Message, Release

if TYPE_CHECKING:   # the runtime imports this module
    from privfl.federation.runtime import RoundRelease


class Wire:
    """Carries messages between the server and clients, recording every client-to-server release."""

    def __init__(self, ledgers: LedgerBook | None = None) -> None:
        self.ledgers = ledgers if ledgers is not None else LedgerBook()
        # where each release's record is also appended before it is delivered (a run directory's releases.jsonl)
        self.journal: ReleaseJournal | None = None
        # Set by the in-process runtime while clients whose procedure only reads what it receives and keeps nothing
        # it releases train (ClientProcedure.hands_over_messages): messages then cross uncopied, both ways.
        self.hand_over = False
        self.bytes_down: dict[int, int] = defaultdict(int)
        self.bytes_up: dict[int, int] = defaultdict(int)

    def server_to_client(self, client_id: int, message: Message) -> Message:
        """Deliver ``message`` to a client: a copy (the client cannot touch the server's tensors), or, while
        :attr:`hand_over` is set, the message itself."""
        self.count_down(client_id, message)
        return message if self.hand_over else message.copy()

    def count_down(self, client_id: int, message: Message) -> None:
        """Count ``message`` as sent to a client that gets its own copy another way (a worker process reads it from
        bytes, :mod:`privfl.federation.workers`)."""
        self.bytes_down[client_id] += message.num_bytes()

    def client_to_server(self, client_id: int, release: Release, *, round: int | None) -> Message:
        """Record ``release`` in the client's ledger, then deliver a copy of its message to the server (while
        :attr:`hand_over` is set, the message itself).

        Raises :class:`accounting.BudgetExceededError` (from the ledger) before anything is delivered when the
        release would exceed the client's budget or the budget its noise was calibrated for.
        """
        metadata = release.ledger_metadata()
        record = self.ledgers[client_id].record(release.event, purpose=release.purpose, round=round, metadata=metadata,
                                                calibrated_for=release.calibrated_for, audience=release.audience)
        if self.journal is not None:
            self.journal.append(client_id, record)
        self.bytes_up[client_id] += metadata["bytes"]
        return release.message if self.hand_over else release.message.copy()

    def record_for(self, client_ids: list[int], release: RoundRelease, *, round: int | None) -> None:
        """Record a release the server makes on behalf of each of ``client_ids`` (a
        :class:`~privfl.federation.runtime.RoundRelease`: central DP's noisy aggregate) in their ledgers, as one
        record, and in the journal, as one line. A refusal records nothing for anyone."""
        record = self.ledgers.record_for(client_ids, release.event, purpose=release.purpose, round=round,
                                         metadata=release.metadata, calibrated_for=release.calibrated_for,
                                         planned=release.planned)
        if self.journal is not None:
            self.journal.append_for(client_ids, record)

    def state_dict(self) -> dict[str, Any]:
        return {
            "ledgers": self.ledgers.state_dict(),
            "bytes_down": [[k, v] for k, v in self.bytes_down.items()],
            "bytes_up": [[k, v] for k, v in self.bytes_up.items()],
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.ledgers.load_state_dict(state["ledgers"])
        self.bytes_down = defaultdict(int, {int(k): int(v) for k, v in state["bytes_down"]})
        self.bytes_up = defaultdict(int, {int(k): int(v) for k, v in state["bytes_up"]})
