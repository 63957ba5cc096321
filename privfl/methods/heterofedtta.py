"""HeteroFedTTA (Ye et al. 2023, "UPFL", section 3.4, Alg. 2): FedTTA with clients of different model sizes.

Clients hold prediction and adaptation models of different widths, so the server cannot average weights; as in
FedMD they exchange logits on a public set D_p (drawn by the server from Gaussian noise: no client's data) instead.
A round distributes the previous consensus, distils it into each client's models (:func:`distill`,
:func:`distillation_loss`), runs FedTTA meta-steps on the client's labels, releases the client's logits on D_p and
averages them (:func:`consensus`). A novel client distils the final consensus into a fresh model, adapts it and
predicts; it sends nothing.

Entry points: :class:`HeteroFedTTAConfig`, :class:`HeteroFedTTAStrategy`, :class:`HeteroFedTTAClient` (registered as
``heterofedtta``); :func:`sizable_models`, :func:`prediction_model`, :func:`public_inputs`.

The round step by step, model sizes, the public set, novel clients and each privacy mode:
docs/methods/fedtta.md, "HeteroFedTTA".
"""

from __future__ import annotations

import dataclasses
import inspect
import math
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch
from torch import nn
from torch.func import functional_call

from accounting.validation import is_finite, is_int_at_least
from privfl.data import NovelClient, TrainingClient
from privfl.devices import ANY_DEVICE, device_of
from privfl.errors import ConfigError, check
from privfl.federation.context import ClientContext, ClientState
from privfl.federation.messages import Message, Release, prefixed
from privfl.federation.seeding import derive_rng, derive_seed, seeded_init
from privfl.methods.base import ModelFactory, Strategy, private_release, register_method, supported_modes
from privfl.methods.fedavg import sample_weights, weighted_mean, weighted_mean_scalar
from privfl.methods.fedtta import (
    PHI,
    PSI,
    AdaptationModel,
    FedTTAClient,
    FedTTAConfig,
    MetaOptimizer,
    inner_step,
    meta_train,
    proxy_kl,
)
from privfl.methods.local_training import weights_of
from privfl.models.targets import MODELS

PUBLIC, BASE, PER = "public.x", "consensus.base", "consensus.per"


# ---------------------------------------------------------------------------------------------------------------------
# Configuration.


