"""IT-PFL-HN, the two-phase variant of ODPFL-HN (Amosy et al., App. B.2; the main method of the earlier version,
"Inference-Time Personalized Federated Learning"; docs/papers.md, ODPFL-HN): pFedHN with an encoder learned beside
it, so a novel unlabelled client can be served.

Phase 1 trains pFedHN and regresses a set encoder ``g_gamma`` onto the embedding rows; phase 2 freezes the encoder and
fine-tunes the hypernetwork on encoder outputs. Training clients are scored with the pre-fine-tune hypernetwork; a
novel client releases one descriptor ``g_gamma(X_new)`` (through :func:`~privfl.privacy.privatize` when
:class:`~privfl.privacy.training.NovelPrivacy` is set) and receives ``f_theta(e_new)``.

Entry points: :class:`ITPFLHNConfig`, :class:`ITPFLHNStrategy`, :class:`ITPFLHNClient` (registered as ``itpflhn``).

Both phases step by step, model selection across the phase boundary, and each privacy mode (the record-level
encoder regression in two releases): docs/methods/hypernetworks.md, "IT-PFL-HN".
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn

from accounting.validation import is_finite
from privfl.data import NovelClient, TrainingClient
from privfl.devices import ANY_DEVICE, on_cpu, on_device
from privfl.errors import ConfigError, TrainingDivergedError, check
from privfl.federation.messages import Message, Release, prefixed
from privfl.federation.seeding import derive_seed, seeded_init
from privfl.methods.base import ClientContext, ClientState, private_release, register_method, supported_modes
from privfl.methods.fedavg import sample_weights, weighted_mean
from privfl.methods.pfedhn import SMOKE_SETTINGS, PFedHNClient, PFedHNConfig, PFedHNStrategy
from privfl.models.encoders import PRIVATIZABLE, build_encoder, encoder_options
from privfl.models.pefll import clipped_rows
from privfl.privacy.record import RecordRelease, Repeated, made_in_turn
from privfl.privacy.training import RECORD, NovelPrivacy, TrainingPrivacy

#: The privacy modes this method runs, and why it refuses the others.
ITPFLHN_PRIVACY = supported_modes(
    distributed="its round is two releases (weight change, then encoder update; or descriptor, then weight "
                "change) and its server chain-rules each client's weight change through the hypernetwork at that "
                "client's own row or descriptor: it needs each client's messages on their own, while secure "
                "aggregation shows only sums")

_ENCODER = "encoder/"
#: The prefix of a central-DP contribution's encoder change.
ENC = "enc."


#: Why an encoder other than the DP-ready DeepSet cannot be made private (refused by name).
_NOT_PRIVATIZABLE = {
    "deepset": "its max-pooled half moves by O(1) when one sample changes, whatever n",
    "dss": "its layers mix every sample with the set's sum before pooling",
    "set_transformer": "its attention lets one sample dominate the pooled output",
}


@dataclass(frozen=True)
class ITPFLHNConfig(PFedHNConfig):
    """pFedHN's settings plus the encoder and the phases.

    ``encoder``: a name of :data:`privfl.models.encoders.ENCODERS` (``"deepset"``: mean+max DeepSet, the papers';
    ``"dp_deepset"``: phi -> mean -> psi, the only one DP can certify, and so the one record-level DP and a private
    ``novel_privacy`` accept; ``"dss"``, ``"set_transformer"``);
    ``encoder_options``: its keyword options (e.g. ``{"hidden": 500}``).
    ``encoder_lr``, ``encoder_momentum``, ``encoder_weight_decay`` (``None``: ``hn_weight_decay``, as the paper
    gives no encoder optimiser; docs/papers.md, ODPFL-HN, U4),
    ``encoder_steps``: the clients' local SGD on the regression loss (full-batch steps per round).
    ``phase1_rounds``: rounds of phase 1; later rounds fine-tune (a run of R rounds fine-tunes for the last
    ``R - phase1_rounds``, none if R <= phase1_rounds; the paper does not give the split of its 500 rounds, and
    400 + 100 is an example).
    ``finetune_lr``: the hypernetwork's learning rate in phase 2 (``None``: ``hn_lr``).

    ``encoder_lr`` defaults to 1e-3 (the paper gives none): the regression loss is a sum over the descriptor's
    coordinates of a set function of a client's whole training split, and on MNIST (pathological, 100 clients) 1e-2
    with momentum 0.9 diverged in the first round (loss 1.7e5, then NaN), while 1e-3 stayed near 10. A non-finite
    encoder update is refused at the server (:class:`~privfl.errors.ConfigError` naming ``encoder_lr``).
    """

    encoder: str = "deepset"
    encoder_options: dict[str, Any] = field(default_factory=dict)
    encoder_lr: float = 1e-3
    encoder_momentum: float = 0.9
    encoder_weight_decay: float | None = None
    encoder_steps: int = 5
    phase1_rounds: int = 400
    finetune_lr: float | None = None

    def __post_init__(self) -> None:
        super().__post_init__()
        valid = encoder_options(self.encoder)          # raises ConfigError naming the valid encoders
        check.require(isinstance(self.encoder_options, dict) and set(self.encoder_options) <= set(valid),
                      "encoder_options", self.encoder_options,
                      f"a dict of options of {self.encoder!r}: {', '.join(valid)}")
        check.require(is_finite(self.encoder_lr) and self.encoder_lr > 0, "encoder_lr", self.encoder_lr,
                      "a finite number > 0")
        check.require(is_finite(self.encoder_momentum) and 0 <= self.encoder_momentum < 1, "encoder_momentum",
                      self.encoder_momentum, "in [0, 1)")
        check.require(self.encoder_weight_decay is None or (is_finite(self.encoder_weight_decay)
                                                       and self.encoder_weight_decay >= 0),
                      "encoder_weight_decay", self.encoder_weight_decay,
                      "None (hn_weight_decay) or a finite number >= 0")
        check.require(isinstance(self.encoder_steps, int) and not isinstance(self.encoder_steps, bool)
                      and self.encoder_steps >= 1, "encoder_steps", self.encoder_steps, "an integer >= 1")
        check.require(isinstance(self.phase1_rounds, int) and not isinstance(self.phase1_rounds, bool)
                      and self.phase1_rounds >= 0, "phase1_rounds", self.phase1_rounds, "an integer >= 0")
        check.require(self.finetune_lr is None or (is_finite(self.finetune_lr) and self.finetune_lr > 0), "finetune_lr",
                      self.finetune_lr, "None (hn_lr) or a finite number > 0")

    def check_privacy(self, privacy: TrainingPrivacy, novel_privacy: NovelPrivacy) -> None:
        """Refuse, before the run, an encoder the run's privacy cannot hold with (and pFedHN's batch clip under
        record-level DP): record-level DP and a private novel descriptor need phi -> mean -> psi."""
        super().check_privacy(privacy, novel_privacy)
        if self.encoder in PRIVATIZABLE:
            return
        why = _NOT_PRIVATIZABLE.get(self.encoder, "it is not phi -> mean -> psi")
        for needed, what in ((privacy.mode == RECORD, "privacy mode 'record' (every descriptor and encoder update of "
                                                      "a training client is a DP release)"),
                             (novel_privacy.private, "novel_privacy (the novel client's descriptor)")):
            if needed:
                raise ConfigError(f"itpflhn with {what} needs an encoder whose output is a mean over samples that "
                                  f"can be clipped and noised ({', '.join(PRIVATIZABLE)}); encoder={self.encoder!r} "
                                  f"cannot be made private: {why}")

    def encoder_config(self) -> dict:
        """The clients' encoder-regression settings, as sent in phase 1 stage 1."""
        wd = self.hn_weight_decay if self.encoder_weight_decay is None else self.encoder_weight_decay
        return {"encoder_lr": self.encoder_lr, "encoder_momentum": self.encoder_momentum,
                "encoder_weight_decay": wd, "encoder_steps": self.encoder_steps}


