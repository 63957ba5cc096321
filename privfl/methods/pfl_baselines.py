"""PFL-sampled, PFL-nearest and PFL-ensemble: pFedHN's personal models applied to a novel client.

The ODPFL-HN papers' baselines (Amosy et al., section 6.2; docs/papers.md, ODPFL-HN, "Baselines"). All three train
exactly as :mod:`privfl.methods.pfedhn` and differ only in how a novel client is served from the pool of training
clients' models ``f_theta(e_j)``: ``pfl_sampled`` scores the pool's expected accuracy
(:class:`privfl.metrics.ExpectedModel`), ``pfl_ensemble`` averages the pool's logits (:class:`LogitEnsemble`) and
``pfl_nearest`` sends the model of the training client nearest in proxy A-distance, which puts raw inputs of every
client on the server (recorded as non-private releases) and so refuses every privacy mode.

How each is served, what the server sees, and which privacy modes run: docs/methods/hypernetworks.md, "PFL-sampled,
PFL-nearest and PFL-ensemble".
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import numpy as np
import torch
from torch import nn

from privfl.data import NovelClient, TrainingClient
from privfl.devices import ANY_DEVICE
from privfl.errors import ConfigError, check
from privfl.federation.messages import Message, Release, prefixed
from privfl.federation.seeding import derive_rng, derive_seed
from privfl.methods.base import ClientContext, ClientState, register_method
from privfl.methods.pfedhn import (
    DISTRIBUTED_REFUSAL,
    SMOKE_SETTINGS,
    PFedHNClient,
    PFedHNConfig,
    PFedHNStrategy,
)
from privfl.metrics import ExpectedModel, Members


class LogitEnsemble(Members):
    """Predicts the mean of its members' logits (PFL-ensemble: "average the logits" of all training-client models,
    Amosy et al., section 6.2)."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.stack([member(x) for member in self.members]).mean(dim=0)


#: Fewest inputs on each side for which :func:`proxy_a_distance` is defined.
MIN_DISTANCE_INPUTS = 4


def proxy_a_distance(a: torch.Tensor, b: torch.Tensor, *, rng: np.random.Generator) -> float:
    """Proxy A-distance ``2 (1 - 2 err)`` between two input samples (Ben-David et al. 2007; the estimator's details
    are this project's, docs/papers.md, ODPFL-HN, U10).

    1. Flatten both to vectors and draw ``m = min(len(a), len(b))`` rows of each (balanced classes, ``rng``);
    2. split each side 50/50 into a fit half and a held-out half;
    3. standardise with the fit half's mean and std; fit a logistic regression labelling ``a`` 0 and ``b`` 1 with
       scikit-learn's default objective ``0.5 ||w||^2 + sum_i log(1 + exp(-s_i (w x_i + c)))`` (C = 1, intercept
       unpenalised), by L-BFGS in float64 (torch, so it honours ``torch.set_num_threads``);
    4. ``err`` = its error on the held-out half; return ``2 (1 - 2 err)`` (about 0 for one distribution, 2 for
       separable ones; it can dip slightly below 0 by chance).
    """
    a = a.reshape(len(a), -1).double()
    b = b.reshape(len(b), -1).double()
    m = min(len(a), len(b))
    if m < MIN_DISTANCE_INPUTS:
        raise ConfigError(f"proxy A-distance needs at least {MIN_DISTANCE_INPUTS} inputs on each side, got {len(a)} "
                          f"and {len(b)}")
    a = a[torch.from_numpy(rng.permutation(len(a))[:m])]
    b = b[torch.from_numpy(rng.permutation(len(b))[:m])]
    half = m // 2
    fit = torch.cat([a[:half], b[:half]])
    held = torch.cat([a[half:], b[half:]])
    fit_y = torch.cat([torch.zeros(half), torch.ones(half)]).double()
    held_y = torch.cat([torch.zeros(m - half), torch.ones(m - half)]).double()
    mean, std = fit.mean(dim=0), fit.std(dim=0, unbiased=False)
    std = torch.where(std < 1e-8, torch.ones_like(std), std)
    fit, held = (fit - mean) / std, (held - mean) / std
    w = torch.zeros(fit.shape[1], dtype=torch.float64, requires_grad=True)
    c = torch.zeros((), dtype=torch.float64, requires_grad=True)
    optimizer = torch.optim.LBFGS([w, c], lr=1.0, max_iter=500, tolerance_grad=1e-9, tolerance_change=1e-12,
                                  history_size=20, line_search_fn="strong_wolfe")

    def objective() -> torch.Tensor:
        optimizer.zero_grad()
        loss = 0.5 * w.dot(w) + nn.functional.binary_cross_entropy_with_logits(fit @ w + c, fit_y, reduction="sum")
        loss.backward()
        return loss

    optimizer.step(objective)
    with torch.no_grad():
        err = float(((held @ w + c > 0).double() != held_y).double().mean())
    return 2.0 * (1.0 - 2.0 * err)


