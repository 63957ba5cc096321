"""The mechanisms the empirical DP audits release from, each on its worst-case pair of neighbouring inputs.

The pairs: :func:`worst_case_pair` (privatize's replace-one pair), :func:`odpflhn_gradient_pair` (ODPFL-HN's
record-level encoder gradient) and :func:`dp_gmm_worst_case_pair` (the DP-GMM release's S1 block). Each
``*_releases`` function draws ``trials`` releases on both inputs of its pair through the project's own code:
:func:`privatize_releases`, :func:`odpflhn_gradient_releases`, :func:`dp_gmm_releases`, and the two deliberately
broken mechanisms the audit must catch, :func:`classic_releases` and :func:`maxpool_releases`. The audits that run
them: :mod:`attacks.audit`; the DP-GMM block audit: docs/attacks.md, "Empirical DP audits".
"""

from __future__ import annotations

import math

import numpy as np

__all__ = ["classic_releases", "dp_gmm_releases", "dp_gmm_worst_case_pair", "maxpool_releases",
           "odpflhn_gradient_pair", "odpflhn_gradient_releases", "privatize_releases", "worst_case_pair"]


def worst_case_pair(n: int, bound: float = 1.0):
    """A privatisable 1-D DeepSet and a replace-one pair whose clipped means differ by exactly ``2 * bound / n``.

    The encoder is a :class:`~privfl.models.set_encoders.DPDeepSetEncoder` whose ``phi`` is the identity on 1-D
    inputs (a bias-free ``Linear(1, 1)`` with weight 1) and whose ``psi`` is the identity, so the released descriptor
    *is* the noisy clipped mean. ``D`` is ``n - 1`` zeros and one sample ``10 * bound`` (clipped to ``+bound``);
    ``D'`` replaces it by ``-10 * bound`` (clipped to ``-bound``).
    """
    import torch
    from torch import nn

    from privfl.models.set_encoders import DPDeepSetEncoder

    encoder = DPDeepSetEncoder(input_dim=1, hidden=1, output_dim=1)
    linear = nn.Linear(1, 1, bias=False)
    with torch.no_grad():
        linear.weight.fill_(1.0)
    encoder.phi = nn.Sequential(nn.Flatten(), linear)
    encoder.psi = nn.Identity()
    x_d = torch.zeros(n, 1)
    x_d[-1, 0] = 10.0 * bound
    x_dp = torch.zeros(n, 1)
    x_dp[-1, 0] = -10.0 * bound
    return encoder, x_d, x_dp


def _torch_generator(seed: int):
    import torch
    g = torch.Generator()
    g.manual_seed(int(seed))
    return g


def privatize_releases(eps, delta, trials, bound, n, seed, vectorised):
    """``trials`` releases of a privatised DeepSet on each input of :func:`worst_case_pair` (module docstring)."""
    from privfl.privacy import privatize

    encoder, x_d, x_dp = worst_case_pair(n, bound)
    generator = _torch_generator(seed)
    private = privatize(encoder, eps, delta, bound=bound, relation="replace_one",
                                         noise="seeded", generator=generator)
    mean_d, mean_dp = private.clipped_mean(x_d), private.clipped_mean(x_dp)
    gap = float((mean_d - mean_dp).norm())
    if not math.isclose(gap, 2 * bound / n, rel_tol=1e-9):
        raise AssertionError(f"worst-case pair broken: clipped means differ by {gap}, not 2*bound/n")
    if not vectorised:  # the full release path, one call per release
        rd = np.stack([private.release(x_d)[0].double().numpy() for _ in range(trials)])
        rdp = np.stack([private.release(x_dp)[0].double().numpy() for _ in range(trials)])
        return rd, rdp
    # Vectorised: `trials` independent draws of exactly the noise release() adds (the same mechanism object, same
    # sigma, same add_noise), on the same clipped means; psi is the identity, so this is the released descriptor.
    mechanism = private.mechanism(n)
    rd = mechanism.add_noise(mean_d.expand(trials, -1).clone()).numpy()
    rdp = mechanism.add_noise(mean_dp.expand(trials, -1).clone()).numpy()
    return rd, rdp


