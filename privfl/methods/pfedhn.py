"""pFedHN (Shamsian et al., ICML 2021): a server hypernetwork generates each training client's personal model.

The server holds an embedding row ``e_i`` per training client and a hypernetwork ``f_theta``
(:class:`privfl.models.HyperNetwork`); each round it sends ``w_i = f_theta(e_i)``, the client trains it locally and
releases its weight change, and the server chain-rules the changes into ``theta`` and the rows. pFedHN has no
encoder, so it serves no novel client. Runs under ``record``, ``local`` and ``central`` privacy; ``distributed`` is
refused (each change is needed on its own).

Entry points: :class:`PFedHNConfig`, :class:`PFedHNStrategy`, :class:`PFedHNClient` (registered as ``pfedhn``);
:func:`sgd_momentum_step` and :func:`refuse_batch_clip`, shared with the other hypernetwork methods.

The round step by step, the lazy row updates, each privacy mode's argument and head-only generation:
docs/methods/hypernetworks.md, "pFedHN".
"""

from __future__ import annotations

import math
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from accounting.validation import is_finite
from privfl.data import TrainingClient
from privfl.devices import ANY_DEVICE, on_cpu, on_device
from privfl.errors import ConfigError, TrainingDivergedError, check
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
from privfl.methods.fedavg import sample_weights
from privfl.methods.local_training import sgd_settings
from privfl.methods.shared_part import SharedPart, check_shared_settings, norm_of
from privfl.models import HyperNetwork, backprop_weight_change, embedding_dim
from privfl.models.hypernetwork import generated_names, target_shapes
from privfl.privacy.training import RECORD, NovelPrivacy, TrainingPrivacy

EMBED_DIM_RULES = ("quarter", "pfedhn")
#: The prefix of a central-DP contribution's hypernetwork gradient.
HN = "hn."