def _pool_prefix(client_id: int) -> str:
    return f"client{client_id}/"


class PFLPoolStrategy(PFedHNStrategy):
    """pFedHN training; a novel client receives every pool model (client ids listed in the config)."""

    def pool(self) -> list[int]:
        """The training clients whose models form the pool: those that have taken part in a round."""
        if not self.embeddings:
            raise ConfigError("no training client has taken part in a round yet, so there is no model to serve")
        return sorted(self.embeddings)

    def novel_request(self, client_id: int) -> Message:
        arrays: dict[str, torch.Tensor] = {}
        ids = self.pool()
        for j in ids:
            arrays.update(prefixed(_pool_prefix(j), self.generate(self.embeddings[j])))
        return Message(arrays=arrays, config={"members": ",".join(str(j) for j in ids)})


class PFLPoolClient(PFedHNClient):
    """Builds the pool's models on the novel client; sends nothing."""

    serves_novel_clients = True

    def pool_models(self, message: Message) -> list[nn.Module]:
        ids = [int(j) for j in str(message.config["members"]).split(",")]
        return [self.load_generated(message.subset(_pool_prefix(j)), self.model_factory()) for j in ids]


class PFLSampledClient(PFLPoolClient):
    def novel_model(self, novel: NovelClient, message: Message) -> nn.Module:
        return self.central_model(message)

    def central_model(self, message: Message) -> nn.Module:
        return ExpectedModel(self.pool_models(message))


class PFLEnsembleClient(PFLPoolClient):
    def novel_model(self, novel: NovelClient, message: Message) -> nn.Module:
        return self.central_model(message)

    def central_model(self, message: Message) -> nn.Module:
        return LogitEnsemble(self.pool_models(message))


@dataclass(frozen=True)
class PFLNearestConfig(PFedHNConfig):
    """pFedHN's settings plus ``nearest_max_inputs``: the most inputs each side releases for the A-distance."""

    nearest_max_inputs: int = 500

    def __post_init__(self) -> None:
        super().__post_init__()
        check.require(isinstance(self.nearest_max_inputs, int) and not isinstance(self.nearest_max_inputs, bool)
                      and self.nearest_max_inputs >= 4, "nearest_max_inputs", self.nearest_max_inputs,
                      "an integer >= 4")


