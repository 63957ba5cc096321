"""ODPFL-HN (Amosy, Eyal and Chechik, "On-Demand Unlabeled Personalized Federated Learning"): a client encoder and a
hypernetwork trained end to end, so that a novel client with unlabelled data gets a personalised model from one
descriptor (docs/papers.md, ODPFL-HN).

The server holds a set encoder g_gamma and a hypernetwork f_theta. A training round (the paper's Algorithm 1) is a
three-stage dialogue with each sampled client: descriptor up, generated model down and weight change up, descriptor
gradient down and encoder gradient up; the server then steps both networks. A novel client receives gamma, releases
its descriptor (optionally through :func:`privfl.privacy.privatize`) and receives f_theta(e).

Entry points: :class:`ODPFLHNConfig`, :class:`ODPFLHNStrategy`, :class:`ODPFLHNClient` (registered as ``odpflhn``)
and :func:`client_descriptor`.

The stages in detail, serving, and the three changes that make the descriptor matter (softmax prototypes, identity
psi, standardised descriptors): docs/methods/hypernetworks.md, "ODPFL-HN".
"""

from __future__ import annotations

import math
from typing import Any

import numpy as np
import torch
from torch import nn

from privfl.data import NovelClient, TrainingClient
from privfl.devices import ANY_DEVICE, device_of, on_cpu, on_device
from privfl.errors import ConfigError, InternalError, TrainingDivergedError
from privfl.federation.messages import Message, Release, prefixed
from privfl.federation.seeding import derive_rng, derive_seed, seeded_init
from privfl.methods.base import (
    ClientContext,
    ClientProcedure,
    ClientState,
    Strategy,
    private_release,
    register_method,
    supported_modes,
)
from privfl.methods.local_training import minibatches, weights_of
from privfl.methods.odpflhn_config import ODPFLHNConfig
from privfl.methods.shared_part import SHARED_PREFIX, SharedPart, mean_of, norm_of
from privfl.models.encoders import build_encoder
from privfl.models.hypernetwork import (
    HyperNetwork,
    RoundGradientMean,
    backprop_weight_change,
    embedding_dim,
    generated_names,
)
from privfl.models.pefll import clipped_rows
from privfl.privacy.record import ClippedMean, RecordRelease

#: The privacy modes this method runs, and why it refuses the others.
ODPFLHN_PRIVACY = supported_modes(
    distributed="the server generates each client's model from that client's own descriptor, which secure "
                "aggregation hides (only sums are seen)")

ENCODER_PREFIX = "encoder."
HN_PREFIX = "hnet."


# -- pieces shared by both sides -------------------------------------------------------------------------------------


def descriptor_dim(config: ODPFLHNConfig, num_training_clients: int) -> int:
    """The descriptor size: ``encoder_hidden`` with an identity psi (the descriptor is phi's pooled mean), else
    ``embed_dim`` or ``floor(N_train / 4)`` (at least 2; the paper's d_e = N/4, App. C)."""
    if config.encoder == "dp_deepset" and config.encoder_psi == "identity":
        return config.encoder_hidden
    return config.embed_dim or max(2, embedding_dim(num_training_clients))


def make_encoder(config: ODPFLHNConfig, input_shape: tuple[int, ...], embed_dim: int) -> nn.Module:
    """The set encoder of ``config`` for samples of ``input_shape`` and descriptors of size ``embed_dim``."""
    return build_encoder(config.encoder, input_shape, embed_dim, **config.encoder_options())


