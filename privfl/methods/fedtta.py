"""FedTTA, FedTTA-Prox and FedTTA++ (Ye et al. 2023, "UPFL: Unsupervised Personalized FL towards New Clients").

Every training client meta-learns two models: the prediction model f(.; psi) and a small adaptation model
g(.; phi), an MLP over the logits (K -> 32 -> 32 -> 32 -> 1) whose output norm over a batch is an unsupervised loss.
The server averages both, FedAvg style. A novel client downloads (psi, phi), adapts psi on its own unlabelled data
with that loss and predicts; it sends nothing.

Local meta-step on training client i (paper Eqs. 3-9, Alg. 1; one of ``local_steps`` per round):

1. draw a minibatch (X, Y) of ``batch_size`` from the client's train split (support = query set);
2. Z = f(X; psi); l_per = ||g(Z; phi)||_2, the L2 norm of the B per-sample outputs (Eq. 4);
3. inner step, kept differentiable: psi~ = psi - inner_lr * grad_psi l_per (Eq. 5; ``torch.func.functional_call``
   plus ``autograd.grad(create_graph=True)``);
4. L = CE(f(X; psi~), Y) (Eq. 6) + mu * KL(softmax(f(X; psi_server)) || softmax(Z)) for FedTTA-Prox/++ (Eq. 13; the
   teacher is the frozen server model, the student the *pre-adaptation* logits; ``kl_direction`` flips it);
5. psi <- psi - lr * grad_psi L and phi <- phi - adapt_lr * grad_phi L (Eqs. 7-8). grad_phi L exists only through
   the inner gradient (the mixed second derivative d^2 l_per / dpsi dphi), so the second-order terms are required.

Server (Alg. 1): psi_{r+1} = psi_r + mean_i Delta psi_i, phi_{r+1} = phi_r + mean_i Delta phi_i (uniform mean as in
the paper; ``weighted=True`` weights by train-split size as the authors' code does).

Test time on a novel client (Eqs. 10-12), with phi frozen:

1. l_per(psi) = mean over batch_size-sample chunks (64 on MNIST) of ||g(f(x_chunk; psi); phi)||_2 over the client's
   whole unlabelled set (the chunking keeps the loss on the training scale: the norm grows like sqrt(B));
2. psi <- psi - inner_lr * grad_psi l_per; FedTTA and FedTTA-Prox take ``tta_steps = 1`` step;
3. FedTTA++ (paper section 3.3.2): up to ``tta_steps = 50`` steps; after each, the mean prediction entropy
   H = mean_x -sum_k p_k log p_k; the iterates compete with iterate 0 (the unadapted model); stop after ``patience``
   steps without a strict decrease and return the **lowest-entropy iterate**. (The released code multiplies by the
   patience counter instead of the probabilities, so its argmin is always iterate 0, the unadapted model; this
   follows the paper.) Whether iterate 0 competes is ``unadapted_candidate``: ``True`` (default) as the released code
   has it; ``False`` as the paper's Algorithm 1 writes it, where the candidates are the iterates after each step
   (so at least one step is always served, and the stopping count starts at step 1).
4. predict argmax f(x; psi) on the same data (transductive).

Training clients are scored the same way, adapting on their unlabelled validation split (paper: "validation").

Registered as ``fedtta`` (mu = 0, one test-time step), ``fedtta_prox`` (mu = 0.01) and ``fedtta_pp`` (mu = 0.01,
early-stopped adaptation, up to 50 steps, patience 1); the defaults are the paper's MNIST values (Table 4).

Privacy
-------
Without ``dp_epsilon`` a round's release is the full (Delta psi, Delta phi), recorded as non-private. With it, each
release is client-level DP: the concatenated update is clipped to ``dp_max_norm`` and noised on the client by
:class:`privfl.privacy.client_dp.ClientLevelGaussian`, calibrated so that the client is (dp_epsilon, dp_delta)-DP
over ``dp_participations`` releases (the argument, including why client sampling gives no amplification here, is in
that module). Each release carries that lifetime budget (``calibrated_for``), so the client's ledger refuses a
release beyond the cap, also after a resume; a schedule of client sampling that would take a client past it is
refused before the run starts (:func:`privfl.experiment.build_runtime`). Novel clients release nothing.

Why per-sample DP-SGD does not apply directly: DP-SGD bounds each record's influence by clipping per-sample
gradients of a loss that is a sum over records. The meta-loss is not: psi~ depends on l_per = ||g(f(X))||_2, a norm
over the whole batch, so every record's outer loss depends on every other record of the batch, and one record can
move the gradient of all of them (Opacus' per-sample hooks would silently compute something else, and they do not
follow ``create_graph`` inner loops). The valid alternative is microbatch clipping: split each Poisson-sampled batch
into disjoint microbatches of s records (assigned by a per-record key so that adding or removing a record changes
one microbatch only), run steps 2-5 inside each microbatch, clip each microbatch's meta-gradient (psi and phi
together) to C, sum, add N(0, sigma^2 C^2) and account as DP-SGD with sampling rate B / n (add-or-remove-one: one
record touches one clipped unit). s = 64 keeps the paper's statistic but gives one clipped unit per step; s = 1
makes the loss per-sample (|g(z)|) and changes the statistic seen at test time. Not implemented here.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn
from torch.func import functional_call


from accounting.validation import is_finite, is_int_at_least
from privfl.errors import check
from privfl.data import NovelClient, TrainingClient
from privfl.federation.messages import Message, Release, prefixed
from privfl.federation.seeding import derive_seed, seeded_init
from privfl.methods.base import (
    ClientContext,
    ClientProcedure,
    ClientState,
    LocalTrainingConfig,
    Strategy,
    register_method,
)
from privfl.methods.fedavg import weighted_mean, weighted_mean_scalar
from privfl.methods.local_training import difference, minibatches, weights_of
from privfl.privacy.client_dp import MODES, ClientLevelGaussian

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
    (``None``: ``batch_size``, the size the training loss was computed on). ``adapt_hidden`` and ``adapt_layers``
    shape g. ``weighted`` weights the server mean by train-split size. ``lr_decay`` decays eta_out, eta_in and eta_ad
    alike. ``weight_decay`` applies to both models and to the inner step; ``grad_clip`` clips psi's and phi's
    meta-gradients separately and the test-time gradient.

    Client-level DP (see module docstring): ``dp_epsilon`` (None: off), ``dp_delta``, ``dp_max_norm`` (C, joint L2
    norm of (Delta psi, Delta phi)), ``dp_participations`` (the most rounds one client takes part in; required with
    ``dp_epsilon``; a further release raises), ``dp_mode`` and ``dp_shares`` (``"distributed"``: M), ``dp_noise``
    (``"secure"``, the default, OS-seeded; ``"seeded"``: reproducible research runs from the client's own
    ``dp_noise_seed``). Under DP a client whose local loss diverged releases noise around a zero update rather than
    staying silent.
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
    dp_epsilon: float | None = None
    dp_delta: float = 1e-5
    dp_max_norm: float = 1.0
    dp_participations: int | None = None
    dp_mode: str = "local"
    dp_shares: int = 1
    dp_noise: str = "secure"
    dp_noise_seed: int = 0

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
                      "None (batch_size) or an integer >= 1")
        check.require(isinstance(self.weighted, bool), "weighted", self.weighted, "True or False")
        check.require(isinstance(self.unadapted_candidate, bool), "unadapted_candidate", self.unadapted_candidate,
                      "True or False")
        check.require(self.dp_mode in MODES, "dp_mode", self.dp_mode, f"one of {', '.join(MODES)}")
        if self.dp_epsilon is not None:
            check.require(is_finite(self.dp_epsilon) and self.dp_epsilon > 0, "dp_epsilon", self.dp_epsilon,
                          "None or a finite number > 0")
            check.require(is_finite(self.dp_delta) and 0 < self.dp_delta < 1, "dp_delta", self.dp_delta, "in (0, 1)")
            check.require(is_finite(self.dp_max_norm) and self.dp_max_norm > 0, "dp_max_norm", self.dp_max_norm,
                          "a finite number > 0")
            check.require(is_int_at_least(self.dp_participations, 1), "dp_participations", self.dp_participations,
                          "an integer >= 1 with dp_epsilon (the most rounds one client takes part in)")
            check.require(not self.weighted, "weighted", self.weighted,
                          "False with dp_epsilon (the sample count is data-dependent and not released)")
            check.require(is_int_at_least(self.dp_shares, 1) and (self.dp_mode == "distributed" or self.dp_shares == 1),
                          "dp_shares", self.dp_shares, "an integer >= 1, and 1 unless dp_mode='distributed'")
            check.require(self.dp_noise in ("secure", "seeded"), "dp_noise", self.dp_noise, "'secure' or 'seeded'")
            check.require(isinstance(self.dp_noise_seed, int) and not isinstance(self.dp_noise_seed, bool),
                          "dp_noise_seed", self.dp_noise_seed, "an int")

    @property
    def training_dp(self) -> str | None:
        """What protects the training clients' releases (``None``: nothing), read by
        :class:`~privfl.experiment.RunConfig`."""
        return None if self.dp_epsilon is None else f"client-level DP (dp_epsilon={self.dp_epsilon})"

    @property
    def shares_per_round(self) -> int | None:
        """M of ``dp_mode="distributed"``: the clients whose noise shares make up each round's sum (else ``None``)."""
        return self.dp_shares if self.dp_epsilon is not None and self.dp_mode == "distributed" else None

    @property
    def participation_cap(self) -> int | None:
        """The most rounds a training client may take part in (``dp_participations``; ``None``: no cap)."""
        return None if self.dp_epsilon is None else self.dp_participations

    def round_config(self, round: int) -> dict:
        decay = self.lr_decay ** (round / 10)
        return {**super().round_config(round), "inner_lr": self.inner_lr * decay, "adapt_lr": self.adapt_lr * decay}

    def privacy(self, generator: torch.Generator | None = None) -> ClientLevelGaussian | None:
        """The client-level mechanism of one client, or ``None`` without ``dp_epsilon``."""
        if self.dp_epsilon is None:
            return None
        return ClientLevelGaussian(epsilon=self.dp_epsilon, delta=self.dp_delta, max_norm=self.dp_max_norm,
                                   participations=self.dp_participations, mode=self.dp_mode,
                                   num_shares=self.dp_shares, generator=generator)


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
        norm = torch.sqrt(sum((gr ** 2).sum() for gr in grads))
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
    """Holds (psi, phi); sends both every round; averages both models' changes (uniform, or by sample count)."""

    def __init__(self, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self.psi = weights_of(self.model_factory.init(self.seed))
        g = seeded_init(adaptation_factory(self.model_factory.num_classes, self.config),
                        derive_seed(self.seed, "fedtta_adaptation_model"))
        self.phi = weights_of(g)
        self.rounds_done = 0

    def _message(self, round: int) -> Message:
        return Message(arrays={**prefixed(PSI, self.psi), **prefixed(PHI, self.phi)},
                       config=self.config.round_config(round))

    def configure_train(self, round: int, client_ids: list[int]) -> dict[int, Message]:
        message = self._message(round)
        return {cid: message for cid in client_ids}

    def aggregate_train(self, round: int, replies: dict[int, Message]) -> dict[str, float]:
        self.rounds_done = round + 1
        if not replies:
            return {}
        ids = sorted(replies)
        counts = [replies[cid].metrics.get("num_examples", 1.0) if self.config.weighted else 1.0 for cid in ids]
        change = weighted_mean([replies[cid].arrays for cid in ids], counts)
        self.psi = {k: v + change[PSI + k] for k, v in self.psi.items()}
        self.phi = {k: v + change[PHI + k] for k, v in self.phi.items()}
        losses = [replies[cid].metrics["loss"] for cid in ids if "loss" in replies[cid].metrics]
        return {"train_loss": weighted_mean_scalar(losses, [1.0] * len(losses))} if losses else {}

    def novel_request(self, client_id: int) -> Message:
        # The test-time step uses eta_in decayed to the last trained round (the paper does not say which rate;
        # docs/papers.md, FedTTA, U8).
        return self._message(max(self.rounds_done - 1, 0))

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
        self._adapter: nn.Module | None = None
        # Set to a list to keep each test-time adaptation's outcome (chosen iterate, steps, entropies): a diagnostic
        # for the experimenter running the clients; nothing in it is sent anywhere.
        self.adaptation_log: list[Adaptation] | None = None

    def adapter_from(self, weights: dict[str, torch.Tensor]) -> nn.Module:
        """The workspace adaptation model loaded with ``weights``."""
        if self._adapter is None:
            self._adapter = adaptation_factory(self.model_factory.num_classes, self.config)()
        self._adapter.load_state_dict(weights)
        return self._adapter

    def train(self, data: TrainingClient, message: Message, state: ClientState, ctx: ClientContext) -> Release | None:
        start_psi, start_phi = message.subset(PSI), message.subset(PHI)
        f, g = self.model_from(start_psi), self.adapter_from(start_phi)
        loss = meta_train(f, g, data.x_train, data.y_train, message.config, self.config, rng=ctx.rng,
                          teacher=start_psi if self.config.mu > 0 else None)
        generator = None
        if self.config.dp_noise == "seeded":   # the client's own seed; never the run seed, which the server knows
            generator = torch.Generator().manual_seed(
                derive_seed(self.config.dp_noise_seed, "fedtta_client_dp", ctx.round, ctx.client_id))
        mechanism = self.config.privacy(generator=generator)
        update = {**prefixed(PSI, difference(weights_of(f), start_psi)),
                  **prefixed(PHI, difference(weights_of(g), start_phi))}
        # Diverged: a non-finite loss, or a finite loss whose last step still overflowed the weights.
        if not (math.isfinite(loss) and all(torch.isfinite(v).all() for v in update.values())):
            if mechanism is None:
                return None  # a diverged client sends nothing (the authors' code gives it weight 0)
            # Under DP a diverged client still releases (noise around a zero update): whether it speaks, or fails,
            # would otherwise depend on its data, outside any mechanism.
            update = {**prefixed(PSI, {k: torch.zeros_like(v) for k, v in start_psi.items()}),
                      **prefixed(PHI, {k: torch.zeros_like(v) for k, v in start_phi.items()})}
        if mechanism is None:
            return Release.non_private(Message(arrays=update, metrics={"num_examples": float(data.num_train),
                                                                       "loss": loss}), purpose="model_update")
        noisy, event, _ = mechanism.release(update)
        # Only the noised update leaves: sample count and loss are data-dependent and no mechanism covers them. The
        # cap of dp_participations releases is the ledger's (calibrated_for): a count in the client's state would
        # roll back with it when a run resumes from a checkpoint, while the releases made since stay recorded.
        return Release(Message(arrays=noisy), purpose="model_update", event=event,
                       metadata={"noise": self.config.dp_noise, "max_norm": self.config.dp_max_norm,
                                 "relation": "replace one client's whole dataset", "mode": self.config.dp_mode,
                                 "participations": mechanism.participations, "num_shares": mechanism.num_shares},
                       calibrated_for=mechanism.lifetime_budget)

    def adapted_model(self, x: torch.Tensor, message: Message) -> nn.Module:
        """Download (psi, phi), adapt psi on ``x`` (unlabelled), return the prediction model with the chosen psi."""
        f, g = self.model_from(message.subset(PSI)), self.adapter_from(message.subset(PHI))
        f.eval()   # test time: no dropout noise in the adaptation loss or in FedTTA++'s entropies (meta_train sets
        g.eval()   # train mode again)
        result = self.adaptation(f, g, x, message)
        f.load_state_dict(result.weights, strict=False)
        return f

    def adaptation(self, f: nn.Module, g: nn.Module, x: torch.Tensor, message: Message) -> Adaptation:
        """The test-time adaptation of this method's settings on ``x`` (see :func:`adapt`)."""
        cfg = self.config
        result = adapt(f, g, dict(f.named_parameters()), dict(g.named_parameters()), x,
                       inner_lr=float(message.config.get("inner_lr", cfg.inner_lr)), steps=cfg.tta_steps,
                       patience=cfg.patience, chunk=cfg.tta_chunk or cfg.batch_size, weight_decay=cfg.weight_decay,
                       grad_clip=cfg.grad_clip or 0.0, unadapted_candidate=cfg.unadapted_candidate)
        if self.adaptation_log is not None:
            self.adaptation_log.append(result)
        return result

    def evaluation_model(self, data: TrainingClient, message: Message, state: ClientState) -> nn.Module:
        return self.adapted_model(data.x_val, message)

    def novel_model(self, novel: NovelClient, message: Message) -> nn.Module:
        return self.adapted_model(novel.x, message)


def meta_train(f: nn.Module, g: nn.Module, x: torch.Tensor, y: torch.Tensor, round_config: dict,
               config: FedTTAConfig, *, rng, teacher: dict[str, torch.Tensor] | None = None) -> float:
    """``local_steps`` meta-steps (steps 1-5) on (x, y), updating ``f`` and ``g`` in place; the mean CE (nats).

    ``teacher`` is the frozen server psi of the proxy term (FedTTA-Prox/++).
    """
    if len(y) == 0:
        raise ValueError("meta_train needs at least one training sample")
    lr, inner_lr, adapt_lr = (float(round_config[k]) for k in ("lr", "inner_lr", "adapt_lr"))
    steps, batch_size = int(round_config["local_steps"]), int(round_config["batch_size"])
    weight_decay, grad_clip = float(round_config.get("weight_decay", 0.0)), float(round_config.get("grad_clip", 0.0))
    f.train()
    g.train()
    psi, phi = dict(f.named_parameters()), dict(g.named_parameters())
    optimizer = torch.optim.SGD([
        {"params": list(psi.values()), "lr": lr},
        {"params": list(phi.values()), "lr": adapt_lr, "momentum": config.adapt_momentum},
    ], lr=lr, weight_decay=weight_decay)
    teacher = None if teacher is None else {k: v.detach() for k, v in teacher.items()}
    total = 0.0
    for index in minibatches(len(y), batch_size, steps, rng):
        batch = torch.from_numpy(index)
        xb, yb = x[batch], y[batch]
        teacher_logits = None
        if teacher is not None:   # the frozen server model predicts as a served model does: in eval mode
            f.eval()
            with torch.no_grad():
                teacher_logits = functional_call(f, teacher, (xb,))
            f.train()
        loss, ce = meta_loss(f, g, psi, phi, xb, yb, inner_lr=inner_lr, weight_decay=weight_decay, mu=config.mu,
                             teacher_logits=teacher_logits, kl_direction=config.kl_direction)
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        if grad_clip > 0:
            torch.nn.utils.clip_grad_norm_(psi.values(), grad_clip)
            torch.nn.utils.clip_grad_norm_(phi.values(), grad_clip)
        optimizer.step()
        total += ce.item()
    return total / steps


register_method(
    "fedtta", strategy=FedTTAStrategy, client=FedTTAClient, config=FedTTAConfig,
    description="FedTTA: meta-learned prediction and adaptation models, averaged; novel clients adapt locally "
                "with the learned unsupervised loss (one step) and send nothing",
)
register_method(
    "fedtta_prox", strategy=FedTTAStrategy, client=FedTTAClient, config=FedTTAProxConfig,
    description="FedTTA-Prox: FedTTA plus mu * KL to the frozen server model's outputs",
)
register_method(
    "fedtta_pp", strategy=FedTTAStrategy, client=FedTTAClient, config=FedTTAPPConfig,
    description="FedTTA++: FedTTA-Prox with entropy early-stopped test-time adaptation (up to 50 steps, keeps "
                "the lowest-entropy model)",
)
