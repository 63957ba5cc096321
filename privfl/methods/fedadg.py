"""FedADG (Zhang, Lei, Shi, Huang and Chen, 2021, "Federated Learning with Domain Generalization", arXiv 2111.10487):
every client aligns its feature distribution to one reference distribution, learned adversarially, so the features
the federation averages are domain-invariant.

Each client holds a feature extractor F and classifier C (the target network), a class-conditional generator G of
reference features (F, C and G are averaged as in FedAvg) and a discriminator D that never leaves the client. Every
privacy mode runs: record level trains F, C and D by DP-SGD and G as post-processing.

Entry points: :class:`FedADGConfig`, :class:`FedADGModel`, :class:`FedADGStrategy`, :class:`FedADGClient`
(registered as ``fedadg``); :func:`adversarial_step`, :func:`record_adversarial_losses`, :func:`generator_steps`.

The local steps (cited below as "steps 1 to 3 of the module docstring"), the simplifications and each privacy mode:
docs/methods/baselines.md, "FedADG".
"""

from __future__ import annotations

import functools
import math
import warnings
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any, cast

import numpy as np
import torch
from torch import nn
from torch.func import functional_call

from accounting import PrivacyEvent
from accounting.validation import is_finite, is_int_at_least
from privfl.data import TrainingClient
from privfl.devices import ANY_DEVICE, device_of
from privfl.errors import check
from privfl.federation.messages import Message, Release
from privfl.federation.seeding import derive_seed, seeded_init
from privfl.methods.base import ClientContext, ClientState, register_method, supported_modes
from privfl.methods.fedavg import FedAvgClient, FedAvgStrategy, ServerStepConfig
from privfl.methods.fedsr import classifier_layer, forward_with_representation, update_release
from privfl.methods.local_training import difference, minibatches, sgd_settings, weights_of
from privfl.privacy.dp_sgd import GenericPathWarning


@dataclass(frozen=True)
class FedADGConfig(ServerStepConfig):
    """Local settings (``lr`` = eta_f for F and C) plus the adversarial ones: ``adv_weight`` lambda_0 in [0, 1),
    ``gan_lr`` for D and G, ``noise_dim`` (the paper's 10) and the MLP width ``gan_hidden``."""

    adv_weight: float = 0.1
    gan_lr: float = 0.05
    noise_dim: int = 10
    gan_hidden: int = 64

    def __post_init__(self) -> None:
        super().__post_init__()
        check.require(is_finite(self.adv_weight) and 0 <= self.adv_weight < 1, "adv_weight", self.adv_weight,
                      "in [0, 1)")
        check.require(is_finite(self.gan_lr) and self.gan_lr > 0, "gan_lr", self.gan_lr, "a finite number > 0")
        for name in ("noise_dim", "gan_hidden"):
            value = getattr(self, name)
            check.require(is_int_at_least(value, 1), name, value, "an integer >= 1")


class FedADGModel(nn.Module):
    """Target network (F and C), generator G and discriminator D; ``forward`` is the target's."""

    def __init__(self, target: nn.Module, num_classes: int, *, noise_dim: int, hidden: int) -> None:
        super().__init__()
        self.target = target
        self.num_classes = num_classes
        self.noise_dim = noise_dim
        width = classifier_layer(target).in_features
        self.generator = nn.Sequential(nn.Linear(noise_dim + num_classes, hidden), nn.ReLU(),
                                       nn.Linear(hidden, width), nn.ReLU())
        self.discriminator = nn.Sequential(nn.Linear(width + num_classes, hidden), nn.ReLU(), nn.Linear(hidden, 1))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.target(x)

    def reference(self, onehot: torch.Tensor) -> torch.Tensor:
        """Reference features G(xi, e_y), xi ~ U[0, 1)^noise_dim (drawn on the CPU generator wherever G computes)."""
        noise = torch.rand(len(onehot), self.noise_dim).to(onehot.device)
        return self.generator(torch.cat([noise, onehot], dim=1))

    def discriminate(self, features: torch.Tensor, onehot: torch.Tensor) -> torch.Tensor:
        return self.discriminator(torch.cat([features, onehot], dim=1)).squeeze(1)


def adversarial_step(model: FedADGModel, x: torch.Tensor, y: torch.Tensor, optimizers: dict[str, torch.optim.SGD],
                     *, adv_weight: float, grad_clip: float = 0.0) -> dict[str, float]:
    """Steps 1 to 3 of the module docstring on one minibatch; returns the losses as floats."""
    onehot = nn.functional.one_hot(y, model.num_classes).float()

    def update(name: str, loss: torch.Tensor) -> None:
        model.zero_grad(set_to_none=True)
        loss.backward()
        params = [p for group in optimizers[name].param_groups for p in group["params"]]
        if grad_clip > 0:
            torch.nn.utils.clip_grad_norm_(params, grad_clip)
        optimizers[name].step()

    features, logits = forward_with_representation(model.target, x)                            # step 1
    ce = nn.functional.cross_entropy(logits, y)
    adv_f = ((1 - model.discriminate(features, onehot)) ** 2).mean()
    update("target", (1 - adv_weight) * ce + adv_weight * adv_f)

    reference = model.reference(onehot)                                                        # step 2
    adv_d = (((1 - model.discriminate(reference.detach(), onehot)) ** 2).mean()
             + (model.discriminate(features.detach(), onehot) ** 2).mean())
    update("discriminator", adv_d)

    adv_g = (model.discriminate(model.reference(onehot), onehot) ** 2).mean()                  # step 3
    update("generator", adv_g)
    return {"ce": ce.item(), "adv_f": adv_f.item(), "adv_d": adv_d.item(), "adv_g": adv_g.item()}


