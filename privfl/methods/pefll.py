"""PeFLL (Scott, Zakerinia and Lampert, ICLR 2024): an embedding network and a hypernetwork trained by learning to
learn.

A client describes itself by ``v_i = mean_j phi(x_j, y_j; eta_v)`` (labels are inputs); the server's hypernetwork
turns it into the client's model ``theta_i = h(v_i; eta_h)``. A training round is the paper's Algorithm 2 in three
stages, each ending with a release: the descriptor ``v_i``, the weight change, and the embedding-network gradient.
Because the descriptor needs labels, an unseen client is a labelled held-out client
(:func:`unseen_clients_with_labels`); an unlabelled novel client is refused.

Entry points: :class:`PeFLLConfig`, :class:`PeFLLStrategy`, :class:`PeFLLClient` (registered as ``pefll``) and
:func:`unseen_clients_with_labels`.

The stages line by line, serving, each privacy mode, head-only generation and how training clients are scored:
docs/methods/hypernetworks.md, "PeFLL".
"""

from __future__ import annotations

import math
import warnings
from dataclasses import dataclass
from typing import Any, cast

import torch
from torch import nn

from accounting import NeighboringRelation
from accounting.validation import is_finite
from privfl.data import FederatedDataset, TrainingClient
from privfl.devices import ANY_DEVICE, device_of, on_cpu
from privfl.errors import ConfigError, InternalError, TrainingDivergedError, check
from privfl.federation.messages import Message, Release, Scalar, prefixed
from privfl.federation.seeding import derive_seed, seeded_init
from privfl.methods.base import (
    ClientContext,
    ClientProcedure,
    ClientState,
    MethodConfig,
    Strategy,
    private_release,
    register_method,
    supported_modes,
)
from privfl.methods.pfedhn import refuse_batch_clip
from privfl.methods.shared_part import SharedPart, check_shared_settings, norm_of
from privfl.models.hypernetwork import (
    HyperNetwork,
    RoundGradientMean,
    backprop_weight_change,
    embedding_dim,
    generated_names,
    target_shapes,
)
from privfl.models.pefll import EMBEDDING_KINDS, EmbeddingNetwork, clipped_rows, resolve_kind
from privfl.privacy.labelled import release_labelled_mean
from privfl.privacy.record import RecordRelease, noise_source
from privfl.privacy.training import NovelPrivacy, TrainingPrivacy

#: The privacy modes this method runs, and why it refuses the others.
PEFLL_PRIVACY = supported_modes(
    distributed="its round is a three-stage dialogue in which the server answers each client's descriptor and "
                "weight change on their own (h(v_i), then the descriptor gradient): it needs each client's "
                "messages, while secure aggregation shows only sums")

EMBED = "embed."
#: The prefix of a central-DP contribution's hypernetwork gradient.
HNET = "hnet."
DESCRIPTOR, DESCRIPTOR_GRAD = "descriptor", "descriptor_grad"
_STATE_BATCH = "pefll.batch"
_STATE_EMBED = "pefll.embed."
SERVER_OPTIMIZERS = ("adam", "sgd")


