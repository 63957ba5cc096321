"""FedSR (Nguyen, Torr and Lim, NeurIPS 2022, "FedSR: A Simple and Effective Domain Generalization Method for
Federated Learning"): FedAvg whose local loss makes the representation simple (L2R) and essential (CMI).

The representation is probabilistic, z ~ N(mu(x), diag sigma(x)^2), and the classifier reads z; the local loss adds
an L2 penalty on z and a conditional mutual-information bound to the cross-entropy, and the server averages as FedAvg
does. Every privacy mode runs (record level: the loss is a batch mean of per-record terms, trained by DP-SGD).

Entry points: :class:`FedSRConfig`, :class:`FedSRModel`, :class:`FedSRStrategy`, :class:`FedSRClient` (registered as
``fedsr``); the loss terms :func:`l2_representation`, :func:`conditional_mi_bound` and their per-record forms.

The local step, the coefficients and the compact design choices: docs/methods/baselines.md, "FedSR".
"""

from __future__ import annotations

import functools
import warnings
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch
from torch import nn

from accounting import PrivacyEvent
from accounting.validation import is_finite
from privfl.data import TrainingClient
from privfl.errors import ConfigError, check
from privfl.federation.messages import Message, Release
from privfl.federation.seeding import seeded_init
from privfl.methods.base import ClientContext, ClientProcedure, ClientState, private_release, register_method
from privfl.methods.fedavg import FEDAVG_PRIVACY, FedAvgClient, FedAvgStrategy, ServerStepConfig
from privfl.methods.local_training import difference, minibatches, sgd_settings, weights_of
from privfl.privacy.dp_sgd import GenericPathWarning

L2R_FORMS = ("norm", "squared")


@dataclass(frozen=True)
class FedSRConfig(ServerStepConfig):
    """Local SGD settings plus the regulariser coefficients ``l2r_coeff`` (alpha_L2R), ``cmi_coeff`` (alpha_CMI) and
    the L2R form ``l2r`` (``"norm"``: E||z||, the FedSR code; ``"squared"``: E||z||^2, the paper's Eq. 4)."""

    l2r_coeff: float = 0.01
    cmi_coeff: float = 0.0005
    l2r: str = "norm"

    def __post_init__(self) -> None:
        super().__post_init__()
        check.require(is_finite(self.l2r_coeff) and self.l2r_coeff >= 0, "l2r_coeff", self.l2r_coeff,
                      "a finite number >= 0")
        check.require(is_finite(self.cmi_coeff) and self.cmi_coeff >= 0, "cmi_coeff", self.cmi_coeff,
                      "a finite number >= 0")
        check.require(self.l2r in L2R_FORMS, "l2r", self.l2r, f"one of {', '.join(L2R_FORMS)}")


def classifier_layer(model: nn.Module) -> nn.Linear:
    """The target network's last linear layer (its classifier); its input is the representation."""
    linears = [m for m in model.modules() if isinstance(m, nn.Linear)]
    if not linears:
        raise ConfigError(f"{type(model).__name__} has no linear layer to read a representation before")
    return linears[-1]


def forward_with_representation(model: nn.Module, x: torch.Tensor,
                                transform: Callable[[torch.Tensor], torch.Tensor] | None = None
                                ) -> tuple[torch.Tensor, torch.Tensor]:
    """(h, logits): the classifier's input h and the model's output, with h replaced by ``transform(h)`` if given."""
    captured = {}

    def hook(module: nn.Module, args: tuple) -> tuple | None:
        captured["h"] = args[0]
        return None if transform is None else (transform(args[0]),)

    handle = classifier_layer(model).register_forward_pre_hook(hook)
    try:
        logits = model(x)
    finally:
        handle.remove()
    return captured["h"], logits


def l2_representation(z: torch.Tensor, *, squared: bool = False) -> torch.Tensor:
    """L2R (step 3): the batch mean of ||z_i||_2, or of ||z_i||_2^2 with ``squared``."""
    return record_l2_representation(z, squared=squared).mean()


def record_l2_representation(z: torch.Tensor, *, squared: bool = False) -> torch.Tensor:
    """||z_i||_2 (or its square) of each record, shape (B,)."""
    return (z ** 2).sum(dim=1) if squared else z.norm(dim=1)


