"""What a run is: the :class:`RunConfig` (written to ``config.json``) and the method objects it builds.

This module sits at the level of the methods (it imports data, models and methods, nothing that runs rounds), so every
engine builds a run's strategy and client procedure here: the in-process runtime (:mod:`privfl.experiment`), each
Flower node and the Flower server (:mod:`privfl.engines.flower`), the sweep and the benchmarks.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from privfl.data import FederatedDataset, FederationSpec, build_federation
from privfl.devices import check_device, resolve_device
from privfl.errors import ConfigError
from privfl.federation.runtime import sample_clients
from privfl.methods import METHODS, ClientProcedure, MethodConfig, ModelFactory, Strategy, get_method
from privfl.modes.plan import Plan, plan
from privfl.modes.wrappers import planned_participations, protect, support
from privfl.privacy.training import DISTRIBUTED, LOCAL, NovelPrivacy, TrainingPrivacy

SELECTIONS = ("best_val", "last")


@dataclass(frozen=True)
class RunConfig:
    """Everything that determines a run's numbers (written to ``config.json``).

    ``method_config`` holds the method's own settings (``lr``, ``local_steps``, ``batch_size``, ``mu``, ...); names
    the method does not have are refused. ``model="auto"`` picks LeNet for 3-channel images and the 2NN otherwise.
    ``select="best_val"`` serves novel clients with the server state of the evaluation round with the best mean
    validation accuracy over training clients (each report is a recorded release); ``"last"`` uses the final round.
    ``delta`` is the delta at which epsilon is reported. ``privacy`` protects the training clients (one mode for
    every method, :class:`~privfl.privacy.training.TrainingPrivacy`); ``novel_privacy`` the novel clients' release,
    for methods whose novel clients send one (:class:`~privfl.privacy.training.NovelPrivacy`). In central
    client-level DP, ``client_fraction`` is the Poisson sampling rate q.

    ``workers`` is how many processes train a round's clients on the in-process engine (1: one after another in
    this process); with more, torch must run on one thread (``torch.set_num_threads(1)``, ``--threads 1``) and the
    numbers are those of the one-thread run with ``workers=1`` (:mod:`privfl.federation.workers`).

    ``device`` is where the models compute (:mod:`privfl.devices`): ``"cpu"`` (the default), ``"cuda"`` (refused
    where torch finds no CUDA device, or for a method that runs on the CPU only, or with ``workers > 1``), or
    ``"auto"``: CUDA where present and the method runs there with one worker, else the CPU (:func:`run_device`).

    ``features`` names a frozen feature stage in front of the method's networks (:mod:`privfl.models.features`:
    ``"scatter"``, ``"mobilenet_v2"``; ``None``: the raw inputs), with ``features_options``; the target network is
    then a head on features (``model="linear"`` or ``"feature_mlp"``).

    ``central_eval`` scores the server model on the central held-out set, the novel clients' samples with their
    hidden labels, at every evaluation round (:mod:`privfl.evaluation.central`: which model, which set, and why it
    is no release); a method without one server model, or ``split="client_test"``, is refused.

    ``delta`` must be the delta of ``privacy`` and of ``novel_privacy`` where they are private (each epsilon is
    reported at the delta its noise is calibrated for). A delta at least one over what a guarantee protects (the
    records of the smallest training client at record level, the training clients at client level, the records of
    the smallest novel client) is refused before the run starts unless ``allow_large_delta``
    (:func:`~privfl.privacy.training.delta_meaning` says why).
    """

    federation: FederationSpec = field(default_factory=FederationSpec)
    method: str = "fedavg"
    method_config: dict[str, Any] = field(default_factory=dict)
    model: str = "auto"
    rounds: int = 200
    client_fraction: float = 1.0
    eval_every: int = 10
    checkpoint_every: int = 10
    select: str = "best_val"
    seed: int = 0
    delta: float = 1e-5
    privacy: TrainingPrivacy = field(default_factory=TrainingPrivacy)
    novel_privacy: NovelPrivacy = field(default_factory=NovelPrivacy)
    workers: int = 1
    device: str = "cpu"
    features: str | None = None
    features_options: dict[str, Any] = field(default_factory=dict)
    allow_large_delta: bool = False
    central_eval: bool = False

    def __post_init__(self) -> None:
        spec = get_method(self.method)
        method_config = spec.make_config(**self.method_config)
        for name, kind in (("privacy", TrainingPrivacy), ("novel_privacy", NovelPrivacy)):
            value = getattr(self, name)
            if isinstance(value, dict):
                object.__setattr__(self, name, kind.from_dict(value))
            elif not isinstance(value, kind):
                raise ConfigError(f"{name} must be a {kind.__name__} (or a dict of its settings), got {value!r}")
        checks = [
            ("rounds", self.rounds, isinstance(self.rounds, int) and self.rounds >= 1, "an integer >= 1"),
            ("client_fraction", self.client_fraction,
             isinstance(self.client_fraction, (int, float)) and 0 < self.client_fraction <= 1, "in (0, 1]"),
            ("eval_every", self.eval_every, isinstance(self.eval_every, int) and self.eval_every >= 1,
             "an integer >= 1"),
            ("checkpoint_every", self.checkpoint_every,
             isinstance(self.checkpoint_every, int) and self.checkpoint_every >= 1, "an integer >= 1"),
            ("select", self.select, self.select in SELECTIONS, f"one of {', '.join(SELECTIONS)}"),
            ("seed", self.seed, isinstance(self.seed, int) and self.seed >= 0, "an integer >= 0"),
            ("delta", self.delta, isinstance(self.delta, float) and 0 < self.delta < 1, "a probability in (0, 1)"),
            ("workers", self.workers, isinstance(self.workers, int) and not isinstance(self.workers, bool)
             and self.workers >= 1, "an integer >= 1 (processes that train a round's clients)"),
            ("allow_large_delta", self.allow_large_delta, isinstance(self.allow_large_delta, bool), "True or False"),
            ("central_eval", self.central_eval, isinstance(self.central_eval, bool), "True or False"),
        ]
        for name, value, ok, valid in checks:
            if not ok:
                raise ConfigError(f"{name} must be {valid}, got {value!r}")
        check_device(self.device)
        if self.features is not None:
            from privfl.models.features import STAGES

            if self.features not in STAGES:
                raise ConfigError(f"features must be None (the raw inputs) or one of {', '.join(STAGES)}, got "
                                  f"{self.features!r}")
        if not isinstance(self.features_options, Mapping) or (self.features_options and self.features is None):
            raise ConfigError(f"features_options {self.features_options!r} need a feature stage (features); without "
                              "one there is nothing to set")
        for name, setting in (("privacy", self.privacy), ("novel_privacy", self.novel_privacy)):
            if setting.private and setting.delta != self.delta:
                raise ConfigError(f"delta={self.delta!r} (the delta every epsilon of the run is reported at) differs "
                                  f"from {name} delta={setting.delta!r} (the delta its noise is calibrated for): the "
                                  f"summary would state another guarantee than the one the noise gives (at a large "
                                  f"delta it reads epsilon 0); give both the same delta")
        if self.device == "cuda" and self.workers > 1:
            raise ConfigError(f"device 'cuda' with workers={self.workers}: worker processes train on the CPU; use "
                              "workers=1 on CUDA, or device 'cpu'")
        support(spec, self.privacy.mode)
        if self.central_eval and spec.central_eval is not None:
            raise ConfigError(f"central_eval: method {self.method!r} has no server model to evaluate centrally: "
                              f"{spec.central_eval}")
        if self.central_eval and self.federation.split == "client_test":
            raise ConfigError("central_eval scores the server model on the novel clients' samples, and "
                              "split='client_test' has none (its test split is the training clients' validation "
                              "splits); use split='train_test' or 'merged'")
        if isinstance(method_config, MethodConfig):
            method_config.check_privacy(self.privacy, self.novel_privacy)
        if self.novel_privacy.private and spec.novel_privacy is not None:
            raise ConfigError(f"novel_privacy epsilon={self.novel_privacy.epsilon!r} has nothing to protect in method "
                              f"{self.method!r}: {spec.novel_privacy}")
        if self.novel_privacy.private and not spec.client.serves_novel_clients:
            raise ConfigError(f"novel_privacy epsilon={self.novel_privacy.epsilon!r} would go unused: a run of method "
                              f"{self.method!r} serves no novel client (its procedure says why: "
                              f"{spec.client.__module__}.{spec.client.__name__}); leave it unset, and set it where "
                              "the novel clients are served")
        if self.privacy.private and self.select == "best_val":
            raise ConfigError(f"select='best_val' with {self.privacy.describe()}: choosing the round on validation "
                              "makes every training client report its validation accuracy, a release no mechanism "
                              "covers, so its epsilon would be infinite; use select='last'")
        if self.select == "best_val" and self.federation.val_fraction == 0:
            raise ConfigError("select='best_val' picks the round on training clients' validation splits, but "
                              "val_fraction=0 gives them none; use select='last' or a val_fraction > 0")

    def to_dict(self) -> dict[str, Any]:
        values = dataclasses.asdict(self)
        values["federation"] = self.federation.to_dict()
        values["privacy"] = self.privacy.to_dict()
        values["novel_privacy"] = self.novel_privacy.to_dict()
        return values

    @classmethod
    def from_dict(cls, values: dict[str, Any]) -> RunConfig:
        """The inverse of :meth:`to_dict`; missing keys take their defaults, unknown keys raise ConfigError."""
        values = dict(values)
        names = [f.name for f in dataclasses.fields(cls)]
        unknown = sorted(set(values) - set(names))
        if unknown:
            raise ConfigError(f"unknown run setting(s) {', '.join(unknown)}; valid settings: {', '.join(names)}")
        values["federation"] = FederationSpec.from_dict(values.get("federation", {}))
        values["privacy"] = TrainingPrivacy.from_dict(values.get("privacy"))
        values["novel_privacy"] = NovelPrivacy.from_dict(values.get("novel_privacy"))
        return cls(**values)

    def method_settings(self) -> Any:
        """The method's config object (its dataclass, validated)."""
        return get_method(self.method).make_config(**self.method_config)


