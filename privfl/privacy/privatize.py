"""``privatize``: turn a trained DeepSet encoder into a module whose output on a client's sample set is a DP release.

The encoder must be ``psi(mean_i phi(x_i))``; :func:`privatize` clips phi per sample to a bound B, adds Gaussian noise
calibrated with the analytic Gaussian mechanism to the mean for its certified sensitivity, and applies psi as
post-processing (Lemma 2 of Amosy et al., the ODPFL-HN paper, with the corrections of docs/papers.md, ODPFL-HN,
E2-E8). Entry points: :func:`privatize` and :class:`PrivateEncoder`.

The privacy argument step by step (structure, clipping, sensitivity, calibration, trust):
docs/privacy.md, "privatize: the novel client's descriptor".
"""

from __future__ import annotations

import copy
from typing import Any

import torch
from torch import nn

from accounting import GaussianEvent, NeighboringRelation, PrivacyLedger
from accounting.validation import is_int_at_least
from privfl.devices import device_of
from privfl.errors import ConfigError
from privfl.models.set_encoders import MaxPool, MeanMaxPool, MeanPool
from privfl.privacy.mechanisms import GaussianMechanism, NoiseSource, check_epsilon_delta, check_noise
from privfl.privacy.sensitivity import (
    SensitivityCertificate,
    certify_mean_of_batch_means,
    certify_mean_of_clipped,
    check_bound,
    check_relation,
    clipped_rows,
)

PURPOSE = "descriptor"
_STAGES = ("phi", "pool", "psi")


def _refuse_if_not_mean_deepset(encoder: object) -> None:
    """Raise :class:`ConfigError` naming the first module the mean-of-clipped sensitivity argument cannot bound."""
    if not isinstance(encoder, nn.Module):
        raise ConfigError(f"encoder must be an nn.Module with phi, pool and psi, got {type(encoder).__name__}")
    for name, module in encoder.named_modules(prefix="encoder"):
        kind = type(module).__name__
        if isinstance(module, MaxPool):
            raise ConfigError(f"{name} is {kind}: its sensitivity does not shrink with n (one sample can move a max "
                              "by O(1)); privatize needs phi -> MeanPool -> psi, e.g. DPDeepSetEncoder")
        if isinstance(module, nn.MultiheadAttention):
            raise ConfigError(f"{name} is {kind}: attention lets one sample dominate, so its sensitivity does not "
                              "shrink with n; privatize needs phi -> MeanPool -> psi, e.g. DPDeepSetEncoder")
    stages: dict[str, nn.Module] = {}
    for stage in _STAGES:
        stage_module = getattr(encoder, stage, None)
        if not isinstance(stage_module, nn.Module):
            raise ConfigError(f"encoder ({type(encoder).__name__}) has no module encoder.{stage}: privatize needs the "
                              "structure phi -> pool (MeanPool) -> psi, e.g. DPDeepSetEncoder")
        stages[stage] = stage_module
    for name, child in encoder.named_children():
        if name not in _STAGES:
            raise ConfigError(f"encoder.{name} is {type(child).__name__}: it is not reached only through "
                              "phi -> pool -> psi, so privatize cannot bound what it contributes")
    phi_modules = {id(m) for m in stages["phi"].modules()}
    shared = [name for name, m in stages["psi"].named_modules(prefix="encoder.psi") if id(m) in phi_modules]
    if shared:
        raise ConfigError(f"{shared[0]} is also a module of encoder.phi: psi must see only the noisy mean, and a "
                          "module both use can carry what phi saw of the data past the noise")
    pool = stages["pool"]
    if type(pool) is not MeanPool:  # a subclass could override forward; the mean is recomputed here anyway
        extra = " (its max half does not shrink with n)" if isinstance(pool, MeanMaxPool) else ""
        raise ConfigError(f"encoder.pool is {type(pool).__name__}{extra}: only MeanPool (the mean over samples) has "
                          "a sensitivity of 2*bound/n")


