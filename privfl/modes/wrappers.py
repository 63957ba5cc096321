"""The privacy layer around any method: what a training client sends, and what the server makes of it, under the
mode of :class:`~privfl.privacy.training.TrainingPrivacy` (the modes and their arguments are in
:mod:`privfl.privacy.training`).

Strategies wrap strategies and procedures wrap procedures, as Flower's DP wrappers do, so a method's own code knows
only its record-level releases and every engine runs the wrapped objects unchanged. :class:`PrivateClient` wraps a
client procedure (checks record-level events; clips and noises in local and distributed mode); :class:`Aggregator`
wraps a strategy in central and distributed mode; :func:`protect` wraps both halves as the method's registration
allows, refusing by name a mode the method cannot run. :func:`support` and :func:`planned_participations` serve the
calibration.

What each wrapper does per mode, and distributed mode in process and on Flower (cited below as "the module
docstring"): docs/privacy.md, "The layer around every method".
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from typing import Any

import torch

from accounting import NonPrivateEvent, PrivacyBudget
from privfl.errors import ConfigError, InternalError
from privfl.federation.context import ClientContext, ClientState
from privfl.federation.messages import Message, Release
from privfl.federation.runtime import ReleaseSum, RoundRelease, SecureSum, sample_clients
from privfl.federation.seeding import derive_rng, derive_seed
from privfl.methods.base import ClientProcedure, MethodSpec, Strategy
from privfl.privacy.client_dp import add_clipped, clip_update
from privfl.privacy.mechanisms import os_seeded_generator, standard_normal
from privfl.privacy.training import (
    ADAPTIVE,
    CENTRAL,
    DISTRIBUTED,
    LOCAL,
    RECORD,
    ClientLevelNoise,
    TrainingPrivacy,
    central_noise_multiplier,
    central_round_event,
    client_level_noise,
    share_epsilon,
    update_noise_multiplier,
)


def _generator(privacy: TrainingPrivacy, purpose: str, *keys: int) -> torch.Generator:
    """The generator of one draw: OS-seeded (``noise`` "secure" or "hardened"), or keyed by the privacy seed and
    ``keys`` ("seeded")."""
    if privacy.noise == "seeded":
        return torch.Generator().manual_seed(derive_seed(privacy.noise_seed, purpose, *keys))
    return os_seeded_generator(torch.device("cpu"))


def _gaussian(privacy: TrainingPrivacy, shape: tuple[int, ...], purpose: str, *keys: int) -> torch.Tensor:
    """N(0, I) of ``shape`` in float64, from the privacy layer's noise source."""
    return standard_normal(shape, generator=_generator(privacy, purpose, *keys), hardened=privacy.noise == "hardened",
                           dtype=torch.float64)


def _flatten(arrays: Mapping[str, torch.Tensor], what: str) -> tuple[list[str], torch.Tensor]:
    names = list(arrays)
    for name in names:
        if not arrays[name].is_floating_point():
            raise ConfigError(f"{what} holds the non-floating tensor {name!r} ({arrays[name].dtype}): client-level DP "
                              "adds Gaussian noise to every number a client sends, which that tensor cannot carry")
    flat = torch.cat([arrays[n].detach().reshape(-1).double() for n in names]) if names else torch.zeros(0,
                                                                                                      dtype=torch.float64)
    return names, flat


