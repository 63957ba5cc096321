"""Per-client scores and their summaries (mean and standard error over clients, pooled accuracy)."""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
from torch import nn


@dataclass(frozen=True)
class ClientScore:
    """One client's result on its evaluation set: sample count, correct predictions, summed cross-entropy (nats).

    For an :class:`ExpectedModel` ``correct`` and ``loss_sum`` are expectations (means over its members), so
    ``correct`` may be fractional.
    """

    num_samples: int
    correct: int | float
    loss_sum: float

    @property
    def accuracy(self) -> float:
        return self.correct / self.num_samples if self.num_samples else float("nan")

    @property
    def loss(self) -> float:
        return self.loss_sum / self.num_samples if self.num_samples else float("nan")


class Members(nn.Module):
    """A non-empty list of models held as one module: the base of :class:`ExpectedModel` and of the methods' logit
    ensembles."""

    def __init__(self, members: list[nn.Module]) -> None:
        super().__init__()
        if not members:
            raise ValueError(f"a {type(self).__name__} needs at least one member, got an empty list")
        self.members = nn.ModuleList(members)


class ExpectedModel(Members):
    """One of ``members`` drawn uniformly at random, scored by its expectation: PFL-sampled, the ODPFL-HN papers'
    baseline, scored by the mean accuracy of all the personalised models on each novel client (Amosy et al.,
    section 6.2; docs/papers.md, ODPFL-HN, U11).

    It makes no single prediction, so calling it raises; :func:`score_model` scores it as the mean over members of
    each member's score (accuracy = mean of the members' accuracies, loss = mean of their losses).
    """

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        raise TypeError("an ExpectedModel stands for a uniformly drawn member and has no single prediction; "
                        "score it with score_model (mean over members) or call one of .members")


@torch.no_grad()
def score_model(model: nn.Module, x: torch.Tensor, y: torch.Tensor, *, batch_size: int = 2048) -> ClientScore:
    """Accuracy and cross-entropy of ``model`` on ``(x, y)``, in eval mode, in batches.

    An :class:`ExpectedModel` scores as the mean of its members' scores.
    """
    if isinstance(model, ExpectedModel):
        scores = [score_model(member, x, y, batch_size=batch_size) for member in model.members]
        return ClientScore(num_samples=len(y), correct=sum(s.correct for s in scores) / len(scores),
                           loss_sum=sum(s.loss_sum for s in scores) / len(scores))
    was_training = model.training
    model.eval()
    correct, loss_sum = 0, 0.0
    device = next(iter(model.parameters()), torch.empty(0)).device   # the data goes where the model computes
    for start in range(0, len(y), batch_size):
        logits = model(x[start:start + batch_size].to(device))
        target = y[start:start + batch_size].to(device)
        correct += int((logits.argmax(dim=1) == target).sum())
        loss_sum += float(nn.functional.cross_entropy(logits, target, reduction="sum"))
    model.train(was_training)
    return ClientScore(num_samples=len(y), correct=correct, loss_sum=loss_sum)


def mean_sem(values: list[float]) -> tuple[float, float]:
    """Mean and standard error of the mean (sample std with ddof=1 over sqrt(n)); NaN values are skipped."""
    finite = [v for v in values if not math.isnan(v)]
    if not finite:
        return float("nan"), float("nan")
    mean = sum(finite) / len(finite)
    if len(finite) < 2:
        return mean, float("nan")
    variance = sum((v - mean) ** 2 for v in finite) / (len(finite) - 1)
    return mean, math.sqrt(variance / len(finite))


def summarize_scores(scores: list[ClientScore]) -> dict[str, float | None]:
    """Mean +- SEM of accuracy over clients (in %), pooled (sample-weighted) accuracy, mean loss, client count.

    With no scored client (a method that serves no novel clients) every value but the count is ``None``.
    """
    scored = [s for s in scores if s.num_samples > 0]
    if not scored:
        return {"accuracy_mean": None, "accuracy_sem": None, "accuracy_pooled": None, "loss_mean": None,
                "num_clients": 0}
    acc_mean, acc_sem = mean_sem([100.0 * s.accuracy for s in scored])
    total = sum(s.num_samples for s in scored)
    pooled = 100.0 * sum(s.correct for s in scored) / total if total else float("nan")
    loss_mean, _ = mean_sem([s.loss for s in scored])
    return {"accuracy_mean": acc_mean, "accuracy_sem": acc_sem, "accuracy_pooled": pooled,
            "loss_mean": loss_mean, "num_clients": len(scored)}
