"""Baselines beside FedPFT on the same frozen features: centralized, local heads, their one-shot ensemble, and FedAvg
of the head (the registered ``fedavg`` method driven with :class:`~privfl.methods.fedpft.HeadFactory`).

All of them train the same :class:`~privfl.methods.fedpft.FeatureHead` with the same optimiser and settings as
FedPFT's server (:func:`~privfl.methods.fedpft.train_head`), on the training clients' train splits. None of them is
private: centralized sends raw features; local heads and the ensemble send a head trained on raw data; their
communication is reported, not recorded in a ledger (they are experimenter-side references, not methods of a run).

Bytes (per the paper's conventions, digest section 9): raw features in float16 (``n * d * 2``, labels not counted);
a head in float32 (``4 * (C d + C)``), which is what ``fedavg`` puts on the wire.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import numpy as np
import torch
from torch import nn

from privfl.data import FederatedDataset
from privfl.federation.runtime import InProcessRuntime
from privfl.federation.seeding import derive_rng
from privfl.methods.base import get_method
from privfl.methods.fedpft import FeatureHead, HeadFactory, train_head

__all__ = ["FeatureHead", "MaxProbabilityEnsemble", "accuracy", "centralized_head", "fedavg_head_curve", "head_bytes",
           "local_heads", "mean_local_accuracy", "pooled_train"]


def pooled_train(federation: FederatedDataset) -> tuple[torch.Tensor, torch.Tensor]:
    """All training clients' train splits, concatenated (the centralized oracle's data)."""
    clients = federation.training_clients
    return torch.cat([c.x_train for c in clients]), torch.cat([c.y_train for c in clients])


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


class MaxProbabilityEnsemble(nn.Module):
    """The paper's one-shot ensemble: for each input, the class with the highest softmax probability over all heads.

    ``forward`` returns ``log`` of the per-class maximum probability, so ``argmax`` is the ensemble's prediction.
    """

    def __init__(self, heads: list[nn.Module]) -> None:
        super().__init__()
        self.heads = nn.ModuleList(heads)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        probabilities = torch.stack([torch.softmax(head(x), dim=1) for head in self.heads])
        return probabilities.max(dim=0).values.clamp_min(1e-30).log()


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
    from privfl.evaluation.metrics import score_model

    return 100.0 * score_model(model, torch.as_tensor(x, dtype=torch.float32), torch.as_tensor(y)).accuracy


def mean_local_accuracy(heads: dict[int, nn.Module], x: torch.Tensor, y: torch.Tensor) -> float:
    """Mean over clients of each local head's accuracy (%) on ``(x, y)``."""
    return float(np.mean([accuracy(head, x, y) for head in heads.values()]))