@dataclass(frozen=True)
class PFedHNConfig(LocalTrainingConfig):
    """pFedHN's settings. Local-training defaults are pFedHN's code (inner lr 5e-3, 50 inner steps, batch 64,
    inner weight decay 5e-5, each step's gradient clipped to norm 50; with record-level DP set ``grad_clip=None``, as
    DP-SGD clips each record's gradient instead) with the papers' local momentum 0.9; server
    defaults are pFedHN's code (SGD, lr 1e-2, momentum 0.9, weight decay 1e-3, the embedding group at the
    hypernetwork's lr, gradient-norm clip 50).

    ``momentum``: heavy-ball coefficient of the clients' local SGD.
    ``hn_lr``, ``hn_weight_decay``: server SGD for the hypernetwork; ``embed_lr`` / ``embed_weight_decay`` for the
    embedding rows (``None``: the hypernetwork's value); ``hn_momentum``: server momentum (both groups).
    ``server_grad_clip``: max L2 norm of the round's averaged server gradient (``None``: no clipping).
    ``embed_dim``: descriptor size d_e; ``None`` applies ``embed_dim_rule`` (``"quarter"``: floor(N/4), or
    ``"pfedhn"``: int(1 + N/4)) to N = the number of *training* clients, which is all the server knows (the paper's
    N counts novel clients too: CIFAR N = 100 gives 25; set ``embed_dim=25`` to match it; docs/papers.md,
    ODPFL-HN, U5).
    ``hidden_dim``, ``n_hidden``, ``spectral_norm``, ``hn_chunked``: the hypernetwork (:class:`HyperNetwork`).
    ``generated`` (:data:`~privfl.models.hypernetwork.GENERATED_PARTS`): ``"all"`` (the paper: the hypernetwork
    emits the whole target), ``"head"`` or ``"head_bias"`` (it emits the target's last layer, or that layer's bias;
    the rest is one shared part that every client trains locally and the server moves by the mean of the clients'
    weight changes, FedAvg's step: ``shared -= shared_lr * m``, with ``m`` a heavy-ball average of the mean change at
    ``shared_momentum``; :mod:`privfl.methods.shared_part`).
    """

    lr: float = 5e-3
    local_steps: int = 50
    weight_decay: float = 5e-5
    grad_clip: float | None = 50.0
    momentum: float = 0.9
    hn_lr: float = 1e-2
    embed_lr: float | None = None
    hn_momentum: float = 0.9
    hn_weight_decay: float = 1e-3
    embed_weight_decay: float | None = None
    server_grad_clip: float | None = 50.0
    embed_dim: int | None = None
    embed_dim_rule: str = "quarter"
    hidden_dim: int = 100
    n_hidden: int = 3
    spectral_norm: bool = False
    hn_chunked: bool | None = None
    generated: str = "all"
    shared_lr: float = 1.0
    shared_momentum: float = 0.0

    def __post_init__(self) -> None:
        super().__post_init__()
        check_shared_settings(self.generated, self.shared_lr, self.shared_momentum)
        check.require(is_finite(self.momentum) and 0 <= self.momentum < 1, "momentum", self.momentum, "in [0, 1)")
        check.require(is_finite(self.hn_momentum) and 0 <= self.hn_momentum < 1, "hn_momentum", self.hn_momentum,
                      "in [0, 1)")
        for name in ("hn_lr", "embed_lr"):
            value = getattr(self, name)
            if name == "hn_lr" or value is not None:
                check.require(is_finite(value) and value > 0, name, value, "a finite number > 0" +
                              (" or None (the hypernetwork's)" if name != "hn_lr" else ""))
        for name in ("hn_weight_decay", "embed_weight_decay"):
            value = getattr(self, name)
            if name == "hn_weight_decay" or value is not None:
                check.require(is_finite(value) and value >= 0, name, value, "a finite number >= 0" +
                              (" or None (the hypernetwork's)" if name != "hn_weight_decay" else ""))
        check.require(self.server_grad_clip is None or (is_finite(self.server_grad_clip) and self.server_grad_clip > 0),
                      "server_grad_clip", self.server_grad_clip, "None or a finite number > 0")
        check.require(self.embed_dim is None or (_int(self.embed_dim) and self.embed_dim >= 1), "embed_dim",
                      self.embed_dim, "None (by embed_dim_rule) or an integer >= 1")
        check.require(self.embed_dim_rule in EMBED_DIM_RULES, "embed_dim_rule", self.embed_dim_rule,
                      f"one of {', '.join(EMBED_DIM_RULES)}")
        check.require(_int(self.hidden_dim) and self.hidden_dim >= 1, "hidden_dim", self.hidden_dim, "an integer >= 1")
        check.require(_int(self.n_hidden) and self.n_hidden >= 0, "n_hidden", self.n_hidden, "an integer >= 0")
        check.require(isinstance(self.spectral_norm, bool), "spectral_norm", self.spectral_norm, "True or False")
        check.require(self.hn_chunked in (None, True, False), "hn_chunked", self.hn_chunked,
                      "None (by target size), True or False")

    def check_privacy(self, privacy: TrainingPrivacy, novel_privacy: NovelPrivacy) -> None:
        """Refuse, before the run, the per-step batch clip under record-level DP (:func:`refuse_batch_clip`)."""
        refuse_batch_clip(self.grad_clip, privacy)

    @property
    def embedding_lr(self) -> float:
        return self.hn_lr if self.embed_lr is None else self.embed_lr

    @property
    def embedding_weight_decay(self) -> float:
        return self.hn_weight_decay if self.embed_weight_decay is None else self.embed_weight_decay

    def round_config(self, round: int) -> dict:
        return {**super().round_config(round), "momentum": self.momentum}


def refuse_batch_clip(grad_clip: float | None, privacy: TrainingPrivacy) -> None:
    """Refuse a per-step batch-gradient clip under record-level DP: DP-SGD clips each record's gradient instead (the
    privacy clip), and :meth:`ClientProcedure.fit` would refuse it at the first round."""
    if privacy.mode == RECORD and grad_clip:
        raise ConfigError(f"grad_clip={grad_clip!r} clips each local step's batch gradient, a stabiliser that "
                          f"record-level DP-SGD replaces with its per-record clip (privacy clip={privacy.clip!r}); "
                          "set grad_clip to None (0 where 0 means off) with privacy mode 'record'")