@dataclass(frozen=True)
class HeteroFedTTAConfig(FedTTAConfig):
    """HeteroFedTTA's settings (learning rates: the paper's CIFAR-10 HeteroFedTTA values 0.5 / 0.1 / 0.005).

    Beyond :class:`~privfl.methods.fedtta.FedTTAConfig`: ``widths`` the ``hidden`` width of each prediction-model
    size and ``adapt_widths`` the hidden width of the matching adaptation model (same length; client ``cid`` gets
    size ``cid % len(widths)``); ``conv`` the conv channels of each size (``None``: the model's own; the paper's
    CNNs: :data:`PAPER_CNN_SIZES`); ``novel_size`` the size index a novel client builds (``None``: by its id, like
    training clients); ``public_size`` and ``public_std`` the server-drawn unlabelled public set; ``kd_lambda`` the
    weight of the base-model KL in Eq. 14; ``distill_epochs`` / ``novel_distill_epochs`` passes over the public set
    per Digest step (training / novel clients) in batches of ``distill_batch``.

    Not applicable here and refused: ``mu`` (FedTTA-Prox's teacher is the server model, and there is none) and
    ``adapt_hidden`` (use ``adapt_widths``).
    """

    lr: float = 0.1
    inner_lr: float = 0.5
    adapt_lr: float = 0.005
    widths: tuple[int, ...] = (100, 200, 400)
    adapt_widths: tuple[int, ...] = (32, 64, 128)
    conv: tuple[tuple[int, int], ...] | None = None
    novel_size: int | None = None
    public_size: int = 1000
    public_std: float = 1.0
    kd_lambda: float = 0.8
    distill_epochs: int = 1
    novel_distill_epochs: int = 2
    distill_batch: int = 100

    def __post_init__(self) -> None:
        check.require(self.mu == 0, "mu", self.mu, "0 for heterofedtta (FedTTA-Prox's teacher is a server model; "
                      "HeteroFedTTA has none)")
        default_hidden = next(f.default for f in dataclasses.fields(FedTTAConfig) if f.name == "adapt_hidden")
        check.require(self.adapt_hidden == default_hidden, "adapt_hidden", self.adapt_hidden,
                      f"left at {default_hidden} for heterofedtta (set adapt_widths, one width per size)")
        super().__post_init__()
        for name in ("widths", "adapt_widths"):  # lists arrive from config.json; keep the dataclass hashable
            value = getattr(self, name)
            check.require(isinstance(value, (list, tuple)) and len(value) >= 1
                          and all(is_int_at_least(w, 1) for w in value), name, value,
                          "a non-empty sequence of integers >= 1")
            object.__setattr__(self, name, tuple(value))
        check.require(len(self.adapt_widths) == len(self.widths), "adapt_widths", self.adapt_widths,
                      f"as long as widths ({len(self.widths)} sizes)")
        if self.conv is not None:   # lists of lists arrive from config.json
            check.require(isinstance(self.conv, (list, tuple)) and len(self.conv) == len(self.widths)
                          and all(isinstance(c, (list, tuple)) and len(c) == 2 and all(is_int_at_least(v, 1) for v in c)
                             for c in self.conv), "conv", self.conv,
                          f"None or one pair of conv channel counts (integers >= 1) per size "
                          f"({len(self.widths)} sizes)")
            object.__setattr__(self, "conv", tuple(tuple(c) for c in self.conv))
        check.require(self.novel_size is None
                      or (is_int_at_least(self.novel_size, 0) and self.novel_size < len(self.widths)),
                      "novel_size", self.novel_size, f"None or an integer in [0, {len(self.widths) - 1}]")
        check.require(is_int_at_least(self.public_size, 1), "public_size", self.public_size, "an integer >= 1")
        check.require(is_finite(self.public_std) and self.public_std > 0, "public_std", self.public_std,
                      "a finite number > 0")
        check.require(is_finite(self.kd_lambda) and self.kd_lambda >= 0, "kd_lambda", self.kd_lambda,
                      "a finite number >= 0")
        for name in ("distill_epochs", "novel_distill_epochs"):
            check.require(is_int_at_least(getattr(self, name), 0), name, getattr(self, name), "an integer >= 0")
        check.require(is_int_at_least(self.distill_batch, 1), "distill_batch", self.distill_batch, "an integer >= 1")

    def conv_of(self, size: int) -> tuple[int, int] | None:
        """The conv channels of size index ``size`` (``None``: the model's own)."""
        return None if self.conv is None else self.conv[size]

    def size_of(self, client_id: int) -> int:
        """The size index of training client ``client_id``: ``client_id % len(widths)``."""
        return int(client_id) % len(self.widths)

    def novel_size_of(self, client_id: int) -> int:
        return self.size_of(client_id) if self.novel_size is None else self.novel_size


#: The paper's three prediction CNNs (App. Table 3), with ``model="fedtta_cnn"``.
PAPER_CNN_SIZES = {"widths": (512, 512, 512), "conv": ((16, 32), (32, 64), (64, 128))}


# ---------------------------------------------------------------------------------------------------------------------
# The functional core.


def sizable_models() -> tuple[str, ...]:
    """Target models whose constructor takes a ``hidden`` width (the ones HeteroFedTTA can size)."""
    return tuple(sorted(name for name, cls in MODELS.items() if "hidden" in inspect.signature(cls).parameters))


def prediction_model(factory: ModelFactory, width: int, conv: tuple[int, int] | None = None) -> nn.Module:
    """The target ``factory.name`` for the factory's shape and classes, with ``hidden=width`` (and ``conv=conv``)."""
    if factory.name not in MODELS or factory.name not in sizable_models():
        raise ConfigError(f"heterofedtta needs a model with a hidden width, got model {factory.name!r}; "
                          f"valid choices: {', '.join(sizable_models())}")
    cls = MODELS[factory.name]
    if conv is None:
        return cls(tuple(factory.input_shape), factory.num_classes, hidden=width)
    if "conv" not in inspect.signature(cls).parameters:
        with_conv = sorted(n for n, c in MODELS.items() if "conv" in inspect.signature(c).parameters)
        raise ConfigError(f"conv={conv!r} sets conv channels, but model {factory.name!r} has none; models with "
                          f"them: {', '.join(with_conv)}")
    return cls(tuple(factory.input_shape), factory.num_classes, hidden=width, conv=conv)


