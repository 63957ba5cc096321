"""Central evaluation: the server model scored on a central held-out set, beside the per-client scores.

What pfl's central evaluation and Flower's server-side ``evaluate_fn`` give: one pooled accuracy and loss of the
model the server holds, per evaluation round (``--central-eval``, ``RunConfig.central_eval``; the ``central_*``
fields of ``metrics.jsonl``).

**The model.** A method with one server model declares it in its registration (``MethodSpec.central_eval`` is
``None``): the model a new client would get from the server before it uses any data of its own, the strategy's
:meth:`~privfl.methods.base.Strategy.novel_request` built by
:meth:`~privfl.methods.base.ClientProcedure.central_model` (FedAvg's global weights; TENT's and FedTTA's model before
a client adapts it; the PFL pool's expected model or ensemble). A personalised method, whose every model is made
from one client's release (ODPFL-HN, PeFLL, pFedHN, ...), has none, and a run with central evaluation is refused
with the registration's reason.

**The held-out set.** The samples of the run's novel clients, pooled, with the hidden labels the evaluator scores
them with (:class:`~privfl.data.NovelLabels`): data no training client holds (with ``split="train_test"`` the
source's test split, capped by ``max_samples`` where set; with ``split="merged"`` the novel clients' share of the
merged pool), shifted as the novel clients' data is. ``split="client_test"`` has no novel clients (its test split is
the training clients' validation splits), so it is refused.

**Privacy.** Central evaluation is the experimenter's measurement of a released model, as scoring a novel client at
the end is: no client computes or sends anything for it, nothing is recorded in a ledger, no method or strategy
sees the held-out samples or labels, and model selection (``select="best_val"``) never reads it. The model is
post-processing of what the training clients released; the held-out set is the novel clients' data, which the run
already scores.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import torch
from torch import nn

from privfl.metrics import score_model

if TYPE_CHECKING:
    from privfl.data import FederatedDataset

#: The client id of the server-model request: a client that is none of the run's (ids are >= 0).
CENTRAL_CLIENT = -1


def central_model(strategy: Any, client: Any) -> nn.Module:
    """The server model of ``strategy`` as ``client`` (the method's procedure) builds it without any client's data."""
    return client.central_model(strategy.novel_request(CENTRAL_CLIENT))


def evaluate_central(strategy: Any, client: Any, federation: FederatedDataset) -> dict[str, float | int]:
    """``central_accuracy`` (pooled over every held-out sample, %), ``central_loss`` (mean cross-entropy, nats) and
    ``central_num_samples`` of the server model on the novel clients' samples and hidden labels.

    Scored one novel client at a time and summed (no pooled copy of the data); in a forked torch RNG, so building
    the model draws nothing the run's later numbers depend on."""
    if not federation.novel_clients:
        raise ValueError("central evaluation needs held-out samples, and this federation has no novel clients")
    with torch.random.fork_rng(devices=[]):
        model = central_model(strategy, client)
        scores = [score_model(model, novel.x, federation.novel_labels.labels(novel.client_id))
                  for novel in federation.novel_clients]
    total = sum(s.num_samples for s in scores)
    return {"central_accuracy": 100.0 * sum(s.correct for s in scores) / total,
            "central_loss": sum(s.loss_sum for s in scores) / total, "central_num_samples": total}
