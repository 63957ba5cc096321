"""What a run is: the :class:`RunConfig` (written to ``config.json``) and the method objects it builds.

This module sits at the level of the methods (it imports data, models and methods, nothing that runs rounds), so every
engine builds a run's strategy and client procedure here: the in-process runtime (:mod:`privfl.experiment`), each
Flower node and the Flower server (:mod:`privfl.federation.flower`), the sweep and the benchmarks.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from privfl.data import FederatedDataset, FederationSpec
from privfl.errors import ConfigError
from privfl.federation.runtime import sample_clients
from privfl.methods import ClientProcedure, ModelFactory, Strategy, get_method

SELECTIONS = ("best_val", "last")


@dataclass(frozen=True)
class RunConfig:
    """Everything that determines a run's numbers (written to ``config.json``).

    ``method_config`` holds the method's own settings (``lr``, ``local_steps``, ``batch_size``, ``mu``, ...); names
    the method does not have are refused. ``model="auto"`` picks LeNet for 3-channel images and the 2NN otherwise.
    ``select="best_val"`` serves novel clients with the server state of the evaluation round with the best mean
    validation accuracy over training clients (each report is a recorded release); ``"last"`` uses the final round.
    ``delta`` is the delta at which epsilon is reported.
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

    def __post_init__(self) -> None:
        method_config = get_method(self.method).make_config(**self.method_config)
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
        ]
        for name, value, ok, valid in checks:
            if not ok:
                raise ConfigError(f"{name} must be {valid}, got {value!r}")
        private = getattr(method_config, "training_dp", None)   # what protects training clients' releases, if any
        if private and self.select == "best_val":
            raise ConfigError(f"select='best_val' with {private}: choosing the round on validation makes every "
                              "training client report its validation accuracy, a release no mechanism covers, so "
                              "its epsilon would be infinite; use select='last'")
        if self.select == "best_val" and self.federation.val_fraction == 0:
            raise ConfigError("select='best_val' picks the round on training clients' validation splits, but "
                              "val_fraction=0 gives them none; use select='last' or a val_fraction > 0")

    def to_dict(self) -> dict[str, Any]:
        values = dataclasses.asdict(self)
        values["federation"] = self.federation.to_dict()
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


def model_factory(config: RunConfig, input_shape: tuple[int, ...], num_classes: int) -> ModelFactory:
    return ModelFactory(model_name_for(config, input_shape), tuple(input_shape), num_classes)


def build_client(config: RunConfig, input_shape: tuple[int, ...], num_classes: int) -> ClientProcedure:
    """The method's client procedure (what a Flower node builds; the in-process runtime gets it from
    :func:`build_method`)."""
    spec = get_method(config.method)
    return spec.client(model_factory=model_factory(config, input_shape, num_classes), config=config.method_settings())


def build_method(config: RunConfig, federation: FederatedDataset) -> tuple[Strategy, ClientProcedure]:
    """The method's server strategy and client procedure for ``federation``, after the run-level checks that can
    refuse it before anything is released (:func:`check_participations`, :func:`check_shares`)."""
    spec = get_method(config.method)
    method_config = config.method_settings()
    factory = model_factory(config, federation.input_shape, federation.num_classes)
    strategy = spec.strategy(model_factory=factory, config=method_config, seed=config.seed,
                             num_training_clients=len(federation.training_clients))
    client = spec.client(model_factory=factory, config=method_config)
    training_ids = [c.client_id for c in federation.training_clients]
    check_participations(config, getattr(method_config, "participation_cap", None), training_ids)
    check_shares(config, getattr(method_config, "shares_per_round", None), training_ids)
    return strategy, client


def check_shares(config: RunConfig, shares: int | None, client_ids: list[int]) -> None:
    """Refuse distributed noise with more shares than a round samples clients (their sum would be short of noise)."""
    per_round = len(sample_clients(sorted(client_ids), config.client_fraction, seed=config.seed, round=0))
    if shares is not None and shares > per_round:
        raise ConfigError(f"dp_shares={shares} noise shares make up each round's sum, but a round samples "
                          f"{per_round} training clients: their sum would carry less noise than its calibration; set "
                          f"dp_shares to at most {per_round}")


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
                          f"dp_participations={cap} (the releases each client's noise is calibrated for); set "
                          f"dp_participations to {most} or more, or run fewer rounds")
    raise ConfigError(f"this run cannot be resumed within its privacy budget: its checkpoint holds {from_round} "
                      f"rounds, but its clients' ledgers (releases.jsonl) also hold the releases of the rounds run "
                      f"after it, and running those rounds again releases again; training clients {over} would make "
                      f"up to {most} releases, more than dp_participations={cap}. Releases made cannot be taken "
                      "back: start the run again, with checkpoint_every=1 (an interruption then costs the round in "
                      "progress) and a dp_participations that leaves room for the rounds an interruption repeats")
