"""privatize(): structural refusals, clipping and its sensitivity, ledger recording and budgets, sensitivity proofs."""

from __future__ import annotations

import math
import warnings

import pytest
import torch
from torch import nn

from accounting import (
    BudgetExceededError,
    GaussianEvent,
    NeighboringRelation,
    PrivacyBudget,
    PrivacyLedger,
    SelfComposedEvent,
    analytic_gaussian_sigma,
    epsilon,
)
from privfl.errors import ConfigError
from privfl.federation.messages import Message, Release
from privfl.models.set_encoders import DeepSetEncoder, DPDeepSetEncoder, MaxPool, MeanPool
from privfl.privacy import (
    PrivateEncoder,
    SensitivityCertificate,
    certify_mean_of_batch_means,
    certify_mean_of_clipped,
    privatize,
)

EPS, DELTA = 1.0, 1e-5


def encoder(seed: int = 0) -> DPDeepSetEncoder:
    torch.manual_seed(seed)
    return DPDeepSetEncoder(input_dim=6, hidden=8, output_dim=3)


class Stages(nn.Module):
    """A phi -> pool -> psi encoder built from given modules."""

    def __init__(self, phi: nn.Module, pool: nn.Module, psi: nn.Module | None = None) -> None:
        super().__init__()
        self.phi, self.pool, self.psi = phi, pool, psi if psi is not None else nn.Identity()


class AttentionPool(nn.Module):
    def __init__(self, dim: int) -> None:
        super().__init__()
        self.attention = nn.MultiheadAttention(dim, num_heads=1)


# -- structure -----------------------------------------------------------------------------------------------------


def test_refuses_deepset_naming_its_max_half():
    with pytest.raises(ConfigError, match=r"encoder\.pool\.max is MaxPool: its sensitivity does not shrink with n"):
        privatize(DeepSetEncoder(input_dim=4, hidden=8), EPS, DELTA)


@pytest.mark.parametrize("make,named", [
    (lambda: Stages(nn.Identity(), nn.MultiheadAttention(4, num_heads=1)), r"encoder\.pool is MultiheadAttention"),
    (lambda: Stages(nn.Identity(), AttentionPool(4)), r"encoder\.pool\.attention is MultiheadAttention"),
    (lambda: Stages(nn.Identity(), MaxPool()), r"encoder\.pool is MaxPool"),
    (lambda: Stages(nn.Sequential(nn.Linear(4, 4), MaxPool()), MeanPool()), r"encoder\.phi\.1 is MaxPool"),
    (lambda: Stages(nn.Identity(), nn.Identity()), r"encoder\.pool is Identity"),
    (lambda: nn.Sequential(nn.Linear(4, 4)), r"encoder\.phi"),
])
def test_refuses_structures_whose_sensitivity_does_not_shrink(make, named):
    with pytest.raises(ConfigError, match=named):
        privatize(make(), EPS, DELTA)


def test_refuses_a_module_outside_phi_pool_psi():
    enc = encoder()
    enc.skip = nn.Linear(6, 3)  # an unclipped branch around the pooling
    with pytest.raises(ConfigError, match=r"encoder\.skip is Linear: it is not reached only through phi"):
        privatize(enc, EPS, DELTA)


def test_accepts_dp_deepset_and_conv_phi():
    assert isinstance(privatize(encoder(), EPS, DELTA), PrivateEncoder)
    cnn = Stages(nn.Sequential(nn.Conv2d(1, 2, 3), nn.ReLU(), nn.MaxPool2d(2), nn.Flatten()), MeanPool(),
                 nn.Linear(8, 2))  # spatial max pooling inside phi is per sample: fine
    out = privatize(cnn, EPS, DELTA, generator=torch.Generator().manual_seed(0))(torch.randn(5, 1, 6, 6))
    assert out.shape == (2,)


