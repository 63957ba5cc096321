"""Local minibatch SGD on one client, shared by every method that trains on clients.

Minibatches are drawn epoch by epoch without replacement (a fresh permutation each pass, as a shuffled DataLoader
does) from the client's in-memory tensors, with the order taken from the client's keyed generator.
"""

from __future__ import annotations

import weakref
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
    device = device_of(model)
    step = SGDStep(list(params.values()), lr=lr, weight_decay=weight_decay, momentum=momentum)
    on_device = device.type == "cpu" and x.device == device and y.device == device
    total = 0.0
    for index in minibatches(len(y), batch_size, steps, rng):
        batch = torch.from_numpy(index)
        # index_select: the rows x[batch] gives, without advanced indexing's parsing of its index
        xb, yb = (x.index_select(0, batch), y.index_select(0, batch)) if on_device else \
            (x[batch].to(device), y[batch].to(device))
        loss = nn.functional.cross_entropy(model(xb), yb)
        total += loss.item()
        if extra_loss is not None:
            loss = loss + extra_loss(params)
        step.zero_grad()
        loss.backward()
        if grad_clip > 0:
            torch.nn.utils.clip_grad_norm_(params.values(), grad_clip)
        step.step()
    return total / steps


class SGDStep:
    """torch's SGD (no dampening, no Nesterov) as a few tensor operations: on the CPU the very operations of
    ``torch.optim.SGD``'s single-tensor path, which torch takes for CPU parameters (the same numbers bit for bit),
    without the optimiser's per-step bookkeeping (parameter groups, profiler ranges, state dicts), about a tenth of
    a small model's step; elsewhere ``torch.optim.SGD`` itself."""

    def __init__(self, params: list[nn.Parameter], *, lr: float, weight_decay: float = 0.0,
                 momentum: float = 0.0) -> None:
        self.params = params
        self.lr, self.weight_decay, self.momentum = float(lr), float(weight_decay), float(momentum)
        plain = all(type(p) is nn.Parameter and p.device.type == "cpu" and not p.is_sparse for p in params)
        self.optimizer = None if plain else torch.optim.SGD(params, lr=lr, weight_decay=weight_decay,
                                                            momentum=momentum)
        self.buffers: list[torch.Tensor | None] = [None] * len(params)

    def zero_grad(self) -> None:
        if self.optimizer is not None:
            self.optimizer.zero_grad(set_to_none=True)
            return
        for p in self.params:
            p.grad = None

    @torch.no_grad()
    def step(self) -> None:
        if self.optimizer is not None:
            self.optimizer.step()
            return
        for i, param in enumerate(self.params):
            grad = param.grad
            if grad is None:
                continue
            if self.weight_decay != 0:
                grad = grad.add(param, alpha=self.weight_decay)
            if self.momentum != 0:
                buf = self.buffers[i]
                if buf is None:
                    buf = self.buffers[i] = grad.detach().clone()
                else:
                    buf.mul_(self.momentum).add_(grad, alpha=1)
                grad = buf
            param.add_(grad, alpha=-self.lr)


def weights_of(model: nn.Module) -> dict[str, torch.Tensor]:
    """A detached copy of the model's state dict on the CPU (what a client keeps or sends, wherever it computes)."""
    return on_cpu(model.state_dict())


def load_weights(model: nn.Module, weights: Mapping[str, torch.Tensor]) -> None:
    """``model.load_state_dict(weights)`` (strict): when ``weights`` holds exactly the model's state by name and shape
    and every module loads as ``nn.Module`` does (no loading hooks, no module of its own loading), each tensor is
    copied into place as ``load_state_dict`` itself copies it, without its per-module bookkeeping (half its time on a
    small model); otherwise ``load_state_dict``."""
    targets = model.state_dict(keep_vars=True)
    if (targets.keys() != weights.keys() or not _plain_loading(model)
            or any(not isinstance(weights[k], torch.Tensor) or weights[k].shape != t.shape
                   for k, t in targets.items())):
        model.load_state_dict(weights)
        return
    with torch.no_grad():
        for k, t in targets.items():
            t.copy_(weights[k])


def _plain_loading(model: nn.Module) -> bool:
    """Whether every module of ``model`` loads a state dict as ``nn.Module`` does (remembered per model: a workspace
    model gets no loading hooks after it is built)."""
    known = _PLAIN.get(model)
    if known is None:
        known = _PLAIN[model] = not model._load_state_dict_post_hooks and all(
            type(m)._load_from_state_dict is nn.Module._load_from_state_dict and not m._load_state_dict_pre_hooks
            for m in model.modules())
    return known


_PLAIN: weakref.WeakKeyDictionary[nn.Module, bool] = weakref.WeakKeyDictionary()


def change_of(model: nn.Module, before: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """``difference(weights_of(model), before)`` without the copy in between: the model's weights minus ``before``
    (its names), computed where ``before`` is (the same numbers: the subtraction of the same tensors)."""
    after = model.state_dict()
    return {k: (after[k].detach() if after[k].device == before[k].device else after[k].detach().to(before[k].device))
            - before[k] for k in before}


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