def model_name_for(config: RunConfig, input_shape: tuple[int, ...]) -> str:
    """The target network's name: ``config.model``, or for ``"auto"`` LeNet on 3-channel images, the 2NN otherwise."""
    if config.model != "auto":
        return config.model
    shape = tuple(input_shape)
    return "lenet" if len(shape) == 3 and shape[0] == 3 else "mlp2nn"


def run_device(config: RunConfig) -> str:
    """Where ``config``'s models compute here, ``"cpu"`` or ``"cuda"`` (:func:`privfl.devices.resolve_device`):
    ``"auto"`` takes CUDA only for a method registered to run there and one worker; ``"cuda"`` for a method that runs
    on the CPU only is refused by name."""
    spec = get_method(config.method)
    device = resolve_device(config.device, runs_on=spec.devices if config.workers == 1 else ("cpu",))
    if device not in spec.devices:
        runs = ", ".join(name for name, other in sorted(METHODS.items()) if device in other.devices)
        raise ConfigError(f"method {config.method!r} runs on the CPU only, not on device {config.device!r} (device "
                          f"'cuda' runs {runs}); use device 'cpu' or 'auto'")
    return device


def run_federation(config: RunConfig, *, progress: bool = False) -> FederatedDataset:
    """The run's federation: built from ``config.federation`` and the run seed, then mapped through the frozen
    feature stage ``config.features`` where one is named (cached on disk: each input is transformed once)."""
    federation = build_federation(config.federation, seed=config.seed)
    if config.features is None:
        return federation
    from privfl.models.features import featurize

    return featurize(federation, config.features, dict(config.features_options), progress=progress)