def _int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def sgd_momentum_step(param: torch.Tensor, grad: torch.Tensor, buffer: torch.Tensor | None, *, lr: float,
                      momentum: float, weight_decay: float) -> tuple[torch.Tensor, torch.Tensor]:
    """One step of torch's SGD (dampening 0, no Nesterov), out of place: returns ``(new_param, new_buffer)``.

    ``d = grad + weight_decay * param``; ``buffer = d`` on the first step, else ``momentum * buffer + d``;
    ``param - lr * buffer``.
    """
    d = grad + weight_decay * param if weight_decay else grad
    buffer = d.clone() if buffer is None or momentum == 0 else momentum * buffer + d
    return param - lr * buffer, buffer


class PFedHNStrategy(Strategy):
    """Holds the hypernetwork, the clients' embedding rows and the server optimiser's momentum buffers.

    Working values of a round (the descriptors its messages were generated from) live on the strategy until
    ``aggregate_train``; ``last_gradients`` keeps the round's averaged, clipped server gradient for inspection.
    """

    def __init__(self, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        cfg = self.config
        self.embed_dim = cfg.embed_dim or embedding_dim(self.num_training_clients, rule=cfg.embed_dim_rule)
        target = self.model_factory.init(self.seed)
        #: Where the hypernetwork, the rows and their momentum live; what leaves the strategy is on the CPU.
        self.device = torch.device(self.model_factory.device)
        generated = None if cfg.generated == "all" else generated_names(target, cfg.generated)
        self.hnet = seeded_init(
            lambda: HyperNetwork(target, embed_dim=self.embed_dim, hidden_dim=cfg.hidden_dim, n_hidden=cfg.n_hidden,
                                 spectral_norm=cfg.spectral_norm, chunked=cfg.hn_chunked, generated=generated),
            derive_seed(self.seed, "pfedhn_hypernetwork")).to(self.device)
        #: The trainable target tensors the hypernetwork does not generate (none with ``generated="all"``), from the
        #: target's seeded initialisation; FedAvg's step moves them.
        self.shared_part = SharedPart(target, [n for n in target_shapes(target) if n not in self.hnet.shapes],
                                      lr=cfg.shared_lr, momentum=cfg.shared_momentum, device=self.device)
        if self.shared_part:      # its momentum is saved only when there is a shared part
            self.training_only = (*type(self).training_only, "shared_momentum")
        self.hn_momentum: dict[str, torch.Tensor] = {}
        self.embeddings: dict[int, torch.Tensor] = {}
        self.embedding_momentum: dict[int, torch.Tensor] = {}
        self._sent: dict[int, torch.Tensor] = {}
        self._row_gradients: dict[int, torch.Tensor] = {}
        self.last_gradients: dict[str, Any] | None = None

    # -- embeddings and generation -------------------------------------------------------------------------------
    def initial_embedding(self, client_id: int) -> torch.Tensor:
        """Client ``client_id``'s row before training: N(0, 1) from a stream keyed by (seed, client id), drawn on
        the CPU and moved to the strategy's device."""
        generator = torch.Generator().manual_seed(derive_seed(self.seed, "pfedhn_embedding", client_id))
        return torch.randn(self.embed_dim, generator=generator).to(self.device)

    def embedding(self, client_id: int) -> torch.Tensor:
        """Client ``client_id``'s current embedding row (its initial row if it has not trained yet)."""
        row = self.embeddings.get(client_id)
        return self.initial_embedding(client_id) if row is None else row

    @torch.no_grad()
    def generate(self, descriptor: torch.Tensor, hn_state: dict[str, torch.Tensor] | None = None,
                 shared: dict[str, torch.Tensor] | None = None) -> dict[str, torch.Tensor]:
        """Target weights ``f_theta(descriptor)`` (detached, on the CPU: what a message carries), from the current
        hypernetwork or from ``hn_state``; the shared part (as it stands, or ``shared``) fills in the tensors the
        hypernetwork does not generate."""
        descriptor = descriptor.to(self.device)
        if hn_state is None:
            out = self.hnet(descriptor)
        else:
            out = torch.func.functional_call(self.hnet, hn_state, (descriptor,))
        return self.shared_part.complete({k: v.detach().to("cpu", copy=True) for k, v in out.items()}, shared)

    def hypernetwork_state(self) -> dict[str, torch.Tensor]:
        """A copy of the hypernetwork's state (parameters and any buffers)."""
        return {k: v.detach().clone() for k, v in self.hnet.state_dict().items()}

    # -- rounds --------------------------------------------------------------------------------------------------
    def configure_train(self, round: int, client_ids: list[int]) -> dict[int, Message]:
        """Step 1: ``w_i = f_theta(e_i)`` for each sampled client, with the local-training settings."""
        self._sent = {cid: self.embedding(cid) for cid in client_ids}
        config = self.config.round_config(round)
        return {cid: Message(arrays=self.generate(e), config=dict(config)) for cid, e in self._sent.items()}

    def aggregate_train(self, round: int, replies: dict[int, Message]) -> dict[str, float]:
        """Steps 3-4 on the weight changes of ``replies`` (the embedding rows move)."""
        descriptors = {cid: self._sent.get(cid, self.embedding(cid)) for cid in replies}
        self._sent = {}
        return self.hypernetwork_update(descriptors, replies, update_embeddings=True, lr=self.config.hn_lr)

    def hypernetwork_update(self, descriptors: dict[int, torch.Tensor], replies: dict[int, Message], *,
                            update_embeddings: bool, lr: float) -> dict[str, float]:
        """Chain-rule each reply's weight change ``d_i`` through ``f_theta`` at ``descriptors[i]``, average over the
        clients, clip, and step the hypernetwork (and, with ``update_embeddings``, the clients' embedding rows).

        Returns the round's metrics: ``train_loss`` (sample-weighted mean of the clients' local losses) and
        ``hn_grad_norm`` (L2 norm of the averaged gradient before clipping); with a shared part, it takes FedAvg's
        step from the mean of the changes' shared tensors (``shared_change_norm``, that mean's norm).
        """
        ids = sorted(replies)
        if not ids:
            return {}
        count = len(ids)
        hn_grad: dict[str, torch.Tensor] = {}
        row_grads: dict[int, torch.Tensor] = {}
        divisor = torch.tensor(float(count), device=self.device)
        for cid in ids:                                      # step 3
            grads, descriptor_grad = backprop_weight_change(self.hnet, descriptors[cid], replies[cid].arrays)
            for name, g in grads.items():
                # acc + g / count in one pass over acc and g (addcdiv_ with value 1 rounds exactly as the two
                # operations do); the first client's g / count is a fresh tensor the sum may then own
                if name in hn_grad:
                    hn_grad[name].addcdiv_(g, divisor)
                else:
                    hn_grad[name] = g / count
            row_grads[cid] = descriptor_grad / count
        if not update_embeddings:
            row_grads = {}
        # step 4: the clip covers everything that steps (torch.nn.utils.clip_grad_norm_'s rule)
        norm = self._clip_([*hn_grad.values(), *row_grads.values()], f"the weight changes of clients {ids}", lr)
        shared = self.shared_part.mean_change([replies[cid].arrays for cid in ids])
        shared_norm = self._check_shared(shared, f"the weight changes of clients {ids}")
        self.last_gradients = {"hypernetwork": hn_grad, "embeddings": row_grads, "norm": norm}
        self._step(hn_grad, row_grads, lr, shared)
        weights = sample_weights(replies, ids)
        losses = [float(replies[cid].metrics.get("loss", float("nan"))) for cid in ids]
        metrics = {"train_loss": sum(v * w for v, w in zip(losses, weights)) / sum(weights), "hn_grad_norm": norm}
        if self.shared_part:
            metrics["shared_change_norm"] = shared_norm
        return metrics

    def _check_shared(self, change: dict[str, torch.Tensor], source: str) -> float:
        """The norm of the shared part's mean change, refused before anything steps when it is not finite."""
        norm = norm_of(change)
        if not math.isfinite(norm):
            raise TrainingDivergedError(f"the hypernetwork training diverged (non-finite shared-part change, norm "
                                        f"{norm}, from {source}); lower the local lr (now {self.config.lr!r}) or "
                                        f"shared_lr (now {self.config.shared_lr!r})")
        return norm

    def _clip_(self, grads: list[torch.Tensor], source: str, lr: float) -> float:
        """Scale ``grads`` (the round's own tensors) in place to joint L2 norm at most ``server_grad_clip``; return
        the norm before. A non-finite norm is refused before anything steps: clipping would not help (0 * NaN is
        NaN), and a NaN hypernetwork would only surface later, as NaN client models, with the last checkpoint
        already overwritten."""
        norm = math.sqrt(sum(float(g.pow(2).sum()) for g in grads))
        if not math.isfinite(norm):
            raise TrainingDivergedError(f"the hypernetwork training diverged (non-finite gradient, norm {norm}, from "
                                        f"{source}); lower the hypernetwork lr (now {lr!r}) or the local lr (now "
                                        f"{self.config.lr!r})")
        clip = self.config.server_grad_clip
        if clip is not None and clip / (norm + 1e-6) < 1:
            scale = clip / (norm + 1e-6)
            for g in grads:
                g.mul_(scale)
        return norm

    def _step(self, hn_grad: dict[str, torch.Tensor], row_grads: dict[int, torch.Tensor], lr: float,
              shared: dict[str, torch.Tensor] | None = None) -> None:
        """One SGD step with momentum: the hypernetwork at ``lr``, each row of ``row_grads`` at the embedding lr; the
        shared part FedAvg's step from its mean change ``shared``."""
        cfg = self.config
        params = dict(self.hnet.named_parameters())
        with torch.no_grad():
            for name, g in hn_grad.items():
                new, self.hn_momentum[name] = sgd_momentum_step(
                    params[name].detach(), g, self.hn_momentum.get(name), lr=lr, momentum=cfg.hn_momentum,
                    weight_decay=cfg.hn_weight_decay)
                params[name].copy_(new)
        for cid, g in row_grads.items():
            self.embeddings[cid], self.embedding_momentum[cid] = sgd_momentum_step(
                self.embedding(cid), g, self.embedding_momentum.get(cid), lr=cfg.embedding_lr,
                momentum=cfg.hn_momentum, weight_decay=cfg.embedding_weight_decay)
        if shared:
            self.shared_part.step(shared)

    # -- client-level DP: the shared hypernetwork moves from a noisy mean ----------------------------------------------

    def hypernetwork_contributions(self, descriptors: dict[int, torch.Tensor], changes: dict[int, Message]
                                   ) -> Iterator[tuple[int, dict[str, torch.Tensor]]]:
        """Central DP, step 3 per client: ``g_theta_i`` (prefixed ``"hn."``) from the weight change ``changes[i]``
        at ``descriptors[i]``, with the change's shared tensors (prefixed ``"shared."``; none with
        ``generated="all"``), in increasing client id; ``g_e_i`` is kept for :meth:`apply_hypernetwork_mean`."""
        self._row_gradients = {}
        for cid in sorted(changes):
            grads, descriptor_grad = backprop_weight_change(self.hnet, descriptors[cid], changes[cid].arrays)
            self._row_gradients[cid] = descriptor_grad
            yield cid, {**prefixed(HN, {name: g.cpu() for name, g in grads.items()}),   # the privacy layer's, on
                        **self.shared_part.contribution(changes[cid].arrays)}           # the CPU

    def hypernetwork_shapes(self) -> dict[str, torch.Tensor]:
        """Zeros shaped like a contribution's hypernetwork gradient (prefixed ``"hn."``) and shared tensors (prefixed
        ``"shared."``), on the CPU."""
        return {**{HN + name: torch.zeros(p.shape, dtype=p.dtype) for name, p in self.hnet.named_parameters()
                   if p.requires_grad}, **self.shared_part.contribution_shapes()}

    def apply_hypernetwork_mean(self, mean: dict[str, torch.Tensor], count: float, *, update_embeddings: bool,
                                lr: float) -> dict[str, float]:
        """Step 4 from the noisy mean: ``theta`` from ``mean``'s ``"hn."`` tensors alone (clipped to
        ``server_grad_clip`` on its own), and, with ``update_embeddings``, each contributing client's row from its
        own ``g_e_i / count`` (clipped on its own); the shared part from ``mean``'s ``"shared."`` tensors. Returns
        the noisy mean's norm before clipping (post-processing)."""
        hn_grad = {name[len(HN):]: g.to(self.device, copy=True) for name, g in mean.items() if name.startswith(HN)}
        rows, self._row_gradients = self._row_gradients, {}
        norm = self._clip_(list(hn_grad.values()), "the noisy mean of the clients' hypernetwork gradients", lr)
        shared = self.shared_part.from_mean(mean)
        shared_norm = self._check_shared(shared, "the noisy mean of the clients' weight changes")
        row_grads = {}
        if update_embeddings:
            for cid, g in rows.items():
                row_grads[cid] = g / count
                self._clip_([row_grads[cid]], f"client {cid}'s weight change", lr)
        self.last_gradients = {"hypernetwork": hn_grad, "embeddings": row_grads, "norm": norm}
        self._step(hn_grad, row_grads, lr, shared)
        return {"hn_grad_norm": norm, **({"shared_change_norm": shared_norm} if self.shared_part else {})}

    def contributions(self, round: int, replies: dict[int, Message]) -> Iterator[tuple[int, dict[str, torch.Tensor]]]:
        """Central DP: client i contributes its hypernetwork gradient ``g_theta_i`` (see the module docstring)."""
        return self.hypernetwork_contributions({cid: self._sent.get(cid, self.embedding(cid)) for cid in replies},
                                               replies)

    def contribution_shapes(self) -> dict[str, torch.Tensor]:
        return self.hypernetwork_shapes()

    def apply_mean(self, round: int, mean: dict[str, torch.Tensor], count: float) -> dict[str, float]:
        """Step 4 from the noisy mean of the ``g_theta_i`` (``count`` = q N), each row from its own ``g_e_i``."""
        self._sent = {}
        return self.apply_hypernetwork_mean(mean, count, update_embeddings=True, lr=self.config.hn_lr)

    def configure_evaluate(self, client_id: int) -> Message:
        """A training client is scored with its own generated model ``f_theta(e_i)``."""
        return Message(arrays=self.generate(self.embedding(client_id)))

    def novel_request(self, client_id: int) -> Message:
        raise ConfigError("method 'pfedhn' has no encoder and serves no novel client; use 'pfl_sampled', "
                          "'pfl_nearest' or 'pfl_ensemble' (pFedHN's training, applied to novel clients) or "
                          "'itpflhn'")

    # -- checkpoints ---------------------------------------------------------------------------------------------
    training_only: tuple[str, ...] = ("hypernetwork_momentum", "embedding_momentum")

    def state_dict(self) -> dict[str, Any]:
        """Copies on the CPU of the hypernetwork, its momentum, the embedding rows and their momentum (rows keyed by
        str id), and the shared part with its momentum (``"shared"``, ``"shared_momentum"``; only when there is
        one)."""
        return {
            "hypernetwork": on_cpu(self.hnet.state_dict()),
            "hypernetwork_momentum": on_cpu(self.hn_momentum),
            "embeddings": on_cpu({str(k): v for k, v in self.embeddings.items()}),
            "embedding_momentum": on_cpu({str(k): v for k, v in self.embedding_momentum.items()}),
            **(self.shared_part.state_dict() if self.shared_part else {}),
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.hnet.load_state_dict({k: v.clone() for k, v in state["hypernetwork"].items()})
        self.hn_momentum = on_device(state.get("hypernetwork_momentum", {}), self.device)
        self.embeddings = {int(k): v for k, v in on_device(state["embeddings"], self.device).items()}
        self.embedding_momentum = {int(k): v for k, v in
                                   on_device(state.get("embedding_momentum", {}), self.device).items()}
        self.shared_part.load_state_dict(state)
        self._sent, self._row_gradients = {}, {}


class PFedHNClient(ClientProcedure):
    """Trains the generated weights locally (DP-SGD under record-level DP) and sends the weight change
    ``before - after``."""

    serves_novel_clients = False

    def __init__(self, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self.config.check_privacy(self.privacy, self.novel_privacy)   # also where no RunConfig checked it

    def load_generated(self, weights: dict[str, torch.Tensor], model: nn.Module | None = None) -> nn.Module:
        """``model`` (by default the workspace model) with its parameters set to ``weights``.

        Generated weights cover the target's parameters only; a target with buffers keeps its own.
        """
        model = self.workspace_model() if model is None else model
        missing, unexpected = model.load_state_dict(weights, strict=False)
        params = {n for n, _ in model.named_parameters()}
        if unexpected or params & set(missing):
            raise ConfigError(f"generated weights do not match the target: missing {sorted(params & set(missing))}, "
                              f"unexpected {sorted(unexpected)}")
        return model

    def local_weight_change(self, data: TrainingClient, message: Message, ctx: ClientContext) -> Release:
        """Step 2: local SGD from the received weights (DP-SGD under record-level DP, where the sample count and
        the loss, which no mechanism covers, are not sent); the release carries ``d_i = w_i - w_i_new``."""
        start = message.arrays
        model = self.load_generated(start)
        loss, event = self.fit(model, data, sgd_settings(message.config), ctx.rng)
        after = dict(model.named_parameters())
        change = {name: start[name] - after[name].detach().cpu() for name in start}
        metrics = {} if event is not None else {"num_examples": float(data.num_train), "loss": loss}
        return private_release(Message(arrays=change, metrics=metrics), "weight_change", event,
                               metadata={"noise": self.privacy.noise, "max_grad_norm": self.privacy.clip})

    def train(self, data: TrainingClient, message: Message, state: ClientState, ctx: ClientContext) -> Release:
        return self.local_weight_change(data, message, ctx)

    def evaluation_model(self, data: TrainingClient, message: Message, state: ClientState) -> nn.Module:
        return self.load_generated(message.arrays)


#: Why client-level distributed DP is refused by every method that trains pFedHN's way.
DISTRIBUTED_REFUSAL = ("its server chain-rules each client's weight change through the hypernetwork at that client's "
                       "own embedding row, and moves that row from it: it needs each client's change on its own, "
                       "while secure aggregation shows the server only their sum")

#: The privacy modes of pFedHN (module docstring).
PFEDHN_PRIVACY = supported_modes(distributed=DISTRIBUTED_REFUSAL)

#: Small hypernetworks and no batch clip (which record-level DP-SGD refuses), for the fast synthetic runs.
SMOKE_SETTINGS = {"hidden_dim": 8, "n_hidden": 1, "embed_dim": 2, "grad_clip": None}


register_method(
    "pfedhn", strategy=PFedHNStrategy, client=PFedHNClient, config=PFedHNConfig,
    description="pFedHN: a server hypernetwork maps learned client embeddings to personal models (training clients "
                "only; see pfl_sampled / pfl_nearest / pfl_ensemble for novel clients)",
    privacy=PFEDHN_PRIVACY, releases_per_round=1, smoke_settings=SMOKE_SETTINGS,
    novel_privacy="it serves no novel client (it has no encoder)", devices=ANY_DEVICE,
    central_eval="it generates each training client's model from that client's own embedding and serves no new client",
)
