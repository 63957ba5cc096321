"""FedADG (Zhang, Lei, Shi, Huang and Chen, 2021, "Federated Learning with Domain Generalization", arXiv 2111.10487):
every client aligns its feature distribution to one reference distribution, learned adversarially, so the features
the federation averages are domain-invariant.

Each client holds four networks: the feature extractor F and classifier C (together the target network: F =
everything before its last linear layer, C = that layer) and a class-conditional generator G(xi, y) of reference
features from noise xi ~ U[0, 1)^noise_dim, which the server averages as in FedAvg, and a class-conditional
discriminator D(h, y) that stays on the client for the whole run, as the FedADG code keeps one local discriminator per
client (``local_d``): it is kept in the client's state, never sent, and starts from an initialisation of its own
(seeded by the run seed and the client id). One local step on a minibatch (x, y), with one-hot labels e_y and
lambda_0 = ``adv_weight``:

1. F and C:  min (1 - lambda_0) * CE(C(F(x)), y) + lambda_0 * E (1 - D(F(x), e_y))^2      (L_err and L_advf);
2. D:        min E (1 - D(G(xi, e_y), e_y))^2 + E D(F(x), e_y)^2                        (L_advd: reference -> 1,
             extracted features -> 0; least-squares GAN losses);
3. G:        min E D(G(xi, e_y), e_y)^2                                                  (L_advg).

Steps 1 and 3 pull the extracted and the reference distributions toward each other; D tells them apart. F, C use the
client learning rate eta_f = ``lr`` (FedTTA paper, Table 4: MNIST 0.3); D and G use ``gan_lr``.

Simplifications of this compact version (documented, not from the paper): the FedADG paper first trains F and C with
CE for some epochs and then alternates the adversarial phase for others; here the three updates alternate on every
one of the ``local_steps`` minibatches. The feature dimension is the target network's penultimate width (200 for the
MNIST 2NN; the FedTTA paper's FedADG used 128 on MNIST), the noise dimension is the paper's 10, and G and D are
two-layer MLPs of width ``gan_hidden``. ``adv_weight``, ``gan_lr`` and ``gan_hidden`` are not given by the FedTTA
paper (its App. D and Table 4 give only eta_f and the noise and feature dimensions); their defaults (0.1, 0.05, 64)
are chosen for this protocol, not quoted. The FedADG code (its VLCS script)
uses lambda_0 = 0.15 (``alpha = 0.85`` on the task loss), a G and D learning rate 0.7 times the task's, one-hot labels
scaled by 0.6, label smoothing 0.2 and a random-projection discriminator with a sigmoid output that maximises
D(reference)^2 + (1 - D(F(x)))^2 (the same targets as step 2's least squares); its generator step trains on a
detached G output, so G gets no gradient there, which is not reproduced. Novel clients receive the target network only
and send nothing.

Privacy (the run's privacy layer, ``RunConfig.privacy``; :mod:`privfl.privacy.training`). Every mode runs.

``record`` (add or remove one record). A client releases the change of F, C and G. F and C read the records; D reads
the records' features, so D is a function of the data, and G is trained against D with labels. So D must itself be
trained privately for G to be post-processing, and G's conditioning labels must be public. The round at record level
(:meth:`FedADGClient.record_round`):

1. one DP-SGD fit (:meth:`~privfl.methods.base.ClientProcedure.fit`) trains F, C and D together on the per-record loss
   (:func:`record_adversarial_losses`)
   (1 - lambda_0) CE_i + lambda_0 (1 - D(F(x_i), e_yi))^2 + D(F(x_i), e_yi)^2 + (1 - D(G(xi_i, e_yi), e_yi))^2,
   where D is held fixed in the second term and F and G in the last two, so its gradient is step 1's for F and C and
   step 2's for D (steps 1 and 2 read the same F, G and D, as in the alternation above); record i's loss reads record
   i and noise xi_i drawn for it alone, so each record's gradient over F, C and D is clipped to C and noised
   (Abadi et al. 2016); D moves at ``gan_lr`` by training D' = D / s with s = sqrt(gan_lr / lr) (as FedTTA's phi,
   :mod:`privfl.methods.fedtta`), and weight decay is a data-independent term on F and C alone;
2. then G takes ``local_steps`` SGD steps of step 3 against the fitted D, on labels drawn uniformly from the classes
   (public) and fresh noise: a function of D and public randomness, so post-processing.

What it changes: G follows D once per round instead of after every D step, and is conditioned on uniform labels
instead of the batch's. The round is one DP-SGD fit (the default
:meth:`~privfl.methods.base.ClientProcedure.round_event`); D stays in the client's state, itself a DP output, and
later rounds compose in the ledger. Loss parts and the sample count, which no mechanism covers, are not sent.

``local`` and ``distributed``: the layer clips the change of F, C and G jointly and adds the noise (D never leaves the
client, and every release is clipped whatever D did). ``central``: the server step is FedAvg's mean of those changes
(:meth:`~privfl.methods.fedavg.FedAvgStrategy.apply_mean`), so the trusted aggregator steps from their clipped sum
noised once. In every privacy mode a change that is not finite is released as zeros rather than failing the round
(:func:`privfl.methods.fedsr.update_release`).
"""

from __future__ import annotations

import functools
import math
import warnings
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

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
from privfl.methods.base import ClientContext, ClientState, register_method
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

        def decay(params: dict[str, torch.Tensor]) -> torch.Tensor:   # on F and C only, as step 1's optimiser has it
            return 0.5 * weight_decay * sum((p ** 2).sum() for name, p in params.items() if name.startswith("target."))

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
        return event


register_method(
    "fedadg", strategy=FedADGStrategy, client=FedADGClient, config=FedADGConfig,
    description="FedADG: FedAvg with class-conditional adversarial alignment of features to a generated reference "
                "distribution",
    # every mode (module docstring): F, C and D by DP-SGD and G as post-processing at record level; the server step
    # is FedAvg's mean over F, C and G (central, distributed); local DP is the layer's
    privacy={"record": None, "central": None, "distributed": None, "local": None},
    smoke_settings={"gan_hidden": 8}, devices=ANY_DEVICE,
    central_eval=None,
)