def model_factory(config: RunConfig, input_shape: tuple[int, ...], num_classes: int) -> ModelFactory:
    return ModelFactory(model_name_for(config, input_shape), tuple(input_shape), num_classes,
                        device=run_device(config))


def participations(config: RunConfig, num_training_clients: int) -> int:
    """The most rounds a training client releases in: the client-level ``participations`` cap where one is set, else
    the most the run's public sampling schedule gives any client (what record-level noise is calibrated for)."""
    return config.privacy.participations or planned_participations(num_training_clients, config.client_fraction,
                                                                   config.seed, config.rounds)


def _client(config: RunConfig, factory: ModelFactory, num_training_clients: int) -> ClientProcedure:
    return get_method(config.method).client(
        model_factory=factory, config=config.method_settings(), privacy=config.privacy,
        novel_privacy=config.novel_privacy, participations=participations(config, num_training_clients))


def run_plan(config: RunConfig, federation: FederatedDataset) -> Plan:
    """What the run's releases will spend (:func:`privfl.modes.plan.plan`), before any is made: the noise is
    calibrated and the schedule priced here, and a run the accountant cannot price is refused."""
    n = len(federation.training_clients)
    client = build_client(config, federation.input_shape, federation.num_classes, n)
    return plan(get_method(config.method), client, config.privacy, config.novel_privacy, delta=config.delta,
                rounds=config.rounds, client_fraction=config.client_fraction, seed=config.seed,
                num_training_clients=n)


