"""The shape every method has: a server strategy and client procedures, registered by name.

A method is one module that defines a :class:`Strategy` subclass (server side), a :class:`ClientProcedure` subclass
(client side), a frozen dataclass of its hyperparameters (:class:`MethodConfig`), and one :func:`register_method`
call. The runtime drives them through messages only, so the same method code runs on any engine; every message up is
a release on the wire. Novel clients follow one two-down, one-up protocol (``novel_request``, ``novel_query``,
``novel_reply``, ``novel_model``). Other entry points: :func:`get_method`, :class:`MethodSpec`,
:func:`private_release`. What a round releases under record-level DP is declared here
(:meth:`ClientProcedure.record_releases`) and priced, calibrated and run by :mod:`privfl.privacy.record`.

The exchanges of a round, the novel-client protocol and the privacy contract every method keeps:
docs/federation.md, "The shape of a method".
"""

from __future__ import annotations

import dataclasses
import math
import numbers
import types
import typing
from abc import ABC, abstractmethod
from collections.abc import Callable, Iterable, Iterator, Mapping
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch
from torch import nn

from accounting import ComposedEvent, PrivacyEvent
from accounting.validation import is_finite, is_int_at_least
from privfl.data import NovelClient, TrainingClient
from privfl.errors import ConfigError, check
from privfl.federation.context import ClientContext, ClientState
from privfl.federation.messages import Message, Release
from privfl.federation.runtime import ReleaseSum, RoundRelease, SecureSum, sample_clients
from privfl.federation.seeding import derive_seed, seeded_init
from privfl.methods.local_training import ExtraLoss, load_weights, local_sgd
from privfl.models import build_model
from privfl.privacy import privatize, record
from privfl.privacy.gradient_mean import release_gradient_mean
from privfl.privacy.privatize import PrivateEncoder
from privfl.privacy.record import ClippedMean, DPSGDFit, RecordRelease
from privfl.privacy.training import (
    MODES,
    RECORD,
    NovelPrivacy,
    TrainingPrivacy,
    record_sampling_rate,
    record_steps_for_epochs,
)
from privfl.registry import Registry


@dataclass(frozen=True)
class MethodConfig:
    """Base of every method's settings: a frozen dataclass, validated at construction, written to ``config.json``
    inside the run config. What the run checks read of a method is in its registration (:class:`MethodSpec`: the
    privacy modes it runs, its releases per round), not in optional attributes of its config."""

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)

    def replace(self, **changes: Any) -> MethodConfig:
        return dataclasses.replace(self, **changes)

    def check_privacy(self, privacy: TrainingPrivacy, novel_privacy: NovelPrivacy) -> None:
        """Refuse, before the run starts, settings under which the run's privacy cannot hold. The registration
        refuses whole modes (``MethodSpec.privacy``); this refuses combinations of a mode and settings (ODPFL-HN's
        random descriptor batches under add/remove-one, say). Nothing by default."""


@dataclass(frozen=True)
class LocalTrainingConfig(MethodConfig):
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
        check.positive(self.lr, "lr")
        check.integer(self.local_steps, "local_steps")
        check.integer(self.batch_size, "batch_size")
        check.non_negative(self.weight_decay, "weight_decay")
        check.require(self.grad_clip is None or (is_finite(self.grad_clip) and self.grad_clip > 0), "grad_clip",
                      self.grad_clip, "None or a finite number > 0")
        check.fraction(self.lr_decay, "lr_decay")

    def round_config(self, round: int) -> dict:
        """What the server sends each round: the (decayed) learning rate and the local-training settings."""
        return {"lr": self.lr * self.lr_decay ** (round / 10), "local_steps": self.local_steps,
                "batch_size": self.batch_size, "weight_decay": self.weight_decay,
                "grad_clip": self.grad_clip or 0.0}