def public_inputs(input_shape: tuple[int, ...], size: int, std: float, seed: int) -> torch.Tensor:
    """The server's public set: ``size`` inputs from N(0, std^2), a pure function of ``seed``."""
    generator = torch.Generator().manual_seed(derive_seed(seed, "heterofedtta_public_set"))
    return std * torch.randn((size, *input_shape), generator=generator)


def consensus(logits: list[torch.Tensor], weights: list[float] | None = None) -> torch.Tensor:
    """The ensemble knowledge: the (weighted) mean of the clients' logit matrices on the public set."""
    if not logits:
        raise ValueError("consensus needs at least one client's logits")
    weights = [1.0] * len(logits) if weights is None else weights
    return weighted_mean([{"z": z} for z in logits], weights)["z"]


def distillation_loss(f: nn.Module, g: nn.Module, psi: dict[str, torch.Tensor], phi: dict[str, torch.Tensor],
                      x: torch.Tensor, teacher_base: torch.Tensor, teacher_per: torch.Tensor, *, inner_lr: float,
                      kd_lambda: float, weight_decay: float = 0.0, kl_direction: str = "teacher_student"
                      ) -> torch.Tensor:
    """Eq. 14 on one public batch: KL(F_per || f(x; psi~)) + kd_lambda * KL(F_base || f(x; psi)), batch means.

    psi~ is one differentiable inner step on ``x`` with the student's g, so the first term reaches phi.
    """
    logits = functional_call(f, psi, (x,))
    psi_tilde = inner_step(f, g, psi, phi, x, inner_lr=inner_lr, weight_decay=weight_decay, logits=logits)
    personalised = functional_call(f, psi_tilde, (x,))
    loss = proxy_kl(personalised, teacher_per.detach(), kl_direction)
    if kd_lambda > 0:
        loss = loss + kd_lambda * proxy_kl(logits, teacher_base.detach(), kl_direction)
    return loss


def distill(f: nn.Module, g: nn.Module, x: torch.Tensor, teacher_base: torch.Tensor, teacher_per: torch.Tensor,
            round_config: dict, config: HeteroFedTTAConfig, *, epochs: int, rng: np.random.Generator) -> float:
    """The Digest step: ``epochs`` shuffled passes over the public set, one SGD step per batch of ``distill_batch``,
    with the optimiser settings of :func:`~privfl.methods.fedtta.meta_train` (psi at ``lr``, phi at ``adapt_lr``);
    updates ``f`` and ``g`` in place and returns the mean KD loss (nan without steps)."""
    opt = MetaOptimizer(f, g, round_config, config.adapt_momentum)
    total, steps = 0.0, 0
    device = device_of(f)      # each batch and its teachers go where the models compute
    for _ in range(epochs):
        for batch in torch.from_numpy(rng.permutation(len(x))).split(config.distill_batch):
            loss = distillation_loss(f, g, opt.psi, opt.phi, x[batch].to(device), teacher_base[batch].to(device),
                                     teacher_per[batch].to(device), inner_lr=opt.inner_lr, kd_lambda=config.kd_lambda,
                                     weight_decay=opt.weight_decay, kl_direction=config.kl_direction)
            opt.step(loss)
            total, steps = total + loss.item(), steps + 1
    return total / steps if steps else math.nan


# ---------------------------------------------------------------------------------------------------------------------
# Server and client.