def conditional_mi_bound(mu: torch.Tensor, sigma: torch.Tensor, y: torch.Tensor, r_mu: torch.Tensor,
                         r_sigma_raw: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """CMI (step 4): mean_i sum_j KL(N(C mu_ij, (C sigma_ij)^2) || N(r_mu[y_i]_j, softplus(r_sigma_raw)[y_i]_j^2))."""
    return record_conditional_mi_bound(mu, sigma, y, r_mu, r_sigma_raw, scale).mean()


def record_conditional_mi_bound(mu: torch.Tensor, sigma: torch.Tensor, y: torch.Tensor, r_mu: torch.Tensor,
                                r_sigma_raw: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """Record i's term of :func:`conditional_mi_bound` (its KL summed over the d dimensions), shape (B,)."""
    r_sigma = nn.functional.softplus(r_sigma_raw)[y]
    r_mean = r_mu[y]
    mu_scaled, sigma_scaled = mu * scale, sigma * scale
    kl = (torch.log(r_sigma) - torch.log(sigma_scaled)
          + (sigma_scaled ** 2 + (mu_scaled - r_mean) ** 2) / (2 * r_sigma ** 2) - 0.5)
    return kl.sum(dim=1)


class FedSRModel(nn.Module):
    """The target network plus FedSR's sigma head and reference distribution; ``forward`` is the target's (z = mu)."""

    def __init__(self, target: nn.Module, num_classes: int) -> None:
        super().__init__()
        self.target = target
        width = classifier_layer(target).in_features
        self.sigma_head = nn.Linear(width, width)
        self.r_mu = nn.Parameter(torch.zeros(num_classes, width))
        self.r_sigma = nn.Parameter(torch.ones(num_classes, width))
        self.C = nn.Parameter(torch.ones(()))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.target(x)

    def sample(self, x: torch.Tensor) -> dict[str, torch.Tensor]:
        """Step 1 and the logits of step 2: ``{"logits", "z", "mu", "sigma"}``."""
        parts = {}

        def reparametrise(h: torch.Tensor) -> torch.Tensor:
            parts["sigma"] = nn.functional.softplus(self.sigma_head(h))
            parts["z"] = h + parts["sigma"] * torch.randn_like(h)
            return parts["z"]

        parts["mu"], parts["logits"] = forward_with_representation(self.target, x, reparametrise)
        return parts

    def record_terms(self, x: torch.Tensor, y: torch.Tensor, *, squared: bool = False) -> dict[str, torch.Tensor]:
        """Steps 1 to 4 per record: ``{"ce", "l2r", "cmi"}``, each of shape (B,)."""
        parts = self.sample(x)
        return {"ce": nn.functional.cross_entropy(parts["logits"], y, reduction="none"),
                "l2r": record_l2_representation(parts["z"], squared=squared),
                "cmi": record_conditional_mi_bound(parts["mu"], parts["sigma"], y, self.r_mu, self.r_sigma, self.C)}

    def objective(self, x: torch.Tensor, y: torch.Tensor, *, l2r_coeff: float, cmi_coeff: float,
                  squared: bool = False) -> tuple[torch.Tensor, dict[str, float]]:
        """Step 5's loss on one minibatch (the batch mean of :func:`record_objective`), and its parts (CE, L2R, CMI)
        as floats."""
        terms = self.record_terms(x, y, squared=squared)
        ce, l2r, cmi = (terms[k].mean() for k in ("ce", "l2r", "cmi"))
        return ce + l2r_coeff * l2r + cmi_coeff * cmi, {"ce": ce.item(), "l2r": l2r.item(), "cmi": cmi.item()}


def record_objective(model: FedSRModel, x: torch.Tensor, y: torch.Tensor, *, l2r_coeff: float, cmi_coeff: float,
                     squared: bool = False) -> torch.Tensor:
    """Step 5's loss of each record, shape (B,): L_CE + alpha_L2R L2R + alpha_CMI CMI of record i alone (the
    per-sample loss of record-level DP-SGD; its batch mean is :meth:`FedSRModel.objective`)."""
    terms = model.record_terms(x, y, squared=squared)
    return terms["ce"] + l2r_coeff * terms["l2r"] + cmi_coeff * terms["cmi"]


def sgd_on_batches(model: nn.Module, x: torch.Tensor, y: torch.Tensor, loss_of_batch, *, lr: float, steps: int,
                   batch_size: int, rng: np.random.Generator, weight_decay: float = 0.0,
                   grad_clip: float = 0.0) -> dict[str, float]:
    """``steps`` SGD steps on every parameter of ``model`` of ``loss_of_batch(x_b, y_b) -> (loss, parts)`` over the
    minibatches of :func:`~privfl.methods.local_training.minibatches`; returns the mean of each part."""
    if len(y) == 0:
        raise ValueError("local training needs at least one training sample")
    model.train()
    params = list(model.parameters())
    optimizer = torch.optim.SGD(params, lr=lr, weight_decay=weight_decay)
    totals: dict[str, float] = {}
    for index in minibatches(len(y), batch_size, steps, rng):
        batch = torch.from_numpy(index)
        loss, parts = loss_of_batch(x[batch], y[batch])
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        if grad_clip > 0:
            torch.nn.utils.clip_grad_norm_(params, grad_clip)
        optimizer.step()
        for name, value in parts.items():
            totals[name] = totals.get(name, 0.0) + value / steps
    return totals


class FedSRStrategy(FedAvgStrategy):
    """FedAvg's server over the target network and FedSR's extra parameters."""

    def __init__(self, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        factory = self.model_factory
        self.weights = weights_of(seeded_init(lambda: FedSRModel(factory(), factory.num_classes), self.seed))


class FedSRClient(FedAvgClient):
    """Steps 1 to 5 for ``local_steps`` minibatches; sends the change of every parameter."""

    def workspace_model(self) -> nn.Module:
        if self._model is None:
            # Built off the global generator: the runtime seeds it per (round, client) for the noise draws, and
            # whether this process already built its workspace must not shift them (a resumed run would differ).
            with torch.random.fork_rng(devices=[]):
                self._model = FedSRModel(self.model_factory(), self.model_factory.num_classes)
        return self._model

    def train(self, data: TrainingClient, message: Message, state: ClientState, ctx: ClientContext) -> Release:
        """Steps 1 to 5 for ``local_steps`` minibatches (record level: DP-SGD on :func:`record_objective`); the
        release is the weight change."""
        start = message.arrays
        model = self.model_from(start)
        settings = sgd_settings(message.config)
        config = self.config
        event, metrics = None, {}
        if self.record_level:
            losses = functools.partial(record_objective, l2r_coeff=config.l2r_coeff, cmi_coeff=config.cmi_coeff,
                                       squared=config.l2r == "squared")
            with warnings.catch_warnings():
                # the label-indexed reference makes the torch.func path the only one for this loss: no news each round
                warnings.simplefilter("ignore", GenericPathWarning)
                _, event = self.fit(model, data, settings, ctx.rng, per_sample_loss=losses)
        else:
            assert isinstance(model, FedSRModel)   # the workspace model is one
            def loss_of_batch(xb: torch.Tensor, yb: torch.Tensor):
                return model.objective(xb, yb, l2r_coeff=config.l2r_coeff, cmi_coeff=config.cmi_coeff,
                                       squared=config.l2r == "squared")

            parts = sgd_on_batches(model, data.x_train, data.y_train, loss_of_batch, rng=ctx.rng, **settings)
            metrics = {"num_examples": float(data.num_train), "loss": parts["ce"], "l2r": parts["l2r"],
                       "cmi": parts["cmi"]}
        return update_release(self, difference(weights_of(model), start), event, metrics)


def update_release(procedure: ClientProcedure, update: dict[str, torch.Tensor], event: PrivacyEvent | None,
                   metrics: dict[str, float]) -> Release:
    """A weight change as a training client of FedSR, FedADG or AFL releases it (purpose ``"model_update"``), with
    the round's record-level ``event`` (``None`` otherwise).

    Under every privacy mode: ``metrics`` (data no mechanism covers) are not sent, and a non-finite change (the local
    training diverged, which can depend on the data) is released as zeros rather than failing the round or
    falling silent; at record level that decision reads the change alone, post-processing of DP-SGD's noisy steps.
    Without DP the change and ``metrics`` are sent as they are.
    """
    if not procedure.privacy.private:
        return private_release(Message(arrays=update, metrics=metrics), "model_update", event)
    if not all(bool(torch.isfinite(v).all()) for v in update.values()):
        update = {k: torch.zeros_like(v) for k, v in update.items()}
    return private_release(Message(arrays=update), "model_update", event,
                           metadata={"noise": procedure.privacy.noise, "max_grad_norm": procedure.privacy.clip})


register_method(
    "fedsr", strategy=FedSRStrategy, client=FedSRClient, config=FedSRConfig,
    description="FedSR: FedAvg with a probabilistic representation, an L2 representation regulariser and a "
                "conditional mutual-information regulariser",
    privacy=FEDAVG_PRIVACY,   # per-record loss (record level); the server step is FedAvg's mean (central, distributed)
    central_eval=None,
)