def client_descriptor(encoder: nn.Module, x: torch.Tensor, config: ODPFLHNConfig, *, seed: int) -> torch.Tensor:
    """A training client's descriptor of its inputs ``x`` (graph kept to the encoder).

    Steps: 1. ``"full"``: the encoder on the whole set (ClientEncoding of Algorithm 1); ``"batch_mean"``: the mean of
    the encoder's outputs on random batches of ``descriptor_batch_size`` (App. B.1), the batches drawn from ``seed``;
    2. with ``train_mean_noise`` (dp_deepset only) Gaussian noise of that std is added to the pooled mean before
    psi, drawn from ``seed`` (noise-aware training, docs/papers.md, ODPFL-HN, U12). The same seed gives the same
    descriptor, so
    stage 2 recomputes exactly what stage 0 released.
    """
    device = device_of(encoder)         # the batches go where the encoder computes; the noise is drawn on the CPU
    if config.descriptor == "full":
        sets = [x.to(device)]
    else:
        order = torch.from_numpy(derive_rng(seed, "descriptor_batches").permutation(len(x)))
        sets = [x[index].to(device) for index in torch.split(order, config.descriptor_batch_size)]
    if config.train_mean_noise > 0:
        generator = torch.Generator().manual_seed(derive_seed(seed, "descriptor_noise"))
        outputs = []
        for batch in sets:
            mean = encoder.get_submodule("pool")(encoder.get_submodule("phi")(batch))
            noise = torch.randn(mean.shape, generator=generator, dtype=mean.dtype).to(mean.device)
            outputs.append(encoder.get_submodule("psi")(mean + config.train_mean_noise * noise))
    else:
        outputs = [encoder(batch) for batch in sets]
    return torch.stack(outputs).mean(dim=0)


def _clip_(grads: list[torch.Tensor], max_norm: float | None) -> float:
    norm = float(torch.linalg.vector_norm(torch.stack([torch.linalg.vector_norm(g) for g in grads])))
    if max_norm is not None and norm > max_norm:
        for g in grads:
            g.mul_(max_norm / (norm + 1e-6))
    return norm


# -- server -----------------------------------------------------------------------------------------------------------