def odpflhn_gradient_pair(n: int, bound: float = 1.0):
    """The worst-case add/remove-one pair of ODPFL-HN's record-level encoder-gradient release (stage 2 of a round,
    :meth:`privfl.methods.odpflhn.ODPFLHNClient._private_backprop`, the path a training client runs).

    The server chooses the encoder and the descriptor gradient: phi a bias-free ``Linear(2, 1)`` with weight
    ``[1, 0]``, psi the identity (so ``v = J_psi^T de = de``), ``de = [10]``. Record ``a = [0.9, 0]`` gives the
    per-record contribution ``de * a = [9, 0]``, clipped to ``[C, 0]``; ``b = -a`` gives ``[-C, 0]``. ``D`` is ``n``
    copies of ``a`` (``n`` = the public lower bound ``min_samples``), ``D'`` adds ``b``: the means of the clipped
    contributions are ``[C, 0]`` and ``[C (n - 1) / (n + 1), 0]``, ``2 C / (n + 1)`` apart, against the certified
    sensitivity ``2 C / n`` (n private, calibrated at ``min_samples``). Returns ``(encoder, x_d, x_dp, de)``.
    """
    import torch
    from torch import nn

    from privfl.models.set_encoders import DPDeepSetEncoder

    encoder = DPDeepSetEncoder(input_dim=2, hidden=1, output_dim=1)
    linear = nn.Linear(2, 1, bias=False)
    with torch.no_grad():
        linear.weight.copy_(torch.tensor([[1.0, 0.0]]))
    encoder.phi = nn.Sequential(nn.Flatten(), linear)
    encoder.psi = nn.Identity()
    record = torch.tensor([[0.9, 0.0]])
    x_d = record.repeat(n, 1)
    x_dp = torch.cat([x_d, -record])
    return encoder, x_d, x_dp, torch.tensor([10.0])


def odpflhn_gradient_releases(eps, delta, trials, bound, n, seed, vectorised):
    """Releases of ODPFL-HN's encoder gradient on the worst-case pair (:func:`odpflhn_gradient_pair`), from the
    record-level client's own code at the noise multiplier whose single release is ``(eps, delta)``-DP
    (``bound`` is the per-record clip C, ``n`` the public ``min_samples``). Every release on D and on D' must carry
    the same event and the same sigma: a noise scale that depended on n would show here first."""
    import torch

    from accounting import analytic_gaussian_sigma
    from privfl.data import TrainingClient
    from privfl.federation.context import ClientContext
    from privfl.methods.base import ModelFactory
    from privfl.methods.odpflhn import ENCODER_GRADIENT_NOISE, NOISY_MEAN, ODPFLHNClient, ODPFLHNConfig
    from privfl.privacy.training import TrainingPrivacy

    encoder, x_d, x_dp, descriptor_grad = odpflhn_gradient_pair(n, bound)
    z = analytic_gaussian_sigma(eps, delta, 1.0)          # one Gaussian release of noise multiplier z is (eps, delta)
    privacy = TrainingPrivacy(mode="record", noise_multiplier=z, clip=float(bound), min_samples=n, noise="seeded",
                              noise_seed=int(seed))
    client = ODPFLHNClient(model_factory=ModelFactory("mlp2nn", (2,), 2), config=ODPFLHNConfig(embed_dim=1),
                           privacy=privacy)

    def release(x, round):
        data = TrainingClient(client_id=0, x_train=x, y_train=torch.zeros(len(x), dtype=torch.int64),
                              x_val=x[:0], y_val=torch.zeros(0, dtype=torch.int64))
        ctx = ClientContext(client_id=0, round=round, run_seed=0, rng=np.random.default_rng(round))
        state = {NOISY_MEAN: torch.zeros(1, dtype=torch.float64)}
        out = client._private_backprop(encoder, data, descriptor_grad, state, ctx)
        return out.message.arrays["phi.1.weight"].double().reshape(-1), out.event

    if not vectorised:
        rd, rdp, events = [], [], set()
        for t in range(trials):
            value, event = release(x_d, t)
            rd.append(value.numpy())
            events.add(event)
            value, event = release(x_dp, trials + t)
            rdp.append(value.numpy())
            events.add(event)
        if len(events) != 1:
            raise AssertionError(f"the releases on D and D' carry different events: {events}")
        return np.stack(rd), np.stack(rdp)
    # Vectorised: one release on each input with the same seeded noise gives each data term (release minus that
    # noise, drawn again from the same seed by the same mechanism); then `trials` draws of the mechanism's own noise
    value_d, event_d = release(x_d, 0)
    value_dp, event_dp = release(x_dp, 0)
    if event_d != event_dp:
        raise AssertionError(f"the releases on D and D' carry different events: {event_d} and {event_dp}")
    kind = client.encoder_gradient_release()
    ctx = ClientContext(client_id=0, round=0, run_seed=0, rng=np.random.default_rng(0))
    mechanism = kind.mechanism(client.noise_multiplier(), **client.noise_source(ctx, ENCODER_GRADIENT_NOISE))
    noise = mechanism.add_noise(torch.zeros_like(value_d))
    mean_d, mean_dp = value_d - noise, value_dp - noise
    gap = float((mean_d - mean_dp).norm())
    if not math.isclose(gap, 2 * bound / (n + 1), rel_tol=1e-4):
        raise AssertionError(f"worst-case pair broken: the data terms differ by {gap}, not 2 C / (n + 1)")
    # the same sigma, from a generator of the audit's seed (so an audit repeats); the client's own noise source is
    # keyed per release and would give every trial the same draw
    fresh = kind.mechanism(client.noise_multiplier(), noise="seeded", generator=_torch_generator(seed))
    rd = fresh.add_noise(mean_d.expand(trials, -1).clone()).numpy()
    rdp = fresh.add_noise(mean_dp.expand(trials, -1).clone()).numpy()
    return rd, rdp


