"""The shape every method has: a server strategy and client procedures, registered by name.

A method is one module that defines a :class:`Strategy` subclass (server side), a :class:`ClientProcedure` subclass
(client side), a frozen dataclass of its hyperparameters, and one :func:`register_method` call. The runtime (in-process
today, Flower later) drives them through messages only, so the same method code runs on any runtime:

* ``Strategy.configure_train`` -> one message down to each sampled training client;
* ``ClientProcedure.train`` -> a :class:`Release` (or ``None`` when the client sends nothing), recorded by the wire;
* ``Strategy.aggregate_train`` -> the server's update from the delivered messages.

A round may be a dialogue of several such exchanges (``Strategy.train_stages``; ``Strategy.configure_stage`` and
``ClientProcedure.train_stage`` for stages after the first). Every message up is a release on the wire.

Novel clients follow a two-down, one-up protocol that covers every method in the project (FedAvg: the global model;
ODPFL-HN: descriptor up, generated model down; TENT/FedTTA: model down, adaptation on the client):

1. ``Strategy.novel_request(client_id)`` -> first message down;
2. ``ClientProcedure.novel_query(novel, message)`` -> a release up, or ``None`` (the client reveals nothing);
3. ``Strategy.novel_reply(client_id, delivered)`` -> the second message down (by default the request again);
4. ``ClientProcedure.novel_model(novel, message)`` -> the client's model, built on the client.

A :class:`~privfl.data.NovelClient` holds no labels, so no procedure can use them.
"""

from __future__ import annotations

import dataclasses
import math
from abc import ABC, abstractmethod
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from privfl.data import NovelClient, TrainingClient
from privfl.errors import ConfigError
from privfl.federation.context import ClientContext, ClientState
from privfl.federation.messages import Message, Release
from privfl.federation.seeding import seeded_init
from privfl.models import build_model

@dataclass(frozen=True)
class LocalTrainingConfig:
    """Settings shared by every method that runs local SGD on clients.

    ``lr`` is the client (local) learning rate; ``local_steps`` counts minibatch steps per round (not epochs).
    ``weight_decay``, ``grad_clip`` (max L2 norm of each step's gradient; a stabiliser, not DP clipping; ``None``
    for none) and ``lr_decay`` (the round-r learning rate is ``lr * lr_decay ** (r / 10)``) are the stabilisers the
    FedTTA authors' code applies (weight decay 1e-4, clip 10, decay 0.99); the paper states none of them, so they
    default to off.
    """

    lr: float = 0.1
    local_steps: int = 20
    batch_size: int = 64
    weight_decay: float = 0.0
    grad_clip: float | None = None
    lr_decay: float = 1.0

    def __post_init__(self) -> None:
        _require(_finite(self.lr) and self.lr > 0, "lr", self.lr, "a finite number > 0")
        _require(_int_at_least(self.local_steps, 1), "local_steps", self.local_steps,
                 "an integer >= 1")
        _require(_int_at_least(self.batch_size, 1), "batch_size", self.batch_size,
                 "an integer >= 1")
        _require(_finite(self.weight_decay) and self.weight_decay >= 0, "weight_decay", self.weight_decay,
                 "a finite number >= 0")
        _require(self.grad_clip is None or (_finite(self.grad_clip) and self.grad_clip > 0), "grad_clip",
                 self.grad_clip, "None or a finite number > 0")
        _require(_finite(self.lr_decay) and 0 < self.lr_decay <= 1, "lr_decay", self.lr_decay, "in (0, 1]")

    def round_config(self, round: int) -> dict:
        """What the server sends each round: the (decayed) learning rate and the local-training settings."""
        return {"lr": self.lr * self.lr_decay ** (round / 10), "local_steps": self.local_steps,
                "batch_size": self.batch_size, "weight_decay": self.weight_decay,
                "grad_clip": self.grad_clip or 0.0}


def _finite(value: Any) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)


def _int_at_least(value: Any, minimum: int) -> bool:
    """An int >= ``minimum`` that is not a bool (``True`` is an int in Python, never a step count)."""
    return isinstance(value, int) and not isinstance(value, bool) and value >= minimum


def _require(ok: bool, name: str, value: Any, valid: str) -> None:
    if not ok:
        raise ConfigError(f"{name} must be {valid}, got {value!r}")


@dataclass(frozen=True)
class ModelFactory:
    """Builds the target network; ``init(seed)`` gives the same initial weights for the same seed everywhere."""

    name: str
    input_shape: tuple[int, ...]
    num_classes: int

    def __call__(self) -> nn.Module:
        return build_model(self.name, self.input_shape, self.num_classes)

    def init(self, seed: int) -> nn.Module:
        return seeded_init(self, seed)


