"""FedTTA, FedTTA-Prox and FedTTA++ (Ye et al. 2023, "UPFL: Unsupervised Personalized FL towards New Clients").

Every training client meta-learns two models: the prediction model f(.; psi) and a small adaptation model
g(.; phi), an MLP over the logits (K -> 32 -> 32 -> 32 -> 1) whose output norm over a batch is an unsupervised loss.
The server averages both, FedAvg style. A novel client downloads (psi, phi), adapts psi on its own unlabelled data
with that loss and predicts; it sends nothing.

Registered as ``fedtta`` (mu = 0, one test-time step), ``fedtta_prox`` (mu = 0.01) and ``fedtta_pp`` (mu = 0.01,
early-stopped adaptation); the defaults are the paper's MNIST values (Table 4). Every privacy mode runs; record level
trains a per-record meta-loss (:func:`record_meta_losses`) with DP-SGD.

Entry points: :class:`FedTTAConfig` (and the Prox/++ configs), :class:`FedTTAStrategy`, :class:`FedTTAClient`; the
pieces other methods reuse: :class:`AdaptationModel`, :func:`inner_step`, :func:`meta_loss`, :func:`meta_train`,
:func:`adapt` and :func:`adaptation_factory`.

The meta-step and the test-time procedure step by step, and each privacy mode with what it changes (cited below as
"the module docstring"): docs/methods/fedtta.md, "FedTTA, FedTTA-Prox and FedTTA++".
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
from privfl.data import NovelClient, TrainingClient
from privfl.devices import ANY_DEVICE, device_of, on_device
from privfl.errors import ConfigError, check
from privfl.federation.messages import Message, Release, prefixed
from privfl.federation.seeding import derive_seed, seeded_init
from privfl.methods.base import (
    ClientContext,
    ClientProcedure,
    ClientState,
    LocalTrainingConfig,
    Strategy,
    private_release,
    register_method,
    supported_modes,
)
from privfl.methods.fedavg import sample_weights, weighted_mean, weighted_mean_scalar
from privfl.methods.local_training import difference, minibatches, weights_of
from privfl.privacy.dp_sgd import GenericPathWarning
from privfl.privacy.training import RECORD, NovelPrivacy, TrainingPrivacy

KL_DIRECTIONS = ("teacher_student", "student_teacher")
PSI, PHI = "psi.", "phi."


# ---------------------------------------------------------------------------------------------------------------------
# Configuration.


@dataclass(frozen=True)
class FedTTAConfig(LocalTrainingConfig):
    """FedTTA's settings (defaults: the paper's MNIST values for FedTTA, Table 4).

    ``lr`` is the outer rate eta_out of psi, ``inner_lr`` eta_in (training and test time), ``adapt_lr`` eta_ad of
    phi with SGD momentum ``adapt_momentum`` (the authors' code uses 0.9). ``mu`` weighs the proxy KL term (0 for
    FedTTA). ``tta_steps`` test-time steps (0: no adaptation, an ablation), with ``patience`` (``None``: no early
    stopping, the last iterate is used) the entropy early stopping of FedTTA++, ``unadapted_candidate`` whether the
    unadapted model competes in it (see the module docstring). ``tta_chunk`` is the test-time chunk size of l_per
    (``None``: the size the training loss was computed on, ``batch_size``, or 1 under record-level DP).
    ``adapt_hidden`` and ``adapt_layers`` shape g. ``weighted`` weights the server mean by train-split size.
    ``lr_decay`` decays eta_out, eta_in and eta_ad alike. ``weight_decay`` applies to both models and to the inner
    step; ``grad_clip`` clips psi's and phi's meta-gradients separately and the test-time gradient.

    Training clients are protected by the run's privacy layer (``RunConfig.privacy``; see the module docstring):
    ``weighted`` must then be False, and at record level ``adapt_momentum`` 0 and ``grad_clip`` None
    (:meth:`check_privacy`).
    """

    lr: float = 0.3
    inner_lr: float = 0.5
    adapt_lr: float = 0.01
    adapt_momentum: float = 0.0
    mu: float = 0.0
    kl_direction: str = "teacher_student"
    tta_steps: int = 1
    patience: int | None = None
    unadapted_candidate: bool = True
    tta_chunk: int | None = None
    adapt_hidden: int = 32
    adapt_layers: int = 3
    weighted: bool = False

    def __post_init__(self) -> None:
        super().__post_init__()
        for name in ("inner_lr", "adapt_lr"):
            check.require(is_finite(getattr(self, name)) and getattr(self, name) > 0, name, getattr(self, name),
                          "a finite number > 0")
        check.require(is_finite(self.adapt_momentum) and 0 <= self.adapt_momentum < 1, "adapt_momentum",
                      self.adapt_momentum, "in [0, 1)")
        check.require(is_finite(self.mu) and self.mu >= 0, "mu", self.mu, "a finite number >= 0")
        check.require(self.kl_direction in KL_DIRECTIONS, "kl_direction", self.kl_direction,
                      f"one of {', '.join(KL_DIRECTIONS)}")
        check.require(is_int_at_least(self.tta_steps, 0), "tta_steps", self.tta_steps, "an integer >= 0")
        check.require(self.patience is None or is_int_at_least(self.patience, 1), "patience", self.patience,
                      "None (no early stopping) or an integer >= 1")
        check.require(self.patience is None or self.tta_steps >= 1, "tta_steps", self.tta_steps,
                      "an integer >= 1 when patience is set")
        for name in ("adapt_hidden", "adapt_layers"):
            check.require(is_int_at_least(getattr(self, name), 1), name, getattr(self, name), "an integer >= 1")
        check.require(self.tta_chunk is None or is_int_at_least(self.tta_chunk, 1), "tta_chunk", self.tta_chunk,
                      "None (the training loss's size) or an integer >= 1")
        check.require(isinstance(self.weighted, bool), "weighted", self.weighted, "True or False")
        check.require(isinstance(self.unadapted_candidate, bool), "unadapted_candidate", self.unadapted_candidate,
                      "True or False")

    def check_privacy(self, privacy: TrainingPrivacy, novel_privacy: NovelPrivacy) -> None:
        """Refuse, before the run, the settings a privacy mode cannot honour (module docstring): ``weighted`` with
        any mode (the sample counts are not sent), and at record level ``adapt_momentum`` (momentum on phi alone) and
        ``grad_clip`` (DP-SGD's per-record clip replaces it)."""
        if privacy.private and self.weighted:
            raise ConfigError(f"weighted=True weights the server mean by each client's sample count, which a private "
                              f"client does not send (no mechanism covers it); set weighted=False with privacy mode "
                              f"{privacy.mode!r}")
        if privacy.mode != RECORD:
            return
        if self.adapt_momentum:
            raise ConfigError(f"adapt_momentum={self.adapt_momentum!r} puts momentum on phi only; record-level DP-SGD "
                              "takes one step rule for psi and phi together; set adapt_momentum=0 with privacy mode "
                              "'record'")
        if self.grad_clip:
            raise ConfigError(f"grad_clip={self.grad_clip!r} clips each step's batch gradient, a stabiliser DP-SGD "
                              "replaces with its per-record clip (privacy clip); leave grad_clip unset with privacy "
                              "mode 'record'")

    def round_config(self, round: int) -> dict:
        decay = self.lr_decay ** (round / 10)
        return {**super().round_config(round), "inner_lr": self.inner_lr * decay, "adapt_lr": self.adapt_lr * decay}


@dataclass(frozen=True)
class FedTTAProxConfig(FedTTAConfig):
    """FedTTA-Prox: the proxy KL term, mu = 0.01 (paper, MNIST: 0.5 / 0.3 / 0.001)."""

    adapt_lr: float = 0.001
    mu: float = 0.01


@dataclass(frozen=True)
class FedTTAPPConfig(FedTTAProxConfig):
    """FedTTA++: FedTTA-Prox training, entropy early-stopped adaptation (up to 50 steps, MNIST patience 1)."""

    tta_steps: int = 50
    patience: int | None = 1


# ---------------------------------------------------------------------------------------------------------------------
# The functional core (reused by HeteroFedTTA and by tests).


class AdaptationModel(nn.Module):
    """g(.; phi): an MLP over raw logits, K -> hidden (x layers, ReLU) -> 1, one scalar per sample (paper 2.1)."""

    def __init__(self, num_classes: int, hidden: int = 32, layers: int = 3) -> None:
        super().__init__()
        sizes = [num_classes] + [hidden] * layers
        blocks: list[nn.Module] = []
        for fan_in, fan_out in zip(sizes[:-1], sizes[1:], strict=True):
            blocks += [nn.Linear(fan_in, fan_out), nn.ReLU()]
        self.net = nn.Sequential(*blocks, nn.Linear(sizes[-1], 1))

    def forward(self, logits: torch.Tensor) -> torch.Tensor:
        return self.net(logits)


def personalization_loss(g: nn.Module, phi: dict[str, torch.Tensor], logits: torch.Tensor,
                         chunk: int | None = None) -> torch.Tensor:
    """l_per = ||g(Z; phi)||_2 over the batch (Eq. 4); with ``chunk``, the mean of that norm over ``chunk``-sized
    consecutive pieces of Z (the test-time form). Invariant to the order of the samples within a chunk."""
    scores = functional_call(g, phi, (logits,)).reshape(-1)
    if chunk is None or chunk >= len(scores):
        return torch.linalg.vector_norm(scores)
    if chunk == 1:   # the norm of one number is its absolute value (the record-level statistic)
        return scores.abs().mean()
    return torch.stack([torch.linalg.vector_norm(piece) for piece in scores.split(chunk)]).mean()


def inner_step(f: nn.Module, g: nn.Module, psi: dict[str, torch.Tensor], phi: dict[str, torch.Tensor],
               x: torch.Tensor, *, inner_lr: float, weight_decay: float = 0.0, create_graph: bool = True,
               chunk: int | None = None, grad_clip: float = 0.0, logits: torch.Tensor | None = None
               ) -> dict[str, torch.Tensor]:
    """psi~ = psi - inner_lr * (grad_psi l_per + weight_decay * psi) (Eq. 5); differentiable with ``create_graph``.

    ``grad_clip > 0`` rescales the gradient to at most that L2 norm (test time only; the authors' code does).
    ``logits``: f(x; psi) when the caller already has them (saves a forward pass).
    """
    logits = functional_call(f, psi, (x,)) if logits is None else logits
    loss = personalization_loss(g, phi, logits, chunk)
    grads = torch.autograd.grad(loss, tuple(psi.values()), create_graph=create_graph)
    if grad_clip > 0:
        norm = torch.sqrt(cast(torch.Tensor, sum((gr ** 2).sum() for gr in grads)))
        scale = torch.clamp(grad_clip / (norm + 1e-6), max=1.0)
        grads = tuple(gr * scale for gr in grads)
    return {name: p - inner_lr * (gr + weight_decay * p) for (name, p), gr in zip(psi.items(), grads, strict=True)}


def proxy_kl(student_logits: torch.Tensor, teacher_logits: torch.Tensor, direction: str = "teacher_student"
             ) -> torch.Tensor:
    """KL between softmax outputs, averaged over the batch (Eq. 13). ``"teacher_student"``: KL(teacher || student)
    (the authors' code); ``"student_teacher"``: KL(student || teacher) (the paper as written)."""
    log_s = torch.log_softmax(student_logits, dim=1)
    log_t = torch.log_softmax(teacher_logits, dim=1)
    if direction == "teacher_student":
        return (log_t.exp() * (log_t - log_s)).sum(dim=1).mean()
    return (log_s.exp() * (log_s - log_t)).sum(dim=1).mean()


def meta_loss(f: nn.Module, g: nn.Module, psi: dict[str, torch.Tensor], phi: dict[str, torch.Tensor],
              x: torch.Tensor, y: torch.Tensor, *, inner_lr: float, weight_decay: float = 0.0, mu: float = 0.0,
              teacher_logits: torch.Tensor | None = None, kl_direction: str = "teacher_student"
              ) -> tuple[torch.Tensor, torch.Tensor]:
    """Steps 2-4 of the meta-step: (L, CE) with L = CE(f(X; psi~), Y) + mu * KL(teacher, f(X; psi)).

    Backpropagating L reaches psi through psi~ (with its Hessian-vector term) and phi through the inner gradient.
    """
    logits = functional_call(f, psi, (x,))
    psi_tilde = inner_step(f, g, psi, phi, x, inner_lr=inner_lr, weight_decay=weight_decay, logits=logits)
    ce = nn.functional.cross_entropy(functional_call(f, psi_tilde, (x,)), y)
    loss = ce
    if mu > 0:
        if teacher_logits is None:
            raise ValueError("mu > 0 needs the frozen server model's logits (teacher_logits)")
        loss = loss + mu * proxy_kl(logits, teacher_logits.detach(), kl_direction)
    return loss, ce


class MetaLearner(nn.Module):
    """f(.; psi) and g(.; phi) as one module, so that record-level DP-SGD clips each record's gradient over psi and
    phi together. g's own parameters hold phi' = phi / ``phi_scale`` and g is evaluated at ``phi_scale`` * phi' (the
    reparametrisation that keeps eta_ad as phi's rate under DP-SGD's single step rule; see the module docstring)."""

    def __init__(self, f: nn.Module, g: nn.Module, phi_scale: float) -> None:
        super().__init__()
        self.f = f
        self.g = g
        self.phi_scale = float(phi_scale)

    def phi(self) -> dict[str, torch.Tensor]:
        """phi = phi_scale * phi', by name."""
        return {k: self.phi_scale * v for k, v in self.g.named_parameters()}


def record_meta_losses(learner: MetaLearner, x: torch.Tensor, y: torch.Tensor, *, inner_lr: float,
                       weight_decay: float = 0.0, mu: float = 0.0, teacher: Mapping[str, torch.Tensor] | None = None,
                       kl_direction: str = "teacher_student") -> torch.Tensor:
    """The per-record meta-loss of record-level DP (s = 1, module docstring), shape (B,): for each record alone,
    psi~_i = psi - inner_lr (grad_psi |g(f(x_i; psi); phi)| + weight_decay psi) and
    L_i = CE(f(x_i; psi~_i), y_i) + mu KL(teacher(x_i), f(x_i; psi)).

    Record i's loss reads record i only (each record's inner step is its own, computed with ``torch.func`` under
    ``vmap``; random layers draw independently per record), so per-record clipping bounds its influence. The teacher
    (the frozen server weights, required with ``mu > 0``) predicts in eval mode, as in :func:`meta_train`.
    """
    # phi first: reading a trained parameter outside a linear layer is what makes DP-SGD's "fast" per-sample path
    # refuse this loss (its batched forward would not see the per-record inner steps) and take the torch.func path
    phi = learner.phi()
    f, g = learner.f, learner.g
    psi: dict[str, torch.Tensor] = dict(f.named_parameters())
    if mu > 0:
        if teacher is None:
            raise ValueError("mu > 0 needs the frozen server model's weights (teacher)")
        training = f.training
        f.eval()
        teacher_logits = functional_call(f, {k: v.detach() for k, v in teacher.items()}, (x,)).detach()
        f.train(training)

    def one(xi: torch.Tensor, yi: torch.Tensor, ti: torch.Tensor | None) -> torch.Tensor:
        xi, yi = xi.unsqueeze(0), yi.unsqueeze(0)
        grads = torch.func.grad(lambda p: personalization_loss(g, phi, functional_call(f, p, (xi,))))(psi)
        tilde = {k: p - inner_lr * (grads[k] + weight_decay * p) for k, p in psi.items()}
        loss = nn.functional.cross_entropy(functional_call(f, tilde, (xi,)), yi)
        if ti is not None:
            loss = loss + mu * proxy_kl(functional_call(f, psi, (xi,)), ti.unsqueeze(0), kl_direction)
        return loss

    if mu > 0:
        return torch.vmap(one, randomness="different")(x, y, teacher_logits)
    return torch.vmap(one, in_dims=(0, 0, None), randomness="different")(x, y, None)


def prediction_entropy(logits: torch.Tensor) -> float:
    """Mean over samples of -sum_k p_k ln p_k, p = softmax(logits) (nats)."""
    log_p = torch.log_softmax(logits, dim=1)
    return float(-(log_p.exp() * log_p).sum(dim=1).mean())


@dataclass(frozen=True)
class Adaptation:
    """The outcome of test-time adaptation: the chosen weights, which iterate they are, and every entropy seen."""

    weights: dict[str, torch.Tensor]
    chosen_step: int
    steps_taken: int
    entropies: tuple[float, ...]


def adapt(f: nn.Module, g: nn.Module, psi: dict[str, torch.Tensor], phi: dict[str, torch.Tensor], x: torch.Tensor,
          *, inner_lr: float, steps: int, patience: int | None = None, chunk: int = 64, weight_decay: float = 0.0,
          grad_clip: float = 0.0, unadapted_candidate: bool = True) -> Adaptation:
    """Test-time adaptation of psi on unlabelled ``x`` with phi frozen (steps 1-3 of the test-time procedure).

    Without ``patience``: ``steps`` steps, the last iterate. With it (FedTTA++): iterate 0 (unless
    ``unadapted_candidate`` is False) and each step's iterate are candidates; stop after ``patience`` steps without a
    strict decrease of the mean prediction entropy below the best candidate's; return the candidate of lowest
    entropy. Iterate 0's entropy is recorded either way.
    """
    phi = {k: v.detach() for k, v in phi.items()}
    current = {k: v.detach() for k, v in psi.items()}
    with torch.no_grad():
        entropies = [prediction_entropy(functional_call(f, current, (x,)))] if patience is not None else []
    best_entropy = entropies[0] if entropies and unadapted_candidate else math.inf
    best, best_step, waited, taken = current, 0, 0, 0
    for step in range(1, steps + 1):
        params = {k: v.clone().requires_grad_(True) for k, v in current.items()}
        current = {k: v.detach() for k, v in inner_step(f, g, params, phi, x, inner_lr=inner_lr,
                                                        weight_decay=weight_decay, create_graph=False, chunk=chunk,
                                                        grad_clip=grad_clip).items()}
        taken = step
        if patience is None:
            continue
        with torch.no_grad():
            entropy = prediction_entropy(functional_call(f, current, (x,)))
        entropies.append(entropy)
        if entropy < best_entropy or (step == 1 and not unadapted_candidate):   # step 1 is then the first candidate
            best, best_step, best_entropy, waited = current, step, entropy, 0
        else:
            waited += 1
            if waited >= patience:
                break
    if patience is None:
        best, best_step = current, taken
    return Adaptation(weights=best, chosen_step=best_step, steps_taken=taken, entropies=tuple(entropies))


# ---------------------------------------------------------------------------------------------------------------------
# Server and client.


def adaptation_factory(num_classes: int, config: FedTTAConfig):
    return lambda: AdaptationModel(num_classes, config.adapt_hidden, config.adapt_layers)


class FedTTAStrategy(Strategy):
    """Holds (psi, phi); sends both every round; averages both models' changes (uniform, or by sample count; under
    central and distributed DP from the noisy mean of the clients' updates, :meth:`apply_mean`)."""

    def __init__(self, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self.psi = weights_of(self.model_factory.init(self.seed))
        g = seeded_init(adaptation_factory(self.model_factory.num_classes, self.config),
                        derive_seed(self.seed, "fedtta_adaptation_model"))
        self.phi = weights_of(g)
        self.rounds_done = 0

    def round_message(self, round: int) -> Message:
        return Message(arrays={**prefixed(PSI, self.psi), **prefixed(PHI, self.phi)},
                       config=self.config.round_config(round))

    def aggregate_train(self, round: int, replies: dict[int, Message]) -> dict[str, float]:
        self.rounds_done = round + 1
        if not replies:
            return {}
        ids = sorted(replies)
        counts = sample_weights(replies, ids, self.config.weighted)
        change = weighted_mean([replies[cid].arrays for cid in ids], counts)
        self.psi = {k: v + change[PSI + k] for k, v in self.psi.items()}
        self.phi = {k: v + change[PHI + k] for k, v in self.phi.items()}
        losses = [replies[cid].metrics["loss"] for cid in ids if "loss" in replies[cid].metrics]
        return {"train_loss": weighted_mean_scalar(losses, [1.0] * len(losses))} if losses else {}

    def contribution_shapes(self) -> dict[str, torch.Tensor]:
        """A client's contribution is its update (Delta psi, Delta phi), as it releases it."""
        return {**prefixed(PSI, {k: torch.zeros_like(v) for k, v in self.psi.items()}),
                **prefixed(PHI, {k: torch.zeros_like(v) for k, v in self.phi.items()})}

    def apply_mean(self, round: int, mean: dict[str, torch.Tensor], count: float) -> dict[str, float]:
        """The server step of Alg. 1 from the noisy mean update: psi += mean Delta psi, phi += mean Delta phi
        (uniform: the sample counts are private)."""
        self.rounds_done = round + 1
        self.psi = {k: v + mean[PSI + k].to(v.dtype) for k, v in self.psi.items()}
        self.phi = {k: v + mean[PHI + k].to(v.dtype) for k, v in self.phi.items()}
        return {}

    def novel_request(self, client_id: int) -> Message:
        # The test-time step uses eta_in decayed to the last trained round (the paper does not say which rate;
        # docs/papers.md, FedTTA, U8).
        return self.round_message(max(self.rounds_done - 1, 0))

    def state_dict(self) -> dict[str, Any]:
        return {"psi": self.psi, "phi": self.phi, "rounds_done": self.rounds_done}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.psi = {k: v.clone() for k, v in state["psi"].items()}
        self.phi = {k: v.clone() for k, v in state["phi"].items()}
        self.rounds_done = int(state["rounds_done"])


class FedTTAClient(ClientProcedure):
    """Meta-trains (psi, phi) locally; adapts psi on unlabelled data to predict (training and novel clients)."""

    def __init__(self, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self.config.check_privacy(self.privacy, self.novel_privacy)   # also when built without a RunConfig
        self._adapter: nn.Module | None = None
        # Set to a list to keep each test-time adaptation's outcome (chosen iterate, steps, entropies): a diagnostic
        # for the experimenter running the clients; nothing in it is sent anywhere.
        self.adaptation_log: list[Adaptation] | None = None

    def adapter_from(self, weights: dict[str, torch.Tensor]) -> nn.Module:
        """The workspace adaptation model loaded with ``weights``."""
        if self._adapter is None:
            self._adapter = adaptation_factory(self.model_factory.num_classes, self.config)().to(
                self.model_factory.device)
        self._adapter.load_state_dict(weights)
        return self._adapter

    def train(self, data: TrainingClient, message: Message, state: ClientState, ctx: ClientContext) -> Release | None:
        """Steps 1-5 for ``local_steps`` meta-steps (record level: DP-SGD on the per-record meta-loss); the release
        is (Delta psi, Delta phi); see the module docstring for what each privacy mode protects."""
        start_psi, start_phi = message.subset(PSI), message.subset(PHI)
        f, g = self.model_from(start_psi), self.adapter_from(start_phi)
        teacher = on_device(start_psi, self.model_factory.device) if self.config.mu > 0 else None
        if self.record_level:
            loss, event = self.meta_fit(f, g, data, message.config, ctx.rng, teacher=teacher)
        else:
            loss, event = meta_train(f, g, data.x_train, data.y_train, message.config, self.config, rng=ctx.rng,
                                     teacher=teacher), None
        update = {**prefixed(PSI, difference(weights_of(f), start_psi)),
                  **prefixed(PHI, difference(weights_of(g), start_phi))}
        if self.diverged(loss, update.values()):
            if not self.privacy.private:
                return None  # a diverged client sends nothing (the authors' code gives it weight 0)
            # Under DP it releases a zero update (the layer then noises it): its silence would reveal its data.
            update = {k: torch.zeros_like(v) for k, v in update.items()}
        # Private clients send the update alone: sample count and loss are data-dependent and no mechanism covers them
        metrics = {} if self.privacy.private else {"num_examples": float(data.num_train), "loss": loss}
        return private_release(Message(arrays=update, metrics=metrics), "model_update", event,
                               metadata={"noise": self.privacy.noise, "max_grad_norm": self.privacy.clip})

    def diverged(self, loss: float, tensors) -> bool:
        """Whether local training diverged: a non-finite weight, or (except at record level, where the loss is data
        no mechanism covers) a non-finite loss."""
        return not (all(bool(torch.isfinite(t).all()) for t in tensors)
                    and (self.record_level or math.isfinite(loss)))

    def meta_fit(self, f: nn.Module, g: nn.Module, data: TrainingClient, round_config: Mapping[str, Any],
                 rng: np.random.Generator, *, teacher: Mapping[str, torch.Tensor] | None = None
                 ) -> tuple[float, PrivacyEvent]:
        """Record level: ``local_steps`` DP-SGD steps on the per-record meta-loss (:func:`record_meta_losses`),
        updating ``f`` and ``g`` in place; the mean loss (kept on the client) and the round's DP-SGD event.

        phi is trained as phi' = phi / s, s = sqrt(eta_ad / eta_out), and weight decay is the data-independent term
        (weight_decay / 2)(||psi||^2 + ||phi||^2), so that each model moves at its own rate (module docstring).
        """
        cfg = self.config
        lr, inner_lr, adapt_lr = (float(round_config[k]) for k in ("lr", "inner_lr", "adapt_lr"))
        weight_decay = float(round_config.get("weight_decay", 0.0))
        scale = math.sqrt(adapt_lr / lr)
        with torch.no_grad():
            for p in g.parameters():
                p.div_(scale)
        learner = MetaLearner(f, g, scale)

        def decay(params: Mapping[str, torch.Tensor]) -> torch.Tensor:
            return 0.5 * weight_decay * cast(torch.Tensor, sum(((scale * p if name.startswith("g.") else p) ** 2).sum()
                                                               for name, p in params.items()))

        losses = functools.partial(record_meta_losses, inner_lr=inner_lr, weight_decay=weight_decay, mu=cfg.mu,
                                   teacher=teacher, kl_direction=cfg.kl_direction)
        settings = {"lr": lr, "steps": int(round_config["local_steps"]), "batch_size": int(round_config["batch_size"]),
                    "grad_clip": float(round_config.get("grad_clip", 0.0))}
        try:
            with warnings.catch_warnings():
                # the inner step makes the torch.func path the only one for this loss: no news to report each round
                warnings.simplefilter("ignore", GenericPathWarning)
                loss, event = self.fit(learner, data, settings, rng,
                                       per_sample_loss=losses,
                                       extra_loss=decay if weight_decay > 0 else None)
        finally:
            with torch.no_grad():
                for p in g.parameters():
                    p.mul_(scale)
        assert event is not None   # record level: fit ran DP-SGD, which returns its event
        return loss, event

    def adapted_model(self, x: torch.Tensor, message: Message) -> nn.Module:
        """Download (psi, phi), adapt psi on ``x`` (unlabelled), return the prediction model with the chosen psi."""
        f, g = self.model_from(message.subset(PSI)), self.adapter_from(message.subset(PHI))
        f.eval()   # test time: no dropout noise in the adaptation loss or in FedTTA++'s entropies (meta_train sets
        g.eval()   # train mode again)
        result = self.adaptation(f, g, x, message)
        f.load_state_dict(result.weights, strict=False)
        return f

    @property
    def tta_chunk(self) -> int:
        """The chunk of the test-time l_per: ``tta_chunk``, else the size g was trained on (``batch_size``; one
        record under record-level DP, whose meta-loss is per record)."""
        return self.config.tta_chunk or (1 if self.record_level else self.config.batch_size)

    def adaptation(self, f: nn.Module, g: nn.Module, x: torch.Tensor, message: Message) -> Adaptation:
        """The test-time adaptation of this method's settings on ``x`` (see :func:`adapt`)."""
        cfg = self.config
        x = x.to(device_of(f))      # the inputs go where the models compute
        result = adapt(f, g, dict(f.named_parameters()), dict(g.named_parameters()), x,
                       inner_lr=float(message.config.get("inner_lr", cfg.inner_lr)), steps=cfg.tta_steps,
                       patience=cfg.patience, chunk=self.tta_chunk, weight_decay=cfg.weight_decay,
                       grad_clip=cfg.grad_clip or 0.0, unadapted_candidate=cfg.unadapted_candidate)
        if self.adaptation_log is not None:
            self.adaptation_log.append(result)
        return result

    def evaluation_model(self, data: TrainingClient, message: Message, state: ClientState) -> nn.Module:
        return self.adapted_model(data.x_val, message)

    def novel_model(self, novel: NovelClient, message: Message) -> nn.Module:
        return self.adapted_model(novel.x, message)

    def central_model(self, message: Message) -> nn.Module:
        """The downloaded prediction model psi, before any client adapts it."""
        return self.model_from(message.subset(PSI))


def meta_train(f: nn.Module, g: nn.Module, x: torch.Tensor, y: torch.Tensor, round_config: dict,
               config: FedTTAConfig, *, rng, teacher: dict[str, torch.Tensor] | None = None) -> float:
    """``local_steps`` meta-steps (steps 1-5) on (x, y), updating ``f`` and ``g`` in place; the mean CE (nats).

    ``teacher`` is the frozen server psi of the proxy term (FedTTA-Prox/++).
    """
    if len(y) == 0:
        raise ValueError("meta_train needs at least one training sample")
    steps, batch_size = int(round_config["local_steps"]), int(round_config["batch_size"])
    opt = MetaOptimizer(f, g, round_config, config.adapt_momentum)
    device = device_of(f)      # the batches and the teacher go where the models compute
    teacher = None if teacher is None else {k: v.detach().to(device) for k, v in teacher.items()}
    total = 0.0
    for index in minibatches(len(y), batch_size, steps, rng):
        batch = torch.from_numpy(index)
        xb, yb = x[batch].to(device), y[batch].to(device)
        teacher_logits = None
        if teacher is not None:   # the frozen server model predicts as a served model does: in eval mode
            f.eval()
            with torch.no_grad():
                teacher_logits = functional_call(f, teacher, (xb,))
            f.train()
        loss, ce = meta_loss(f, g, opt.psi, opt.phi, xb, yb, inner_lr=opt.inner_lr, weight_decay=opt.weight_decay,
                             mu=config.mu, teacher_logits=teacher_logits, kl_direction=config.kl_direction)
        opt.step(loss)
        total += ce.item()
    return total / steps


class MetaOptimizer:
    """The optimiser of one client's meta-training on (psi, phi) (:func:`meta_train`, and HeteroFedTTA's Digest
    step): SGD with psi at ``lr`` and phi at ``adapt_lr`` with momentum ``adapt_momentum``, the round's weight decay,
    and each model's gradient clipped to ``grad_clip`` (0: no clip). Puts ``f`` and ``g`` in train mode; ``psi`` and
    ``phi`` are their parameters by name, ``inner_lr`` and ``weight_decay`` the round's for the loss."""

    def __init__(self, f: nn.Module, g: nn.Module, round_config: dict, adapt_momentum: float) -> None:
        lr, self.inner_lr, adapt_lr = (float(round_config[k]) for k in ("lr", "inner_lr", "adapt_lr"))
        self.weight_decay = float(round_config.get("weight_decay", 0.0))
        self.grad_clip = float(round_config.get("grad_clip", 0.0))
        f.train()
        g.train()
        self.psi: dict[str, torch.Tensor] = dict(f.named_parameters())
        self.phi: dict[str, torch.Tensor] = dict(g.named_parameters())
        self.optimizer = torch.optim.SGD([
            {"params": list(self.psi.values()), "lr": lr},
            {"params": list(self.phi.values()), "lr": adapt_lr, "momentum": adapt_momentum},
        ], lr=lr, weight_decay=self.weight_decay)

    def step(self, loss: torch.Tensor) -> None:
        """One step down ``loss``: backward, the per-model clip, the SGD step."""
        self.optimizer.zero_grad(set_to_none=True)
        loss.backward()
        if self.grad_clip > 0:
            torch.nn.utils.clip_grad_norm_(self.psi.values(), self.grad_clip)
            torch.nn.utils.clip_grad_norm_(self.phi.values(), self.grad_clip)
        self.optimizer.step()


#: Every mode runs (module docstring): record level trains the per-record meta-loss with DP-SGD; the server step is
#: the mean of the clients' updates, so central and distributed DP step from their noisy mean; local DP is the layer's.
FEDTTA_PRIVACY = supported_modes()
#: A small adaptation model for the conformance runs.
SMOKE = {"adapt_hidden": 4, "adapt_layers": 1}

register_method(
    "fedtta", strategy=FedTTAStrategy, client=FedTTAClient, config=FedTTAConfig,
    description="FedTTA: meta-learned prediction and adaptation models, averaged; novel clients adapt locally "
                "with the learned unsupervised loss (one step) and send nothing",
    privacy=FEDTTA_PRIVACY, smoke_settings=SMOKE, devices=ANY_DEVICE,
    central_eval=None,
)
register_method(
    "fedtta_prox", strategy=FedTTAStrategy, client=FedTTAClient, config=FedTTAProxConfig,
    description="FedTTA-Prox: FedTTA plus mu * KL to the frozen server model's outputs",
    privacy=FEDTTA_PRIVACY, smoke_settings=SMOKE, devices=ANY_DEVICE,
    central_eval=None,
)
register_method(
    "fedtta_pp", strategy=FedTTAStrategy, client=FedTTAClient, config=FedTTAPPConfig,
    description="FedTTA++: FedTTA-Prox with entropy early-stopped test-time adaptation (up to 50 steps, keeps "
                "the lowest-entropy model)",
    privacy=FEDTTA_PRIVACY, smoke_settings={**SMOKE, "tta_steps": 3}, devices=ANY_DEVICE,
    central_eval=None,
)