class RunningSum(nn.Module):
    """Adds every input it sees to a buffer and returns the sum so far: state carried from sample to sample."""

    def __init__(self, dim: int) -> None:
        super().__init__()
        self.register_buffer("total", torch.zeros(dim))

    def forward(self, h: torch.Tensor) -> torch.Tensor:
        self.total.add_(h.detach().sum(0))   # in place: vmap cannot batch it, so phi runs one sample after another
        return self.total.unsqueeze(0).clone()


class Normless(torch.Tensor):
    """A tensor whose norm is always 0, so that clipping would leave it as it is."""

    @classmethod
    def __torch_function__(cls, func, types, args=(), kwargs=None):
        out = super().__torch_function__(func, types, args, kwargs or {})
        return torch.zeros_like(out) if func in (torch.Tensor.norm, torch.linalg.vector_norm) else out


class NormlessPhi(nn.Module):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if float(x.sum()) > -1e9:            # a data-dependent branch: vmap fails, the per-sample loop runs
            return (100.0 * x).as_subclass(Normless)
        return x


def test_refuses_a_phi_that_changes_its_state_while_it_runs_and_restores_it():
    # v_i would be x_1 + ... + x_i: the mean moves by about 1 when one early record changes, not by 2 bound / n
    enc = Stages(nn.Sequential(nn.Flatten(), RunningSum(6)), MeanPool())
    ledger = PrivacyLedger(0)
    private = privatize(enc, EPS, DELTA, ledger=ledger, generator=torch.Generator().manual_seed(0))
    with pytest.raises(ConfigError, match=r"encoder\.phi changed its state while it ran \(1\.total\).*nothing was "
                                          "released or recorded"):
        private(torch.randn(50, 6))
    assert len(ledger) == 0 and torch.equal(enc.phi[1].total, torch.zeros(6))   # the data-dependent sum is gone


class RunningMax(nn.Module):
    """Keeps the coordinate-wise maximum of every input it saw in a **non-persistent** buffer (not in state_dict)."""

    def __init__(self, dim: int) -> None:
        super().__init__()
        self.register_buffer("peak", torch.zeros(dim), persistent=False)

    def forward(self, h: torch.Tensor) -> torch.Tensor:
        torch.maximum(self.peak, h.detach().amax(0), out=self.peak)   # in place: one sample after another
        return self.peak.unsqueeze(0).clone()


class Rebinding(nn.Module):
    """Replaces its non-persistent buffer by a new tensor at every call (the old object is left as it was)."""

    def __init__(self, dim: int) -> None:
        super().__init__()
        self.register_buffer("last", torch.zeros(dim), persistent=False)

    def forward(self, h: torch.Tensor) -> torch.Tensor:
        if float(h.sum()) > -1e9:            # a data-dependent branch: vmap fails, the per-sample loop runs
            self.last = self.last + h.detach().sum(0)
        return self.last.unsqueeze(0).clone()


def test_refuses_a_phi_with_a_running_max_in_a_non_persistent_buffer_and_restores_it():
    # row i is max(x_1..x_i): one early record moves every later row, so the mean is not 2 bound / n sensitive;
    # state_dict() does not hold the buffer, so a check of state_dict alone released this
    enc = Stages(nn.Sequential(nn.Flatten(), RunningMax(6)), MeanPool())
    ledger = PrivacyLedger(0)
    private = privatize(enc, EPS, DELTA, ledger=ledger, generator=torch.Generator().manual_seed(0))
    assert "peak" not in str(list(enc.state_dict()))
    with pytest.raises(ConfigError, match=r"encoder\.phi changed its state while it ran \(1\.peak\).*nothing was "
                                          "released or recorded"):
        private(torch.rand(50, 6))
    assert len(ledger) == 0 and torch.equal(enc.phi[1].peak, torch.zeros(6))


def test_refuses_a_phi_that_replaces_a_buffer_and_puts_the_original_back():
    enc = Stages(nn.Sequential(nn.Flatten(), Rebinding(6)), MeanPool())
    original = enc.phi[1].last
    private = privatize(enc, EPS, DELTA, generator=torch.Generator().manual_seed(0))
    with pytest.raises(ConfigError, match=r"encoder\.phi changed its state while it ran \(1\.last\)"):
        private(torch.rand(20, 6))
    assert enc.phi[1].last is original and torch.equal(original, torch.zeros(6))