def classic_releases(eps, delta, trials, bound, n, seed):
    """DELIBERATELY BROKEN: the worst-case pair with noise from the classic closed form (proved only for eps < 1)."""
    encoder, x_d, x_dp = worst_case_pair(n, bound)
    from privfl.privacy import privatize
    private = privatize(encoder, eps, delta, bound=bound, noise="seeded", generator=_torch_generator(seed))
    sens = 2 * bound / n
    sigma = sens * math.sqrt(2 * math.log(1.25 / delta)) / eps  # classic formula, deliberately broken (audit target)
    rng = np.random.default_rng(seed)
    rd = private.clipped_mean(x_d).numpy() + sigma * rng.standard_normal((trials, 1))
    rdp = private.clipped_mean(x_dp).numpy() + sigma * rng.standard_normal((trials, 1))
    return rd, rdp


def maxpool_releases(eps, delta, trials, bound, n, seed):
    """DELIBERATELY BROKEN: a mean+max DeepSet released with noise calibrated for the mean's ``2 * bound / n``.

    privatize refuses this encoder (encoder.pool is MeanMaxPool), so the release is built by hand: phi per sample,
    clipped to the L2 ball of radius ``bound`` exactly as privatize clips, the encoder's own MeanMaxPool, then the
    Gaussian mechanism with the mean-of-clipped certificate. The max half moves by O(bound) whatever n.
    """
    import torch
    from torch import nn

    from privfl.models.set_encoders import DeepSetEncoder
    from privfl.privacy.mechanisms import GaussianMechanism
    from privfl.privacy.sensitivity import certify_mean_of_clipped

    encoder = DeepSetEncoder(input_dim=1, hidden=2, output_dim=1)
    linear = nn.Linear(1, 2, bias=False)
    with torch.no_grad():
        linear.weight.fill_(1.0)
    encoder.phi = nn.Sequential(nn.Flatten(), linear)
    # Replace-one pair for the max: D = n-1 samples at -b and one at +b; D' = all n at -b.
    x_d = torch.full((n, 1), -10.0 * bound)
    x_d[-1, 0] = 10.0 * bound
    x_dp = torch.full((n, 1), -10.0 * bound)

    def pooled(x):
        with torch.no_grad():
            v = encoder.phi(x).double()
            v = v * torch.clamp(bound / v.norm(dim=1, keepdim=True), max=1.0)
            return encoder.pool(v)

    sens = certify_mean_of_clipped(bound, n, "replace_one", n_public=True, delta=delta).value  # the false claim
    mechanism = GaussianMechanism(epsilon=eps, delta=delta, sensitivity=sens, generator=_torch_generator(seed))
    rd = mechanism.add_noise(pooled(x_d).expand(trials, -1).clone()).numpy()
    rdp = mechanism.add_noise(pooled(x_dp).expand(trials, -1).clone()).numpy()
    return rd, rdp