class PrivateEncoder(nn.Module):
    """A DP set encoder: ``forward(x)`` on one client's sample set ``x`` ``[n, ...]`` is one (epsilon, delta)-DP
    release of a descriptor (see the module docstring for the privacy argument). Build it with :func:`privatize`.

    The wrapped encoder is kept in eval mode (train-mode BatchNorm would couple the samples) and forward runs without
    autograd: a release is a value, not a graph back into the client's data.

    Attributes:
        encoder: the wrapped encoder (phi, pool, psi).
        epsilon, delta: the per-release target, natural-log epsilon and delta a probability.
        bound: per-sample L2 clipping radius.
        relation: the neighbouring relation of every release.
        noise: ``"seeded"``, ``"secure"`` or ``"hardened"``.
        ledger: the client's :class:`accounting.PrivacyLedger`, or ``None`` (then the caller must record releases,
            e.g. by sending them as a :class:`~privfl.federation.messages.Release` through the wire).
        last_certificate: the sensitivity certificate of the latest release.
    """

    def __init__(self, encoder: nn.Module, *, epsilon: float | None, delta: float | None, bound: float,
                 relation: NeighboringRelation, ledger: PrivacyLedger | None, noise: NoiseSource,
                 generator: torch.Generator | None, min_samples: int | None,
                 noise_multiplier: float | None = None) -> None:
        super().__init__()
        self.encoder = encoder
        self.epsilon, self.delta = epsilon, delta
        self.noise_multiplier = noise_multiplier
        self.bound = bound
        self.relation = relation
        self.ledger = ledger
        self.noise = noise
        self.generator = generator
        self.min_samples = min_samples
        self.last_certificate: SensitivityCertificate | None = None
        self.encoder.eval()

    def train(self, mode: bool = True) -> PrivateEncoder:
        """Sets this module's flag only: the wrapped encoder stays in eval mode (per-sample phi)."""
        self.training = mode
        self.encoder.eval()
        return self

    # -- the pieces ---------------------------------------------------------------------------------------------------

    def certificate(self, n: int) -> SensitivityCertificate:
        """The sensitivity certificate for a release on ``n`` samples (depends on public quantities only)."""
        if self.relation is NeighboringRelation.REPLACE_ONE:
            return certify_mean_of_clipped(self.bound, n, self.relation, n_public=True, delta=self.delta)
        if self.min_samples is None:
            raise ConfigError("relation='add_or_remove_one' keeps n private, so the noise is calibrated to a public "
                              "lower bound on n: min_samples must be an int >= 2, got min_samples=None")
        if n < self.min_samples:
            # n itself stays out of the message: it is private under add/remove-one, and an error's text can reach
            # the server (Flower reports a ClientApp's exception); that a client too small is refused is public
            raise ConfigError(f"the client has fewer samples than the public lower bound min_samples="
                              f"{self.min_samples} the add/remove-one guarantee is calibrated for; nothing released")
        return certify_mean_of_clipped(self.bound, self.min_samples, self.relation, n_public=False, delta=self.delta)

    def mechanism(self, n: int) -> GaussianMechanism:
        """The Gaussian mechanism of a release on ``n`` samples."""
        return self._mechanism(self.certificate(n).value)

    def _mechanism(self, sensitivity: float) -> GaussianMechanism:
        return GaussianMechanism(epsilon=self.epsilon, delta=self.delta, sensitivity=sensitivity,
                                 relation=self.relation, noise=self.noise, generator=self.generator,
                                 noise_multiplier=self.noise_multiplier)

    def _stage(self, name: str) -> nn.Module:
        """``encoder.phi`` or ``encoder.psi``: :func:`privatize` checked that they are modules; an encoder built or
        changed otherwise is refused here."""
        module = getattr(self.encoder, name, None)
        if not isinstance(module, nn.Module):
            raise ConfigError(f"encoder ({type(self.encoder).__name__}) has no module encoder.{name}: a PrivateEncoder "
                              "needs the structure phi -> pool (MeanPool) -> psi; build it with privatize")
        return module

    def _check_samples(self, x: object) -> int:
        if not isinstance(x, torch.Tensor) or x.ndim < 1 or x.shape[0] < 1:
            got = tuple(x.shape) if isinstance(x, torch.Tensor) else type(x).__name__
            raise ConfigError(f"x must be one client's sample set, a tensor of shape [n >= 1, ...], got {got}")
        if not x.is_floating_point():
            raise ConfigError(f"x must be a floating-point tensor, got dtype {x.dtype}")
        if not bool(torch.isfinite(x).all()):
            bad = int((~torch.isfinite(x)).sum())
            raise ConfigError(f"x contains {bad} NaN/inf value(s); nothing was released or recorded")
        return int(x.shape[0])

    @torch.no_grad()
    def clipped_mean(self, x: torch.Tensor) -> torch.Tensor:
        """The mean over samples of ``phi(x_i)`` projected onto the L2 ball of radius ``bound``, in float64.

        This is the **pre-noise** value: it is not private, records nothing, and must never leave the client.
        """
        self._check_samples(x)
        self.encoder.eval()          # a caller holding the encoder may have switched it back to train mode
        # a fresh copy per release: a plain attribute of phi (a running max, a cached record) cannot carry one
        # release's data into a later one, nor reach psi, which runs on its own copy (_record_noise_psi)
        phi = copy.deepcopy(self._stage("phi"))
        # each sample alone: v_i can depend on x_i only, whatever phi does across its batch dimension
        x = x.to(device_of(self.encoder))      # where the encoder computes (psi's device too)
        try:
            rows = clipped_rows(phi, lambda s: phi(s.unsqueeze(0)).reshape(-1), (x,), self.bound, name="encoder.phi")
        except (RuntimeError, IndexError) as error:
            if type(error) not in (RuntimeError, IndexError):
                raise                          # privfl's own errors (InternalError, ...) are not about the input
            dtype = next((p.dtype for p in phi.parameters() if p.is_floating_point()), x.dtype)
            fix = (f"x must have the dtype phi computes in (pass x.to({dtype}))" if x.dtype != dtype else
                   "x must be [n, *sample shape] with each sample shaped as phi was built for (one sample: x[None])")
            raise ConfigError(
                f"encoder.phi cannot take the samples of x ({x.shape[0]} of shape {tuple(x.shape[1:])}, dtype "
                f"{x.dtype}): {str(error).splitlines()[0]}; {fix}; nothing was released or recorded") from None
        return rows.mean(dim=0)

    # -- releases -----------------------------------------------------------------------------------------------------

    @torch.no_grad()
    def release(self, x: torch.Tensor) -> tuple[torch.Tensor, GaussianEvent]:
        """One DP release on ``x`` ``[n, ...]``: ``(descriptor, event)``, what a client needs to build a Release.

        Steps: 1. validate x (NaN/inf -> ConfigError, nothing recorded); 2. certify the sensitivity from public
        quantities; 3. clipped mean (nothing leaves); 4. record the event in the ledger (BudgetExceededError here
        releases nothing); 5. add Gaussian noise; 6. psi as post-processing.
        """
        n = self._check_samples(x)
        certificate = self.certificate(n)
        mean = self.clipped_mean(x)
        metadata: dict[str, Any] = {"noise": self.noise, "bound": self.bound}
        if self.min_samples is None:
            metadata["n"] = n                               # public under replace-one: it set the noise
        else:
            metadata["min_samples"] = self.min_samples      # add/remove-one: n is private and stays out
        return self._record_noise_psi(certificate, mean, metadata)

    @staticmethod
    def batch_sizes(n: int, batch_size: int) -> list[int]:
        """The sizes of the ``k = ceil(n / batch_size)`` consecutive batches of ``n`` samples: ``batch_size`` each,
        the last one ``n - (k-1) batch_size`` (possibly smaller). Depends on the public n and batch_size only."""
        if not is_int_at_least(batch_size, 1):
            raise ConfigError(f"batch_size must be an int >= 1, got {batch_size!r}")
        batch_size = int(batch_size)
        k = -(-n // batch_size)
        return [batch_size] * (k - 1) + [n - (k - 1) * batch_size]

    def batched_certificate(self, n: int, batch_size: int) -> SensitivityCertificate:
        """The sensitivity certificate of a batch-averaged release on ``n`` samples (public quantities only);
        :class:`ConfigError` under add/remove-one (the partition itself would change)."""
        return certify_mean_of_batch_means(self.bound, self.batch_sizes(n, batch_size), self.relation,
                                           delta=self.delta)

    @torch.no_grad()
    def batched_clipped_mean(self, x: torch.Tensor, batch_size: int) -> torch.Tensor:
        """``(1/k) sum_j mean_{i in batch j} clip(phi(x_i))`` over the consecutive batches of
        :meth:`batch_sizes`, in float64; phi runs on one batch at a time.

        This is the **pre-noise** value: it is not private, records nothing, and must never leave the client.
        """
        sizes = self.batch_sizes(self._check_samples(x), batch_size)
        return torch.stack([self.clipped_mean(batch) for batch in torch.split(x, sizes)]).mean(dim=0)

    def _record_noise_psi(self, certificate: SensitivityCertificate, mean: torch.Tensor,
                          metadata: dict[str, Any]) -> tuple[torch.Tensor, GaussianEvent]:
        """Steps 4-6 of a release: record (before any noise exists), add noise, psi."""
        mechanism = self._mechanism(certificate.value)
        event = mechanism.event
        if self.ledger is not None:
            self.ledger.record(event, purpose=PURPOSE, metadata=metadata)
        noisy_mean = mechanism.add_noise(mean)
        psi = copy.deepcopy(self._stage("psi"))     # the encoder's phi never ran on data: its copy holds none
        psi_dtype = next((p.dtype for p in psi.parameters()), torch.get_default_dtype())
        descriptor = psi(noisy_mean.to(psi_dtype))
        self.last_certificate = certificate
        return descriptor, event

    @torch.no_grad()
    def release_batched(self, x: torch.Tensor, *, batch_size: int) -> tuple[torch.Tensor, GaussianEvent]:
        """One DP release of a **batch-averaged** descriptor (ODPFL-HN's option for large clients, App. B.1;
        docs/papers.md, ODPFL-HN, E7): ``(descriptor, event)`` as :meth:`release`.

        ``x`` ``[n, ...]`` is split into ``k = ceil(n / batch_size)`` consecutive batches of sizes ``n_1 .. n_k``
        (``batch_size`` each, the last possibly smaller; the split depends on the public n and batch_size only,
        never on the data values). The released value is ``psi(m + N(0, sigma^2 I))`` with
        ``m = (1/k) sum_j mean_{i in batch j} v_i`` and ``v_i`` the clipped ``phi(x_i)``; psi is applied once, to the
        noisy average (post-processing), not per batch, so no Lipschitz constant of psi is needed.

        **Sensitivity** ``2 bound / (k min_j n_j)``, replace-one with n (hence the sizes) public: the replaced record
        lives in exactly one batch j, whose mean moves by at most ``2 bound / n_j`` (two clipped vectors, weight
        ``1/n_j``); the other batch means are unchanged, so ``m`` moves by at most ``2 bound / (k n_j)``
        ``<= 2 bound / (k min_j n_j)``, attained by a record in the smallest batch replaced by its antipode.
        With equal batches (``batch_size`` divides n) ``k n_j = n``: the same ``2 bound / n`` as the plain mean
        (and then ``m`` *is* the plain mean). An unequal, shorter last batch gives its records a larger weight, so
        the sensitivity, hence the noise, is **larger** than for :meth:`release`: e.g. sizes (50, 50, 20) give
        ``2/60`` against ``2/120``. Prefer :meth:`release` (the exact mean, whose phi is already per sample) unless
        batching is needed for memory, and then choose ``batch_size`` dividing n, or close to it.

        Add/remove-one is refused (ConfigError, nothing recorded): adding a record changes the partition.

        Steps: 1. validate x and batch_size; 2. certify (add/remove refused here); 3. batch-averaged clipped mean
        (nothing leaves); 4. record the event in the ledger (purpose ``"descriptor"``, metadata with the batch
        sizes; BudgetExceededError here releases nothing and draws no noise); 5. Gaussian noise; 6. psi.
        """
        n = self._check_samples(x)
        sizes = self.batch_sizes(n, batch_size)
        certificate = self.batched_certificate(n, batch_size)
        mean = self.batched_clipped_mean(x, batch_size)
        metadata: dict[str, Any] = {"noise": self.noise, "n": n, "bound": self.bound, "batch_sizes": sizes}
        return self._record_noise_psi(certificate, mean, metadata)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """One DP release of the descriptor of ``x`` ``[n, ...]`` (recorded in the ledger if there is one)."""
        return self.release(x)[0]

    def extra_repr(self) -> str:
        return (f"epsilon={self.epsilon}, delta={self.delta}, bound={self.bound}, relation={self.relation.value!r}, "
                f"noise={self.noise!r}")


def privatize(encoder: nn.Module, eps: float | None, delta: float | None, *, bound: float = 1.0,
              relation: NeighboringRelation | str = "replace_one", ledger: PrivacyLedger | None = None,
              noise: NoiseSource | None = None, generator: torch.Generator | None = None,
              min_samples: int | None = None, noise_multiplier: float | None = None) -> PrivateEncoder:
    """Wrap a mean-pooled DeepSet ``encoder`` so that each forward call is one (eps, delta)-DP descriptor release.

    Args:
        encoder: a module with ``phi``, ``pool`` (a MeanPool) and ``psi`` and nothing else, e.g. a trained
            :class:`~privfl.models.set_encoders.DPDeepSetEncoder`. Anything else is refused with a ConfigError
            naming the module (max pooling, attention, extra branches).
        eps: epsilon per release (natural log), finite and > 0.
        delta: delta per release, in (0, 1); a warning is given when delta >= 1/n.
        bound: per-sample L2 clipping radius applied to phi's outputs (> 0).
        relation: ``"replace_one"`` (n public; the ODPFL-HN setting) or ``"add_or_remove_one"`` (n private; needs
            ``min_samples``).
        ledger: the client's ledger; every release is recorded before its noisy output is computed.
        noise: ``"secure"`` (OS-seeded, for deployments), ``"hardened"`` (OS-seeded and drawn against
            floating-point attacks, see :class:`~privfl.privacy.mechanisms.GaussianMechanism`) or ``"seeded"``
            (reproducible, research only); by default seeded exactly when ``generator`` is given.
        generator: the torch.Generator for seeded noise, whose seed only the client may know (required for
            ``"seeded"``: torch's global generator is keyed from the run seed, which the server knows).
        min_samples: public lower bound on n, required for (and only for) add/remove-one.
        noise_multiplier: instead of ``eps`` and ``delta`` (both ``None`` then): each release has noise
            ``noise_multiplier`` times its certified sensitivity, for a release that is one of a schedule calibrated
            as a whole (a record-level training client's descriptors over a run; its ledger composes them).

    Returns:
        a :class:`PrivateEncoder` sharing ``encoder``'s parameters (and putting it in eval mode).

    >>> from privfl.models.set_encoders import DPDeepSetEncoder
    >>> private = privatize(DPDeepSetEncoder(input_dim=4, hidden=8, output_dim=2), 1.0, 1e-5)
    >>> private(torch.randn(50, 4)).shape
    torch.Size([2])
    """
    _refuse_if_not_mean_deepset(encoder)
    if noise_multiplier is None:
        epsilon, delta = check_epsilon_delta(eps, delta)
    else:
        GaussianMechanism(sensitivity=1.0, noise_multiplier=noise_multiplier, epsilon=eps, delta=delta)  # validates
        epsilon, delta = None, None
    bound = check_bound(bound)
    relation = check_relation(relation)
    noise = check_noise(noise, generator)
    if ledger is not None and not isinstance(ledger, PrivacyLedger):
        raise ConfigError(f"ledger must be an accounting.PrivacyLedger or None, got {ledger!r}")
    if relation is NeighboringRelation.ADD_OR_REMOVE_ONE:
        if min_samples is None or not is_int_at_least(min_samples, 2):
            raise ConfigError("relation='add_or_remove_one' keeps n private, so the noise is calibrated to a public "
                              f"lower bound on n: give min_samples as an int >= 2, got min_samples={min_samples!r}")
        min_samples = int(min_samples)
    elif min_samples is not None:
        raise ConfigError(f"min_samples is used only with relation='add_or_remove_one' (under replace_one n is public "
                          f"and sets the noise), got min_samples={min_samples!r}")
    return PrivateEncoder(encoder, epsilon=epsilon, delta=delta, bound=float(bound), relation=relation, ledger=ledger,
                          noise=noise, generator=generator, min_samples=min_samples,
                          noise_multiplier=noise_multiplier)


__all__ = ["PURPOSE", "PrivateEncoder", "privatize"]
