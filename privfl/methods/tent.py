"""TENT (Wang et al., ICLR 2021, "Tent: Fully test-time adaptation by entropy minimization") on top of FedAvg.

Training is FedAvg's (same strategy, same client update, DP-SGD option included). At test time a client that holds
only unlabelled inputs adapts the received model on them by entropy minimisation (the normalisation layers' scale
and shift, or every parameter with ``adapt="all"``) and predicts on the same inputs (transductive); nothing goes up.

Entry points: :class:`TentConfig`, :class:`TentStrategy`, :class:`TentClient` (registered as ``tent``) and
:func:`tent_adapt`.

The adaptation steps, the FedTTA paper's settings and models without normalisation layers (cited below as "the
module docstring"): docs/methods/baselines.md, "TENT".
"""

from __future__ import annotations

import copy
import math
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from accounting.validation import is_finite, is_int_at_least
from privfl.data import NovelClient, TrainingClient
from privfl.devices import ANY_DEVICE, device_of
from privfl.errors import ConfigError, check
from privfl.federation.messages import Message
from privfl.methods.base import ClientState, register_method
from privfl.methods.fedavg import FEDAVG_PRIVACY, FedAvgClient, FedAvgConfig, FedAvgStrategy

ADAPT_CHOICES = ("norm", "all")
ENTROPY_UNITS = {"bits": 2.0, "nats": math.e}

#: Layers whose affine (weight, bias) parameters TENT adapts.
NORM_LAYERS = (nn.modules.batchnorm._BatchNorm, nn.LayerNorm, nn.GroupNorm, nn.modules.instancenorm._InstanceNorm)


@dataclass(frozen=True)
class TentConfig(FedAvgConfig):
    """FedAvg's training settings plus the test-time adaptation.

    ``adapt``: ``"norm"`` (normalisation-layer affine parameters, TENT's rule) or ``"all"`` (every parameter, what the
    FedTTA paper did on its normalisation-free models). ``tta_steps``: entropy-minimisation steps (>= 0; 0 serves the
    FedAvg model unchanged). ``tta_lr``: their learning rate; ``None`` reuses ``lr`` (the paper's choice).
    ``tta_batch_size``: ``None`` for one full-data batch per step (the FedTTA code), else each step uses the next
    minibatch of a pass over the data, the pass's short last minibatch included when it holds 2 samples or more
    (batch statistics need two). ``entropy_unit``: ``"bits"`` (log base 2, the FedTTA code) or ``"nats"``.
    """

    adapt: str = "norm"
    tta_steps: int = 1
    tta_lr: float | None = None
    tta_batch_size: int | None = None
    tta_weight_decay: float = 1e-4
    tta_grad_clip: float | None = 10.0
    entropy_unit: str = "bits"

    def __post_init__(self) -> None:
        super().__post_init__()
        check.require(self.adapt in ADAPT_CHOICES, "adapt", self.adapt, f"one of {', '.join(ADAPT_CHOICES)}")
        check.require(is_int_at_least(self.tta_steps, 0), "tta_steps", self.tta_steps,
                      "an integer >= 0")
        check.require(self.tta_lr is None or (is_finite(self.tta_lr) and self.tta_lr > 0), "tta_lr", self.tta_lr,
                      "None (reuse lr) or a finite number > 0")
        check.require(self.tta_batch_size is None or is_int_at_least(self.tta_batch_size, 1),
                      "tta_batch_size", self.tta_batch_size, "None (all data in one batch) or an integer >= 1")
        check.require(is_finite(self.tta_weight_decay) and self.tta_weight_decay >= 0, "tta_weight_decay",
                      self.tta_weight_decay, "a finite number >= 0")
        check.require(self.tta_grad_clip is None or (is_finite(self.tta_grad_clip) and self.tta_grad_clip > 0),
                      "tta_grad_clip", self.tta_grad_clip, "None or a finite number > 0")
        check.require(self.entropy_unit in ENTROPY_UNITS, "entropy_unit", self.entropy_unit,
                      f"one of {', '.join(ENTROPY_UNITS)}")


def prediction_entropy(logits: torch.Tensor, *, base: float = 2.0) -> torch.Tensor:
    """Mean over samples of -sum_k p_k log_base p_k with p = softmax(logits) (TENT Eq. 1); bits for base 2."""
    log_p = torch.log_softmax(logits, dim=1)
    return -(log_p.exp() * log_p).sum(dim=1).mean() / math.log(base)


def normalisation_parameters(model: nn.Module) -> dict[str, nn.Parameter]:
    """The affine parameters (weight and bias, by name) of every normalisation layer in ``model``."""
    found = {}
    for module_name, module in model.named_modules():
        if isinstance(module, NORM_LAYERS):
            for param_name, param in module.named_parameters(recurse=False):
                found[f"{module_name}.{param_name}" if module_name else param_name] = param
    return found