@pytest.mark.parametrize("value", [math.nan, math.inf])
def test_a_non_finite_weight_is_named_as_such_not_as_a_state_change(value):
    enc = encoder()
    with torch.no_grad():
        enc.phi[1].weight[2, 3] = value       # e.g. a diverged model from the server
    ledger = PrivacyLedger(0)
    private = privatize(enc, EPS, DELTA, ledger=ledger)
    with pytest.raises(ConfigError, match=r"encoder\.phi has a parameter with NaN or inf values before it ran "
                                          r"\(1\.weight\).*nothing was released or recorded"):
        private(torch.randn(30, 6))
    assert len(ledger) == 0


def test_a_non_finite_buffer_is_named_as_such():
    phi = nn.Sequential(nn.Flatten(), nn.Linear(6, 4), nn.BatchNorm1d(4))
    with torch.no_grad():
        phi[2].running_var[1] = math.inf
    private = privatize(Stages(phi, MeanPool()), EPS, DELTA)
    with pytest.raises(ConfigError, match=r"encoder\.phi has a buffer with NaN or inf values before it ran "
                                          r"\(2\.running_var\)"):
        private(torch.randn(30, 6))


def test_refuses_a_phi_output_that_is_not_a_plain_tensor():
    ledger = PrivacyLedger(0)
    private = privatize(Stages(NormlessPhi(), MeanPool()), EPS, DELTA, ledger=ledger)
    with pytest.raises(ConfigError, match="encoder.phi returned a Normless, not a plain torch.Tensor"):
        private(torch.randn(10, 6))
    assert len(ledger) == 0


def test_refuses_a_psi_that_shares_a_module_with_phi():
    shared = nn.Linear(6, 6)
    with pytest.raises(ConfigError, match=r"encoder\.psi\.0 is also a module of encoder\.phi"):
        privatize(Stages(nn.Sequential(shared), MeanPool(), nn.Sequential(shared)), EPS, DELTA)


def test_each_release_runs_phi_in_eval_mode_even_if_the_caller_switched_it_back():
    enc = Stages(nn.Sequential(nn.Linear(6, 4), nn.BatchNorm1d(4)), MeanPool())
    private = privatize(enc, EPS, DELTA, generator=torch.Generator().manual_seed(0))
    enc.train()                              # the caller still holds the encoder
    stats = enc.phi[1].running_mean.clone()
    private(torch.randn(30, 6) + 5.0)        # in train mode BatchNorm would fold these samples into its statistics
    assert not enc.training and torch.equal(enc.phi[1].running_mean, stats)


# -- clipping and sensitivity ---------------------------------------------------------------------------------------


@pytest.mark.parametrize("n", [1, 10, 100])
def test_clipped_mean_moves_at_most_2_bound_over_n(n):
    bound = 0.5
    enc = encoder()
    with torch.no_grad():  # a malicious server scales the encoder up: the client-side clip must still hold
        for p in enc.phi.parameters():
            p.mul_(1000.0)
    private = privatize(enc, EPS, DELTA, bound=bound)
    gen = torch.Generator().manual_seed(n)
    worst = 0.0
    for trial in range(20):
        x = torch.randn(n, 6, generator=gen)
        neighbour = x.clone()
        neighbour[trial % n] = 1e4 * torch.randn(6, generator=gen)  # one adversarial, far-away sample
        diff = (private.clipped_mean(x) - private.clipped_mean(neighbour)).norm().item()
        worst = max(worst, diff)
    assert worst <= 2 * bound / n * (1 + 1e-9)
    raw = (enc.phi(x).mean(0) - enc.phi(neighbour).mean(0)).norm().item()
    assert raw > 2 * bound / n  # without the clip the bound would not hold