def make_encoder(config: ITPFLHNConfig, input_shape: tuple[int, ...], embed_dim: int) -> nn.Module:
    """The configured encoder for samples of ``input_shape`` with descriptors of size ``embed_dim``."""
    return build_encoder(config.encoder, input_shape, embed_dim, **config.encoder_options)


class ITPFLHNStrategy(PFedHNStrategy):
    """pFedHN's state plus the encoder weights and the pre-fine-tune hypernetwork (from the first phase-2 round)."""

    train_stages = 2

    def __init__(self, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        encoder = seeded_init(lambda: make_encoder(self.config, self.model_factory.input_shape, self.embed_dim),
                              derive_seed(self.seed, "itpflhn_encoder"))
        self.encoder_weights = {k: v.detach().clone() for k, v in encoder.state_dict().items()}
        self.pre_finetune: dict[str, torch.Tensor] | None = None
        #: The shared part at the end of phase 1 (with a shared part, from the first phase-2 round).
        self.pre_finetune_shared: dict[str, torch.Tensor] | None = None
        self._weight_changes: dict[int, Message] = {}
        self._descriptors: dict[int, torch.Tensor] = {}

    def in_phase2(self, round: int) -> bool:
        return round >= self.config.phase1_rounds

    def _encoder_message(self, **config: Any) -> Message:
        return Message(arrays=prefixed(_ENCODER, self.encoder_weights), config={"embed_dim": self.embed_dim, **config})

    def configure_train(self, round: int, client_ids: list[int]) -> dict[int, Message]:
        if not self.in_phase2(round):                                             # phase 1, step 1
            messages = super().configure_train(round, client_ids)
            for message in messages.values():
                message.config["phase"] = 1
            return messages
        if self.pre_finetune is None:                                             # step 4
            self.pre_finetune = self.hypernetwork_state()
            self.hn_momentum = {}
            if self.shared_part:
                self.pre_finetune_shared = self.shared_part.snapshot()
                self.shared_part.momentum = {}
        self._descriptors = {}
        return {cid: self._encoder_message(phase=2) for cid in client_ids}        # step 5

    def configure_stage(self, round: int, stage: int, replies: dict[int, Message]) -> dict[int, Message]:
        if not self.in_phase2(round):                                             # phase 1, step 2
            self._weight_changes = replies
            config = {"phase": 1, **self.config.encoder_config()}
            messages = {}
            for cid in sorted(replies):
                message = self._encoder_message(**config)
                message.arrays["embedding"] = self._sent[cid].to("cpu", copy=True)
                messages[cid] = message
            return messages
        self._descriptors = {cid: m.arrays["descriptor"] for cid, m in replies.items()}   # step 6
        config = {**self.config.round_config(round), "phase": 2}
        return {cid: Message(arrays=self.generate(e), config=dict(config)) for cid, e in self._descriptors.items()}

    def aggregate_train(self, round: int, replies: dict[int, Message]) -> dict[str, float]:
        if self.in_phase2(round):                                                 # step 7
            descriptors, self._descriptors = self._descriptors, {}
            lr = self.config.hn_lr if self.config.finetune_lr is None else self.config.finetune_lr
            return self.hypernetwork_update({cid: descriptors[cid] for cid in replies}, replies,
                                            update_embeddings=False, lr=lr)
        changes, self._weight_changes = self._weight_changes, {}                  # step 3
        metrics = super().aggregate_train(round, changes)
        if replies:
            ids = sorted(replies)
            counts = sample_weights(replies, ids)      # private clients send no count or loss: a uniform mean
            delta = weighted_mean([replies[cid].arrays for cid in ids], counts)
            self._move_encoder(round, delta, f"clients {ids}")
            if all("encoder_loss" in replies[cid].metrics for cid in ids):
                losses = [float(replies[cid].metrics["encoder_loss"]) for cid in ids]
                metrics["encoder_loss"] = sum(v * w for v, w in zip(losses, counts)) / sum(counts)
        return metrics

    def _move_encoder(self, round: int, delta: dict[str, torch.Tensor], source: str) -> None:
        if not all(bool(torch.isfinite(v).all()) for v in delta.values()):
            raise TrainingDivergedError(f"round {round}: the encoder regression diverged (non-finite encoder update "
                                        f"from {source}); lower encoder_lr (now {self.config.encoder_lr!r}) or "
                                        "encoder_steps")
        self.encoder_weights = {k: v + delta[k].to(v.dtype) for k, v in self.encoder_weights.items()}

    # -- central DP: the hypernetwork and the encoder move from a noisy mean ------------------------------------------

    def contribution_shapes(self) -> dict[str, torch.Tensor]:
        """The hypernetwork gradient (``"hn."``) and the encoder change (``"enc."``), in both phases."""
        return {**self.hypernetwork_shapes(),
                **prefixed(ENC, {k: torch.zeros_like(v) for k, v in self.encoder_weights.items()})}

    def contributions(self, round: int, replies: dict[int, Message]):
        """Client i's contribution to the shared state: ``g_theta_i`` from its weight change, and its encoder change
        (phase 1) or zeros (phase 2, the encoder is frozen); see the module docstring."""
        if self.in_phase2(round):
            zeros = prefixed(ENC, {k: torch.zeros_like(v) for k, v in self.encoder_weights.items()})
            descriptors = {cid: self._descriptors[cid] for cid in replies}
            for cid, gradient in self.hypernetwork_contributions(descriptors, replies):
                yield cid, {**gradient, **zeros}
            return
        changes = {cid: self._weight_changes[cid] for cid in replies if cid in self._weight_changes}
        for cid, gradient in self.hypernetwork_contributions({cid: self._sent[cid] for cid in changes}, changes):
            yield cid, {**gradient, **prefixed(ENC, replies[cid].arrays)}

    def apply_mean(self, round: int, mean: dict[str, torch.Tensor], count: float) -> dict[str, float]:
        """Steps 3 and 7 from the noisy mean (``count`` = q N): ``theta`` from its part alone, in phase 1 the rows
        from their own gradients and ``gamma += mean encoder change``; in phase 2 at the fine-tuning lr."""
        if self.in_phase2(round):
            self._descriptors = {}
            lr = self.config.hn_lr if self.config.finetune_lr is None else self.config.finetune_lr
            return self.apply_hypernetwork_mean(mean, count, update_embeddings=False, lr=lr)
        self._weight_changes, self._sent = {}, {}
        metrics = self.apply_hypernetwork_mean(mean, count, update_embeddings=True, lr=self.config.hn_lr)
        self._move_encoder(round, {k: mean[ENC + k] for k in self.encoder_weights}, "the noisy mean")
        return metrics

    def configure_evaluate(self, client_id: int) -> Message:
        """Training clients: the pre-fine-tune hypernetwork (and shared part) on their embedding row."""
        return Message(arrays=self.generate(self.embedding(client_id), self.pre_finetune, self.pre_finetune_shared))

    def novel_request(self, client_id: int) -> Message:
        return self._encoder_message()

    def novel_reply(self, client_id: int, delivered: Message | None) -> Message:
        if delivered is None or "descriptor" not in delivered.arrays:
            raise ConfigError(f"itpflhn needs novel client {client_id}'s descriptor, and it sent none")
        descriptor = delivered.arrays["descriptor"]
        if descriptor.shape != (self.embed_dim,) or not torch.isfinite(descriptor).all():
            finite = bool(torch.isfinite(descriptor).all())
            raise ConfigError(f"novel client {client_id} sent a descriptor of shape {tuple(descriptor.shape)} "
                              f"(finite: {finite}); expected a finite one of shape ({self.embed_dim},)")
        return Message(arrays=self.generate(descriptor))

    def state_dict(self) -> dict[str, Any]:
        state = {**super().state_dict(), "encoder": {k: v.clone() for k, v in self.encoder_weights.items()}}
        if self.pre_finetune is not None:
            state["pre_finetune"] = on_cpu(self.pre_finetune)
        if self.pre_finetune_shared is not None:
            state["pre_finetune_shared"] = on_cpu(self.pre_finetune_shared)
        return state

    def load_state_dict(self, state: dict[str, Any]) -> None:
        super().load_state_dict(state)
        self.encoder_weights = {k: v.clone() for k, v in state["encoder"].items()}
        pre = state.get("pre_finetune")
        self.pre_finetune = None if pre is None else on_device(pre, self.device)
        pre_shared = state.get("pre_finetune_shared")
        self.pre_finetune_shared = None if pre_shared is None else on_device(pre_shared, self.device)
        self._weight_changes, self._descriptors = {}, {}


class ITPFLHNClient(PFedHNClient):
    """pFedHN's client plus the encoder: regression in phase 1, descriptors in phase 2 and for novel clients."""

    serves_novel_clients = True

    def encoder_from(self, message: Message) -> nn.Module:
        """The encoder built on the client from the configured architecture and the weights in ``message``, on the
        model factory's device."""
        encoder = make_encoder(self.config, self.model_factory.input_shape, int(message.config["embed_dim"]))
        encoder.load_state_dict(message.subset(_ENCODER))
        return encoder.to(self.model_factory.device)

    @torch.no_grad()
    def descriptor(self, message: Message, x: torch.Tensor) -> torch.Tensor:
        """``g_gamma(X)`` over the whole sample set (one batch, the default of Amosy et al., App. B.1), on the
        CPU."""
        encoder = self.encoder_from(message)
        encoder.eval()
        return encoder(x.to(self.model_factory.device)).detach().cpu()

    # -- record level ---------------------------------------------------------------------------------------------

    def record_releases(self) -> tuple[RecordRelease, ...]:
        """Record level: a phase-1 round, one DP-SGD fit and ``encoder_steps`` steps of two mean releases (phi's
        outputs clipped to B, phi's per-record gradients to C; module docstring). It dominates a phase-2 round
        (:meth:`phase2_releases`) at the same noise multiplier, so it is what every round is calibrated for."""
        step = (self.clipped_mean(self.novel_privacy.bound), self.clipped_mean(float(self.privacy.clip)))
        return (self.dp_sgd_fit(), Repeated(step, self.config.encoder_steps))

    def phase2_releases(self) -> tuple[RecordRelease, ...]:
        """Record level: what a phase-2 round releases (its descriptor, then its weight change)."""
        return (self.clipped_mean(self.novel_privacy.bound), self.dp_sgd_fit())

    # -- rounds ---------------------------------------------------------------------------------------------------

    def train(self, data: TrainingClient, message: Message, state: ClientState, ctx: ClientContext) -> Release:
        if int(message.config["phase"]) == 1:                                     # phase 1, step 1
            return self.local_weight_change(data, message, ctx)
        if not self.record_level:                                                 # phase 2, step 5
            return Release.non_private(Message(arrays={"descriptor": self.descriptor(message, data.x_train)}),
                                       purpose="descriptor")
        descriptor, event = self.record_privatize(self.encoder_from(message), ctx,
                                                 "itpflhn_descriptor").release(data.x_train)
        return private_release(Message(arrays={"descriptor": descriptor.to("cpu", torch.get_default_dtype())}),
                               "descriptor", event, metadata=self._metadata())

    def train_stage(self, stage: int, data: TrainingClient, message: Message, state: ClientState,
                    ctx: ClientContext) -> Release:
        if int(message.config["phase"]) == 2:                                     # phase 2, step 6
            return self.local_weight_change(data, message, ctx)
        if self.record_level:                                                     # phase 1, step 2
            return self.private_encoder_regression(data, message, ctx)
        return self.encoder_regression(data, message)

    def _metadata(self) -> dict[str, Any]:
        return {"noise": self.privacy.noise, "bound": float(self.novel_privacy.bound), "clip": float(self.privacy.clip),
                "min_samples": self.privacy.min_samples, "relation": "add or remove one record; n private"}

    def _regression_optimizer(self, encoder: nn.Module, cfg: dict) -> torch.optim.Optimizer:
        return torch.optim.SGD(encoder.parameters(), lr=float(cfg["encoder_lr"]),
                               momentum=float(cfg["encoder_momentum"]), weight_decay=float(cfg["encoder_weight_decay"]))

    def encoder_regression(self, data: TrainingClient, message: Message) -> Release:
        """Full-batch SGD on ``||g_gamma(X_i) - e_i||^2``; releases ``gamma_new - gamma`` and the mean loss."""
        cfg = message.config
        encoder = self.encoder_from(message)
        encoder.train()
        before = {k: v.detach().clone() for k, v in encoder.state_dict().items()}
        device = self.model_factory.device
        target, x = message.arrays["embedding"].to(device), data.x_train.to(device)
        optimizer = self._regression_optimizer(encoder, cfg)
        total = 0.0
        steps = int(cfg["encoder_steps"])
        for _ in range(steps):
            loss = (encoder(x) - target).pow(2).sum()
            total += float(loss.detach())
            optimizer.zero_grad(set_to_none=True)
            loss.backward()
            optimizer.step()
        change = {k: (v.detach() - before[k]).cpu() for k, v in encoder.state_dict().items()}
        return Release.non_private(
            Message(arrays=change, metrics={"num_examples": float(data.num_train), "encoder_loss": total / steps}),
            purpose="encoder_update")

    def private_encoder_regression(self, data: TrainingClient, message: Message, ctx: ClientContext) -> Release:
        """Record level: ``encoder_steps`` steps of the regression, each from two releases (module docstring,
        a.-d.); releases ``gamma_new - gamma`` with their composed event."""
        cfg = message.config
        encoder = self.encoder_from(message)
        private = self.record_privatize(encoder, ctx, "itpflhn_encoder_regression")
        before = {k: v.detach().clone() for k, v in encoder.state_dict().items()}
        target = message.arrays["embedding"].to(self.model_factory.device)
        phi, psi = encoder.get_submodule("phi"), encoder.get_submodule("psi")
        optimizer = self._regression_optimizer(encoder, cfg)
        x, n = data.x_train, data.num_train      # privatize and the gradient mean move the records to the encoder
        unlabelled = torch.zeros(n, dtype=torch.int64)
        bound = private.bound
        stream = {"noise": private.noise, "generator": private.generator}      # one stream for every draw
        steps = int(self.config.encoder_steps)    # the client's own plan, which its noise is calibrated for
        if int(cfg["encoder_steps"]) != steps:
            raise ConfigError(f"the server asked for {cfg['encoder_steps']!r} private regression steps, but this "
                              f"client's record-level plan, which its noise is calibrated for, is {steps}; nothing "
                              "was released")
        events = []
        for _ in range(steps):
            mechanism = private.mechanism(n)                          # refuses a client below min_samples
            noisy_mean = mechanism.add_noise(private.clipped_mean(x))                                       # a.
            dtype = next(iter(psi.parameters()), target).dtype
            mean = noisy_mean.to(dtype).requires_grad_(True)
            psi_params = [p for p in psi.parameters() if p.requires_grad]
            loss = (psi(mean) - target.to(dtype)).pow(2).sum()
            grads = torch.autograd.grad(loss, [mean, *psi_params], allow_unused=True)                        # b.
            cotangent = grads[0].detach()

            def per_record(model: nn.Module, xb: torch.Tensor, yb: torch.Tensor, u=cotangent) -> torch.Tensor:
                return (clipped_rows(model(xb), bound) * u).sum(dim=1)

            phi_grads, gradient_event, _ = self.record_gradient_mean(phi, per_record, x, unlabelled, stream)  # c.
            optimizer.zero_grad(set_to_none=True)                                                            # d.
            for p, g in zip(psi_params, grads[1:], strict=True):
                p.grad = torch.zeros_like(p) if g is None else g.detach()
            for name, p in phi.named_parameters():
                p.grad = phi_grads[name]
            optimizer.step()
            events.append((mechanism.event, gradient_event))
        change = {k: (v.detach() - before[k]).cpu() for k, v in encoder.state_dict().items()}
        event = made_in_turn(events)
        return private_release(Message(arrays=change), "encoder_update", event, metadata=self._metadata())

    def novel_query(self, novel: NovelClient, message: Message) -> Release:
        """Step 2 of serving: the descriptor of all the client's unlabelled inputs, and nothing else; through
        ``privatize`` (replace-one, n public) when ``novel_privacy`` is set."""
        if not self.novel_privacy.private:
            return Release.non_private(Message(arrays={"descriptor": self.descriptor(message, novel.x)}),
                                       purpose="descriptor")
        return self.novel_descriptor_release(self.encoder_from(message), novel, "itpflhn_novel_descriptor")

    def novel_model(self, novel: NovelClient, message: Message) -> nn.Module:
        return self.load_generated(message.arrays)


register_method(
    "itpflhn", strategy=ITPFLHNStrategy, client=ITPFLHNClient, config=ITPFLHNConfig,
    description="IT-PFL-HN (two-phase ODPFL-HN): pFedHN + an encoder regressed onto the client embeddings, then "
                "hypernetwork fine-tuning on encoder outputs; novel clients send one descriptor",
    privacy=ITPFLHN_PRIVACY,
    releases_per_round=2, novel_privacy=None,
    smoke_settings={**SMOKE_SETTINGS, "encoder": "dp_deepset", "encoder_options": {"hidden": 8},
                    "encoder_steps": 2, "phase1_rounds": 1},
    devices=ANY_DEVICE,
    central_eval="it generates each client's model from that client's own descriptor: no model exists before a client "
                 "sends one",
)
