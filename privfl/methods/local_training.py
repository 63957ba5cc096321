"""Local minibatch SGD on one client, shared by every method that trains on clients.

Minibatches are drawn epoch by epoch without replacement (a fresh permutation each pass, as a shuffled DataLoader
does) from the client's in-memory tensors, with the order taken from the client's keyed generator.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Mapping

import numpy as np
import torch
from torch import nn

from privfl.devices import device_of, on_cpu

ExtraLoss = Callable[[Mapping[str, torch.Tensor]], torch.Tensor]


def minibatches(num_samples: int, batch_size: int, steps: int, rng: np.random.Generator) -> Iterator[np.ndarray]:
    """``steps`` index batches of size ``min(batch_size, num_samples)``, epoch-wise without replacement."""
    batch_size = min(batch_size, num_samples)
    order = rng.permutation(num_samples)
    position = 0
    for _ in range(steps):
        if position + batch_size > num_samples:
            order = rng.permutation(num_samples)
            position = 0
        yield order[position:position + batch_size]
        position += batch_size


def local_sgd(
    model: nn.Module,
    x: torch.Tensor,
    y: torch.Tensor,
    *,
    lr: float,
    steps: int,
    batch_size: int,
    rng: np.random.Generator,
    extra_loss: ExtraLoss | None = None,
    weight_decay: float = 0.0,
    grad_clip: float = 0.0,
    momentum: float = 0.0,
) -> float:
    """Run ``steps`` plain SGD steps of cross-entropy (+ ``extra_loss(params)``) on ``(x, y)``; return the mean loss.

    ``weight_decay`` is SGD's L2 coefficient and ``momentum`` its heavy-ball coefficient (torch's SGD: 0 is plain
    SGD, the default; pFedHN's clients use 0.9); ``grad_clip > 0`` rescales each step's whole gradient to at most that
    L2 norm (a stabiliser; it bounds nothing about privacy).

    ``extra_loss`` receives the model's parameters by name; FedProx passes its proximal term and SCAFFOLD its
    control-variate correction (a linear term whose gradient is ``c - c_i``).
    """
    if len(y) == 0:
        raise ValueError("local_sgd needs at least one training sample")
    model.train()
    params = dict(model.named_parameters())
    optimizer = torch.optim.SGD(params.values(), lr=lr, weight_decay=weight_decay, momentum=momentum)
    device = device_of(model)
    total = 0.0
    for index in minibatches(len(y), batch_size, steps, rng):
        batch = torch.from_numpy(index)
        loss = nn.functional.cross_entropy(model(x[batch].to(device)), y[batch].to(device))
        total += loss.item()
        if extra_loss is not None:
            loss = loss + extra_loss(params)
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        if grad_clip > 0:
            torch.nn.utils.clip_grad_norm_(params.values(), grad_clip)
        optimizer.step()
    return total / steps


def weights_of(model: nn.Module) -> dict[str, torch.Tensor]:
    """A detached copy of the model's state dict on the CPU (what a client keeps or sends, wherever it computes)."""
    return on_cpu(model.state_dict())


def difference(after: dict[str, torch.Tensor], before: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """``after - before`` tensor by tensor (a weight change, as a client sends it)."""
    return {k: after[k] - before[k] for k in before}


def sgd_settings(config: dict) -> dict:
    """The keyword arguments of :func:`local_sgd` from a round's message config.

    ``momentum`` is included only when the config carries it (methods that send none get exactly the settings
    they always got).
    """
    settings = {"lr": float(config["lr"]), "steps": int(config["local_steps"]),
                "batch_size": int(config["batch_size"]), "weight_decay": float(config.get("weight_decay", 0.0)),
                "grad_clip": float(config.get("grad_clip", 0.0))}
    if "momentum" in config:
        settings["momentum"] = float(config["momentum"])
    return settings