def test_sensitivity_bound_is_attained_by_an_antipodal_replacement():
    bound, n = 2.0, 8
    private = privatize(Stages(nn.Identity(), MeanPool()), EPS, DELTA, bound=bound)
    x = torch.randn(n, 3, dtype=torch.float64)
    neighbour = x.clone()
    x[0] = torch.tensor([100.0, 0.0, 0.0])
    neighbour[0] = torch.tensor([-100.0, 0.0, 0.0])
    diff = (private.clipped_mean(x) - private.clipped_mean(neighbour)).norm().item()
    assert diff == pytest.approx(2 * bound / n, rel=1e-12)
    assert private.mechanism(n).sensitivity == pytest.approx(2 * bound / n)


def test_non_finite_phi_output_becomes_zero():
    class Blowup(nn.Module):
        def forward(self, x):
            return x / 0.0

    private = privatize(Stages(Blowup(), MeanPool()), EPS, DELTA)
    assert torch.equal(private.clipped_mean(torch.ones(3, 2)), torch.zeros(2, dtype=torch.float64))


# -- releases and the ledger ----------------------------------------------------------------------------------------


def test_each_call_records_a_descriptor_release_with_the_certified_sigma():
    ledger = PrivacyLedger("novel-0")
    private = privatize(encoder(), EPS, DELTA, bound=1.0, ledger=ledger, generator=torch.Generator().manual_seed(0))
    x = torch.randn(50, 6)
    descriptor, event = private.release(x)
    private(x)
    assert descriptor.shape == (3,) and len(ledger) == 2
    expected = GaussianEvent(sigma=analytic_gaussian_sigma(EPS, DELTA, 2 / 50), sensitivity=2 / 50,
                             relation=NeighboringRelation.REPLACE_ONE)
    assert event == expected
    for record in ledger.records:
        assert record.purpose == "descriptor"
        assert record.event == expected
        assert record.metadata == {"noise": "seeded", "n": 50, "bound": 1.0}
    release = Release(Message(arrays={"descriptor": descriptor}), "descriptor", event)  # what a client sends
    assert release.event.relation is NeighboringRelation.REPLACE_ONE
    assert private.last_certificate.value == pytest.approx(2 / 50)


def test_secure_noise_is_recorded_and_differs_between_identical_runs():
    ledger = PrivacyLedger(0)
    x = torch.randn(30, 6)
    a = privatize(encoder(), EPS, DELTA, ledger=ledger, noise="secure")(x)
    b = privatize(encoder(), EPS, DELTA, ledger=ledger, noise="secure")(x)
    assert not torch.equal(a, b)
    assert [r.metadata["noise"] for r in ledger.records] == ["secure", "secure"]
    seeded = [privatize(encoder(), EPS, DELTA, generator=torch.Generator().manual_seed(3))(x) for _ in range(2)]
    assert torch.equal(seeded[0], seeded[1])


def test_budget_refuses_the_third_release_and_records_nothing_for_it():
    n = 40
    event = GaussianEvent(sigma=analytic_gaussian_sigma(EPS, DELTA, 2 / n), sensitivity=2 / n)
    two, three = (epsilon(SelfComposedEvent(event, k), DELTA) for k in (2, 3))
    ledger = PrivacyLedger("novel-1", budget=PrivacyBudget(epsilon=(two + three) / 2, delta=DELTA))
    generator = torch.Generator().manual_seed(0)
    private = privatize(encoder(), EPS, DELTA, ledger=ledger, generator=generator)
    x = torch.randn(n, 6)
    private(x)
    private(x)
    state = generator.get_state()
    with pytest.raises(BudgetExceededError):
        private(x)
    assert len(ledger) == 2
    assert torch.equal(generator.get_state(), state)  # no noise was drawn for the refused release


@pytest.mark.parametrize("x,named", [
    (torch.tensor([[0.0] * 5 + [math.nan]] * 4), "NaN/inf"),
    (torch.tensor([[0.0] * 5 + [math.inf]] * 4), "NaN/inf"),
    (torch.zeros(0, 6), r"\(0, 6\)"),
    (torch.zeros(4, 6, dtype=torch.int64), "int64"),
])
def test_bad_samples_raise_and_record_nothing(x, named):
    ledger = PrivacyLedger(0)
    private = privatize(encoder(), EPS, DELTA, ledger=ledger)
    with pytest.raises(ConfigError, match=named):
        private(x)
    assert len(ledger) == 0