@dataclass(frozen=True)
class ModelFactory:
    """Builds the target network on ``device``; ``init(seed)`` gives the same initial weights for the same seed
    everywhere (built on the CPU, then moved: :mod:`privfl.devices`)."""

    name: str
    input_shape: tuple[int, ...]
    num_classes: int
    device: str = "cpu"

    def __call__(self) -> nn.Module:
        return build_model(self.name, self.input_shape, self.num_classes).to(self.device)

    def init(self, seed: int) -> nn.Module:
        return seeded_init(self, seed)


class Strategy(ABC):
    """Server side of a method. Holds the server state; sees clients only through delivered messages."""

    def __init__(self, *, model_factory: ModelFactory, config: Any, seed: int, num_training_clients: int) -> None:
        self.model_factory = model_factory
        self.config = config
        self.seed = seed
        self.num_training_clients = num_training_clients

    def configure_train(self, round: int, client_ids: list[int]) -> dict[int, Message]:
        """The message for each sampled training client this round: by default the one :meth:`round_message` to
        every client (a method whose clients receive different messages overrides this instead)."""
        message = self.round_message(round)
        return {cid: message for cid in client_ids}

    def round_message(self, round: int) -> Message:
        """The message every sampled training client receives in round ``round`` (:meth:`configure_train`)."""
        raise NotImplementedError(f"{type(self).__name__} implements neither configure_train nor round_message")

    #: Central DP (set by the privacy layer's aggregator, :class:`~privfl.modes.wrappers.Aggregator`): per-client
    #: state the server holds in the clear (ODPFL-HN's and PeFLL's descriptors, pFedHN's rows) may shape what its
    #: owner receives only, never a message to another client, a novel client or the shared state.
    confidential: bool = False

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
    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Continue from :meth:`state_dict`, or take a :meth:`serving_state` (its training-only parts then start
        afresh, as before round 0: it is for scoring and serving, never for more rounds)."""

    #: Keys of :meth:`state_dict` that only later rounds read (server optimiser state: momentum buffers, an
    #: optimiser's moments, control variates), never scoring a training client or serving a novel one.
    training_only: tuple[str, ...] = ()

    def serving_state(self, state: dict[str, Any]) -> dict[str, Any]:
        """``state`` (of :meth:`state_dict`) without its :attr:`training_only` parts: what a best-validation snapshot
        keeps, since it is only ever restored to score training clients and serve novel ones."""
        return {key: value for key, value in state.items() if key not in self.training_only}

    # -- the round's sample and the privacy layer's hooks -------------------------------------------------------------

    def sample_clients(self, round: int, client_ids: list[int], fraction: float, seed: int) -> list[int]:
        """The training clients of ``round``: a seeded uniform sample of fixed size (public: the schedule is a
        function of the run seed). Central client-level DP samples by Poisson instead
        (:class:`~privfl.modes.wrappers.Aggregator`)."""
        return sample_clients(client_ids, fraction, seed=seed, round=round)

    def round_releases(self, round: int) -> list[RoundRelease]:
        """Releases the server makes this round on behalf of every training client, recorded in every training
        client's ledger before the round's messages are used (central DP's noisy aggregate); none by default."""
        return []

    def secure_sum(self) -> SecureSum | None:
        """What the runtime must sum securely: the releases of each round's last stage, which the server then sees
        only as their sum (:meth:`aggregate_sum` in place of :meth:`aggregate_train`); ``None`` (the default): the
        server receives each release. Only the privacy layer's distributed mode asks for one."""
        return None

    def aggregate_sum(self, round: int, total: ReleaseSum) -> dict[str, float]:
        """Update the server state from the secure sum of the last stage's releases (when :meth:`secure_sum` asks
        for one); return round metrics."""
        raise NotImplementedError(f"{type(self).__name__} asks for no secure sum")

    def contributions(self, round: int, replies: dict[int, Message]) -> Iterator[tuple[int, dict[str, torch.Tensor]]]:
        """Central DP: what each client's round contributes to the shared state, as named tensors, in increasing
        client id; the layer clips each to C, sums and noises them, and :meth:`apply_mean` moves the shared state
        from the noisy mean. By default a client's contribution is its last-stage message's arrays. Distributed DP
        sums the releases themselves under secure aggregation, so a method that overrides this cannot run it (the
        layer refuses it, :func:`privfl.modes.wrappers.protect`)."""
        for cid in sorted(replies):
            yield cid, replies[cid].arrays

    def contribution_shapes(self) -> dict[str, torch.Tensor]:
        """Central and distributed DP: zeros shaped like one contribution (central: a round that samples nobody still
        releases noise of that shape; distributed: the arrays every release must be, summed by name)."""
        raise NotImplementedError(f"{type(self).__name__} declares no contribution shapes for client-level DP")

    def apply_mean(self, round: int, mean: dict[str, torch.Tensor], count: float) -> dict[str, float]:
        """Central and distributed DP: move the shared state from the noisy sum of the round's contributions divided
        by ``count`` (central: the expected count q N, public, so ``mean`` is a mean only in expectation;
        distributed: the round's number of clients). Nothing else of the round may move the shared state. Return
        metrics that depend on nothing else."""
        raise NotImplementedError(f"{type(self).__name__} cannot step from a noisy mean of contributions")


class ClientProcedure(ABC):
    """Client side of a method: pure functions of (data, message, client state, context)."""

    serves_novel_clients: bool = True

    #: Declared by a procedure whose ``train`` and ``train_stage`` neither modify a delivered message's tensors nor
    #: keep them after returning, and keep no reference to the tensors they release: the in-process runtime then
    #: hands messages to it and its releases to the server without copying them (:meth:`hands_over_messages`; it
    #: checks that no delivered tensor was modified in place). A subclass that overrides ``train`` or ``train_stage``
    #: does not inherit the declaration: it makes its own.
    shares_messages: bool = False

    def hands_over_messages(self) -> bool:
        """Whether :attr:`shares_messages` holds for this procedure's ``train`` and ``train_stage``: declared by its
        class or a base class that no class below it overrides them from."""
        mro = type(self).__mro__
        declared = next((i for i, c in enumerate(mro) if "shares_messages" in vars(c)), None)
        if declared is None or not vars(mro[declared])["shares_messages"]:
            return False
        return all(next(i for i, c in enumerate(mro) if name in vars(c)) >= declared
                   for name in ("train", "train_stage"))

    def __init__(self, *, model_factory: ModelFactory, config: Any, privacy: TrainingPrivacy | None = None,
                 novel_privacy: NovelPrivacy | None = None, participations: int = 1) -> None:
        self.model_factory = model_factory
        self.config = config
        self.privacy = privacy or TrainingPrivacy()
        self.novel_privacy = novel_privacy or NovelPrivacy()
        self.participations = participations     # the most rounds a training client releases in (calibration)
        self._model: nn.Module | None = None

    # -- record-level DP: the training path every method shares -----------------------------------------------------

    @property
    def record_level(self) -> bool:
        """Whether training clients run record-level DP (DP-SGD and private releases)."""
        return self.privacy.mode == RECORD

    def record_releases(self) -> tuple[RecordRelease, ...]:
        """Record level: what one round of this client releases, in order, declared from public quantities only
        (the run's settings, never the client's data or size), so neighbouring clients (n and n + 1 records) declare
        the same. By default one DP-SGD fit (:meth:`dp_sgd_fit`). The privacy layer prices it
        (:mod:`privfl.privacy.record`); the conformance tests check that a round records what it declares."""
        return (self.dp_sgd_fit(),)

    def dp_sgd_fit(self) -> DPSGDFit:
        """Record level: one fit of :meth:`record_steps` DP-SGD steps at the public rate
        :meth:`record_sampling_rate`."""
        return DPSGDFit(self.record_steps(), self.record_sampling_rate())

    def clipped_mean(self, bound: float) -> ClippedMean:
        """Record level: one release of a mean over the client's records each clipped to ``bound``, calibrated at
        the public ``privacy.min_samples``."""
        return ClippedMean(float(bound), self.privacy.min_samples)

    def round_event(self, noise_multiplier: float) -> PrivacyEvent:
        """Record level: the event of one round of :meth:`record_releases` when every mechanism has noise multiplier
        ``noise_multiplier``; calibrating a target epsilon composes it over the client's rounds."""
        return record.round_event(self.record_releases(), noise_multiplier)

    def planned_round_event(self) -> PrivacyEvent:
        """Record level: the event one round of this client's releases will record, priced before the first release
        (:mod:`privfl.modes.plan`): :meth:`round_event` at :meth:`noise_multiplier`. A method whose releases are
        calibrated otherwise (DP-FedPFT's one Gaussian per message) says so here; public quantities only."""
        return self.round_event(self.noise_multiplier())

    def record_sampling_rate(self) -> float:
        """Record level: q, the public Poisson rate of every DP-SGD step (:func:`~privfl.privacy.training.
        record_sampling_rate` of the privacy settings and this method's ``batch_size``)."""
        return record_sampling_rate(self.privacy, int(self.config.batch_size))

    def record_steps(self) -> int:
        """Record level: the DP-SGD steps of one round's fit, from the method's own settings (public): ``local_steps``,
        or, where the config has ``local_epochs`` set, that many passes at the public rate q (``ceil(epochs / q)``,
        :func:`~privfl.privacy.training.record_steps_for_epochs`). A round whose message asks for other steps is
        refused (:meth:`fit`)."""
        epochs = getattr(self.config, "local_epochs", None) or 0
        return record_steps_for_epochs(epochs, self.record_sampling_rate()) if epochs else int(self.config.local_steps)

    def round_steps(self, data: TrainingClient, config: Mapping[str, Any]) -> int:
        """The local steps a round message asks for: ``local_steps``, or ``local_epochs`` passes over the client's
        records when it sets them: ``epochs * ceil(n / batch_size)`` steps without DP; under record-level DP n is
        private and a pass is ``ceil(epochs / q)`` steps at the public rate q (:meth:`record_steps`)."""
        epochs = int(config.get("local_epochs", 0))
        if not epochs:
            return int(config["local_steps"])
        if self.record_level:
            return record_steps_for_epochs(epochs, self.record_sampling_rate())
        batch_size = int(config["batch_size"])
        return epochs * math.ceil(data.num_train / min(batch_size, data.num_train))

    def noise_source(self, ctx: ClientContext, purpose: str) -> dict[str, Any]:
        """Keyword arguments ``noise`` and ``generator`` for a mechanism of a record-level release
        (:func:`privfl.privacy.record.noise_source`), keyed by ``purpose``, the round and the client."""
        return record.noise_source(self.privacy, lambda seed: derive_seed(seed, purpose, ctx.round, ctx.client_id))

    def noise_multiplier(self) -> float:
        """Record level: z of every mechanism of every training client (the run's ``noise_multiplier``, or
        calibrated once per settings for a target epsilon from :meth:`round_event`, which reads public quantities
        only)."""
        return record.calibrated_noise_multiplier(
            self.privacy, self.participations,
            lambda: (type(self).__name__, repr(self.config), repr(self.novel_privacy)), self.round_event)

    def record_privatize(self, encoder: nn.Module, ctx: ClientContext, purpose: str) -> PrivateEncoder:
        """Record level: ``privatize(encoder)`` for a training client's descriptor: each record's output clipped to
        the novel bound B (training sees the function novel clients release), add/remove-one with n private
        (calibrated at ``privacy.min_samples``), noise multiplier :meth:`noise_multiplier`, noise keyed by
        ``purpose`` (:meth:`noise_source`)."""
        return privatize(encoder, None, None, bound=float(self.novel_privacy.bound), relation="add_or_remove_one",
                         min_samples=self.privacy.min_samples, noise_multiplier=self.noise_multiplier(),
                         **self.noise_source(ctx, purpose))

    def novel_descriptor_release(self, encoder: nn.Module, novel: NovelClient, purpose: str, *,
                                 batch_size: int | None = None) -> Release:
        """A novel client's descriptor through ``privatize(encoder, novel_privacy.epsilon, novel_privacy.delta)``
        (replace-one, n public, each record's output clipped to ``novel_privacy.bound``); seeded noise is keyed by
        ``novel_privacy.noise_seed``, ``purpose`` and the client alone (nothing in the server's message sets it). With
        ``batch_size`` the mean is taken in batches of that size (:meth:`PrivateEncoder.release_batched`)."""
        setting = self.novel_privacy
        private = privatize(encoder, setting.epsilon, setting.delta, bound=setting.bound,
                            **record.noise_source(setting, lambda seed: derive_seed(seed, purpose, novel.client_id)))
        if batch_size is None:
            descriptor, event = private.release(novel.x)
        else:
            descriptor, event = private.release_batched(novel.x, batch_size=batch_size)
        return Release(Message(arrays={"descriptor": descriptor.to("cpu", torch.get_default_dtype())}),
                       purpose="descriptor", event=event,
                       metadata={"noise": setting.noise, "bound": setting.bound, "n": len(novel.x),
                                 "relation": "replace one sample; n public"})

    def record_gradient_mean(self, module: nn.Module, contribution: Callable, x: torch.Tensor, y: torch.Tensor,
                             source: Mapping[str, Any]) -> tuple[dict[str, torch.Tensor], PrivacyEvent, Any]:
        """Record level: :func:`~privfl.privacy.gradient_mean.release_gradient_mean` of ``module``'s gradient of
        ``contribution`` per record, each clipped to ``privacy.clip``, calibrated at ``privacy.min_samples``, noise
        multiplier :meth:`noise_multiplier`, noise from ``source`` (``noise`` and ``generator``: :meth:`noise_source`
        for a release of its own, or the stream of a private encoder whose releases it alternates with)."""
        return release_gradient_mean(module, contribution, x, y, clip=float(self.privacy.clip),
                                     min_samples=self.privacy.min_samples, noise_multiplier=self.noise_multiplier(),
                                     **source)

    def fit(self, model: nn.Module, data: TrainingClient, settings: Mapping[str, Any], rng: np.random.Generator,
            *, per_sample_loss: Callable | None = None, extra_loss: ExtraLoss | None = None,
            params: Iterable[str | nn.Parameter] | None = None) -> tuple[float, PrivacyEvent | None]:
        """Local training on the client's training split, with ``settings`` as :func:`local_sgd` takes them; under
        record-level DP one :meth:`dp_sgd_fit` (:func:`privfl.privacy.record.train_dp_sgd`: per-sample clip
        ``privacy.clip``, noise multiplier :meth:`noise_multiplier`; a server that asks for other steps or batch size
        than the client's own plan is refused before anything is trained). Returns the mean loss and the DP-SGD event
        (``None`` without DP). ``extra_loss`` must not depend on the data (FedProx's proximal term, SCAFFOLD's
        correction): its gradient is added outside the clipped, noised sum."""
        if not self.record_level:
            if per_sample_loss is not None or params is not None:
                raise NotImplementedError("per_sample_loss and params apply to record-level DP-SGD only")
            return local_sgd(model, data.x_train, data.y_train, rng=rng, extra_loss=extra_loss, **settings), None
        return record.train_dp_sgd(model, data.x_train, data.y_train, self.privacy, self.dp_sgd_fit(),
                                   batch_size=int(self.config.batch_size), noise_multiplier=self.noise_multiplier(),
                                   settings=settings, rng=rng, per_sample_loss=per_sample_loss,
                                   extra_loss=extra_loss, params=params)

    def workspace_model(self) -> nn.Module:
        """A model instance reused across calls on this client process (its weights are always overwritten)."""
        if self._model is None:
            self._model = self.model_factory()
        return self._model

    def model_from(self, weights: dict[str, torch.Tensor]) -> nn.Module:
        """The workspace model loaded with ``weights`` (a state dict)."""
        model = self.workspace_model()
        load_weights(model, weights)
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

    def central_model(self, message: Message) -> nn.Module:
        """The server model in ``message`` (the strategy's :meth:`~Strategy.novel_request`), built without any
        client's data: what central evaluation scores (:mod:`privfl.evaluation.central`) for a method whose
        registration declares one (``MethodSpec.central_eval``). By default the weights in it; a method whose novel
        clients adapt the model to their data (TENT, FedTTA) gives the model before adaptation."""
        return self.model_from(message.arrays)


#: The reason a registration gives for a mode it does not declare.
UNDECLARED = "its registration does not declare it"
#: The reason a registration that declares no server model gives for refusing central evaluation.
NO_SERVER_MODEL = "its registration declares no server model"


@dataclass(frozen=True)
class MethodSpec:
    """A registry entry: how to build a method's two halves and parse its hyperparameters, and its privacy contract.

    ``privacy`` maps each mode of :data:`privfl.privacy.training.MODES` to ``None`` (the method runs it) or the
    reason it cannot be made sound (the run is refused with it, before anything is released).
    ``releases_per_round``: how many releases a sampled training client makes in a round (client-level DP splits the
    clip among them; 0 for a method whose training clients send nothing). ``novel_privacy``: ``None`` when the
    method's novel-client release honours :class:`~privfl.privacy.training.NovelPrivacy`, else why there is none
    to protect. ``smoke_settings``: settings for a fast run on a small synthetic federation (the conformance tests
    run every method with them). ``devices``: where its models compute (``"cpu"``, and ``"cuda"`` for a method whose
    client and server keep every tensor they combine on the model's device, :mod:`privfl.devices`).
    ``central_eval``: ``None`` when the method has one server model, the model a new client would get from the
    server before it uses any data of its own (:meth:`Strategy.novel_request` built by
    :meth:`ClientProcedure.central_model`), which central evaluation scores on the central held-out set
    (:mod:`privfl.evaluation.central`); else why it has none (a personalised method: each client's model is made from
    that client's release), and a run with central evaluation is refused with it.
    """

    name: str
    strategy: type[Strategy]
    client: type[ClientProcedure]
    config: type
    description: str
    privacy: Mapping[str, str | None] = field(default_factory=lambda: dict.fromkeys(MODES, UNDECLARED))
    releases_per_round: int = 1
    novel_privacy: str | None = "its novel clients send nothing"
    smoke_settings: Mapping[str, Any] = field(default_factory=dict)
    devices: tuple[str, ...] = ("cpu",)
    central_eval: str | None = NO_SERVER_MODEL

    def make_config(self, **values: Any) -> Any:
        """The method's config from ``values``; unknown names raise :class:`ConfigError` listing the valid ones."""
        fields = {f.name for f in dataclasses.fields(self.config)}
        unknown = sorted(set(values) - fields)
        if unknown:
            raise ConfigError(
                f"method {self.name!r} has no setting {', '.join(unknown)}; valid settings: {', '.join(sorted(fields))}"
            )
        hints = typing.get_type_hints(self.config)
        for name, value in values.items():
            kinds = _value_kinds(hints[name])
            if kinds is not None and not _is_kind(value, kinds):
                raise ConfigError(f"method {self.name!r} setting {name} must be {' or '.join(kinds.values())}, got "
                                  f"{value!r}, {_KIND_NAMES.get(type(value), 'a ' + type(value).__name__)}")
        return self.config(**values)


#: How a value of each type a method config declares is written (``--method-option`` reads its VALUE as JSON).
_KIND_NAMES: dict[type, str] = {str: "a string", bool: "a boolean (true or false)", int: "an integer",
                                float: "a number", dict: "a JSON object", tuple: "a list", list: "a list",
                                type(None): "null"}


def _value_kinds(hint: Any) -> dict[type, str] | None:
    """The Python types a setting annotated ``hint`` accepts, each with how it is written; ``None`` for an annotation
    this check leaves to the config's own (``Any``)."""
    options = typing.get_args(hint) if isinstance(hint, types.UnionType) else (hint,)
    kinds: dict[type, str] = {}
    for option in options:
        origin = typing.get_origin(option) or option
        if origin not in _KIND_NAMES:
            return None
        kinds[origin] = _KIND_NAMES[origin]
    return kinds


def _is_kind(value: Any, kinds: dict[type, str]) -> bool:
    if isinstance(value, bool):                 # a bool is an int to Python, never a number to a config
        return bool in kinds
    if isinstance(value, numbers.Integral) and (int in kinds or float in kinds):
        return True
    if isinstance(value, numbers.Real) and float in kinds:
        return True
    if isinstance(value, list) and tuple in kinds:
        return True
    return isinstance(value, tuple(kinds))


METHODS: Registry[MethodSpec] = Registry("method")


def register_method(name: str, *, strategy: type[Strategy], client: type[ClientProcedure], config: type,
                    description: str, privacy: Mapping[str, str | None] | None = None,
                    releases_per_round: int = 1, novel_privacy: str | None = "its novel clients send nothing",
                    smoke_settings: Mapping[str, Any] | None = None,
                    devices: tuple[str, ...] = ("cpu",), central_eval: str | None = NO_SERVER_MODEL) -> MethodSpec:
    """Add a method to the registry under ``name`` (one call per method module). ``privacy``: each mode of
    :data:`~privfl.privacy.training.MODES` -> ``None`` (supported) or why it is refused; a mode left out is refused
    with :data:`UNDECLARED`. ``central_eval``: ``None`` for a method with one server model, else why it has none
    (:attr:`MethodSpec.central_eval`)."""
    declared = dict(privacy or {})
    unknown = sorted(set(declared) - set(MODES))
    if unknown:
        raise ValueError(f"method {name!r} declares unknown privacy modes {unknown}; valid: {', '.join(MODES)}")
    if not is_int_at_least(releases_per_round, 0):
        raise ValueError(f"releases_per_round must be an integer >= 0, got {releases_per_round!r}")
    spec = MethodSpec(name=name, strategy=strategy, client=client, config=config, description=description,
                      privacy={mode: declared.get(mode, UNDECLARED) for mode in MODES},
                      releases_per_round=releases_per_round, novel_privacy=novel_privacy,
                      smoke_settings=dict(smoke_settings or {}), devices=tuple(devices), central_eval=central_eval)
    return METHODS.register(name, spec)


def supported_modes(**refused: str) -> dict[str, str | None]:
    """The ``privacy`` of :func:`register_method` for a method that runs every mode of
    :data:`~privfl.privacy.training.MODES` but those named, each given with why it is refused:
    ``supported_modes(distributed="its server needs each client's own update")``."""
    unknown = sorted(set(refused) - set(MODES))
    if unknown:
        raise ValueError(f"unknown privacy modes {unknown}; valid: {', '.join(MODES)}")
    return {mode: refused.get(mode) for mode in MODES}


def get_method(name: str) -> MethodSpec:
    """The registered method ``name``; an unknown name raises :class:`ConfigError` listing the valid ones."""
    return METHODS.lookup(name)


def compose(*events: PrivacyEvent | None) -> PrivacyEvent | None:
    """The events of one release composed (``None`` where there is none: a release made without DP)."""
    present = [e for e in events if e is not None]
    if len(present) != len(events):
        if present:
            raise ConfigError("a release made partly with DP and partly without has no guarantee; make every part "
                              "of it private, or none")
        return None
    return present[0] if len(present) == 1 else ComposedEvent(tuple(present))


def private_release(message: Message, purpose: str, *events: PrivacyEvent | None,
                    metadata: Mapping[str, Any] | None = None) -> Release:
    """A release of ``message`` made by the mechanisms whose ``events`` are given (all ``None``: made without DP,
    recorded with epsilon = infinity)."""
    event = compose(*events)
    if event is None:
        return Release.non_private(message, purpose)
    return Release(message, purpose=purpose, event=event, metadata=dict(metadata or {}))
