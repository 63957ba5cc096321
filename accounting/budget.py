"""Privacy budgets: the most a client may spend (:class:`PrivacyBudget`), the slack with which an accountant's epsilon
meets one (:data:`BUDGET_RTOL`), and the error a release over budget raises (:class:`BudgetExceededError`). Ledgers
(:mod:`accounting.ledger`) hold and enforce them.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from accounting.validation import is_finite, is_real

ClientId = int | str

#: Relative slack with which an epsilon meets a budget (:meth:`PrivacyBudget.allows`). The accountant's epsilon is a
#: numerical upper bound: pricing the analytic Gaussian mechanism calibrated exactly to (epsilon, delta) comes back
#: above epsilon by up to 2.2e-9 relative at delta >= 1e-8 and 1.8e-7 at delta = 1e-10 (PLD accountant, epsilon 0.01
#: to 32; client-level compositions of up to 200 releases: 2.2e-12). Without the slack a budget of exactly the
#: calibrated epsilon refuses its own release. The excess it admits, 1e-6 * epsilon, moves the bound e^epsilon on the
#: likelihood ratio by a factor e^(1e-6 epsilon), about 1 + 8e-6 at epsilon = 8.
BUDGET_RTOL = 1e-6


@dataclass(frozen=True)
class PrivacyBudget:
    """The most a client may spend: every composition of its releases must stay (epsilon, delta)-DP.

    ``epsilon`` is natural-log, finite and > 0; ``delta`` a probability in (0, 1).
    """

    epsilon: float
    delta: float

    def __post_init__(self) -> None:
        e = self.epsilon
        if not is_finite(e) or e <= 0:
            raise ValueError(f"budget epsilon must be a finite number > 0, got {e!r}")
        d = self.delta
        if not is_real(d) or not 0 < d < 1:
            raise ValueError(f"budget delta must be a probability in (0, 1), got {d!r}")
        object.__setattr__(self, "epsilon", float(e))
        object.__setattr__(self, "delta", float(d))

    def allows(self, epsilon: float) -> bool:
        """Whether a composition priced at ``epsilon`` (at this budget's delta) stays within the budget, to the
        accountant's numerical precision (:data:`BUDGET_RTOL`); infinity and nan never do."""
        return epsilon <= self.epsilon * (1.0 + BUDGET_RTOL)

    def to_dict(self) -> dict[str, float]:
        return {"epsilon": self.epsilon, "delta": self.delta}

    @classmethod
    def from_dict(cls, d: Mapping[str, Any]) -> PrivacyBudget:
        return cls(epsilon=d["epsilon"], delta=d["delta"])


class BudgetExceededError(Exception):
    """A release was refused because it would take its client over budget; nothing was recorded or sent."""

    def __init__(self, client_id: ClientId, purpose: str, epsilon_before: float, epsilon_after: float,
                 budget: PrivacyBudget, accountant: str) -> None:
        super().__init__(client_id, purpose, epsilon_before, epsilon_after, budget, accountant)
        self.client_id = client_id
        self.purpose = purpose
        self.epsilon_before = epsilon_before
        self.epsilon_after = epsilon_after
        self.budget = budget
        self.accountant = accountant

    def __str__(self) -> str:
        return (
            f"client {self.client_id!r}: release {self.purpose!r} would raise epsilon from "
            f"{self.epsilon_before:.4f} to {self.epsilon_after:.4f} at delta={self.budget.delta:g} "
            f"({self.accountant} accountant), over the budget epsilon={self.budget.epsilon:g}, "
            f"delta={self.budget.delta:g}; nothing was recorded"
        )


__all__ = ["BUDGET_RTOL", "BudgetExceededError", "ClientId", "PrivacyBudget"]