class HeteroFedTTAStrategy(Strategy):
    """Holds the public set and the consensus logits; sends both; averages the clients' logits (FedMD)."""

    def __init__(self, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        cfg = self.config   # refuse an unsizable model now, by name
        prediction_model(self.model_factory, cfg.widths[0], cfg.conv_of(0))
        self.public = public_inputs(tuple(self.model_factory.input_shape), self.config.public_size,
                                    self.config.public_std, self.seed)
        self.base: torch.Tensor | None = None
        self.per: torch.Tensor | None = None
        self.rounds_done = 0

    def round_message(self, round: int) -> Message:
        arrays = {PUBLIC: self.public}
        if self.base is not None and self.per is not None:   # set together
            arrays.update({BASE: self.base, PER: self.per})
        return Message(arrays=arrays, config={**self.config.round_config(round), "seed": self.seed})

    def aggregate_train(self, round: int, replies: dict[int, Message]) -> dict[str, float]:
        self.rounds_done = round + 1
        if not replies:
            return {}
        ids = sorted(replies)
        weights = sample_weights(replies, ids, self.config.weighted)
        self.base = consensus([replies[cid].arrays["base"] for cid in ids], weights)
        self.per = consensus([replies[cid].arrays["per"] for cid in ids], weights)
        metrics = {}
        for key in ("loss", "distill_loss"):
            values = [replies[cid].metrics[key] for cid in ids
                      if math.isfinite(replies[cid].metrics.get(key, math.nan))]
            if values:
                metrics["train_loss" if key == "loss" else key] = weighted_mean_scalar(values, [1.0] * len(values))
        return metrics

    def contribution_shapes(self) -> dict[str, torch.Tensor]:
        """A client's contribution is its release: base and personalised logits on the public set."""
        zeros = torch.zeros(self.config.public_size, self.model_factory.num_classes, dtype=self.public.dtype)
        return {"base": zeros, "per": zeros.clone()}

    def apply_mean(self, round: int, mean: dict[str, torch.Tensor], count: float) -> dict[str, float]:
        """Step 5 from the noisy mean of the clients' logits: F_base and F_per are that mean (uniform: the sample
        counts are private)."""
        self.rounds_done = round + 1
        self.base, self.per = mean["base"].clone(), mean["per"].clone()
        return {}

    def novel_request(self, client_id: int) -> Message:
        return self.round_message(max(self.rounds_done - 1, 0))

    def state_dict(self) -> dict[str, Any]:
        state = {"public": self.public, "rounds_done": self.rounds_done}
        if self.base is not None:
            state.update({"base": self.base, "per": self.per})
        return state

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.public = state["public"].clone()
        self.base = state["base"].clone() if "base" in state else None
        self.per = state["per"].clone() if "per" in state else None
        self.rounds_done = int(state["rounds_done"])


class HeteroFedTTAClient(FedTTAClient):
    """Keeps its own (psi, phi) of its size in its state; distils the consensus, meta-trains, releases logits."""

    def __init__(self, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self._workspaces: dict[int, tuple[nn.Module, nn.Module]] = {}

    def models(self, size: int) -> tuple[nn.Module, nn.Module]:
        """The workspace (f, g) of size index ``size`` (weights always overwritten before use)."""
        if size not in self._workspaces:
            self._workspaces[size] = self.build(size)
        return self._workspaces[size]

    def build(self, size: int) -> tuple[nn.Module, nn.Module]:
        """A fresh (f, g) of size index ``size`` on the model factory's device (built on the CPU, then moved)."""
        cfg = self.config
        device = self.model_factory.device
        return (prediction_model(self.model_factory, cfg.widths[size], cfg.conv_of(size)).to(device),
                AdaptationModel(self.model_factory.num_classes, cfg.adapt_widths[size], cfg.adapt_layers).to(device))

    def initial(self, size: int, seed: int, purpose: str, client_id: int) -> tuple[nn.Module, nn.Module]:
        """The workspace (f, g) of ``size`` loaded with weights seeded by (``seed``, ``purpose``, ``client_id``)."""
        fresh_f, fresh_g = seeded_init(lambda: self.build(size), derive_seed(seed, purpose, client_id))
        f, g = self.models(size)
        f.load_state_dict(fresh_f.state_dict())
        g.load_state_dict(fresh_g.state_dict())
        return f, g

    def own_models(self, client_id: int, message: Message, state: ClientState) -> tuple[nn.Module, nn.Module]:
        """This training client's (f, g): from its state, or seeded initial weights before its first round."""
        size = self.config.size_of(client_id)
        psi, phi = _subset(state, PSI), _subset(state, PHI)
        if not psi:
            return self.initial(size, int(message.config["seed"]), "heterofedtta_init", client_id)
        f, g = self.models(size)
        f.load_state_dict(psi)
        g.load_state_dict(phi)
        return f, g

    def public_logits(self, f: nn.Module, g: nn.Module, x: torch.Tensor, message: Message
                      ) -> tuple[torch.Tensor, torch.Tensor]:
        """(f(D_p; psi), f(D_p; psi~)) with psi~ = psi adapted on D_p by the test-time procedure, on the CPU."""
        f.eval()
        g.eval()
        x = x.to(device_of(f))
        adapted = self.adaptation(f, g, x, message)
        with torch.no_grad():
            return f(x).detach().cpu(), functional_call(f, adapted.weights, (x,)).detach().cpu()

    def train(self, data: TrainingClient, message: Message, state: ClientState, ctx: ClientContext) -> Release | None:
        """Steps 2-4 (record level: the Revisit step is DP-SGD on the per-record meta-loss); the release is the
        public-set logits of the client's models (see the module docstring for each privacy mode)."""
        f, g = self.own_models(ctx.client_id, message, state)
        public = message.arrays[PUBLIC]
        distill_loss = math.nan
        digest = BASE in message.arrays and self.config.distill_epochs > 0
        if digest:
            distill_loss = distill(f, g, public, message.arrays[BASE], message.arrays[PER], message.config,
                                   self.config, epochs=self.config.distill_epochs, rng=ctx.rng)
        if self.record_level:
            loss, event = self.meta_fit(f, g, data, message.config, ctx.rng)
        else:
            loss, event = meta_train(f, g, data.x_train, data.y_train, message.config, self.config, rng=ctx.rng), None
        base, per = self.public_logits(f, g, public, message)
        # finite losses, but the last step overflowed: its logits would poison the consensus
        if self.diverged(loss, (base, per)) or (digest and not math.isfinite(distill_loss)):
            if not self.privacy.private:
                return None  # a diverged client sends nothing and keeps its previous models
            # Under DP it keeps its previous models and releases their logits: its silence would reveal its data.
            base, per = self.public_logits(*self.own_models(ctx.client_id, message, state), public, message)
        else:
            state.update({**prefixed(PSI, weights_of(f)), **prefixed(PHI, weights_of(g))})
        metrics = {} if self.privacy.private else {"num_examples": float(data.num_train), "loss": loss,
                                                   "distill_loss": distill_loss}
        return private_release(Message(arrays={"base": base, "per": per}, metrics=metrics), "public_logits", event,
                               metadata={"noise": self.privacy.noise, "max_grad_norm": self.privacy.clip})

    def evaluation_model(self, data: TrainingClient, message: Message, state: ClientState) -> nn.Module:
        f, g = self.own_models(data.client_id, message, state)
        return self._adapted(f, g, data.x_val, message)

    def novel_model(self, novel: NovelClient, message: Message) -> nn.Module:
        seed = int(message.config["seed"])
        f, g = self.initial(self.config.novel_size_of(novel.client_id), seed, "heterofedtta_novel_init",
                            novel.client_id)
        if BASE in message.arrays and self.config.novel_distill_epochs > 0:
            distill(f, g, message.arrays[PUBLIC], message.arrays[BASE], message.arrays[PER], message.config,
                    self.config, epochs=self.config.novel_distill_epochs,
                    rng=derive_rng(seed, "heterofedtta_novel_distill", novel.client_id))
        return self._adapted(f, g, novel.x, message)

    def _adapted(self, f: nn.Module, g: nn.Module, x: torch.Tensor, message: Message) -> nn.Module:
        f.eval()
        g.eval()
        result = self.adaptation(f, g, x, message)
        f.load_state_dict(result.weights, strict=False)
        return f


def _subset(state: ClientState, prefix: str) -> dict[str, torch.Tensor]:
    return {k[len(prefix):]: v for k, v in state.items() if k.startswith(prefix)}


register_method(
    "heterofedtta", strategy=HeteroFedTTAStrategy, client=HeteroFedTTAClient, config=HeteroFedTTAConfig,
    description="HeteroFedTTA: FedTTA with three client model sizes; clients exchange logits on a server-drawn "
                "unlabelled public set (FedMD) and distil the consensus; novel clients distil and adapt locally, "
                "sending nothing",
    # every mode (module docstring): record level trains the Revisit step with DP-SGD and the rest is
    # post-processing; the consensus is the mean of the clients' logits, so central and distributed DP form it from
    # their noisy mean; local DP is the layer's
    privacy=supported_modes(),
    smoke_settings={"widths": [4, 8, 16], "adapt_widths": [2, 4, 4], "adapt_layers": 1, "public_size": 16,
                    "distill_batch": 8},
    devices=ANY_DEVICE,
    central_eval="its clients hold prediction models of three sizes, each its own, and the server only the consensus "
                 "logits on a public set, no model",
)
