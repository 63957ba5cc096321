"""Baselines beside FedPFT on the same frozen features: centralized, local heads, their one-shot ensemble, and FedAvg
of the head (the registered ``fedavg`` method driven with :class:`~privfl.methods.fedpft.HeadFactory`).

All of them train the same :class:`~privfl.methods.fedpft.FeatureHead` with the same optimiser and settings as
FedPFT's server (:func:`~privfl.methods.fedpft.train_head`), on the training clients' train splits. None of them is
private: centralized sends raw features; local heads and the ensemble send a head trained on raw data; their
communication is reported, not recorded in a ledger (they are experimenter-side references, not methods of a run).

Bytes (the conventions the FedPFT paper's Tables 2 and 5 follow, docs/papers.md, FedPFT): raw features in float16
(``n * d * 2``, labels not counted); a head in float32 (``4 * (C d + C)``), which is what ``fedavg`` puts on the
wire.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from typing import Any

import numpy as np
import torch
from torch import nn

from privfl.data import FederatedDataset
from privfl.federation.runtime import InProcessRuntime
from privfl.federation.seeding import derive_rng
from privfl.methods.base import get_method
from privfl.methods.fedavg import FedAvgStrategy
from privfl.methods.fedpft import FeatureHead, HeadFactory, train_head

__all__ = ["FeatureHead", "MaxProbabilityEnsemble", "accuracy", "centralized_head", "fedavg_head_curve", "head_bytes",
           "local_heads", "log_odds", "mean_local_accuracy", "pooled_train", "pooled_validation",
           "select_on_validation"]


def pooled_train(federation: FederatedDataset) -> tuple[torch.Tensor, torch.Tensor]:
    """All training clients' train splits, concatenated (the centralized oracle's data)."""
    clients = federation.training_clients
    return torch.cat([c.x_train for c in clients]), torch.cat([c.y_train for c in clients])


def pooled_validation(federation: FederatedDataset) -> tuple[torch.Tensor, torch.Tensor]:
    """All training clients' validation splits, concatenated: where hyperparameters are chosen (never test data).

    Raises ConfigError when the federation has no validation data (``val_fraction=0``)."""
    from privfl.errors import ConfigError

    clients = federation.training_clients
    x, y = torch.cat([c.x_val for c in clients]), torch.cat([c.y_val for c in clients])
    if len(y) == 0:
        raise ConfigError("the training clients have no validation splits (val_fraction=0): hyperparameters must be "
                          "chosen on validation data, not on test data; build the federation with val_fraction > 0")
    return x, y


def select_on_validation(candidates: Sequence[Any], fit: Callable[[Any], Any],
                         score: Callable[[Any], float]) -> tuple[Any, Any, dict[str, float]]:
    """Fit one model per candidate setting and keep the one whose ``score`` (a validation accuracy) is highest.

    Returns ``(best candidate, its model, {str(candidate): validation score})``; ties go to the earlier candidate.

    >>> select_on_validation([1, 3, 2], fit=lambda c: c * 10, score=lambda m: -abs(m - 25))
    (3, 30, {'1': -15, '3': -5, '2': -5})
    """
    if not candidates:
        raise ValueError("select_on_validation needs at least one candidate")
    best, scores = None, {}
    for candidate in candidates:
        model = fit(candidate)
        scores[str(candidate)] = value = score(model)
        if best is None or value > best[2]:
            best = (candidate, model, value)
    assert best is not None   # candidates is not empty
    return best[0], best[1], scores


def head_bytes(dim: int, num_classes: int, *, bytes_per_float: int = 4) -> int:
    """Bytes of a linear head ``C d + C`` (float32 by default)."""
    return bytes_per_float * (num_classes * dim + num_classes)


def _factory(federation: FederatedDataset, normalize: bool) -> HeadFactory:
    return HeadFactory("linear", tuple(federation.input_shape), federation.num_classes, normalize=normalize)


def centralized_head(federation: FederatedDataset, *, settings: dict[str, Any], seed: int,
                     normalize: bool = True) -> tuple[nn.Module, int]:
    """The oracle: one head on the pooled real features; returns ``(head, bytes)`` with bytes = ``n d 2``."""
    x, y = pooled_train(federation)
    head = _factory(federation, normalize).init(seed)
    train_head(head, x, y, rng=derive_rng(seed, "centralized_head"), **settings)
    return head, int(x.shape[0] * x.shape[1] * 2)


def local_heads(federation: FederatedDataset, *, settings: dict[str, Any], seed: int,
                normalize: bool = True) -> dict[int, nn.Module]:
    """One head per training client, trained on its own train split only (same initial weights for all)."""
    factory = _factory(federation, normalize)
    heads = {}
    for client in federation.training_clients:
        head = factory.init(seed)
        train_head(head, client.x_train, client.y_train, rng=derive_rng(seed, "local_head", client.client_id),
                   **settings)
        heads[client.client_id] = head
    return heads


def log_odds(logits: torch.Tensor) -> torch.Tensor:
    """``log(p_c / (1 - p_c))`` of ``softmax(logits)`` for every class, computed as ``z_c - logsumexp_{i != c} z_i``.

    A strictly increasing function of the probability that never saturates: where float32 softmax rounds two
    confident heads' top probabilities to exactly 1.0 (and their log-softmax to exactly 0.0), their log-odds still
    differ by the difference of their margins.

    >>> log_odds(torch.tensor([[0.0, 0.0]]))
    tensor([[0., 0.]], dtype=torch.float64)
    >>> bool(torch.softmax(torch.tensor([40.0, 0.0]), 0)[0] == torch.softmax(torch.tensor([60.0, 0.0]), 0)[0])
    True
    >>> log_odds(torch.tensor([[40.0, 0.0], [60.0, 0.0]]))[:, 0]
    tensor([40., 60.], dtype=torch.float64)
    """
    z = logits.double()
    num_classes = z.shape[1]
    others = z[:, None, :].expand(-1, num_classes, -1).masked_fill(torch.eye(num_classes, dtype=torch.bool), -math.inf)
    return z - torch.logsumexp(others, dim=2)


class MaxProbabilityEnsemble(nn.Module):
    """The paper's one-shot ensemble: for each input, the class with the highest softmax probability over all heads.

    ``forward`` returns, per class, the maximum over heads of the class's log-odds (:func:`log_odds`), a strictly
    increasing function of its probability, so ``argmax`` is exactly the max-probability prediction, without the ties
    that saturated softmax outputs (exactly 1.0 in float32 for several heads and classes) would resolve by class index.
    """

    def __init__(self, heads: list[nn.Module]) -> None:
        super().__init__()
        self.heads = nn.ModuleList(heads)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.stack([log_odds(head(x)) for head in self.heads]).max(dim=0).values


def fedavg_head_curve(federation: FederatedDataset, *, rounds: int, lr: float, local_steps: int, batch_size: int,
                      seed: int, evaluate: Callable[[nn.Module], float], normalize: bool = True,
                      progress: Callable[[int], None] | None = None) -> list[dict[str, float]]:
    """FedAvg of the linear head (the registered ``fedavg`` method, full participation) for ``rounds`` rounds.

    After every round, ``evaluate(global head)`` is recorded with the cumulative bytes clients sent, as measured on
    the wire (float32 weight changes). Returns one ``{"round", "accuracy", "bytes_up_total"}`` per round.
    """
    spec = get_method("fedavg")
    config = spec.make_config(lr=lr, local_steps=local_steps, batch_size=batch_size)
    factory = _factory(federation, normalize)
    strategy = spec.strategy(model_factory=factory, config=config, seed=seed,
                             num_training_clients=len(federation.training_clients))
    assert isinstance(strategy, FedAvgStrategy)
    client = spec.client(model_factory=factory, config=config)
    runtime = InProcessRuntime(strategy=strategy, client=client, training_clients=federation.training_clients,
                               seed=seed)
    curve = []
    model = factory()
    for round in range(rounds):
        runtime.run_round(round)
        model.load_state_dict(strategy.weights)
        curve.append({"round": round + 1, "accuracy": float(evaluate(model)),
                      "bytes_up_total": float(sum(runtime.wire.bytes_up.values()))})
        if progress is not None:
            progress(round + 1)
    return curve


def accuracy(model: nn.Module, x: torch.Tensor, y: torch.Tensor) -> float:
    """Top-1 accuracy in % (evaluation helper for the benchmark)."""
    from privfl.metrics import score_model

    return 100.0 * score_model(model, torch.as_tensor(x, dtype=torch.float32), torch.as_tensor(y)).accuracy


def mean_local_accuracy(heads: dict[int, nn.Module], x: torch.Tensor, y: torch.Tensor) -> float:
    """Mean over clients of each local head's accuracy (%) on ``(x, y)``."""
    return float(np.mean([accuracy(head, x, y) for head in heads.values()]))