@dataclass(frozen=True)
class PeFLLConfig(MethodConfig):
    """PeFLL's settings; defaults from the authors' code (``jonnyascott/PeFLL``; docs/papers.md, PeFLL, "Settings")
    unless noted.

    Local training (client): ``lr`` 2e-3, ``local_steps`` 50, ``batch_size`` 32, ``momentum`` 0.9, ``grad_clip`` 50
    (per-step L2 clip of the local gradient, a stabiliser; 0 = off).
    Objective (eq. 1): ``lambda_theta`` weights ``||theta_i||^2`` (local weight decay ``2 lambda_theta``; 2.5e-5
    reproduces the code's inner weight decay 5e-5); ``lambda_h`` and ``lambda_v`` weight ``||eta_h||^2`` and
    ``||eta_v||^2`` (1e-3, pFedHN's weight decay, as the paper's values are not given, docs/papers.md, PeFLL, U2; 0
    reproduces the code's Adam path, which applies none).
    Server: ``server_optimizer`` ``"adam"`` (lr 2e-4) or ``"sgd"`` (with ``server_momentum``), ``server_lr``,
    ``server_grad_clip`` 50 (joint L2 norm of the averaged gradients; 0 = off).
    Networks: ``embed_dim`` d (``None``: ``int(1 + N/4)`` with N the number of training clients; pass the paper's N =
    all clients explicitly), ``embed_kind`` (``"auto"``: CNN with label channels for images, MLP for vectors;
    ``"linear"``: label-only), ``hidden_dim`` 100 and ``n_hidden`` 3 of the hypernetwork.
    Descriptors: ``descriptor_batch`` 32 examples in training (the whole training split under record-level DP; see
    the module docstring); ``eval_descriptor_samples`` examples for seen/unseen clients after training (``None``:
    the whole training split, as the code evaluates). The per-example clipping radius comes from the run's privacy
    settings (the module docstring), not from here: the privacy of training clients is ``RunConfig.privacy``, that
    of unseen clients ``RunConfig.novel_privacy`` (epsilon, delta, bound B, noise source).
    Generated part: ``generated``, ``shared_lr`` and ``shared_momentum`` as in
    :class:`~privfl.methods.pfedhn.PFedHNConfig` (:mod:`privfl.methods.shared_part`).
    """

    lr: float = 2e-3
    local_steps: int = 50
    batch_size: int = 32
    momentum: float = 0.9
    grad_clip: float = 50.0
    lambda_theta: float = 2.5e-5
    lambda_h: float = 1e-3
    lambda_v: float = 1e-3
    server_optimizer: str = "adam"
    server_lr: float = 2e-4
    server_momentum: float = 0.9
    server_grad_clip: float = 50.0
    embed_dim: int | None = None
    embed_kind: str = "auto"
    hidden_dim: int = 100
    n_hidden: int = 3
    descriptor_batch: int = 32
    eval_descriptor_samples: int | None = None
    generated: str = "all"
    shared_lr: float = 1.0
    shared_momentum: float = 0.0

    def __post_init__(self) -> None:
        check_shared_settings(self.generated, self.shared_lr, self.shared_momentum)
        positive = ("lr", "server_lr")
        for name in positive:
            check.require(is_finite(getattr(self, name)) and getattr(self, name) > 0, name, getattr(self, name),
                          "a finite number > 0")
        for name in ("grad_clip", "lambda_theta", "lambda_h", "lambda_v", "server_grad_clip"):
            check.require(is_finite(getattr(self, name)) and getattr(self, name) >= 0, name, getattr(self, name),
                          "a finite number >= 0")
        for name in ("momentum", "server_momentum"):
            check.require(is_finite(getattr(self, name)) and 0 <= getattr(self, name) < 1, name, getattr(self, name),
                          "in [0, 1)")
        for name in ("local_steps", "batch_size", "hidden_dim", "descriptor_batch"):
            value = getattr(self, name)
            check.require(isinstance(value, int) and not isinstance(value, bool) and value >= 1, name, value,
                          "an integer >= 1")
        check.require(isinstance(self.n_hidden, int) and not isinstance(self.n_hidden, bool) and self.n_hidden >= 0,
                      "n_hidden", self.n_hidden, "an integer >= 0")
        for name in ("embed_dim", "eval_descriptor_samples"):
            value = getattr(self, name)
            check.require(value is None or (isinstance(value, int) and not isinstance(value, bool) and value >= 1),
                          name, value, "None or an integer >= 1")
        check.require(self.server_optimizer in SERVER_OPTIMIZERS, "server_optimizer", self.server_optimizer,
                      f"one of {', '.join(SERVER_OPTIMIZERS)}")
        check.require(self.embed_kind in EMBEDDING_KINDS, "embed_kind", self.embed_kind,
                      f"one of {', '.join(EMBEDDING_KINDS)}")

    def check_privacy(self, privacy: TrainingPrivacy, novel_privacy: NovelPrivacy) -> None:
        """Refuse, before the run, the per-step batch clip under record-level DP (DP-SGD clips each record)."""
        refuse_batch_clip(self.grad_clip, privacy)


# ---------------------------------------------------------------------------------------------------------------
# shared pieces


def load_parameters(model: nn.Module, weights: dict[str, torch.Tensor]) -> nn.Module:
    """Copy generated ``weights`` (named like ``model.named_parameters()``) into ``model``; buffers are kept."""
    names = [n for n, _ in model.named_parameters()]
    missing = sorted(set(names) - set(weights))
    if missing:
        raise ConfigError(f"generated weights lack the target tensors {missing}")
    with torch.no_grad():
        for name, param in model.named_parameters():
            param.copy_(weights[name])
    return model