class PFLNearestStrategy(PFedHNStrategy):
    """pFedHN training plus a second stage that collects each new client's inputs; serves the nearest model."""

    train_stages = 2

    def __init__(self, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self.inputs: dict[int, torch.Tensor] = {}
        self._weight_changes: dict[int, Message] = {}
        #: novel client id -> (chosen training client, {training client: d_A}) of the last serving.
        self.last_nearest: dict[int, tuple[int, dict[int, float]]] = {}

    def configure_stage(self, round: int, stage: int, replies: dict[int, Message]) -> dict[int, Message]:
        """Stage 1: ask the clients whose inputs the server lacks for them (step 1 of the module docstring)."""
        self._weight_changes = replies
        request = {"max_inputs": self.config.nearest_max_inputs}
        return {cid: Message(config=dict(request)) for cid in sorted(replies) if cid not in self.inputs}

    def aggregate_train(self, round: int, replies: dict[int, Message]) -> dict[str, float]:
        for cid, message in replies.items():
            self.inputs[cid] = message.arrays["inputs"]
        changes, self._weight_changes = self._weight_changes, {}
        return super().aggregate_train(round, changes)

    def novel_request(self, client_id: int) -> Message:
        return Message(config={"max_inputs": self.config.nearest_max_inputs,
                               "sample_seed": derive_seed(self.seed, "pfl_nearest_query", client_id)})

    def novel_reply(self, client_id: int, delivered: Message | None) -> Message:
        """Step 3: d_A between the novel client's inputs and each stored training client's; the nearest model.

        Only training clients that sent at least :data:`MIN_DISTANCE_INPUTS` inputs are candidates: the proxy
        A-distance needs a fit half and a held-out half of at least two each, and a client of one or two images
        (Dirichlet alpha 0.1 makes them) has no measurable distance. They are skipped, not guessed at."""
        if delivered is None or "inputs" not in delivered.arrays:
            raise ConfigError(f"pfl_nearest needs novel client {client_id}'s inputs, and it sent none")
        if len(delivered.arrays["inputs"]) < MIN_DISTANCE_INPUTS:
            raise ConfigError(f"pfl_nearest: novel client {client_id} sent {len(delivered.arrays['inputs'])} inputs; "
                              f"the proxy A-distance needs at least {MIN_DISTANCE_INPUTS}")
        stored = sorted(j for j in self.inputs if j in self.embeddings)
        if not stored:
            raise ConfigError("pfl_nearest holds no training client's inputs yet (no round has completed)")
        candidates = [j for j in stored if len(self.inputs[j]) >= MIN_DISTANCE_INPUTS]
        if not candidates:
            raise ConfigError(f"pfl_nearest: no training client sent at least {MIN_DISTANCE_INPUTS} inputs, so no "
                              "proxy A-distance can be computed")
        distances = {j: proxy_a_distance(delivered.arrays["inputs"], self.inputs[j],
                                         rng=derive_rng(self.seed, "pfl_nearest_distance", client_id, j))
                     for j in candidates}
        nearest = min(candidates, key=lambda j: (distances[j], j))
        self.last_nearest[client_id] = (nearest, distances)
        return Message(arrays=self.generate(self.embeddings[nearest]), metrics={"a_distance": distances[nearest]})

    def state_dict(self) -> dict[str, Any]:
        return {**super().state_dict(), "inputs": {str(k): v for k, v in self.inputs.items()}}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        super().load_state_dict(state)
        self.inputs = {int(k): v.clone() for k, v in state["inputs"].items()}
        self._weight_changes = {}


def _subsample(x: torch.Tensor, max_inputs: int, rng: np.random.Generator) -> torch.Tensor:
    if len(x) <= max_inputs:
        return x.clone()
    return x[torch.from_numpy(np.sort(rng.choice(len(x), size=max_inputs, replace=False)))].clone()


class PFLNearestClient(PFedHNClient):
    """pFedHN's client; releases a subsample of its inputs when asked (training stage 1, novel query)."""

    serves_novel_clients = True

    def train_stage(self, stage: int, data: TrainingClient, message: Message, state: ClientState,
                    ctx: ClientContext) -> Release:
        x = _subsample(data.x_train, int(message.config["max_inputs"]), ctx.rng)
        return Release.non_private(Message(arrays={"inputs": x}), purpose="raw_inputs")

    def novel_query(self, novel: NovelClient, message: Message) -> Release:
        rng = np.random.default_rng(int(message.config["sample_seed"]))
        x = _subsample(novel.x, int(message.config["max_inputs"]), rng)
        return Release.non_private(Message(arrays={"inputs": x}), purpose="raw_inputs")

    def novel_model(self, novel: NovelClient, message: Message) -> nn.Module:
        return self.load_generated(message.arrays)


#: Why central DP is refused where novel clients receive every training client's model.
POOL_CENTRAL_REFUSAL = ("a novel client receives every training client's generated model f_theta(e_j), and each "
                        "embedding row e_j is per-client server state moved by client j's own weight changes in the "
                        "clear; central DP's noisy sum protects the shared hypernetwork only")
POOL_PRIVACY = {"record": None, "local": None, "central": POOL_CENTRAL_REFUSAL, "distributed": DISTRIBUTED_REFUSAL}
#: Why pfl_nearest runs no privacy mode.
RAW_INPUTS = ("its training clients send a sample of their raw inputs to the server for the proxy A-distance to "
              "novel clients, which no mechanism can make private (the distance needs the inputs as they are)")

register_method(
    "pfl_sampled", strategy=PFLPoolStrategy, client=PFLSampledClient, config=PFedHNConfig,
    description="PFL-sampled: pFedHN; a novel client is scored by the mean accuracy of all training-client models",
    privacy=POOL_PRIVACY, releases_per_round=1, smoke_settings=SMOKE_SETTINGS, devices=ANY_DEVICE,
    central_eval=None,
)
register_method(
    "pfl_ensemble", strategy=PFLPoolStrategy, client=PFLEnsembleClient, config=PFedHNConfig,
    description="PFL-ensemble: pFedHN; a novel client averages the logits of all training-client models",
    privacy=POOL_PRIVACY, releases_per_round=1, smoke_settings=SMOKE_SETTINGS, devices=ANY_DEVICE,
    central_eval=None,
)
register_method(
    "pfl_nearest", strategy=PFLNearestStrategy, client=PFLNearestClient, config=PFLNearestConfig,
    description="PFL-nearest: pFedHN; a novel client gets the model of the training client nearest in proxy "
                "A-distance (both sides' raw inputs reach the server, non-private)",
    privacy=dict.fromkeys(("record", "central", "distributed", "local"), RAW_INPUTS),
    # the weight change every round, and the raw inputs in the round a client first takes part in
    releases_per_round=2,
    novel_privacy="its novel clients send a sample of their raw inputs for the proxy A-distance, which no mechanism "
                  "can make private",
    smoke_settings={**SMOKE_SETTINGS, "nearest_max_inputs": 16}, devices=ANY_DEVICE,
    central_eval="a new client gets the pool model nearest its own inputs, chosen from what it sends: no model exists "
                 "before it does",
)