@pytest.mark.parametrize("kwargs,named", [
    (dict(eps=0.0), "epsilon.*0.0"), (dict(eps=math.inf), "inf"), (dict(delta=1.0), "delta.*1.0"),
    (dict(delta=-0.1), "-0.1"), (dict(bound=0.0), "bound.*0.0"), (dict(bound=math.nan), "nan"),
    (dict(relation="swap"), "swap"), (dict(noise="fast"), "fast"), (dict(ledger="book"), "book"),
    (dict(relation="add_or_remove_one"), "min_samples"), (dict(min_samples=10), "min_samples=10"),
])
def test_bad_configuration_is_named(kwargs, named):
    values = dict(eps=EPS, delta=DELTA) | kwargs
    eps, delta = values.pop("eps"), values.pop("delta")
    with pytest.raises(ConfigError, match=named):
        privatize(encoder(), eps, delta, **values)


def test_delta_at_least_one_over_n_warns():
    private = privatize(encoder(), EPS, 0.05)
    with pytest.warns(UserWarning, match="1/n"):
        private(torch.randn(30, 6))
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        private(torch.randn(10, 6))  # 0.05 < 1/10


def test_add_or_remove_uses_the_public_lower_bound_not_n():
    ledger = PrivacyLedger(0)
    private = privatize(encoder(), EPS, DELTA, relation="add_or_remove_one", min_samples=20, ledger=ledger)
    _, small = private.release(torch.randn(20, 6))
    _, large = private.release(torch.randn(500, 6))
    assert small == large  # sigma does not reveal the private n
    assert small.sensitivity == pytest.approx(2 / 20) and small.relation is NeighboringRelation.ADD_OR_REMOVE_ONE
    with pytest.raises(ConfigError, match="min_samples=20"):
        private(torch.randn(19, 6))
    assert len(ledger) == 2
    # nor does the ledger: n is private under add/remove-one (under replace-one it is public and recorded)
    assert all("n" not in r.metadata and r.metadata["min_samples"] == 20 for r in ledger.records)


# -- sensitivity certificates ---------------------------------------------------------------------------------------


def test_certificate_replace_one():
    cert = certify_mean_of_clipped(1.5, 30)
    assert isinstance(cert, SensitivityCertificate)
    assert cert.value == pytest.approx(0.1) and cert.n_public and cert.relation is NeighboringRelation.REPLACE_ONE
    assert "2B/n" in cert.argument


@pytest.mark.parametrize("args,kwargs,named", [
    ((1.0, 0), {}, "n must be an int >= 1"),
    ((0.0, 10), {}, "bound"),
    ((1.0, 10, "add_or_remove_one"), {}, "n cannot be public"),
    ((1.0, 10, "replace_one", False), {}, "n must be public"),
    ((1.0, 1, "add_or_remove_one", False), {}, ">= 2"),
])
def test_certificate_refusals(args, kwargs, named):
    with pytest.raises(ConfigError, match=named):
        certify_mean_of_clipped(*args, **kwargs)


def test_add_or_remove_bound_checked_by_brute_force():
    """||mean_m - mean_{m-1}|| <= 2B/m for vectors in the B-ball, attained by v_x = B e and all others -B e."""
    bound, n = 1.0, 5
    cert = certify_mean_of_clipped(bound, n, "add_or_remove_one", n_public=False)
    assert cert.value == pytest.approx(2 * bound / n) and not cert.n_public
    gen = torch.Generator().manual_seed(0)
    for m in (n, n + 1, 3 * n):
        v = torch.randn(m, 4, generator=gen, dtype=torch.float64)
        v = v * torch.clamp(bound / v.norm(dim=1, keepdim=True), max=1.0)
        for removed in range(m):
            rest = torch.cat([v[:removed], v[removed + 1:]])
            assert (v.mean(0) - rest.mean(0)).norm() <= 2 * bound / m + 1e-12 <= cert.value + 1e-12
    e = torch.tensor([1.0, 0, 0, 0], dtype=torch.float64)
    worst = torch.cat([bound * e[None], -bound * e.repeat(n - 1, 1)])
    assert (worst.mean(0) - worst[1:].mean(0)).norm().item() == pytest.approx(2 * bound / n)