def dp_gmm_worst_case_pair(n: int, bound: float = 1.0, dim: int = 2, relation: str = "replace_one"):
    """Worst-case neighbouring client datasets ``(x_d, x_dp, y_d, y_dp)`` for the DP-GMM release's S1 block.

    One class (label 0). ``replace_one`` (with public or noisy counts; the replaced record keeps its label): D is
    ``n - 1`` records at 0 and one at ``+bound * e1``, D' the same with ``-bound * e1``, so ``S1`` moves by exactly
    ``2 * bound`` (its sensitivity) while the counts and the second-moment sums (``v*v``, ``vv^T``, ``||v||^2`` are
    even in v) are identical: the S1 block is the only block that differs. ``add_or_remove_one`` (noisy counts): D
    is ``n - 1`` zeros plus ``+bound * e1``, D' the ``n - 1`` zeros; S1 moves by exactly ``bound`` (its sensitivity);
    the counts and second moments move too, but only the S1 block is audited.
    """
    x_d = np.zeros((n, dim))
    x_d[-1, 0] = bound
    if relation == "add_or_remove_one":
        x_dp = np.zeros((n - 1, dim))
    else:
        x_dp = x_d.copy()
        x_dp[-1, 0] = -bound
    return x_d, x_dp, np.zeros(len(x_d), dtype=np.int64), np.zeros(len(x_dp), dtype=np.int64)


def dp_gmm_releases(eps, delta, trials, bound, n, dim, covariance, counts, relation, seed):
    """``trials`` noisy S1 blocks of the one class on each side, the number k of released blocks, and the S1 block's
    own epsilon at ``delta`` (the claim the audit is set against).

    The noise is drawn by the release's own calibration (:func:`privfl.privacy.dp_gmm.calibrate_blocks` on
    ``block_sensitivities(...).blocks()``, as release_class_gaussians builds it), checked against one real release on
    D (its ``sigmas["sum"]`` and its event); then one ``add_noise("sum", ...)`` call per side on the exact clipped
    sums expanded to ``[trials, dim]``.
    """
    import torch

    from accounting import GaussianEvent
    from accounting import epsilon as accountant_epsilon
    from privfl.privacy.dp_gmm import block_sensitivities, calibrate_blocks, clipped_class_sums, release_class_gaussians

    x_d, x_dp, y_d, y_dp = dp_gmm_worst_case_pair(n, bound, dim, relation)
    generator = _torch_generator(seed)
    probe = release_class_gaussians(x_d, y_d, num_classes=1, epsilon=eps, delta=delta, bound=bound,
                                    covariance=covariance, counts=counts, relation=relation, noise="seeded",
                                    generator=_torch_generator(seed + 1))
    sens = block_sensitivities(bound=bound, covariance=covariance, relation=relation, counts=counts)
    k = len(sens.blocks())
    calibration = calibrate_blocks(epsilon=eps, delta=delta, sensitivities=sens.blocks(), relation=relation,
                                   noise="seeded", generator=generator)
    if calibration.sigmas["sum"] != probe.sigmas["sum"] or calibration.event != probe.event \
            or probe.sensitivities.sum != sens.sum:
        raise AssertionError(f"audit noise path out of step with release_class_gaussians: sigma "
                             f"{calibration.sigmas['sum']} vs {probe.sigmas['sum']}")
    block_epsilon = accountant_epsilon(GaussianEvent(sigma=calibration.sigmas["sum"], sensitivity=sens.sum,
                                                     relation=relation), delta)
    s1_d = clipped_class_sums(x_d, y_d, num_classes=1, bound=bound, covariance=covariance)[0][0]
    s1_dp = clipped_class_sums(x_dp, y_dp, num_classes=1, bound=bound, covariance=covariance)[0][0]
    gap = float(torch.linalg.vector_norm(s1_d - s1_dp))
    if not math.isclose(gap, sens.sum, rel_tol=1e-9):
        raise AssertionError(f"worst-case pair broken: S1 blocks differ by {gap}, not the sensitivity {sens.sum}")
    rd = calibration.add_noise("sum", s1_d.expand(trials, -1).clone()).numpy()
    rdp = calibration.add_noise("sum", s1_dp.expand(trials, -1).clone()).numpy()
    return rd, rdp, k, block_epsilon