def record_adversarial_losses(model: FedADGModel, x: torch.Tensor, y: torch.Tensor, *, adv_weight: float,
                              d_scale: float = 1.0) -> torch.Tensor:
    """Record level: steps 1 and 2 as one per-record loss over F, C and D, shape (B,) (module docstring)::

        (1 - lambda_0) CE_i + lambda_0 (1 - D~(F(x_i), e_yi))^2 + D(F~(x_i), e_yi)^2 + (1 - D(G~(xi_i, e_yi), e_yi))^2

    where ~ marks a network held fixed (no gradient), xi_i is drawn for record i alone and D is evaluated at
    ``d_scale`` times the discriminator's own parameters (D' = D / s, so that an SGD step at F's rate moves D at
    ``gan_lr``)."""
    # D's parameters first: read outside a linear layer, they make DP-SGD's "fast" path refuse this loss (D is also
    # applied twice per record) and take the torch.func path
    d = {k: d_scale * v for k, v in model.discriminator.named_parameters()}
    fixed = {k: v.detach() for k, v in d.items()}
    onehot = nn.functional.one_hot(y, model.num_classes).to(x.dtype)

    def discriminate(params: dict[str, torch.Tensor], features: torch.Tensor) -> torch.Tensor:
        return functional_call(model.discriminator, params, (torch.cat([features, onehot], dim=1),)).squeeze(1)

    features, logits = forward_with_representation(model.target, x)
    ce = nn.functional.cross_entropy(logits, y, reduction="none")
    adv_f = (1 - discriminate(fixed, features)) ** 2                                          # step 1, D fixed
    reference = model.reference(onehot).detach()                                              # G fixed
    adv_d = (1 - discriminate(d, reference)) ** 2 + discriminate(d, features.detach()) ** 2    # step 2, F fixed
    return (1 - adv_weight) * ce + adv_weight * adv_f + adv_d


def generator_steps(model: FedADGModel, *, steps: int, batch_size: int, lr: float, rng: np.random.Generator) -> float:
    """Record level, after the round's DP-SGD fit: ``steps`` SGD steps of step 3 on G against the fitted D (fixed),
    each on ``batch_size`` labels drawn uniformly from the classes with ``rng`` and fresh noise: no record is read.
    Returns the mean L_advg."""
    optimizer = torch.optim.SGD(model.generator.parameters(), lr=lr)
    total = 0.0
    for _ in range(steps):
        labels = torch.from_numpy(rng.integers(model.num_classes, size=batch_size)).to(device_of(model))
        onehot = nn.functional.one_hot(labels, model.num_classes).float()
        loss = (model.discriminate(model.reference(onehot), onehot) ** 2).mean()
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        optimizer.step()
        total += loss.item()
    model.discriminator.zero_grad(set_to_none=True)
    return total / steps


LOCAL = "discriminator."   # the prefix of the networks a client keeps to itself


def _build(factory, config) -> FedADGModel:
    """F and C from ``factory``, G and D, all on the factory's device (built on the CPU, then moved)."""
    return FedADGModel(factory(), factory.num_classes, noise_dim=config.noise_dim,
                       hidden=config.gan_hidden).to(factory.device)