def adapted_parameters(model: nn.Module, adapt: str) -> dict[str, nn.Parameter]:
    """The parameters TENT updates: normalisation affine parameters (``"norm"``) or all (``"all"``).

    Raises:
        ConfigError: ``adapt="norm"`` on a model that has no normalisation layer with affine parameters.
    """
    if adapt == "all":
        return dict(model.named_parameters())
    if adapt != "norm":
        raise ConfigError(f"adapt must be one of {', '.join(ADAPT_CHOICES)}, got {adapt!r}")
    params = normalisation_parameters(model)
    if not params:
        raise ConfigError(
            f"adapt='norm' needs normalisation layers with affine parameters, but {type(model).__name__} has none; "
            "use adapt='all' to adapt every parameter (what the FedTTA paper did for its BatchNorm-free models)")
    return params


def use_test_batch_statistics(model: nn.Module) -> None:
    """Make every batch-norm layer normalise with the current batch's statistics, in train and eval mode (TENT's
    Sec. 3.2); the running statistics are dropped, as TENT does."""
    for module in model.modules():
        if isinstance(module, nn.modules.batchnorm._BatchNorm):
            module.track_running_stats = False
            module.running_mean = None
            module.running_var = None


def tent_adapt(model: nn.Module, x: torch.Tensor, *, adapt: str = "norm", steps: int = 1, lr: float,
               batch_size: int | None = None, weight_decay: float = 0.0, grad_clip: float | None = None,
               entropy_base: float = 2.0) -> nn.Module:
    """Adapt ``model`` in place on unlabelled ``x`` by entropy minimisation (steps 2 and 3 of the module docstring).

    Only the parameters of :func:`adapted_parameters` change; the others are frozen. Returns ``model`` in eval mode.
    """
    params = adapted_parameters(model, adapt)
    x = x.to(device_of(model))        # the inputs go where the model computes
    if adapt == "norm":
        if len(x) < 2 and any(isinstance(m, nn.modules.batchnorm._BatchNorm) for m in model.modules()):
            raise ConfigError(f"TENT with adapt='norm' normalises with each batch's own statistics, which need at "
                              f"least 2 samples, but the client has {len(x)}; give clients more data (for training "
                              "clients' validation: a larger val_fraction) or use adapt='all' on a model without "
                              "batch norm")
        use_test_batch_statistics(model)
    model.requires_grad_(False)
    for p in params.values():
        p.requires_grad_(True)
    optimizer = torch.optim.SGD(list(params.values()), lr=lr, weight_decay=weight_decay)
    model.eval()   # dropout off; batch norm still uses batch statistics (running statistics are gone)
    size = len(x) if batch_size is None else min(batch_size, len(x))
    position = 0
    for _ in range(steps):
        # passes over the data in minibatches; a pass's short last minibatch is used when it has 2 samples or more
        # (batch statistics need two), and the next step starts a new pass
        if len(x) - position < min(2, size):
            position = 0
        batch = x[position:position + size]
        loss = prediction_entropy(model(batch), base=entropy_base)
        position += len(batch)
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        if grad_clip is not None:
            torch.nn.utils.clip_grad_norm_(list(params.values()), grad_clip)
        optimizer.step()
    model.requires_grad_(True)
    return model


class TentStrategy(FedAvgStrategy):
    """FedAvg's server; refuses ``adapt="norm"`` up front when the target network has no normalisation layer."""

    def __init__(self, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        adapted_parameters(self.model_factory(), self.config.adapt)


class TentClient(FedAvgClient):
    """FedAvg's client; builds its test-time model by TENT adaptation on its own unlabelled inputs."""

    def adapted_model(self, weights: dict[str, torch.Tensor], x: torch.Tensor) -> nn.Module:
        """A fresh copy of the target with ``weights``, adapted on ``x`` (the workspace model is left untouched)."""
        model = copy.deepcopy(self.model_from(weights))
        if len(x) == 0 or self.config.tta_steps == 0:
            return model.eval()
        config = self.config
        return tent_adapt(model, x, adapt=config.adapt, steps=config.tta_steps,
                          lr=config.lr if config.tta_lr is None else config.tta_lr,
                          batch_size=config.tta_batch_size, weight_decay=config.tta_weight_decay,
                          grad_clip=config.tta_grad_clip, entropy_base=ENTROPY_UNITS[config.entropy_unit])

    def evaluation_model(self, data: TrainingClient, message: Message, state: ClientState) -> nn.Module:
        return self.adapted_model(message.arrays, data.x_val)

    def novel_model(self, novel: NovelClient, message: Message) -> nn.Module:
        return self.adapted_model(message.arrays, novel.x)


register_method(
    "tent", strategy=TentStrategy, client=TentClient, config=TentConfig,
    description="TENT: FedAvg training; a new client minimises its prediction entropy on its unlabelled data "
                "(normalisation affine parameters, or all parameters with adapt='all'); it sends nothing",
    privacy=FEDAVG_PRIVACY, smoke_settings={"adapt": "all"}, devices=ANY_DEVICE,
    central_eval=None,
)