def test_batch_means_sensitivity_is_set_by_the_smallest_batch():
    bound, sizes = 1.0, [10, 10, 3]
    cert = certify_mean_of_batch_means(bound, sizes)
    k, n = len(sizes), sum(sizes)
    assert cert.value == pytest.approx(2 * bound / (k * 3)) and cert.value > 2 * bound / n

    def descriptor(v):  # mean of batch means
        return torch.stack([b.mean(0) for b in torch.split(v, sizes)]).mean(0)

    v = torch.zeros(n, 2, dtype=torch.float64)
    neighbour = v.clone()
    v[-1] = torch.tensor([bound, 0.0])  # a record in the smallest batch, replaced by its antipode
    neighbour[-1] = torch.tensor([-bound, 0.0])
    assert (descriptor(v) - descriptor(neighbour)).norm().item() == pytest.approx(cert.value)
    with pytest.raises(ConfigError, match="replace_one"):
        certify_mean_of_batch_means(bound, sizes, "add_or_remove_one")
    with pytest.raises(ConfigError, match="batch size"):
        certify_mean_of_batch_means(bound, [4, 0])


# -- batch-averaged descriptors -------------------------------------------------------------------------------------


def test_batched_certificate_is_set_by_the_smallest_batch():
    private = privatize(encoder(), EPS, DELTA, bound=1.0)
    assert PrivateEncoder.batch_sizes(120, 50) == [50, 50, 20]
    assert PrivateEncoder.batch_sizes(100, 50) == [50, 50] and PrivateEncoder.batch_sizes(7, 50) == [7]
    cert = private.batched_certificate(120, 50)
    assert cert.value == pytest.approx(2 / (3 * 20)) and cert.value > 2 / 120
    assert private.batched_certificate(100, 50).value == pytest.approx(2 / 100)  # equal batches: as the plain mean
    for bad in (0, -1, 2.5, True, "50"):
        with pytest.raises(ConfigError, match="batch_size"):
            private.batched_certificate(120, bad)


def test_batched_mean_moves_by_exactly_the_certificate_under_an_adversarial_replacement():
    bound = 1.0
    private = privatize(Stages(nn.Identity(), MeanPool()), EPS, DELTA, bound=bound)
    x = torch.randn(120, 3, dtype=torch.float64)
    neighbour = x.clone()
    x[110] = torch.tensor([100.0, 0.0, 0.0])  # a record in the last batch (20 samples), replaced by its antipode
    neighbour[110] = torch.tensor([-100.0, 0.0, 0.0])
    diff = (private.batched_clipped_mean(x, 50) - private.batched_clipped_mean(neighbour, 50)).norm().item()
    assert diff == pytest.approx(2 / (3 * 20), rel=1e-12)
    assert diff == pytest.approx(private.batched_certificate(120, 50).value, rel=1e-12)
    # the same replacement in a full batch moves it less, and with equal batches it is the plain mean
    x[10], neighbour[10] = x[110], neighbour[110]
    x[110] = neighbour[110] = 0.0
    diff_full = (private.batched_clipped_mean(x, 50) - private.batched_clipped_mean(neighbour, 50)).norm().item()
    assert diff_full == pytest.approx(2 / (3 * 50), rel=1e-12)
    assert torch.allclose(private.batched_clipped_mean(x[:100], 50), private.clipped_mean(x[:100]))