class FedADGStrategy(FedAvgStrategy):
    """FedAvg's server over F, C and G (D stays on each client); a novel client is sent F and C only."""

    def __init__(self, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        weights = weights_of(seeded_init(lambda: _build(self.model_factory, self.config), self.seed))
        self.weights = {k: v for k, v in weights.items() if not k.startswith(LOCAL)}

    def novel_request(self, client_id: int) -> Message:
        return Message(arrays={k[len("target."):]: v for k, v in self.weights.items() if k.startswith("target.")})


class FedADGClient(FedAvgClient):
    """Steps 1 to 3 for ``local_steps`` minibatches; sends the change of F, C and G, keeps D in its state."""

    def adg_model(self) -> FedADGModel:
        if getattr(self, "_adg_model", None) is None:
            with torch.random.fork_rng(devices=[]):     # see FedSRClient.workspace_model
                self._adg_model = _build(self.model_factory, self.config)
        return self._adg_model

    def train(self, data: TrainingClient, message: Message, state: ClientState, ctx: ClientContext) -> Release:
        """Steps 1 to 3 for ``local_steps`` minibatches (record level: :meth:`record_round`); the release is the
        change of F, C and G, and D stays in the client's state."""
        start = message.arrays
        model = self.adg_model()
        local = {k: v for k, v in state.items() if k.startswith(LOCAL)}
        if not local:   # the first round this client trains: its own discriminator
            seed = derive_seed(ctx.run_seed, "fedadg_discriminator", ctx.client_id)
            local = {LOCAL + k: v for k, v in weights_of(seeded_init(
                lambda: _build(self.model_factory, self.config).discriminator, seed)).items()}
        model.load_state_dict({**start, **local})
        model.train()
        settings = sgd_settings(message.config)
        event, metrics = None, {}
        if self.record_level:
            event = self.record_round(model, data, settings, ctx.rng)
        else:
            metrics = self.adversarial_round(model, data, settings, ctx.rng)
        weights = weights_of(model)
        kept = {k: v for k, v in weights.items() if k.startswith(LOCAL)}
        # a private client keeps a diverged D out of its state (the decision reads D, itself a DP output at record
        # level), so that one diverged round does not silence its later ones
        if not self.privacy.private or all(bool(torch.isfinite(v).all()) for v in kept.values()):
            state.update(kept)
        return update_release(self, difference({k: weights[k] for k in start}, start), event, metrics)

    def adversarial_round(self, model: FedADGModel, data: TrainingClient, settings: Mapping[str, Any],
                          rng: np.random.Generator) -> dict[str, float]:
        """Steps 1 to 3 alternating on every minibatch; the mean losses (``"loss"`` is the CE)."""
        optimizers = {
            "target": torch.optim.SGD(model.target.parameters(), lr=settings["lr"],
                                      weight_decay=settings["weight_decay"]),
            "discriminator": torch.optim.SGD(model.discriminator.parameters(), lr=self.config.gan_lr),
            "generator": torch.optim.SGD(model.generator.parameters(), lr=self.config.gan_lr),
        }
        totals: dict[str, float] = {}
        steps = settings["steps"]
        device = self.model_factory.device
        for index in minibatches(data.num_train, settings["batch_size"], steps, rng):
            batch = torch.from_numpy(index)
            losses = adversarial_step(model, data.x_train[batch].to(device), data.y_train[batch].to(device), optimizers,
                                      adv_weight=self.config.adv_weight, grad_clip=settings["grad_clip"])
            for name, value in losses.items():
                totals[name] = totals.get(name, 0.0) + value / steps
        return {"num_examples": float(data.num_train), "loss": totals.pop("ce"), **totals}

    def record_round(self, model: FedADGModel, data: TrainingClient, settings: Mapping[str, Any],
                     rng: np.random.Generator) -> PrivacyEvent:
        """Record level (module docstring): one DP-SGD fit of F, C and D on :func:`record_adversarial_losses`, then
        G's steps against the fitted D; returns the fit's event."""
        scale = math.sqrt(self.config.gan_lr / settings["lr"])
        with torch.no_grad():
            for p in model.discriminator.parameters():
                p.div_(scale)
        weight_decay = float(settings.get("weight_decay", 0.0))

        def decay(params: Mapping[str, torch.Tensor]) -> torch.Tensor:   # on F and C only, as step 1's optimiser has it
            return 0.5 * weight_decay * cast(torch.Tensor, sum((p ** 2).sum() for name, p in params.items()
                                                               if name.startswith("target.")))

        trained = [name for name, _ in model.named_parameters() if not name.startswith("generator.")]
        losses = functools.partial(record_adversarial_losses, adv_weight=self.config.adv_weight, d_scale=scale)
        try:
            with warnings.catch_warnings():
                # D applied twice per record makes the torch.func path the only one for this loss: no news each round
                warnings.simplefilter("ignore", GenericPathWarning)
                _, event = self.fit(model, data, {**settings, "weight_decay": 0.0}, rng, per_sample_loss=losses,
                                    extra_loss=decay if weight_decay > 0 else None, params=trained)
        finally:
            with torch.no_grad():
                for p in model.discriminator.parameters():
                    p.mul_(scale)
        generator_steps(model, steps=settings["steps"], batch_size=settings["batch_size"], lr=self.config.gan_lr,
                        rng=rng)
        assert event is not None   # record level: fit ran DP-SGD, which returns its event
        return event


register_method(
    "fedadg", strategy=FedADGStrategy, client=FedADGClient, config=FedADGConfig,
    description="FedADG: FedAvg with class-conditional adversarial alignment of features to a generated reference "
                "distribution",
    # every mode (module docstring): F, C and D by DP-SGD and G as post-processing at record level; the server step
    # is FedAvg's mean over F, C and G (central, distributed); local DP is the layer's
    privacy=supported_modes(),
    smoke_settings={"gan_hidden": 8}, devices=ANY_DEVICE,
    central_eval=None,
)
