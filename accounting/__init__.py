"""Pure differential-privacy mathematics for privfl: events, calibration, accountants and per-client ledgers.

Epsilon is natural-log, delta a probability, sensitivity L2 unless named otherwise. This package imports neither
torch nor privfl (Opacus, and with it torch, is imported only when the "prv" accountant is asked for).

- :mod:`accounting.events`: how a release was privatised (Gaussian, Laplace, subsampled Gaussian, compositions,
  non-private), in the vocabulary of Flower's privacy module, convertible to dp-accounting events.
- :mod:`accounting.calibration`: the analytic Gaussian mechanism (Balle and Wang 2018) and DP-SGD noise calibration.
- :mod:`accounting.accountants`: epsilon / delta of a composition by dp-accounting's PLD and RDP or Opacus' PRV.
- :mod:`accounting.limits`: what they price (the noise floor, the target ceiling) and in how much memory
  (:mod:`accounting.pld`).
- :mod:`accounting.budget`: budgets and the error a release over one raises.
- :mod:`accounting.ledger`: per-client ledgers with budgets that refuse a release before it happens, saved atomically.
- :mod:`accounting.journal`: the release journal, each release appended as it is recorded, lines hash-chained.
"""

from accounting.accountants import (
    ACCOUNTANTS,
    RDP_ORDERS,
    AccountantName,
    PrivacySpent,
    UnsupportedAccountingError,
    check_supported,
    delta_for_epsilon,
    epsilon,
    privacy_spent,
)
from accounting.budget import BudgetExceededError, ClientId, PrivacyBudget
from accounting.calibration import analytic_gaussian_sigma, gaussian_delta, noise_multiplier_for_epsilon
from accounting.events import (
    ComposedEvent,
    GaussianEvent,
    LaplaceEvent,
    NeighboringRelation,
    NonPrivateEvent,
    PrivacyEvent,
    SamplingMethod,
    SelfComposedEvent,
    SubsampledGaussianEvent,
    event_from_dict,
)
from accounting.journal import JournalDamaged, JournalMismatch, JournalPosition, ReleaseJournal
from accounting.ledger import LedgerBook, PrivacyLedger, ReleaseRecord
from accounting.limits import DELTA_FLOOR, EPSILON_CEILING, NOISE_MULTIPLIER_FLOOR
from accounting.pld import PLD_VALUE_DISCRETIZATION_INTERVAL

__all__ = [
    "ACCOUNTANTS",
    "DELTA_FLOOR",
    "EPSILON_CEILING",
    "NOISE_MULTIPLIER_FLOOR",
    "PLD_VALUE_DISCRETIZATION_INTERVAL",
    "RDP_ORDERS",
    "AccountantName",
    "BudgetExceededError",
    "ClientId",
    "ComposedEvent",
    "GaussianEvent",
    "JournalDamaged",
    "JournalMismatch",
    "JournalPosition",
    "LaplaceEvent",
    "LedgerBook",
    "NeighboringRelation",
    "NonPrivateEvent",
    "PrivacyBudget",
    "PrivacyEvent",
    "PrivacyLedger",
    "PrivacySpent",
    "ReleaseJournal",
    "ReleaseRecord",
    "SamplingMethod",
    "SelfComposedEvent",
    "SubsampledGaussianEvent",
    "UnsupportedAccountingError",
    "analytic_gaussian_sigma",
    "check_supported",
    "delta_for_epsilon",
    "epsilon",
    "event_from_dict",
    "gaussian_delta",
    "noise_multiplier_for_epsilon",
    "privacy_spent",
]
