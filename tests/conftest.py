"""Shared fixtures: small federations on the synthetic source, so most tests run in well under a second."""

from __future__ import annotations

import math

import pytest
import torch
from scipy import optimize, stats

from privfl.data import FederationSpec

torch.set_num_threads(2)


def synthetic_spec(**overrides) -> FederationSpec:
    values = dict(source="synthetic", source_options={"num_samples": 1200, "dim": 10, "num_classes": 4},
                  num_clients=12, partition="dirichlet", alpha=1.0, novel_fraction=0.25)
    values.update(overrides)
    return FederationSpec(**values)


@pytest.fixture
def make_spec():
    """A factory of small synthetic federations: ``make_spec(**overrides)``."""
    return synthetic_spec


def tiny_dp_config(method: str = "fedavg", val_fraction: float = 0.2, **overrides):
    """A run of a second or so: 4 training and 2 novel clients on 400 synthetic samples, 4 rounds, seeded
    record-level DP in which every client's batch is its whole split (q = 1: one PLD for every client)."""
    from privfl.config import RunConfig
    from privfl.privacy.training import TrainingPrivacy

    spec = synthetic_spec(source_options={"num_samples": 400, "dim": 6, "num_classes": 3}, num_clients=6,
                          partition="iid", novel_fraction=0.34, val_fraction=val_fraction)
    settings = {"local_steps": 2, "batch_size": 256}
    if method == "odpflhn":
        settings.update(encoder_hidden=4, hn_hidden=8, embed_dim=2)
    values = dict(federation=spec, method=method, method_config=settings, rounds=4, eval_every=2,
                  checkpoint_every=2, seed=3, select="last",
                  privacy=TrainingPrivacy(mode="record", noise_multiplier=1.0, clip=1.0, noise="seeded", noise_seed=1))
    values.update(overrides)
    return RunConfig(**values)


def journal_records(path) -> list[tuple]:
    """``(client id, record as a dict)`` for every release a ``releases.jsonl`` holds, in order, whatever its lines'
    format (:meth:`accounting.ReleaseJournal.entries`)."""
    from accounting import ReleaseJournal

    return [(cid, record.to_dict()) for cid, record in ReleaseJournal(path).entries()]


def book_records(path) -> dict:
    """``{client id: [record as a dict, ...]}`` of a ``ledger.json``, whatever its layout."""
    from accounting import LedgerBook

    return {cid: [r.to_dict() for r in ledger.records] for cid, ledger in LedgerBook.load(path).items()}


@pytest.fixture
def noise_floor_lifted(monkeypatch):
    """Lets a test build and record releases with noise below the floor the accountants price
    (``accounting.limits.NOISE_MULTIPLIER_FLOOR``): for tests of a mechanism's arithmetic as its noise vanishes,
    which never price what they record."""
    import accounting.limits

    monkeypatch.setattr(accounting.limits, "NOISE_MULTIPLIER_FLOOR", 0.0)


def _clear_accounting_caches() -> None:
    import accounting.accountants
    import accounting.pld
    import privfl.privacy.record
    import privfl.privacy.training

    accounting.accountants._epsilon_of_leaves.cache_clear()
    accounting.accountants._supported.cache_clear()
    accounting.pld._step_pld.cache_clear()
    privfl.privacy.training.central_noise_multiplier.cache_clear()
    privfl.privacy.record.clear_calibrations()


@pytest.fixture
def small_pld_grids(monkeypatch):
    """The PLD accountant's point cap lowered to 2^15 (``accounting.pld.PLD_MAX_POINTS``; 2^22 in use), so that
    distributions near the noise floor take milliseconds, not seconds, on the same code; the caches that would keep
    a value priced on the lowered cap are emptied before and after."""
    import accounting.pld

    monkeypatch.setattr(accounting.pld, "PLD_MAX_POINTS", 2 ** 15)
    _clear_accounting_caches()
    yield
    _clear_accounting_caches()


@pytest.fixture
def tiny_config():
    """:func:`tiny_dp_config`: ``tiny_config(method="fedavg", **overrides)``."""
    return tiny_dp_config


def _balle_wang_sigma(eps: float, delta: float, sensitivity: float) -> float:
    """Independent of the package: the sigma at which Balle and Wang's (2018, Thm 8) exact delta equals ``delta``."""
    def excess(log_sigma):
        s = math.exp(log_sigma)
        a, b = sensitivity / (2 * s), eps * s / sensitivity
        return stats.norm.cdf(a - b) - math.exp(eps) * stats.norm.cdf(-a - b) - delta
    return math.exp(optimize.brentq(excess, -10, 10, xtol=1e-13))


@pytest.fixture
def balle_wang_sigma():
    """The analytic Gaussian's sigma computed without the package (an oracle for calibration tests)."""
    return _balle_wang_sigma


@pytest.fixture
def one_thread():
    """One torch thread for the test, restored after it: the machine may be shared (OpenMP threads spin badly when
    it is oversubscribed), and worker and Flower client processes compute with one thread each."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


@pytest.fixture
def task_identity(monkeypatch):
    """The identity Flower gives a process that runs a task (messages cannot be made without one)."""
    from flwr.supercore.task_identity import TaskIdentity

    for name, value in (("_task_id", 1), ("_run_id", 1), ("_node_id", 0)):
        monkeypatch.setattr(TaskIdentity, name, value, raising=False)


class Bias(torch.nn.Module):
    """f(x; b) = b for every sample: logits independent of x, so a step of adaptation is easy to derive by hand."""

    def __init__(self, b):
        super().__init__()
        self.b = torch.nn.Parameter(torch.tensor(b, dtype=torch.float64))

    def forward(self, x):
        return self.b.expand(x.shape[0], -1)


def assert_resumed_as_uninterrupted(full: dict, resumed: dict, full_dir, cut_dir) -> None:
    """A run interrupted and resumed (``cut_dir``) ends as the uninterrupted one (``full_dir``): the same summaries
    and, tensor by tensor, the same server state in the last checkpoint."""
    for key in ("novel", "training_val", "selected_round", "rounds_completed"):
        assert resumed[key] == full[key], key
    a = torch.load(full_dir / "checkpoint.pt", weights_only=True)["runtime"]["strategy"]
    b = torch.load(cut_dir / "checkpoint.pt", weights_only=True)["runtime"]["strategy"]
    assert a.keys() == b.keys() and all(torch.equal(a[k][n], b[k][n]) for k in a for n in a[k])


def tensors_by_name(state, prefix=""):
    """Every tensor in a nested dict of state, by dotted name."""
    found = {}
    for key, value in state.items():
        if isinstance(value, torch.Tensor):
            found[prefix + str(key)] = value
        elif isinstance(value, dict):
            found.update(tensors_by_name(value, f"{prefix}{key}."))
    return found



@pytest.fixture(autouse=True, scope="session")
def feature_cache_in_a_temporary_folder(tmp_path_factory):
    """Feature caches (the ScatterNet stage, backbones) go to a folder of the test session, never the user's
    ~/.cache/privfl; a test that sets PRIVFL_CACHE_DIR itself overrides it."""
    import os

    before = os.environ.get("PRIVFL_CACHE_DIR")
    os.environ["PRIVFL_CACHE_DIR"] = str(tmp_path_factory.mktemp("privfl-cache"))
    yield
    if before is None:
        os.environ.pop("PRIVFL_CACHE_DIR", None)
    else:
        os.environ["PRIVFL_CACHE_DIR"] = before