class ODPFLHNStrategy(Strategy):
    """Holds the encoder, the hypernetwork, their momentum buffers and the last descriptor of each training client."""

    train_stages = 3

    def __init__(self, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        config: ODPFLHNConfig = self.config
        self.embed_dim = descriptor_dim(config, self.num_training_clients)
        target = self.model_factory.init(self.seed)
        input_shape = tuple(self.model_factory.input_shape)
        #: Where the hypernetwork, the encoder, their momentum and the descriptors live (messages and the saved state
        #: are on the CPU).
        self.device = torch.device(self.model_factory.device)
        generated = generated_names(target, config.generated)
        self.hnet = seeded_init(lambda: HyperNetwork(target, embed_dim=self.embed_dim, hidden_dim=config.hn_hidden,
                                                     n_hidden=config.hn_layers,
                                                     standardize=config.standardize_descriptors,
                                                     generated=generated),
                                derive_seed(self.seed, "hnet_init")).to(self.device)
        #: The shared part (every tensor the hypernetwork does not generate, frozen ones included: the client loads
        #: the whole target), from the target's seeded initialisation.
        self.shared_part = SharedPart(target, [name for name, _ in target.named_parameters() if name not in generated],
                                      lr=config.shared_lr, momentum=config.shared_momentum, device=self.device)
        self.encoder = seeded_init(lambda: make_encoder(config, input_shape, self.embed_dim),
                                   derive_seed(self.seed, "encoder_init")).to(self.device)
        self.momentum: dict[str, dict[str, torch.Tensor]] = {"hnet": {}, "encoder": {}}
        self.descriptors: dict[str, torch.Tensor] = {}
        self._round: dict[str, Any] = {}
        if config.frozen_encoder:
            self.train_stages = 2          # descriptor up, model down, weight change up: nothing to back-propagate

    @property
    def shared(self) -> dict[str, torch.Tensor]:
        """The shared part's tensors as they stand (empty when the hypernetwork generates everything)."""
        return self.shared_part.values

    # -- the round ----------------------------------------------------------------------------------------------------

    def _encoder_message(self, **config: Any) -> Message:
        return Message(arrays=prefixed(ENCODER_PREFIX, weights_of(self.encoder)),
                       config={"embed_dim": self.embed_dim, **config})

    def configure_train(self, round: int, client_ids: list[int]) -> dict[int, Message]:
        """Stage 0: the encoder to every sampled client."""
        self._round = {"descriptors": {}, "hn_grads": RoundGradientMean(self.hnet), "losses": {}}
        message = self._encoder_message(stage=0)
        return {cid: message for cid in client_ids}

    def configure_stage(self, round: int, stage: int, replies: dict[int, Message]) -> dict[int, Message]:
        if stage == 1:
            return self._send_generated_weights(round, replies)
        if stage == 2:
            return self._backprop_changes(replies)
        raise InternalError(f"ODPFL-HN has stages 0, 1, 2; got stage {stage}")

    def _send_generated_weights(self, round: int, replies: dict[int, Message]) -> dict[int, Message]:
        """Stage 1: w_i = f_theta(e_i) to each client that released a descriptor, with the local-training settings."""
        config: ODPFLHNConfig = self.config
        messages = {}
        for cid, reply in replies.items():
            descriptor = reply.arrays["descriptor"].to(self.device, torch.get_default_dtype())
            self._round["descriptors"][cid] = descriptor
            self.descriptors[str(cid)] = descriptor.clone()
        if self.hnet.standardizer is not None and self.descriptors:
            # post-processing of non-private training releases: the latest descriptor of every client seen so far
            self.hnet.standardizer.fit(torch.stack([self.descriptors[k] for k in sorted(self.descriptors)]))
        for cid in replies:
            weights = self.generated_weights(self._round["descriptors"][cid])
            messages[cid] = Message(arrays=weights, config={
                "lr": config.lr, "local_steps": config.local_steps, "local_epochs": config.local_epochs or 0,
                "batch_size": config.batch_size, "momentum": config.local_momentum,
                "weight_decay": config.local_weight_decay, "stage": 1})
        return messages

    def _backprop_changes(self, replies: dict[int, Message]) -> dict[int, Message]:
        """Stage 2: the chain rule through the hypernetwork (Algorithm 1, the server's step between ClientUpdate and
        ClientBackprop); de_i and the encoder down."""
        descriptor_grads = {}
        for cid in sorted(replies):       # ascending: the order the hypernetwork gradients are summed in
            descriptor_grad = self._round["hn_grads"].add(cid, self._round["descriptors"][cid], replies[cid].arrays)
            self._round["losses"][cid] = float(replies[cid].metrics.get("loss", float("nan")))
            descriptor_grads[cid] = descriptor_grad.detach()
        if self.hnet.standardizer is not None and descriptor_grads:
            # the standardizer is refitted to the descriptors: differentiate its statistics as well, over this round's
            # clients, or the encoder drifts along the directions a refit undoes (DescriptorStandardizer docstring)
            ids = sorted(descriptor_grads)
            projected = self.hnet.standardizer.batch_gradients(
                torch.stack([self._round["descriptors"][cid] for cid in ids]),
                torch.stack([descriptor_grads[cid] for cid in ids]))
            descriptor_grads = dict(zip(ids, projected, strict=True))
        messages = {}
        for cid, descriptor_grad in descriptor_grads.items():
            message = self._encoder_message(stage=2)
            message.arrays["descriptor_grad"] = descriptor_grad.cpu()
            messages[cid] = message
        return messages

    def aggregate_train(self, round: int, replies: dict[int, Message]) -> dict[str, float]:
        """Average the hypernetwork and encoder gradients of the clients that finished, clip, one SGD step each."""
        if self.config.frozen_encoder and "hn_grads" in self._round:   # the last replies are the weight changes
            for cid in sorted(replies):
                self._round["hn_grads"].add(cid, self._round["descriptors"][cid], replies[cid].arrays)
                self._round["losses"][cid] = float(replies[cid].metrics.get("loss", float("nan")))
        done = sorted(cid for cid in replies if cid in self._round.get("hn_grads", ()))
        if not done:
            return {}
        shared_grads = self.shared_part.mean_change([self._round["hn_grads"].inputs(cid)[1] for cid in done])
        hn_grads = self._round["hn_grads"].mean(done)
        encoder_grads = {} if self.config.frozen_encoder else mean_of([replies[cid].arrays for cid in done])
        losses = [self._round["losses"][cid] for cid in done]
        self._round = {}
        return {"train_loss": float(np.mean(losses)), **self._step(round, hn_grads, encoder_grads, shared_grads)}

    # -- central DP: the shared networks move from the noisy mean of the clients' gradients only --------------------

    def contributions(self, round: int, replies: dict[int, Message]):
        """A client's contribution to the shared networks: its hypernetwork gradient (the chain rule of its weight
        change at its descriptor, computed again here, one client at a time) and its encoder gradient, jointly."""
        if self.config.frozen_encoder:      # the last replies are the weight changes themselves
            for cid in sorted(replies):
                if cid in self._round.get("descriptors", {}):
                    hn_grads, _ = backprop_weight_change(self.hnet, self._round["descriptors"][cid],
                                                         replies[cid].arrays)
                    yield cid, {**prefixed(HN_PREFIX, on_cpu(hn_grads)),     # the privacy layer's, on the CPU
                                **self.shared_part.contribution(replies[cid].arrays)}
            return
        kept = self._round.get("hn_grads")
        for cid in sorted(replies):
            if kept is None or cid not in kept:
                continue
            descriptor, change = kept.inputs(cid)
            hn_grads, _ = backprop_weight_change(self.hnet, descriptor, change)
            yield cid, {**prefixed(HN_PREFIX, on_cpu(hn_grads)), **prefixed(ENCODER_PREFIX, replies[cid].arrays),
                        **self.shared_part.contribution(change)}

    def contribution_shapes(self) -> dict[str, torch.Tensor]:
        """Zeros shaped like a contribution, on the CPU (where the privacy layer clips, sums and noises)."""
        shapes = {HN_PREFIX + k: torch.zeros(p.shape, dtype=p.dtype) for k, p in self.hnet.named_parameters()}
        shapes.update(self.shared_part.contribution_shapes())
        if not self.config.frozen_encoder:
            shapes.update({ENCODER_PREFIX + k: torch.zeros(p.shape, dtype=p.dtype)
                           for k, p in self.encoder.named_parameters() if p.requires_grad})
        return shapes

    def apply_mean(self, round: int, mean: dict[str, torch.Tensor], count: float) -> dict[str, float]:
        """The server step of :meth:`aggregate_train` from the noisy mean of the contributions."""
        message = Message(arrays=on_device(mean, self.device))
        self._round = {}
        return self._step(round, message.subset(HN_PREFIX), message.subset(ENCODER_PREFIX),
                          message.subset(SHARED_PREFIX))

    def _step(self, round: int, hn_grads: dict[str, torch.Tensor], encoder_grads: dict[str, torch.Tensor],
              shared_grads: dict[str, torch.Tensor]) -> dict[str, float]:
        """Clip each averaged gradient to ``grad_clip``, then one SGD step each (refused when one is not finite); the
        shared part takes FedAvg's step from the mean weight change (:meth:`SharedPart.step`)."""
        config: ODPFLHNConfig = self.config
        hn_norm = _clip_(list(hn_grads.values()), config.grad_clip)
        encoder_norm = _clip_(list(encoder_grads.values()), config.grad_clip) if encoder_grads else 0.0
        shared_norm = norm_of(shared_grads)
        if not (math.isfinite(hn_norm) and math.isfinite(encoder_norm) and math.isfinite(shared_norm)):
            # refuse before stepping, so the hypernetwork, the encoder and the last checkpoint stay finite (a NaN
            # step would only surface a round later, as NaN descriptors)
            raise TrainingDivergedError(
                f"round {round}: ODPFL-HN training diverged (non-finite gradients: hypernetwork norm {hn_norm}, "
                f"encoder norm {encoder_norm}, shared-part change {shared_norm}); lower hn_lr (now "
                f"{config.hn_lr!r}), encoder_lr (now {config.encoder_lr!r}) or the local lr (now {config.lr!r})")
        encoder_wd = config.hn_weight_decay if config.encoder_weight_decay is None else config.encoder_weight_decay
        self._sgd_step("hnet", self.hnet, hn_grads, config.hn_lr, config.hn_weight_decay)
        if encoder_grads:
            self._sgd_step("encoder", self.encoder, encoder_grads, config.encoder_lr, encoder_wd)
        if shared_grads:
            self.shared_part.step(shared_grads)
        metrics = {"hn_grad_norm": hn_norm, "encoder_grad_norm": encoder_norm}
        if self.shared:
            metrics["shared_change_norm"] = shared_norm
        if self.hnet.standardizer is not None:
            metrics["descriptor_scale"] = float(self.hnet.standardizer.scale)
        return metrics

    def _sgd_step(self, which: str, module: nn.Module, grads: dict[str, torch.Tensor], lr: float, wd: float) -> None:
        """torch.optim.SGD's update (dampening 0, no Nesterov): g += wd p; b = mu b + g (b = g at first); p -= lr b."""
        buffers = self.momentum[which]
        mu = self.config.server_momentum
        new_buffers = {}
        with torch.no_grad():
            for name, param in module.named_parameters():
                if name not in grads:
                    continue
                g = grads[name].to(param.device, param.dtype) + wd * param
                if mu > 0:
                    g = g if name not in buffers else mu * buffers[name] + g
                    new_buffers[name] = g
                param.sub_(lr * g)
        self.momentum[which] = new_buffers

    # -- evaluation and novel clients ---------------------------------------------------------------------------------

    def generated_weights(self, descriptor: torch.Tensor) -> dict[str, torch.Tensor]:
        """The target's weights for ``descriptor``: f_theta(descriptor) for the generated part and the shared part
        as it stands, in the target's order, detached, on the CPU."""
        with torch.no_grad():
            generated = self.hnet(descriptor.to(self.device, torch.get_default_dtype()))
        return on_cpu(self.shared_part.complete(generated))

    def configure_evaluate(self, client_id: int) -> Message:
        """A training client's model from the last descriptor it released; for a client not yet sampled, the mean of
        the known descriptors, or 0 when there are none or they are confidential (central DP: the aggregator holds
        them in the clear, and a message to another client may carry nothing of them)."""
        descriptor = self.descriptors.get(str(client_id))
        if descriptor is None:
            known = [] if self.confidential else list(self.descriptors.values())
            descriptor = torch.stack(known).mean(dim=0) if known else torch.zeros(self.embed_dim)
        return Message(arrays=self.generated_weights(descriptor))

    def novel_request(self, client_id: int) -> Message:
        """The encoder (the inference protocol's first message: the server sends g_gamma)."""
        return self._encoder_message(stage="novel")

    def novel_reply(self, client_id: int, delivered: Message | None) -> Message:
        """f_theta(e) for the descriptor the novel client released (the inference protocol's reply)."""
        if delivered is None or "descriptor" not in delivered.arrays:
            raise ConfigError(f"novel client {client_id} sent no descriptor; ODPFL-HN needs one to build its model")
        return Message(arrays=self.generated_weights(delivered.arrays["descriptor"]))

    # -- state --------------------------------------------------------------------------------------------------------

    training_only = ("hnet_momentum", "encoder_momentum", "shared_momentum")

    def state_dict(self) -> dict[str, Any]:
        return {
            "hnet": on_cpu(self.hnet.state_dict()),
            "encoder": on_cpu(self.encoder.state_dict()),
            "hnet_momentum": on_cpu(self.momentum["hnet"]),
            "encoder_momentum": on_cpu(self.momentum["encoder"]),
            "descriptors": on_cpu(self.descriptors),
            **self.shared_part.state_dict(),
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.hnet.load_state_dict(state["hnet"])
        self.encoder.load_state_dict(state["encoder"])
        self.momentum = {"hnet": on_device(state.get("hnet_momentum", {}), self.device),
                         "encoder": on_device(state.get("encoder_momentum", {}), self.device)}
        self.shared_part.load_state_dict(state)     # a state saved before the shared part existed leaves it as is
        self.descriptors = {str(k): v for k, v in on_device(state["descriptors"], self.device).items()}
        self._round = {}


# -- client -----------------------------------------------------------------------------------------------------------


def local_sgd_momentum(model: nn.Module, x: torch.Tensor, y: torch.Tensor, *, lr: float, steps: int,
                       batch_size: int, momentum: float, weight_decay: float, rng: np.random.Generator) -> float:
    """``steps`` minibatch SGD steps (momentum, weight decay) of the mean cross-entropy; returns the mean loss."""
    model.train()
    optimizer = torch.optim.SGD(model.parameters(), lr=lr, momentum=momentum, weight_decay=weight_decay)
    device = device_of(model)
    total = 0.0
    for index in minibatches(len(y), batch_size, steps, rng):
        batch = torch.from_numpy(index)
        loss = nn.functional.cross_entropy(model(x[batch].to(device)), y[batch].to(device))
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        optimizer.step()
        total += loss.item()
    return total / steps


class ODPFLHNClient(ClientProcedure):
    """Encodes its data, trains the generated model locally, back-propagates the descriptor gradient; as a novel
    client, releases one (optionally private) descriptor."""

    def __init__(self, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self._encoders: dict[int, nn.Module] = {}

    def encoder_from(self, message: Message) -> nn.Module:
        """The workspace encoder loaded with the weights in ``message``."""
        embed_dim = int(message.config["embed_dim"])
        if embed_dim not in self._encoders:
            self._encoders[embed_dim] = make_encoder(self.config, tuple(self.model_factory.input_shape),
                                                     embed_dim).to(self.model_factory.device)
        encoder = self._encoders[embed_dim]
        encoder.load_state_dict(message.subset(ENCODER_PREFIX))
        return encoder

    @staticmethod
    def _descriptor_seed(ctx: ClientContext) -> int:
        # Stage 0 and stage 2 must draw the same batches and noise: keyed by (run seed, round, client) only.
        return derive_seed(ctx.run_seed, "odpflhn_descriptor", ctx.round, ctx.client_id)

    def train(self, data: TrainingClient, message: Message, state: ClientState, ctx: ClientContext) -> Release:
        """Stage 0 (ClientEncoding of Algorithm 1): release e_i = g_gamma(X_i); under record-level DP through
        privatize (add or remove one record, n private, calibrated at ``privacy.min_samples``), the noisy mean kept
        in the round's working state for stage 2."""
        encoder = self.encoder_from(message)
        if not self.record_level:
            with torch.no_grad():
                descriptor = client_descriptor(encoder, data.x_train, self.config, seed=self._descriptor_seed(ctx))
            return Release.non_private(Message(arrays={"descriptor": descriptor.cpu()}), purpose="descriptor")
        private = self.record_privatize(encoder, ctx, "odpflhn_descriptor")
        mechanism = private.mechanism(data.num_train)      # refuses a client below min_samples, naming no n
        noisy_mean = mechanism.add_noise(private.clipped_mean(data.x_train))
        state[NOISY_MEAN] = noisy_mean.cpu()
        with torch.no_grad():
            descriptor = encoder.get_submodule("psi")(noisy_mean.to(_psi_dtype(encoder))).to(
                "cpu", torch.get_default_dtype())
        return private_release(Message(arrays={"descriptor": descriptor}), "descriptor", mechanism.event,
                               metadata={"noise": self.privacy.noise, "bound": self.novel_privacy.bound,
                                         "min_samples": self.privacy.min_samples})

    def train_stage(self, stage: int, data: TrainingClient, message: Message, state: ClientState,
                    ctx: ClientContext) -> Release:
        if stage == 1:
            return self._client_update(data, message, ctx)
        if stage == 2:
            return self._client_backprop(data, message, state, ctx)
        raise InternalError(f"ODPFL-HN has stages 0, 1, 2; got stage {stage}")

    def _client_update(self, data: TrainingClient, message: Message, ctx: ClientContext) -> Release:
        """Stage 1 (ClientUpdate of Algorithm 1): local SGD from w_i (DP-SGD under record-level DP); release
        w_before - w_after."""
        start = message.arrays
        model = self.model_from(start)
        config = message.config
        settings = {"lr": float(config["lr"]), "steps": self.round_steps(data, config),
                    "batch_size": int(config["batch_size"]), "momentum": float(config["momentum"]),
                    "weight_decay": float(config["weight_decay"])}
        loss, event = self.fit(model, data, settings, ctx.rng)
        after = dict(model.named_parameters())
        change = {k: start[k] - after[k].detach().cpu() for k in start}
        metrics = {} if event is not None else {"loss": loss, "num_examples": float(data.num_train)}
        return private_release(Message(arrays=change, metrics=metrics), "weight_change", event,
                               metadata={"noise": self.privacy.noise, "max_grad_norm": self.privacy.clip})

    def _client_backprop(self, data: TrainingClient, message: Message, state: ClientState,
                         ctx: ClientContext) -> Release:
        """Stage 2 (ClientBackprop of Algorithm 1): release (de_i/dgamma)^T de_i; under record-level DP, its phi
        part as a noisy mean of per-record contributions clipped to ``privacy.clip`` (see the module docstring)."""
        encoder = self.encoder_from(message)
        descriptor_grad = message.arrays["descriptor_grad"].to(self.model_factory.device)
        if self.record_level:
            return self._private_backprop(encoder, data, descriptor_grad, state, ctx)
        descriptor = client_descriptor(encoder, data.x_train, self.config, seed=self._descriptor_seed(ctx))
        names = [n for n, p in encoder.named_parameters() if p.requires_grad]
        params = [p for p in encoder.parameters() if p.requires_grad]
        grads = torch.autograd.grad(descriptor, params, grad_outputs=descriptor_grad, allow_unused=True)
        arrays = {n: torch.zeros_like(p) if g is None else g.detach() for n, p, g in zip(names, params, grads,
                                                                                        strict=True)}
        return Release.non_private(Message(arrays=on_cpu(arrays)), purpose="encoder_gradient")

    def _private_backprop(self, encoder: nn.Module, data: TrainingClient, descriptor_grad: torch.Tensor,
                          state: ClientState, ctx: ClientContext) -> Release:
        """Steps: 1. psi's gradient and v = J_psi(m~)^T de at the noisy mean m~ released in stage 0 (post-processing
        of that release and the server's de: no privacy cost); 2. each record's contribution to phi's gradient,
        h_i = d/dtheta <v, clip_B(phi_theta(x_i))>, clipped to C (:class:`~privfl.privacy.per_sample.
        ClippedGradientSum`); 3. their mean plus Gaussian noise of z times the mean's add/remove sensitivity with n
        private, 2 C / min_samples (steps 2 and 3: :func:`~privfl.privacy.gradient_mean.release_gradient_mean`)."""
        if NOISY_MEAN not in state:
            raise InternalError("ODPFL-HN stage 2 under record-level DP found no stage-0 release in the client state")
        noisy_mean = state[NOISY_MEAN]
        psi_params = {n: p for n, p in encoder.get_submodule("psi").named_parameters() if p.requires_grad}
        device = device_of(encoder)
        mean = noisy_mean.detach().to(device, _psi_dtype(encoder)).requires_grad_(True)
        out = encoder.get_submodule("psi")(mean)
        grads = torch.autograd.grad(out, [mean, *psi_params.values()], grad_outputs=descriptor_grad.to(out.dtype),
                                    allow_unused=True)
        v = grads[0].detach()
        arrays = {f"psi.{n}": torch.zeros_like(p) if g is None else g.detach()
                  for (n, p), g in zip(psi_params.items(), grads[1:], strict=True)}
        # 2-3. per-record contributions to phi's gradient, clipped, their mean noised
        bound = self.novel_privacy.bound

        def contribution(model: nn.Module, xb: torch.Tensor, yb: torch.Tensor) -> torch.Tensor:
            rows = clipped_rows(model(xb).reshape(len(xb), -1), bound)     # privatize's projection onto the ball
            return (rows * v.to(rows.dtype)).sum(dim=1)

        encoder.eval()
        labels = torch.zeros(data.num_train, dtype=torch.long)      # the contribution reads no label
        phi_grads, event, _ = self.record_gradient_mean(encoder.get_submodule("phi"), contribution, data.x_train,
                                                        labels, self.noise_source(ctx, ENCODER_GRADIENT_NOISE))
        arrays.update(prefixed("phi.", phi_grads))
        arrays = on_cpu({n: arrays[n] for n, p in encoder.named_parameters() if p.requires_grad})
        return private_release(Message(arrays=arrays), "encoder_gradient", event,
                               metadata={"noise": self.privacy.noise, "clip": float(self.privacy.clip),
                                         "min_samples": self.privacy.min_samples})

    def encoder_gradient_release(self) -> ClippedMean:
        """Record level: the encoder-gradient release, a mean of per-record contributions clipped to
        ``privacy.clip``."""
        return self.clipped_mean(float(self.privacy.clip))

    def record_releases(self) -> tuple[RecordRelease, ...]:
        """Record level: a round's releases: the descriptor (a mean of phi's outputs clipped to the novel bound B),
        the weight change (DP-SGD) and, unless the encoder is frozen, the encoder gradient
        (:meth:`encoder_gradient_release`)."""
        releases: tuple[RecordRelease, ...] = (self.clipped_mean(self.novel_privacy.bound), self.dp_sgd_fit())
        return releases if self.config.frozen_encoder else (*releases, self.encoder_gradient_release())

    def evaluation_model(self, data: TrainingClient, message: Message, state: ClientState) -> nn.Module:
        return self.model_from(message.arrays)

    def novel_query(self, novel: NovelClient, message: Message) -> Release:
        """The novel client's only release: its descriptor, through privatize when ``novel_privacy`` has an epsilon.

        Steps (the paper's inference protocol and its DP option, section 7): 1. load the encoder; 2. without
        privacy, e = g_gamma(X) (full set or batch mean), released with epsilon = infinity; 3. with privacy,
        ``privatize(encoder, eps, delta, bound=...)`` clips phi per sample, adds analytic-Gaussian noise to the mean
        (n public, replace-one) and applies psi; the release carries the mechanism's event, so the wire records
        exactly that epsilon.
        """
        config: ODPFLHNConfig = self.config
        novel_privacy = self.novel_privacy
        encoder = self.encoder_from(message)
        if not novel_privacy.private:
            with torch.no_grad():
                seed = derive_seed(novel_privacy.noise_seed, "novel_descriptor", novel.client_id)
                descriptor = client_descriptor(encoder, novel.x, _noiseless(config), seed=seed)
            return Release.non_private(Message(arrays={"descriptor": descriptor.cpu()}), purpose="descriptor")
        batch_size = config.descriptor_batch_size if config.descriptor == "batch_mean" else None
        return self.novel_descriptor_release(encoder, novel, "novel_noise", batch_size=batch_size)

    def novel_model(self, novel: NovelClient, message: Message) -> nn.Module:
        return self.model_from(message.arrays)


#: The client state key of the noisy mean a record-level client released in stage 0 (stage 2 differentiates psi at
#: it).
NOISY_MEAN = "odpflhn.noisy_mean"
#: The purpose the seeded noise of the encoder-gradient release is keyed by (the audit draws it again).
ENCODER_GRADIENT_NOISE = "odpflhn_encoder_gradient"


def _psi_dtype(encoder: nn.Module) -> torch.dtype:
    return next((p.dtype for p in encoder.get_submodule("psi").parameters()), torch.get_default_dtype())


def _noiseless(config: ODPFLHNConfig) -> ODPFLHNConfig:
    """The config without training-time descriptor noise (a novel client's clean descriptor)."""
    import dataclasses

    return dataclasses.replace(config, train_mean_noise=0.0) if config.train_mean_noise else config


register_method(
    "odpflhn", strategy=ODPFLHNStrategy, client=ODPFLHNClient, config=ODPFLHNConfig,
    description="ODPFL-HN: set encoder + hypernetwork trained end to end (Algorithm 1, pFedHN sign); novel clients "
                "send one descriptor (optionally DP via privatize) and receive a generated model",
    privacy=ODPFLHN_PRIVACY,
    releases_per_round=3, novel_privacy=None,
    smoke_settings={"local_steps": 2, "batch_size": 16, "encoder_hidden": 8, "hn_hidden": 8, "hn_layers": 1},
    devices=ANY_DEVICE,
    central_eval="it generates each client's model from that client's own descriptor: no model exists before a client "
                 "sends one",
)
