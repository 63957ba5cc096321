"""What crosses the wire: arrays, metrics and config, shaped like Flower's records so an adapter stays thin.

A :class:`Message` is plain data: named tensors (Flower's ``ArrayRecord``), named numbers (``MetricRecord``) and named
settings (``ConfigRecord``). A :class:`Release` is what a client procedure hands to the federation layer when it wants
to send something to the server: the message plus how it was privatised. Only the wire turns a release into a
message the server sees, after recording it in the client's ledger (see :mod:`privfl.federation.wire`).
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

import torch

from accounting import NonPrivateEvent, PrivacyBudget, PrivacyEvent

Scalar = int | float | str | bool


@dataclass
class Message:
    """Named tensors, metrics and config travelling between server and one client."""

    arrays: dict[str, torch.Tensor] = field(default_factory=dict)
    metrics: dict[str, float] = field(default_factory=dict)
    config: dict[str, Scalar] = field(default_factory=dict)

    def num_bytes(self) -> int:
        """Bytes of the tensor payload as sent (element size times count); metrics and config are not counted."""
        return sum(t.numel() * t.element_size() for t in self.arrays.values())

    def copy(self) -> Message:
        """A deep copy detached from any autograd graph: what arrives on the other side of a wire."""
        return Message(
            arrays={k: v.detach().clone() for k, v in self.arrays.items()},
            metrics=dict(self.metrics),
            config=dict(self.config),
        )

    def subset(self, prefix: str) -> dict[str, torch.Tensor]:
        """The arrays whose names start with ``prefix``, with the prefix removed."""
        return {k[len(prefix):]: v for k, v in self.arrays.items() if k.startswith(prefix)}


def prefixed(prefix: str, tensors: Mapping[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """``tensors`` with every name prefixed by ``prefix`` (to carry several tensor groups in one message)."""
    return {prefix + k: v for k, v in tensors.items()}


@dataclass(frozen=True)
class Release:
    """A message a client wants to send to the server, with the privacy event that describes how it was made.

    ``event`` is an :mod:`accounting` event. A release built without a privacy mechanism carries
    :class:`accounting.NonPrivateEvent`, so the client's epsilon becomes infinite and no summary can claim otherwise.
    ``purpose`` names what is released (``"model_update"``, ``"descriptor"``, ...) and is kept in the ledger.
    ``metadata`` (JSON-able values) says how the release was made where the event alone does not: the noise source
    (``"secure"`` or ``"seeded"``), the clipping bound, whether counts were declared public, the neighbouring
    relation in words. The wire keeps it in the ledger record beside the byte count. ``calibrated_for`` is the
    budget the noise was calibrated for over the client's whole ledger, where the mechanism assumes a number of
    releases (client-level DP over ``participations`` rounds): the ledger refuses the release that would pass it
    (:meth:`accounting.PrivacyLedger.record`). ``audience`` is who sees it (:data:`accounting.ledger.AUDIENCES`):
    ``"trusted_aggregator"`` for a contribution in the clear to the aggregator of central DP.
    """

    message: Message
    purpose: str
    event: PrivacyEvent = field(default_factory=NonPrivateEvent)
    metadata: Mapping[str, Any] = field(default_factory=dict)
    calibrated_for: PrivacyBudget | None = None
    audience: str = "everyone"

    def ledger_metadata(self) -> dict[str, Any]:
        """What the ledger keeps beside the event: ``metadata`` and the payload's byte count."""
        return {**self.metadata, "bytes": self.message.num_bytes()}

    @classmethod
    def non_private(cls, message: Message, purpose: str) -> Release:
        """A release made without any privacy mechanism (recorded with epsilon = infinity)."""
        return cls(message=message, purpose=purpose, event=NonPrivateEvent())