def build_client(config: RunConfig, input_shape: tuple[int, ...], num_classes: int,
                 num_training_clients: int) -> ClientProcedure:
    """The method's client procedure under the run's privacy layer (what a Flower node builds; the in-process
    runtime gets it from :func:`build_method`)."""
    client = _client(config, model_factory(config, input_shape, num_classes), num_training_clients)
    return _protect(config, None, client, num_training_clients)[1]


def build_method(config: RunConfig, federation: FederatedDataset) -> tuple[Strategy, ClientProcedure]:
    """The method's server strategy and client procedure for ``federation`` under the run's privacy layer
    (:func:`privfl.modes.wrappers.protect`), after the run-level checks that can refuse it before anything is
    released."""
    spec = get_method(config.method)
    factory = model_factory(config, federation.input_shape, federation.num_classes)
    num_training = len(federation.training_clients)
    strategy = spec.strategy(model_factory=factory, config=config.method_settings(), seed=config.seed,
                             num_training_clients=num_training)
    client = _client(config, factory, num_training)
    if config.privacy.mode in (LOCAL, DISTRIBUTED) and config.privacy.participations is not None:
        check_participations(config, config.privacy.participations, [c.client_id for c in federation.training_clients])
    protected, client = _protect(config, strategy, client, num_training)
    assert protected is not None   # protect wraps the strategy it is given
    return protected, client


def _protect(config: RunConfig, strategy: Strategy | None, client: ClientProcedure,
             num_training_clients: int) -> tuple[Strategy | None, ClientProcedure]:
    return protect(get_method(config.method), strategy, client, config.privacy, rounds=config.rounds,
                   client_fraction=config.client_fraction, seed=config.seed,
                   num_training_clients=num_training_clients)


def check_participations(config: RunConfig, cap: int | None, client_ids: list[int], *, from_round: int = 0,
                         made: Mapping[int, int] | None = None) -> None:
    """Refuse a run whose client sampling would have a training client release more than ``cap`` times.

    The schedule is public (seeded by the run seed), so it is checked before anything runs, rather than ending the
    run at the round where a client's ledger refuses its release over the budget its noise was calibrated for. A
    resumed run passes ``from_round`` (the rounds its checkpoint holds) and ``made`` (each client's private releases
    in its ledger, those made after the checkpoint included: re-running their rounds releases again).
    """
    if cap is None:
        return
    counts = {cid: (made or {}).get(cid, 0) for cid in client_ids}
    for round_index in range(from_round, config.rounds):
        for cid in sample_clients(sorted(client_ids), config.client_fraction, seed=config.seed, round=round_index):
            counts[cid] += 1
    most = max(counts.values(), default=0)
    if most <= cap:
        return
    over = sorted(cid for cid, n in counts.items() if n > cap)
    if from_round == 0 and not made:
        raise ConfigError(f"with rounds={config.rounds}, client_fraction={config.client_fraction} and seed="
                          f"{config.seed}, training clients {over} take part in up to {most} rounds, more than "
                          f"privacy participations={cap} (the releases each client's noise is calibrated for); set "
                          f"participations to {most} or more (or leave it unset), or run fewer rounds")
    raise ConfigError(f"this run cannot be resumed within its privacy budget: its checkpoint holds {from_round} "
                      f"rounds, but its clients' ledgers (releases.jsonl) also hold the releases of the rounds run "
                      f"after it, and running those rounds again releases again; training clients {over} would make "
                      f"up to {most} rounds of releases, more than the {cap} its noise is calibrated for. Releases "
                      "made cannot be taken back: start the run again, with checkpoint_every=1 (an interruption then "
                      "costs the round in progress) and a privacy participations that leaves room for the rounds an "
                      "interruption repeats")