def test_batched_release_records_one_event_with_the_analytic_sigma():
    ledger = PrivacyLedger("novel-2")
    private = privatize(encoder(), EPS, DELTA, bound=1.0, ledger=ledger, generator=torch.Generator().manual_seed(0))
    descriptor, event = private.release_batched(torch.randn(120, 6), batch_size=50)
    sensitivity = 2 / (3 * 20)
    expected = GaussianEvent(sigma=analytic_gaussian_sigma(EPS, DELTA, sensitivity), sensitivity=sensitivity,
                             relation=NeighboringRelation.REPLACE_ONE)
    assert descriptor.shape == (3,) and event == expected and len(ledger) == 1
    (record,) = ledger.records
    assert record.purpose == "descriptor" and record.event == expected
    assert record.metadata == {"noise": "seeded", "n": 120, "bound": 1.0, "batch_sizes": [50, 50, 20]}
    assert private.last_certificate.value == pytest.approx(sensitivity)
    assert event.sigma > analytic_gaussian_sigma(EPS, DELTA, 2 / 120)  # more noise than the plain mean


def test_batched_release_refuses_add_or_remove_and_records_nothing():
    ledger = PrivacyLedger(0)
    generator = torch.Generator().manual_seed(0)
    private = privatize(encoder(), EPS, DELTA, relation="add_or_remove_one", min_samples=20, ledger=ledger,
                        generator=generator)
    state = generator.get_state()
    with pytest.raises(ConfigError, match="only under relation='replace_one'"):
        private.release_batched(torch.randn(120, 6), batch_size=50)
    assert len(ledger) == 0 and torch.equal(generator.get_state(), state)


def test_batched_budget_refusal_records_nothing_and_draws_no_noise():
    sensitivity = 2 / (3 * 20)
    one = epsilon(GaussianEvent(sigma=analytic_gaussian_sigma(EPS, DELTA, sensitivity), sensitivity=sensitivity),
                  DELTA)
    ledger = PrivacyLedger("novel-3", budget=PrivacyBudget(epsilon=0.5 * one, delta=DELTA))
    generator = torch.Generator().manual_seed(0)
    private = privatize(encoder(), EPS, DELTA, ledger=ledger, generator=generator)
    state = generator.get_state()
    with pytest.raises(BudgetExceededError):
        private.release_batched(torch.randn(120, 6), batch_size=50)
    assert len(ledger) == 0 and torch.equal(generator.get_state(), state)
    assert private.last_certificate is None


# -- code that tries to get past the clipping (what can be detected cheaply is refused; docs: the trust boundary) ---


class AttributeMax(nn.Module):
    """Remembers the largest input of a release in plain Python attributes (no buffer) and adds it to every output of
    the next release: within one release its rows are consistent, so only a fresh copy per release stops it."""

    def __init__(self) -> None:
        super().__init__()
        self.pending, self.previous = 0.0, 0.0

    def forward(self, h: torch.Tensor) -> torch.Tensor:
        if torch._C._functorch.is_batchedtensor(h):      # a release starts with the batched call
            self.previous = self.pending
        else:                                            # the per-record calls: remember the data as a float
            self.pending = max(self.pending, float(h.abs().max()))
        return h + self.previous


class ReachAround(nn.Module):
    """Under vmap, reads the whole batch through vmap's wrapper and returns its mean for every record (the mean of a
    mean that does not shrink with n, as the audit's 14x reach-around)."""

    def forward(self, h: torch.Tensor) -> torch.Tensor:
        if torch._C._functorch.is_batchedtensor(h):
            whole = torch._C._functorch.get_unwrapped(h)
            return 100.0 * whole.reshape(whole.shape[0], -1)[:, :3].mean(dim=0, keepdim=True)
        return h[..., :3]


class Cache(nn.Module):
    """phi's last input, kept in a plain attribute that psi reads: a raw record handed past the noise."""

    def __init__(self) -> None:
        super().__init__()
        self.box: dict[str, torch.Tensor] = {}

    def forward(self, h: torch.Tensor) -> torch.Tensor:
        if not torch._C._functorch.is_batchedtensor(h):
            self.box["record"] = h.detach().clone()
        return torch.zeros(h.shape[0], 3)