def descriptor_of(embedding: EmbeddingNetwork, x: torch.Tensor, y: torch.Tensor, *, bound: float | None,
                  chunk: int = 256) -> torch.Tensor:
    """``(1/n) sum_j clip_B(phi(x_j, y_j))`` over all n examples, computed ``chunk`` examples at a time.

    1. per chunk, the **sum** of the clipped per-example embeddings (graph kept to eta_v);
    2. the total divided by n: the true mean, the paper's descriptor. The authors' code divides instead by twice the
       number of batches (``len(B)`` of an ``(x, y)`` tuple is 2), 16 times the mean with 32-example batches.
    """
    n = len(y)
    if n < 1:
        raise ConfigError("a descriptor needs at least one labelled example, got none")
    embedding.check_labels(y)
    total = None
    device = device_of(embedding)      # each chunk goes where the embedding network computes
    for start in range(0, n, chunk):
        rows = clipped_rows(embedding(x[start:start + chunk].to(device), y[start:start + chunk].to(device)), bound)
        part = rows.sum(dim=0)
        total = part if total is None else total + part
    assert total is not None   # n >= 1: the loop ran
    return total / n


def _clone_tree(value: Any) -> Any:
    """A deep copy of nested dicts/lists/tuples, tensors copied to the CPU (optimizer state without shared storage;
    ``Optimizer.load_state_dict`` moves it to the parameters' device)."""
    if isinstance(value, torch.Tensor):
        return value.detach().to("cpu", copy=True)
    if isinstance(value, dict):
        return {k: _clone_tree(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return type(value)(_clone_tree(v) for v in value)
    return value


def unseen_clients_with_labels(federation: FederatedDataset, *, score_fraction: float = 0.15,
                               min_samples: int = 2) -> list[TrainingClient]:
    """Labelled stand-ins for the federation's novel clients, for methods whose descriptor needs labels (PeFLL).

    For each novel client (whose samples are already in random order): the first ``max(1, floor(score_fraction * n))``
    samples form the **scoring** part (``x_val``, ``y_val``: only the evaluator reads these labels) and the rest the
    labelled **descriptor** part (``x_train``, ``y_train``: the data a new PeFLL client labels itself). The two are
    disjoint, so an unseen client is never scored on the data its model was generated from. The client takes no part
    in training; it is served through the two-down/one-up protocol (``runtime.novel_client_model(client)``).
    Score other methods on the same ``x_val``/``y_val`` for a like-for-like comparison. Novel clients with fewer
    than ``min_samples`` samples (at least 2: one to describe itself, one to score) are left out, with a warning.
    """
    check.require(is_finite(score_fraction) and 0 < score_fraction < 1, "score_fraction", score_fraction, "in (0, 1)")
    check.require(isinstance(min_samples, int) and min_samples >= 2, "min_samples", min_samples, "an integer >= 2")
    clients, skipped = [], []
    for novel in federation.novel_clients:
        x, y = novel.x, federation.novel_labels.labels(novel.client_id)
        if len(y) < min_samples:
            skipped.append(novel.client_id)
            continue
        k = min(max(1, math.floor(score_fraction * len(y))), len(y) - 1)
        clients.append(TrainingClient(novel.client_id, x[k:].clone(), y[k:].clone(), x[:k].clone(), y[:k].clone()))
    if skipped:
        warnings.warn(f"{len(skipped)} novel client(s) have fewer than {min_samples} samples and are left out of the "
                      f"unseen clients (ids {skipped})", stacklevel=2)
    return clients


# ---------------------------------------------------------------------------------------------------------------
# server


class PeFLLStrategy(Strategy):
    """Holds the hypernetwork eta_h (never sent), the embedding network eta_v and their optimiser; stateless towards
    clients except the latest released descriptor per training client (for the runtime's one-message evaluation)."""

    train_stages = 3

    def __init__(self, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        cfg: PeFLLConfig = self.config
        factory = self.model_factory
        self.embed_dim = cfg.embed_dim or embedding_dim(self.num_training_clients, rule="pfedhn")
        self.embed_kind = resolve_kind(cfg.embed_kind, tuple(factory.input_shape))
        target = factory.init(self.seed)
        #: Where both networks and the optimiser's state live (messages and the saved state are on the CPU).
        self.device = torch.device(factory.device)
        generated = None if cfg.generated == "all" else generated_names(target, cfg.generated)
        self.hnet = seeded_init(lambda: HyperNetwork(target, embed_dim=self.embed_dim, hidden_dim=cfg.hidden_dim,
                                                     n_hidden=cfg.n_hidden, generated=generated),
                                derive_seed(self.seed, "pefll_hypernetwork")).to(self.device)
        #: The trainable target tensors h does not generate (none with ``generated="all"``), from the target's seeded
        #: initialisation; FedAvg's step moves them.
        self.shared_part = SharedPart(target, [n for n in target_shapes(target) if n not in self.hnet.shapes],
                                      lr=cfg.shared_lr, momentum=cfg.shared_momentum, device=self.device)
        if self.shared_part:      # its momentum is saved only when there is a shared part
            self.training_only = (*type(self).training_only, "shared_momentum")
        self.embedding = seeded_init(lambda: EmbeddingNetwork(tuple(factory.input_shape), factory.num_classes,
                                                              embed_dim=self.embed_dim, kind=self.embed_kind),
                                     derive_seed(self.seed, "pefll_embedding")).to(self.device)
        groups = [{"params": list(self.hnet.parameters())}, {"params": list(self.embedding.parameters())}]
        if cfg.server_optimizer == "adam":
            self.optimizer: torch.optim.Optimizer = torch.optim.Adam(groups, lr=cfg.server_lr)
        else:
            self.optimizer = torch.optim.SGD(groups, lr=cfg.server_lr, momentum=cfg.server_momentum)
        self.descriptors: dict[int, torch.Tensor] = {}
        #: Whether the descriptors reached the server in the clear under central DP (they are then per-client state
        #: of the trusted aggregator, and none is used for another client's model).
        self._round: dict[str, Any] = {}

    # -- messages down ------------------------------------------------------------------------------------------------

    def _embedding_message(self, client_id: int) -> Message:
        cfg: PeFLLConfig = self.config
        weights = on_cpu(self.embedding.state_dict())
        config: dict[str, Scalar] = {
            "embed_dim": self.embed_dim, "embed_kind": self.embed_kind, "descriptor_batch": cfg.descriptor_batch,
            "eval_descriptor_samples": int(cfg.eval_descriptor_samples or 0)}
        return Message(arrays=prefixed(EMBED, weights), config=config)

    @torch.no_grad()
    def generate(self, descriptor: torch.Tensor) -> dict[str, torch.Tensor]:
        """theta = h(v): the generated target weights (detached, on the CPU), the shared part filling in the tensors h
        does not generate."""
        return on_cpu(self.shared_part.complete(self.hnet(descriptor.to(self.device, torch.float32))))

    def configure_train(self, round: int, client_ids: list[int]) -> dict[int, Message]:
        """Stage 0 (line 3): the embedding network to each sampled client."""
        self._round = {"descriptor": {}, "hnet_grads": RoundGradientMean(self.hnet), "loss": {}}
        return {cid: self._embedding_message(cid) for cid in client_ids}

    def configure_stage(self, round: int, stage: int, replies: dict[int, Message]) -> dict[int, Message]:
        cfg: PeFLLConfig = self.config
        if stage == 1:  # line 8-9: theta_i = h(v_i)
            messages = {}
            for cid, reply in replies.items():
                v = self._checked_descriptor(cid, reply)
                self._round["descriptor"][cid] = v
                self.descriptors[cid] = v
                config: dict[str, Scalar] = {
                    "lr": cfg.lr, "local_steps": cfg.local_steps, "batch_size": cfg.batch_size,
                    "momentum": cfg.momentum, "weight_decay": 2 * cfg.lambda_theta, "grad_clip": cfg.grad_clip}
                messages[cid] = Message(arrays=self.generate(v), config=config)
            return messages
        if stage == 2:  # line 12-13: one VJP through h; Delta eta_h^i stays here, Delta v_i goes down
            messages = {}
            for cid in sorted(replies):   # ascending: the order the hypernetwork gradients are summed in
                dv = self._round["hnet_grads"].add(cid, self._round["descriptor"][cid], replies[cid].arrays)
                self._round["loss"][cid] = float(replies[cid].metrics.get("loss", float("nan")))
                messages[cid] = Message(arrays={DESCRIPTOR_GRAD: dv.detach().cpu()})
            return messages
        raise InternalError(f"PeFLL has stages 0, 1, 2; got stage {stage}")

    def _checked_descriptor(self, client_id: int, reply: Message | None) -> torch.Tensor:
        if reply is None or DESCRIPTOR not in reply.arrays:
            raise ConfigError(f"client {client_id} sent no descriptor; PeFLL needs one to generate a model")
        v = reply.arrays[DESCRIPTOR].detach().to(torch.float32)
        if v.shape != (self.embed_dim,) or not bool(torch.isfinite(v).all()):
            raise ConfigError(f"client {client_id} sent a descriptor of shape {tuple(v.shape)} (finite: "
                              f"{bool(torch.isfinite(v).all())}); expected a finite vector of shape "
                              f"({self.embed_dim},)")
        return v

    # -- the update ---------------------------------------------------------------------------------------------------

    def aggregate_train(self, round: int, replies: dict[int, Message]) -> dict[str, float]:
        """Lines 17-18: average the clients' contributions, add the server regularisers, clip, step."""
        done = sorted(cid for cid in replies if cid in self._round.get("hnet_grads", ()))
        if not done:
            self._round = {}
            return {}
        shared = self.shared_part.mean_change([self._round["hnet_grads"].inputs(cid)[1] for cid in done])
        hnet_grads = self._round["hnet_grads"].mean(done)
        embed_grads = {name: cast(torch.Tensor, sum(replies[cid].arrays[EMBED + name].to(param.device, param.dtype)
                                                    for cid in done)) / len(done)
                       for name, param in self.embedding.named_parameters()}
        losses = [self._round["loss"][cid] for cid in done]
        metrics = self._server_step(round, hnet_grads, embed_grads, f"clients {done}", shared)
        return {"train_loss": sum(losses) / len(losses), **metrics}

    def _server_step(self, round: int, hnet_grads: dict[str, torch.Tensor], embed_grads: dict[str, torch.Tensor],
                     source: str, shared: dict[str, torch.Tensor] | None = None) -> dict[str, float]:
        """Line 18: ``g + 2 lambda eta`` for both networks, the joint clip to ``server_grad_clip``, one optimiser
        step; the shared part FedAvg's step from its mean change ``shared``; the round's working values are
        dropped."""
        cfg: PeFLLConfig = self.config
        hnet_params = dict(self.hnet.named_parameters())
        embed_params = dict(self.embedding.named_parameters())
        for name, param in hnet_params.items():
            param.grad = hnet_grads[name].to(param.device) + 2 * cfg.lambda_h * param.detach()
        for name, param in embed_params.items():
            param.grad = embed_grads[name].to(param.device) + 2 * cfg.lambda_v * param.detach()
        params = [*hnet_params.values(), *embed_params.values()]
        norm = torch.linalg.vector_norm(torch.stack([torch.linalg.vector_norm(p.grad) for p in params]))
        shared_norm = norm_of(shared or {})
        if not (math.isfinite(float(norm)) and math.isfinite(shared_norm)):
            # refuse before stepping, so the networks, Adam's moments and the last checkpoint stay finite (a NaN step
            # would surface a round later, blamed on a client's descriptor)
            self.optimizer.zero_grad(set_to_none=True)
            self._round = {}
            raise TrainingDivergedError(f"round {round}: PeFLL training diverged (non-finite gradients from {source}); "
                                        f"lower lr (now {cfg.lr!r}) or server_lr (now {cfg.server_lr!r}), or set "
                                        "grad_clip")
        if cfg.server_grad_clip > 0:
            torch.nn.utils.clip_grad_norm_(params, cfg.server_grad_clip)
        self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=True)
        if shared:
            self.shared_part.step(shared)
        self._round = {}
        return {"server_grad_norm": float(norm), **({"shared_change_norm": shared_norm} if self.shared_part else {})}

    # -- central DP: both networks move from a noisy mean ----------------------------------------------------------

    def contribution_shapes(self) -> dict[str, torch.Tensor]:
        """A contribution: the hypernetwork gradient (``"hnet."``), the embedding-network gradient (``"embed."``) and
        the shared tensors of the weight change (``"shared."``, none with ``generated="all"``), zeros on the CPU
        (where the privacy layer clips, sums and noises)."""
        return {**{HNET + name: torch.zeros(p.shape, dtype=p.dtype) for name, p in self.hnet.named_parameters()},
                **{EMBED + name: torch.zeros(p.shape, dtype=p.dtype) for name, p in self.embedding.named_parameters()},
                **self.shared_part.contribution_shapes()}

    def contributions(self, round: int, replies: dict[int, Message]):
        """Client i's contribution (module docstring): ``Delta eta_h^i``, chain-ruled here from its weight change at
        its descriptor (line 12), and its ``Delta eta_v^i`` (line 15), for the clients that completed the round."""
        kept = self._round.get("hnet_grads", ())
        for cid in sorted(cid for cid in replies if cid in kept):
            grads, _ = backprop_weight_change(self.hnet, *kept.inputs(cid))
            yield cid, {**prefixed(HNET, on_cpu(grads)),
                        **{EMBED + name: replies[cid].arrays[EMBED + name] for name, _ in
                           self.embedding.named_parameters()},
                        **self.shared_part.contribution(kept.inputs(cid)[1])}

    def apply_mean(self, round: int, mean: dict[str, torch.Tensor], count: float) -> dict[str, float]:
        """Line 18 from the noisy mean of the contributions (``count`` = q N): regularisers, clip, one step."""
        return self._server_step(round, {name: mean[HNET + name] for name, _ in self.hnet.named_parameters()},
                                 {name: mean[EMBED + name] for name, _ in self.embedding.named_parameters()},
                                 "the noisy mean", self.shared_part.from_mean(mean))

    # -- evaluation and novel clients ---------------------------------------------------------------------------------

    def configure_evaluate(self, client_id: int) -> Message:
        """The runtime's one-message evaluation of a training client: h(its latest released descriptor), or, if it
        never trained, h(mean of the released descriptors) (h(0) under central DP, where they are in the clear with
        the aggregator) (model selection only; see the module docstring)."""
        if client_id in self.descriptors:
            v = self.descriptors[client_id]
        elif self.descriptors and not self.confidential:
            v = torch.stack([self.descriptors[c] for c in sorted(self.descriptors)]).mean(dim=0)
        else:   # under central DP the others' descriptors are the aggregator's alone
            v = torch.zeros(self.embed_dim)
        return Message(arrays=self.generate(v))

    def novel_request(self, client_id: int) -> Message:
        """Algorithm 1, step 1: the embedding network."""
        return self._embedding_message(client_id)

    def novel_reply(self, client_id: int, delivered: Message | None) -> Message:
        """Algorithm 1, steps 4-5: theta = h(v) from the client's released descriptor."""
        return Message(arrays=self.generate(self._checked_descriptor(client_id, delivered)))

    training_only: tuple[str, ...] = ("optimizer",)

    def state_dict(self) -> dict[str, Any]:
        return {
            "hypernetwork": on_cpu(self.hnet.state_dict()),
            "embedding": on_cpu(self.embedding.state_dict()),
            "optimizer": _clone_tree(self.optimizer.state_dict()),    # on the CPU; loading moves it to the params
            "descriptor_ids": torch.tensor(sorted(self.descriptors), dtype=torch.int64),
            "descriptors": (torch.stack([self.descriptors[c] for c in sorted(self.descriptors)]) if self.descriptors
                            else torch.zeros(0, self.embed_dim)),
            "descriptors_confidential": self.confidential,
            **(self.shared_part.state_dict() if self.shared_part else {}),
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.hnet.load_state_dict(state["hypernetwork"])
        self.embedding.load_state_dict(state["embedding"])
        if "optimizer" in state:
            self.optimizer.load_state_dict(_clone_tree(state["optimizer"]))
        else:   # a serving state: the moments start afresh
            self.optimizer.state.clear()
        self.descriptors = {int(c): v.clone() for c, v in zip(state["descriptor_ids"].tolist(), state["descriptors"])}
        self.confidential = self.confidential or bool(state.get("descriptors_confidential", False))
        self.shared_part.load_state_dict(state)
        self._round = {}


# ---------------------------------------------------------------------------------------------------------------
# client


class PeFLLClient(ClientProcedure):
    """Computes descriptors with the received embedding network, trains generated models locally, and back-propagates
    the server's descriptor gradient through the embedding network. Keeps nothing across rounds."""

    serves_novel_clients = False  # novel clients need labels (see the module docstring and unseen_clients_with_labels)

    def __init__(self, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self.config.check_privacy(self.privacy, self.novel_privacy)   # also where no RunConfig checked it
        self._embeddings: dict[tuple[str, int], EmbeddingNetwork] = {}

    def embedding_from(self, message_config: dict, weights: dict[str, torch.Tensor]) -> EmbeddingNetwork:
        """The workspace embedding network for (kind, d) from the message, loaded with ``weights``."""
        key = (str(message_config["embed_kind"]), int(message_config["embed_dim"]))
        if key not in self._embeddings:
            factory = self.model_factory
            self._embeddings[key] = EmbeddingNetwork(tuple(factory.input_shape), factory.num_classes,
                                                     embed_dim=key[1], kind=key[0]).to(factory.device)
        net = self._embeddings[key]
        net.load_state_dict(weights)
        return net

    @property
    def embedding_bound(self) -> float | None:
        """B, the L2 radius each per-example embedding is clipped to in training and in a non-private descriptor:
        the novel bound under record-level DP (it sets the descriptor's sensitivity) or when novel clients release
        privately (the networks then train on the function novel clients release), else none. The client's own
        setting: nothing the server sends can change it."""
        return float(self.novel_privacy.bound) if self.record_level or self.novel_privacy.private else None

    # -- record level -------------------------------------------------------------------------------------------------

    def record_releases(self) -> tuple[RecordRelease, ...]:
        """Record level: the three releases of a round (module docstring): the descriptor (a mean of labelled
        records' embeddings clipped to B) and the embedding gradient (a mean of per-record gradients clipped to C)
        around one DP-SGD fit."""
        return (self.clipped_mean(float(self.novel_privacy.bound)), self.dp_sgd_fit(),
                self.clipped_mean(float(self.privacy.clip)))

    def _metadata(self) -> dict[str, Any]:
        return {"noise": self.privacy.noise, "bound": float(self.novel_privacy.bound), "clip": float(self.privacy.clip),
                "min_samples": self.privacy.min_samples, "relation": "add or remove one labelled record; n private"}

    # -- rounds -------------------------------------------------------------------------------------------------------

    def train(self, data: TrainingClient, message: Message, state: ClientState, ctx: ClientContext) -> Release:
        """Stage 0 (lines 5-7): descriptor of one random batch (of the whole training split under record-level DP);
        keep the batch and eta_v for stage 2."""
        weights = message.subset(EMBED)
        net = self.embedding_from(message.config, weights)
        if self.record_level:
            batch = torch.arange(data.num_train, dtype=torch.int64)
            bound = self.embedding_bound
            assert bound is not None   # record level: the novel bound
            v, event, _ = release_labelled_mean(net, data.x_train, data.y_train, bound=bound,
                                                num_classes=self.model_factory.num_classes,
                                                noise_multiplier=self.noise_multiplier(),
                                                relation=NeighboringRelation.ADD_OR_REMOVE_ONE,
                                                min_samples=self.privacy.min_samples,
                                                **self.noise_source(ctx, "pefll_descriptor"))
            release = private_release(Message(arrays={DESCRIPTOR: v.to("cpu", torch.get_default_dtype())}),
                                      "descriptor", event, metadata=self._metadata())
        else:
            size = min(int(message.config["descriptor_batch"]), data.num_train)
            batch = torch.from_numpy(ctx.rng.permutation(data.num_train)[:size]).to(torch.int64)
            with torch.no_grad():
                v = descriptor_of(net, data.x_train[batch], data.y_train[batch], bound=self.embedding_bound)
            release = Release.non_private(Message(arrays={DESCRIPTOR: v.cpu()}), purpose="descriptor")
        state[_STATE_BATCH] = batch
        state["pefll.embed_dim"] = torch.tensor(int(message.config["embed_dim"]))
        state["pefll.embed_kind"] = torch.tensor(EMBEDDING_KINDS.index(str(message.config["embed_kind"])))
        state.update(prefixed(_STATE_EMBED, weights))
        return release

    def train_stage(self, stage: int, data: TrainingClient, message: Message, state: ClientState,
                    ctx: ClientContext) -> Release:
        if stage == 1:
            return self._local_training(data, message, ctx)
        if stage == 2:
            return self._embedding_gradient(data, message, state, ctx)
        raise InternalError(f"PeFLL has stages 0, 1, 2; got stage {stage}")

    def _local_training(self, data: TrainingClient, message: Message, ctx: ClientContext) -> Release:
        """Stage 1 (lines 10-11): k SGD steps from theta_i (DP-SGD under record-level DP, where the loss is not
        sent); send theta_i - theta~_i."""
        cfg = message.config
        start = {k: v.clone() for k, v in message.arrays.items()}
        model = load_parameters(self.workspace_model(), start)
        settings = {"lr": float(cfg["lr"]), "steps": int(cfg["local_steps"]), "batch_size": int(cfg["batch_size"]),
                    "momentum": float(cfg["momentum"]), "weight_decay": float(cfg["weight_decay"]),
                    "grad_clip": float(cfg["grad_clip"])}
        loss, event = self.fit(model, data, settings, ctx.rng)
        change = {k: start[k] - p.detach().cpu() for k, p in model.named_parameters()}
        return private_release(Message(arrays=change, metrics={} if event is not None else {"loss": loss}),
                               "weight_change", event, metadata=self._metadata())

    def _embedding_gradient(self, data: TrainingClient, message: Message, state: ClientState,
                            ctx: ClientContext) -> Release:
        """Stage 2 (lines 14-15): Delta eta_v = (d v/d eta_v)^T Delta v on the stage-0 batch (each record's term
        clipped, averaged and noised under record-level DP); forget the batch."""
        batch = state.pop(_STATE_BATCH)
        d = int(state.pop("pefll.embed_dim"))
        weights = {k[len(_STATE_EMBED):]: state.pop(k) for k in list(state) if k.startswith(_STATE_EMBED)}
        kind = EMBEDDING_KINDS[int(state.pop("pefll.embed_kind"))]
        net = self.embedding_from({"embed_kind": kind, "embed_dim": d}, weights)
        names = [n for n, _ in net.named_parameters()]
        params = [p for _, p in net.named_parameters()]
        cotangent = message.arrays[DESCRIPTOR_GRAD].to(self.model_factory.device)
        bound = self.embedding_bound
        if self.record_level:
            def per_record(model: nn.Module, xb: torch.Tensor, yb: torch.Tensor) -> torch.Tensor:
                return (clipped_rows(model(xb, yb), bound) * cotangent.to(xb.dtype)).sum(dim=1)

            grads, event, _ = self.record_gradient_mean(net, per_record, data.x_train[batch], data.y_train[batch],
                                                        self.noise_source(ctx, "pefll_embedding_gradient"))
            return private_release(Message(arrays={EMBED + n: grads[n].cpu() for n in names}), "embedding_gradient",
                                   event, metadata=self._metadata())
        v = descriptor_of(net, data.x_train[batch], data.y_train[batch], bound=bound)
        param_grads = torch.autograd.grad(v, params, grad_outputs=cotangent.to(v.dtype), allow_unused=True)
        update = {EMBED + n: (torch.zeros_like(p) if g is None else g.detach()).cpu()
                  for n, p, g in zip(names, params, param_grads, strict=True)}
        return Release.non_private(Message(arrays=update), purpose="embedding_gradient")

    # -- seen clients after training and unseen clients: Algorithm 1 ---------------------------------------------------

    def novel_query(self, novel: Any, message: Message) -> Release:
        """Algorithm 1, steps 2-3: the descriptor of the client's labelled data, released (DP with the run's
        ``novel_privacy``: replace-one of a labelled record, n public, B its bound)."""
        if not (hasattr(novel, "x_train") and hasattr(novel, "y_train")):
            raise ConfigError(
                f"PeFLL needs labelled data for a new client's descriptor, but client "
                f"{getattr(novel, 'client_id', '?')} is a {type(novel).__name__} without labels; serve unseen clients "
                "as labelled held-out clients (privfl.methods.pefll.unseen_clients_with_labels)")
        net = self.embedding_from(message.config, message.subset(EMBED))
        limit = int(message.config["eval_descriptor_samples"]) or novel.num_train
        x, y = novel.x_train[:limit], novel.y_train[:limit]
        setting = self.novel_privacy
        if not setting.private:
            with torch.no_grad():
                v = descriptor_of(net, x, y, bound=self.embedding_bound)
            return Release.non_private(Message(arrays={DESCRIPTOR: v.cpu()}), purpose="descriptor")
        # seeded noise is keyed by the client's own seed: nothing in the server's message sets it
        source = noise_source(setting, lambda seed: derive_seed(seed, "pefll_descriptor_noise", novel.client_id))
        v, event, _ = release_labelled_mean(net, x, y, epsilon=setting.epsilon, delta=setting.delta,
                                            bound=setting.bound, num_classes=self.model_factory.num_classes,
                                            **source)
        return Release(Message(arrays={DESCRIPTOR: v.cpu()}), purpose="descriptor", event=event,
                       metadata={"noise": setting.noise, "bound": float(setting.bound),
                                 "relation": "replace one labelled record (x, y); n public"})

    def novel_model(self, novel: Any, message: Message) -> nn.Module:
        """Algorithm 1, step 5: the generated model, used as is (no fine-tuning)."""
        return load_parameters(self.workspace_model(), message.arrays)

    def evaluation_model(self, data: TrainingClient, message: Message, state: ClientState) -> nn.Module:
        return load_parameters(self.workspace_model(), message.arrays)


register_method(
    "pefll", strategy=PeFLLStrategy, client=PeFLLClient, config=PeFLLConfig,
    description="PeFLL: embedding network + hypernetwork trained by learning to learn; unseen clients get a model "
                "from one labelled descriptor (two messages down, one up, no fine-tuning)",
    privacy=PEFLL_PRIVACY,
    releases_per_round=3, novel_privacy=None,
    smoke_settings={"hidden_dim": 8, "n_hidden": 1, "embed_dim": 3, "grad_clip": 0.0, "descriptor_batch": 8},
    devices=ANY_DEVICE,
    central_eval="it generates each client's model from that client's own labelled descriptor: no model exists before "
                 "a client sends one",
)