def _unflatten(names: list[str], flat: torch.Tensor, like: Mapping[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    out, start = {}, 0
    for name in names:
        size = like[name].numel()
        out[name] = flat[start:start + size].view(like[name].shape).to(like[name].dtype)
        start += size
    return out


class PrivateClient(ClientProcedure):
    """A method's client procedure under ``privacy``; see the module docstring.

    ``noise`` (local and distributed modes) is the calibrated :class:`~privfl.privacy.training.ClientLevelNoise`;
    ``method`` names the method in refusals.
    """

    def __init__(self, inner: ClientProcedure, privacy: TrainingPrivacy, *, method: str,
                 noise: ClientLevelNoise | None = None) -> None:
        # deliberately not ClientProcedure.__init__: everything but the privacy handling is the inner procedure's
        self.inner = inner
        self.privacy = privacy
        self.method = method
        self.noise = noise
        self.model_factory = inner.model_factory
        self.config = inner.config
        self.serves_novel_clients = inner.serves_novel_clients

    # -- what is the inner procedure's ------------------------------------------------------------------------------

    def workspace_model(self):
        return self.inner.workspace_model()

    def hands_over_messages(self) -> bool:
        # the wrapper reads a release's tensors, and releases them or fresh ones (the clipped, noised copy)
        return self.inner.hands_over_messages()

    def evaluation_model(self, data, message, state):
        return self.inner.evaluation_model(data, message, state)

    def novel_query(self, novel, message):
        return self.inner.novel_query(novel, message)

    def novel_model(self, novel, message):
        return self.inner.novel_model(novel, message)

    def central_model(self, message):
        return self.inner.central_model(message)

    # -- training releases ------------------------------------------------------------------------------------------

    def train(self, data, message: Message, state: ClientState, ctx: ClientContext) -> Release | None:
        return self._protect(0, self.inner.train(data, message, state, ctx), ctx)

    def train_stage(self, stage: int, data, message: Message, state: ClientState, ctx: ClientContext):
        return self._protect(stage, self.inner.train_stage(stage, data, message, state, ctx), ctx)

    def _protect(self, stage: int, release: Release | None, ctx: ClientContext) -> Release | None:
        mode = self.privacy.mode
        if release is None:
            if mode in (LOCAL, DISTRIBUTED) and self.noise is not None:
                raise ConfigError(f"under client-level DP ({mode}) every sampled client releases at every stage, but "
                                  f"{self.method} sent nothing at stage {stage} of round {ctx.round}: whether a "
                                  "client stays silent can depend on its data, which no noise covers")
            return None
        if mode == RECORD:
            return self._record_level(release)
        if mode == CENTRAL:   # in the clear to the trusted aggregator; metrics are not sent (nothing covers them)
            message = Message(arrays=release.message.arrays, config=release.message.config)
            return Release(message, purpose=release.purpose, event=NonPrivateEvent(),
                           metadata={**release.metadata, "mode": CENTRAL}, audience="trusted_aggregator")
        return self._client_level(stage, release, ctx)

    def _record_level(self, release: Release) -> Release:
        """A record-level release must carry its mechanism's event; metrics are not sent (no event covers them)."""
        event = release.event
        if event.relation is None:
            raise ConfigError(f"{self.method} cannot make its {release.purpose!r} release record-level private (it "
                              f"carries {type(event).__name__}): record-level DP needs every training-client release "
                              "to be a DP function of the client's records")
        message = Message(arrays=release.message.arrays, config=release.message.config)
        return Release(message, purpose=release.purpose, event=event,
                       metadata={**release.metadata, "mode": RECORD}, calibrated_for=release.calibrated_for)

    def _client_level(self, stage: int, release: Release, ctx: ClientContext) -> Release:
        """Local and distributed modes: clip the release to its stage's clip, add the (share of the) noise."""
        noise = self.noise
        if noise is None:
            raise InternalError(f"{self.method}: client-level DP ({self.privacy.mode}) without its calibrated noise")
        index = stage if len(noise.clips) > 1 else 0
        if index >= len(noise.clips):
            raise InternalError(f"{self.method} released at stage {stage}, but its registration declares "
                                f"{len(noise.clips)} releases per round")
        arrays = release.message.arrays
        clipped, norm = clip_update(arrays, noise.clips[index]) if arrays else ({}, 0.0)
        names, flat = _flatten(clipped, f"{self.method}'s {release.purpose!r} release")
        std = noise.sigma if self.privacy.mode == LOCAL else noise.share_sigma
        noisy = flat + std * _gaussian(self.privacy, tuple(flat.shape), "client_level_noise", ctx.run_seed, ctx.round,
                                       ctx.client_id, stage)
        metadata = {"mode": self.privacy.mode, "noise": self.privacy.noise, "clip": noise.clips[index],
                    "participations": noise.participations}
        if self.privacy.mode == DISTRIBUTED:
            metadata.update(shares=noise.shares, share_sigma=noise.share_sigma,
                            observer="the round's sum of releases only (secure aggregation): the event is the sum's")
        return Release(Message(arrays=_unflatten(names, noisy, arrays)), purpose=release.purpose,
                       event=noise.stage_event(index), metadata=metadata,
                       calibrated_for=PrivacyBudget(noise.lifetime_epsilon, noise.delta))


class Aggregator(Strategy):
    """Client-level DP on the server side, around a strategy that declares
    :meth:`~privfl.methods.base.Strategy.apply_mean`: the shared state moves from a noisy sum of the clients'
    contributions only.

    Central mode (see the module docstring, and :mod:`privfl.privacy.training` for the accounting): Poisson client
    sampling at q, each contribution clipped to C, one noise draw on the sum, the sum divided by the expected count
    q N, the round's event recorded in every training client's ledger (:meth:`round_releases`), an adaptive clip if
    asked. Distributed mode: the clients' releases carry their noise shares and their events; the runtime hands the
    aggregator their secure sum only (:meth:`secure_sum`, :meth:`aggregate_sum`: simulated in process, SecAgg+ on
    Flower; see the module docstring), which it divides by the round's number of clients, known to the server.
    """

    def __init__(self, inner: Strategy, privacy: TrainingPrivacy, *, rounds: int, sampling_probability: float,
                 method: str, noise: ClientLevelNoise | None = None) -> None:
        # deliberately not Strategy.__init__: the server state is the inner strategy's
        self.inner = inner
        self.privacy = privacy
        self.method = method
        self.noise = noise                  # distributed: the clients' calibrated noise (their shares, their clip)
        if privacy.mode == DISTRIBUTED and noise is None:
            raise InternalError("the aggregator of distributed DP needs the clients' ClientLevelNoise")
        self.model_factory, self.config, self.seed = inner.model_factory, inner.config, inner.seed
        self.num_training_clients = inner.num_training_clients
        self.train_stages = inner.train_stages
        self.central = privacy.mode == CENTRAL
        self.rounds = rounds
        self.q = float(sampling_probability)
        self.clip = float(privacy.clip_initial) if privacy.clip == ADAPTIVE else float(privacy.clip)
        if not self.central:
            return
        inner.confidential = True      # what the server holds of one client in the clear reaches that client only
        self.expected = self.q * self.num_training_clients            # the public divisor of the noisy sum
        self.noise_multiplier = central_noise_multiplier(privacy, sampling_probability=self.q, rounds=rounds)
        self.event = central_round_event(self.noise_multiplier, self.q)
        self.budget = None if privacy.epsilon is None else PrivacyBudget(privacy.epsilon, privacy.delta)
        if privacy.clip == ADAPTIVE:
            # Andrew et al. take sigma_b = expected clients / 20; the count may take at most a quarter of the round's
            # budget here (sigma_b >= z), so a small epsilon's large z does not leave the update no budget at all
            self.count_noise: float | None = privacy.clip_count_noise or max(self.expected / 20.0,
                                                                             self.noise_multiplier)
            self.update_multiplier = update_noise_multiplier(self.noise_multiplier, self.count_noise)
        else:
            self.count_noise = None
            self.update_multiplier = self.noise_multiplier

    def sample_clients(self, round: int, client_ids: list[int], fraction: float, seed: int) -> list[int]:
        """Central: Poisson sampling, each client independently with probability q, from randomness the server keeps
        to itself (secure), or keyed by the privacy seed (seeded). A round may sample nobody: its sum is noise alone.
        Distributed: the method's own (fixed-size) sample."""
        if not self.central:
            return self.inner.sample_clients(round, client_ids, fraction, seed)
        if self.privacy.noise == "seeded":
            draws = torch.from_numpy(derive_rng(self.privacy.noise_seed, "central_sampling", round)
                                     .random(len(client_ids)))
        else:
            draws = torch.rand(len(client_ids), generator=_generator(self.privacy, "central_sampling"))
        return [cid for cid, u in zip(sorted(client_ids), draws.tolist(), strict=True) if u < self.q]

    def round_releases(self, round: int) -> list[RoundRelease]:
        if not self.central:
            return []
        return [RoundRelease(event=self.event, purpose="central_aggregate", calibrated_for=self.budget,
                             planned=self.rounds,
                             metadata={"mode": CENTRAL, "noise": self.privacy.noise, "sampling_probability": self.q,
                                       "noise_multiplier": self.noise_multiplier, "clip": self.privacy.clip,
                                       "relation": "add or remove one client"})]

    def configure_train(self, round: int, client_ids: list[int]) -> dict[int, Message]:
        return self.inner.configure_train(round, client_ids)

    def configure_stage(self, round: int, stage: int, replies: dict[int, Message]) -> dict[int, Message]:
        return self.inner.configure_stage(round, stage, replies)

    def secure_sum(self) -> SecureSum | None:
        """Distributed: the releases of the round's last stage, summed securely; each is clipped to C_s before its
        share of noise, of standard deviation ``share_sigma``, is added."""
        if self.central:
            return None
        assert self.noise is not None   # distributed: __init__ refuses an aggregator without it
        return SecureSum(like=self.inner.contribution_shapes(), bound=self.noise.clips[-1],
                         noise_std=self.noise.share_sigma,
                         calibrated_for=PrivacyBudget(self.noise.lifetime_epsilon, self.noise.delta))

    def aggregate_sum(self, round: int, total: ReleaseSum) -> dict[str, float]:
        """Distributed: the inner strategy steps from the sum of the round's releases (their shares of noise
        included) over the round's count, which the server knows; the aggregation's own metrics are kept."""
        if self.central:
            raise InternalError("central DP aggregates the clipped contributions, not a secure sum")
        like = self.inner.contribution_shapes()
        if total.count < 1:
            raise InternalError(f"a secure sum of {total.count} releases in round {round}")
        mean = {k: (total.arrays[k] / total.count).to(like[k].dtype) for k in like}
        return {**self.inner.apply_mean(round, mean, float(total.count)), **total.metrics}

    def aggregate_train(self, round: int, replies: dict[int, Message]) -> dict[str, float]:
        """Central, in steps: 1. clip each contribution to C (jointly); 2. sum, add N(0, (z_update C)^2) once;
        3. divide by the expected count q N; 4. with an adaptive clip, the noisy count of contributions within C
        moves C toward the target quantile (Andrew et al. 2021, Algorithm 1); 5. the inner strategy steps from the
        noisy mean. Distributed mode never comes here: the server gets the releases' secure sum only
        (:meth:`aggregate_sum`)."""
        if not self.central:
            raise InternalError("distributed DP aggregates the secure sum of the releases (aggregate_sum), never the "
                                "releases themselves")
        like = self.inner.contribution_shapes()
        total = {k: torch.zeros_like(v, dtype=torch.float64) for k, v in like.items()}
        within = 0
        for _, contribution in self.inner.contributions(round, replies):
            if set(contribution) != set(like):
                raise InternalError(f"{self.method}'s contribution has tensors {sorted(contribution)}, its "
                                    f"contribution_shapes {sorted(like)}")
            norm = add_clipped(total, contribution, self.clip)     # clipped to C, added in float64
            within += int(norm <= self.clip)
        names = list(total)
        flat = torch.cat([total[k].reshape(-1) for k in names])
        draws = _gaussian(self.privacy, (flat.numel() + 1,), "central_noise", round)   # the last one: the count's
        noisy = flat + self.update_multiplier * self.clip * draws[:-1]
        mean = _unflatten(names, noisy / self.expected, like)
        metrics = {"clip": self.clip}
        if self.count_noise is not None:
            count = within - len(replies) / 2.0 + self.count_noise * float(draws[-1])
            fraction = count / self.expected + 0.5
            self.clip *= math.exp(-self.privacy.clip_lr * (fraction - self.privacy.clip_quantile))
            metrics["clip_quantile_estimate"] = fraction
        return {**self.inner.apply_mean(round, mean, self.expected), **metrics}

    def configure_evaluate(self, client_id: int) -> Message:
        return self.inner.configure_evaluate(client_id)

    def novel_request(self, client_id: int) -> Message:
        return self.inner.novel_request(client_id)

    def novel_reply(self, client_id: int, delivered: Message | None) -> Message:
        return self.inner.novel_reply(client_id, delivered)

    def state_dict(self) -> dict[str, Any]:
        return {"inner": self.inner.state_dict(), "clip": self.clip}

    def serving_state(self, state: dict[str, Any]) -> dict[str, Any]:
        return {**state, "inner": self.inner.serving_state(state["inner"])}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.inner.load_state_dict(state["inner"])
        self.clip = float(state["clip"])


def support(spec: MethodSpec, mode: str | None) -> None:
    """Refuse ``mode`` for ``spec`` by name, with the reason its registration gives."""
    if mode is None:
        return
    reason = spec.privacy.get(mode, "it declares no support for it")
    if reason is not None:
        raise ConfigError(f"method {spec.name!r} cannot run with privacy mode {mode!r}: {reason}")


def planned_participations(num_clients: int, fraction: float, seed: int, rounds: int) -> int:
    """The most rounds any training client takes part in under the run's public fixed-size sampling schedule (it
    depends only on the number of clients: :func:`~privfl.federation.runtime.sample_clients` draws positions)."""
    counts = [0] * num_clients
    ids = list(range(num_clients))
    for r in range(rounds):
        for i in sample_clients(ids, fraction, seed=seed, round=r):
            counts[i] += 1
    return max(counts, default=0)


def protect(spec: MethodSpec, strategy: Strategy | None, client: ClientProcedure, privacy: TrainingPrivacy, *,
            rounds: int, client_fraction: float, seed: int, num_training_clients: int,
            ) -> tuple[Strategy | None, ClientProcedure]:
    """The method's strategy (``None`` on a Flower node, which builds only the client) and client procedure under
    ``privacy``; a mode the method's registration does not support is refused by name first."""
    support(spec, privacy.mode)
    if privacy.mode is None:
        return strategy, client
    if privacy.mode == CENTRAL:
        aggregator = None if strategy is None else Aggregator(
            strategy, privacy, rounds=rounds, sampling_probability=client_fraction, method=spec.name)
        return aggregator, PrivateClient(client, privacy, method=spec.name)
    if privacy.mode == RECORD or spec.releases_per_round == 0:
        return strategy, PrivateClient(client, privacy, method=spec.name)
    participations = privacy.participations or planned_participations(num_training_clients, client_fraction, seed,
                                                                      rounds)
    per_round = len(sample_clients(list(range(num_training_clients)), client_fraction, seed=seed, round=0))
    shares = 1 if privacy.mode == LOCAL else (privacy.shares or per_round)
    if shares > per_round:
        raise ConfigError(f"privacy shares={shares} noise shares make up each round's sum, but a round samples "
                          f"{per_round} training clients: their sum would carry less noise than its calibration; set "
                          f"shares to at most {per_round}")
    noise = client_level_noise(privacy, stages=spec.releases_per_round, participations=participations, shares=shares)
    if privacy.mode == LOCAL:
        return strategy, PrivateClient(client, privacy, method=spec.name, noise=noise)
    if spec.releases_per_round != 1:
        raise ConfigError(f"method {spec.name!r} releases {spec.releases_per_round} times a round: distributed DP sums "
                          "one release per client; its registration must refuse mode 'distributed'")
    if spec.strategy.contributions is not Strategy.contributions:
        raise ConfigError(f"method {spec.name!r} derives its contributions from its clients' messages, but "
                          "distributed DP sums the releases themselves under secure aggregation (the server never "
                          "sees one to derive anything from); its registration must refuse mode 'distributed'")
    aggregator = None if strategy is None else Aggregator(
        strategy, privacy, rounds=rounds, sampling_probability=client_fraction, method=spec.name, noise=noise)
    return aggregator, PrivateClient(client, privacy, method=spec.name, noise=noise)


__all__ = ["Aggregator", "PrivateClient", "planned_participations", "protect", "share_epsilon", "support"]