class CachedPsi(nn.Module):
    def __init__(self, cache: Cache) -> None:
        super().__init__()
        object.__setattr__(self, "cache", cache)     # not a registered module: privatize's sharing check misses it

    def forward(self, m: torch.Tensor) -> torch.Tensor:
        record = self.cache.box.get("record")
        return m if record is None else record.reshape(-1)[:3].to(m.dtype)


def test_a_phi_that_remembers_a_release_in_a_python_attribute_does_not_carry_it_into_the_next():
    phi = nn.Sequential(nn.Flatten(), AttributeMax())
    enc = Stages(phi, MeanPool())
    private = privatize(enc, EPS, DELTA, noise="seeded", generator=torch.Generator().manual_seed(0))
    private(1000.0 * torch.ones(4, 6))                       # a first client's data: large values
    assert phi[1].pending == 0.0                             # the encoder's own phi never ran on it
    second = torch.rand(8, 6)
    mean = private.clipped_mean(second)
    fresh = privatize(Stages(nn.Sequential(nn.Flatten(), AttributeMax()), MeanPool()), EPS, DELTA,
                      noise="seeded", generator=torch.Generator().manual_seed(0)).clipped_mean(second)
    assert torch.equal(mean, fresh)


def test_a_phi_that_reaches_around_vmap_is_refused_and_records_nothing():
    enc = Stages(nn.Sequential(nn.Flatten(), ReachAround()), MeanPool())
    ledger = PrivacyLedger(0)
    private = privatize(enc, EPS, DELTA, ledger=ledger, generator=torch.Generator().manual_seed(0))
    with pytest.raises(ConfigError, match=r"encoder\.phi gave record \d+ a different output when the other records "
                                          r"were set to zero.*nothing was released or recorded"):
        private(torch.rand(30, 6))
    assert len(ledger) == 0


def test_a_psi_cannot_return_a_raw_record_phi_cached():
    cache = Cache()
    enc = Stages(nn.Sequential(nn.Flatten(), cache), MeanPool(), CachedPsi(cache))
    records = torch.rand(5, 6) + 10.0
    private = privatize(enc, 1e6, DELTA, noise="seeded", generator=torch.Generator().manual_seed(0))
    descriptor = private(records)
    assert "record" not in cache.box                         # the copy phi ran as cached it, not the encoder's
    assert not any(torch.allclose(descriptor.double(), r[:3].double()) for r in records)
    assert float(descriptor.abs().max()) < 1.0               # the noisy mean of zero rows, not a record near 10


@pytest.mark.parametrize("x,needle", [
    (torch.randn(6), r"\d of shape \(\), dtype torch\.float32\): Dimension out of range.*x must be \[n, \*sample "
                     r"shape\]"),
    (torch.randn(5, 4), r"\d of shape \(4,\), dtype torch\.float32\): mat1 and mat2 shapes cannot be multiplied"),
    (torch.randn(5, 2, 6), r"\d of shape \(2, 6\), dtype torch\.float32\)"),
    (torch.randn(5, 6, dtype=torch.float64),
     r"\d of shape \(6,\), dtype torch\.float64\): .*x must have the dtype phi computes in "
     r"\(pass x\.to\(torch\.float32\)\)"),
])
@pytest.mark.parametrize("call", ["release", "forward", "batched"])
def test_inputs_phi_cannot_take_are_one_line_and_release_nothing(x, needle, call):
    # were raw torch errors (IndexError, RuntimeError) with their tracebacks
    ledger = PrivacyLedger(0)
    private = privatize(encoder(), EPS, DELTA, ledger=ledger)
    run = {"release": lambda: private.release(x), "forward": lambda: private(x),
           "batched": lambda: private.release_batched(x, batch_size=2)}[call]
    with pytest.raises(ConfigError, match=r"encoder\.phi cannot take the samples of x \(" + needle) as refusal:
        run()
    assert "\n" not in str(refusal.value) and "nothing was released or recorded" in str(refusal.value)
    assert len(ledger) == 0