class Strategy(ABC):
    """Server side of a method. Holds the server state; sees clients only through delivered messages."""

    def __init__(self, *, model_factory: ModelFactory, config: Any, seed: int, num_training_clients: int) -> None:
        self.model_factory = model_factory
        self.config = config
        self.seed = seed
        self.num_training_clients = num_training_clients

    @abstractmethod
    def configure_train(self, round: int, client_ids: list[int]) -> dict[int, Message]:
        """The message for each sampled training client this round."""

    #: Message exchanges (one down, one up) per training round. Methods whose round is a dialogue (ODPFL-HN, PeFLL:
    #: descriptor up, model down, weight change up, gradient down, ...) set this above 1 and implement
    #: :meth:`configure_stage` and :meth:`ClientProcedure.train_stage`.
    train_stages: int = 1

    def configure_stage(self, round: int, stage: int, replies: dict[int, Message]) -> dict[int, Message]:
        """Stage ``stage >= 1`` of a round: the next message for each client, given what it sent at ``stage - 1``.

        Only clients present in ``replies`` take part in later stages. Per-round working values the server needs
        later in the round (descriptors, generated weights) live on the strategy until ``aggregate_train``.
        """
        raise NotImplementedError(f"{type(self).__name__} has train_stages={self.train_stages} but no configure_stage")

    @abstractmethod
    def aggregate_train(self, round: int, replies: dict[int, Message]) -> dict[str, float]:
        """Update the server state from the messages delivered at the round's last stage; return round metrics.

        Replace state tensors rather than modifying them in place: the runtime keeps the state of the last
        completed round by reference, to checkpoint it if a round is interrupted.
        """

    def configure_evaluate(self, client_id: int) -> Message:
        """The message a training client evaluates (by default the same as the novel request)."""
        return self.novel_request(client_id)

    @abstractmethod
    def novel_request(self, client_id: int) -> Message:
        """First message down to a novel client."""

    def novel_reply(self, client_id: int, delivered: Message | None) -> Message:
        """Second message down to a novel client, given what it sent (``None`` if it sent nothing)."""
        return self.novel_request(client_id)

    @abstractmethod
    def state_dict(self) -> dict[str, Any]:
        """Everything needed to resume: tensors and plain Python values only (loads with ``weights_only=True``)."""

    @abstractmethod
    def load_state_dict(self, state: dict[str, Any]) -> None: ...


class ClientProcedure(ABC):
    """Client side of a method: pure functions of (data, message, client state, context)."""

    serves_novel_clients: bool = True

    def __init__(self, *, model_factory: ModelFactory, config: Any) -> None:
        self.model_factory = model_factory
        self.config = config
        self._model: nn.Module | None = None

    def workspace_model(self) -> nn.Module:
        """A model instance reused across calls on this client process (its weights are always overwritten)."""
        if self._model is None:
            self._model = self.model_factory()
        return self._model

    def model_from(self, weights: dict[str, torch.Tensor]) -> nn.Module:
        """The workspace model loaded with ``weights`` (a state dict)."""
        model = self.workspace_model()
        model.load_state_dict(weights)
        return model

    @abstractmethod
    def train(self, data: TrainingClient, message: Message, state: ClientState, ctx: ClientContext) -> Release | None:
        """Local work for one round; may update ``state`` in place. Returns what to send, or ``None``."""

    def train_stage(self, stage: int, data: TrainingClient, message: Message, state: ClientState,
                    ctx: ClientContext) -> Release | None:
        """Stage ``stage >= 1`` of a multi-stage round (see :attr:`Strategy.train_stages`); ``state`` is the same
        working copy the round's earlier stages saw, committed only when the round completes."""
        raise NotImplementedError(f"{type(self).__name__} does not implement train_stage")

    def evaluation_model(self, data: TrainingClient, message: Message, state: ClientState) -> nn.Module:
        """The model this training client is scored with (by default the weights in the message)."""
        return self.model_from(message.arrays)

    def novel_query(self, novel: NovelClient, message: Message) -> Release | None:
        """What a novel client sends after the first message (by default nothing)."""
        return None

    def novel_model(self, novel: NovelClient, message: Message) -> nn.Module:
        """The novel client's model, built from the second message (by default the weights in it)."""
        return self.model_from(message.arrays)


@dataclass(frozen=True)
class MethodSpec:
    """A registry entry: how to build a method's two halves and parse its hyperparameters."""

    name: str
    strategy: type[Strategy]
    client: type[ClientProcedure]
    config: type
    description: str

    def make_config(self, **values: Any) -> Any:
        """The method's config from ``values``; unknown names raise :class:`ConfigError` listing the valid ones."""
        fields = {f.name for f in dataclasses.fields(self.config)}
        unknown = sorted(set(values) - fields)
        if unknown:
            raise ConfigError(
                f"method {self.name!r} has no setting {', '.join(unknown)}; valid settings: {', '.join(sorted(fields))}"
            )
        return self.config(**values)


METHODS: dict[str, MethodSpec] = {}


def register_method(name: str, *, strategy: type[Strategy], client: type[ClientProcedure], config: type,
                    description: str) -> MethodSpec:
    """Add a method to the registry under ``name`` (one call per method module)."""
    if name in METHODS:
        raise ValueError(f"method {name!r} is already registered")
    spec = MethodSpec(name=name, strategy=strategy, client=client, config=config, description=description)
    METHODS[name] = spec
    return spec


def get_method(name: str) -> MethodSpec:
    """The registered method ``name``; an unknown name raises :class:`ConfigError` listing the valid ones."""
    if name not in METHODS:
        raise ConfigError(f"unknown method {name!r}; valid choices: {', '.join(sorted(METHODS))}")
    return METHODS[name]

