"""FedPFT and DP-FedPFT (Beitollahi et al. 2024, arXiv:2402.01862): one-shot transfer of per-class Gaussian mixtures.

Every party shares a frozen backbone (:mod:`privfl.models.backbones`); the federation holds its features. Each client
fits a Gaussian mixture per class of its L2-normalised features and sends it (float16, with the class counts); the
server samples synthetic features from the mixtures, trains a classifier head on them and sends it to every client
and to novel clients. ``topology="decentralized"`` is the paper's chain. Plain FedPFT is not private; under
record-level privacy (DP-FedPFT) each client sends the DP-GMM release of
:func:`privfl.privacy.dp_gmm.release_class_gaussians` instead.

Entry points: :class:`FedPFTConfig`, :class:`FedPFTStrategy`, :class:`FedPFTClient` (registered as ``fedpft``);
:func:`fit_class_mixtures`, :func:`encode_mixtures`, :func:`decode_mixtures`, :func:`sample_mixtures`,
:func:`train_head`; the cost model :func:`communication_floats` and :func:`payload_bytes`.

Algorithm 1 step by step, the decentralized chain and each privacy mode: docs/methods/fedpft.md, "FedPFT and
DP-FedPFT".
"""

from __future__ import annotations

import logging
import math
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch
from torch import nn

from accounting import PrivacyEvent
from accounting.validation import is_finite
from privfl.data import NovelClient, TrainingClient
from privfl.errors import ConfigError, check
from privfl.federation.messages import Message, Release, Scalar
from privfl.federation.seeding import derive_rng, derive_seed
from privfl.methods.base import (
    ClientContext,
    ClientProcedure,
    ClientState,
    MethodConfig,
    ModelFactory,
    Strategy,
    register_method,
    supported_modes,
)
from privfl.methods.local_training import local_sgd, weights_of
from privfl.privacy.dp_gmm import (
    COUNTS_MODES,
    COVARIANCE_TYPES,
    check_data,
    release_class_gaussians,
    release_event,
)
from privfl.privacy.record import whole_release_epsilon
from privfl.privacy.training import RECORD, NovelPrivacy, TrainingPrivacy

#: The privacy modes this method runs, and why it refuses the others.
FEDPFT_PRIVACY = supported_modes(
    local="its message carries integer class counts, which the layer's Gaussian noise cannot carry; record-level "
          "DP (DP-FedPFT) noises the counts itself",
    central="the server samples synthetic features from each client's own mixtures, not from a mean of per-client "
            "vectors",
    distributed="the server samples synthetic features from each client's own mixtures, which secure aggregation "
                "hides (only sums are seen)")

__all__ = [
    "COVARIANCE_TYPES", "HEADS", "TOPOLOGIES", "ClassMixture", "FeatureHead", "FedPFTClient", "FedPFTConfig",
    "FedPFTStrategy", "HeadFactory", "communication_floats", "component_summary", "decode_mixtures",
    "encode_mixtures", "fit_class_mixtures", "gmm_floats", "head_factory", "l2_normalize", "payload_bytes",
    "sample_mixtures", "train_head",
]

logger = logging.getLogger(__name__)

TOPOLOGIES = ("centralized", "decentralized")
HEADS = ("linear", "target")
_COUNT_DTYPE = torch.int32


# ---------------------------------------------------------------------------------------------------------------------
# Communication cost (paper Sec. 6.3, eqs. 9-11).


def gmm_floats(dim: int, components: int, covariance: str) -> int:
    """Floats of one class's mixture: per component a weight, a mean (d) and a covariance (d(d+1)/2, d or 1)."""
    check.require(covariance in COVARIANCE_TYPES, "covariance", covariance, f"one of {', '.join(COVARIANCE_TYPES)}")
    per_component = {"full": 2 * dim + (dim * dim - dim) // 2 + 1, "diag": 2 * dim + 1, "spherical": dim + 2}
    return per_component[covariance] * components


def communication_floats(dim: int, components: int, num_classes: int, covariance: str) -> int:
    """The paper's floats per client: (2d + (d^2 - d)/2 + 1) K C (full), (2d + 1) K C (diag), (d + 2) K C (spherical).

    >>> communication_floats(512, 10, 101, "diag")
    1035250
    """
    return gmm_floats(dim, components, covariance) * num_classes


def payload_bytes(dim: int, components: int, num_classes: int, covariance: str) -> int:
    """Bytes FedPFT actually sends per client: the floats above in float16 plus one int32 count per class."""
    return 2 * communication_floats(dim, components, num_classes, covariance) + 4 * num_classes


# ---------------------------------------------------------------------------------------------------------------------
# Mixtures: fit, encode, decode, sample.


@dataclass(frozen=True)
class ClassMixture:
    """One class's Gaussian mixture (float64 numpy arrays).

    ``covariances`` is ``[K, d, d]`` (full), ``[K, d]`` (diag) or ``[K]`` (spherical); ``count`` is the number of
    real samples it summarises (what the server draws by default).
    """

    label: int
    count: int
    weights: np.ndarray
    means: np.ndarray
    covariances: np.ndarray
    covariance_type: str

    @property
    def components(self) -> int:
        return len(self.weights)


def l2_normalize(x: torch.Tensor | np.ndarray) -> torch.Tensor:
    """``x / ||x||`` row by row (rows of norm 0 stay 0): the map applied to features before fitting and in the head."""
    x = torch.as_tensor(x)
    return x / torch.linalg.vector_norm(x, dim=1, keepdim=True).clamp_min(1e-12)


def fit_class_mixtures(features: Any, labels: Any, *, num_classes: int, components: int, covariance: str,
                       seed: int, reg_covar: float = 1e-6, max_iter: int = 100) -> list[ClassMixture]:
    """EM-fitted mixtures for every class present in ``labels`` (``K_eff = min(components, n_c)``), in label order.

    Uses scikit-learn's ``GaussianMixture`` with its defaults (k-means init, tol 1e-3, n_init 1) and
    ``random_state`` derived from ``seed`` and the class. Not private: the means and covariances are functions of the
    raw features (with ``K_eff = n_c`` each mean is a feature).
    """
    from sklearn.mixture import GaussianMixture

    check.require(covariance in COVARIANCE_TYPES, "covariance", covariance, f"one of {', '.join(COVARIANCE_TYPES)}")
    check.require(isinstance(components, int) and not isinstance(components, bool) and components >= 1, "components",
                  components, "an integer >= 1")
    x_checked, y_checked = check_data(features, labels, num_classes)   # labels: integers in [0, num_classes)
    x, y = x_checked.numpy(), y_checked.numpy()
    mixtures = []
    for c in range(num_classes):
        xc = x[y == c]
        if len(xc) == 0:
            continue
        if len(xc) == 1:  # scikit-learn needs 2 samples; EM's answer for one is that sample with variance reg_covar
            shape = {"full": (1, x.shape[1], x.shape[1]), "diag": (1, x.shape[1]), "spherical": (1,)}[covariance]
            cov = np.eye(x.shape[1])[None] * reg_covar if covariance == "full" else np.full(shape, reg_covar)
            mixtures.append(ClassMixture(label=c, count=1, weights=np.ones(1), means=xc.copy(), covariances=cov,
                                         covariance_type=covariance))
            continue
        k = min(components, len(xc))
        gmm = GaussianMixture(n_components=k, covariance_type=covariance, reg_covar=reg_covar, max_iter=max_iter,
                              random_state=int(derive_seed(seed, "fedpft_em", c) % (2**31 - 1)))
        gmm.fit(xc)
        mixtures.append(ClassMixture(label=c, count=len(xc), weights=gmm.weights_, means=gmm.means_,
                                     covariances=gmm.covariances_, covariance_type=covariance))
    return mixtures


def component_summary(mixtures: list[ClassMixture], requested: int) -> dict[str, Any]:
    """What ``K_eff = min(K, n_c)`` did to each class: JSON-able, recorded with the release.

    ``components_effective`` maps each class to its K_eff; ``capped_classes`` lists those with ``n_c < K``;
    ``raw_feature_classes`` those with ``n_c <= K`` (every component sits on one feature, so the means sent are the
    raw features themselves).

    >>> m = ClassMixture(label=2, count=3, weights=np.ones(3) / 3, means=np.zeros((3, 1)), covariances=np.ones((3, 1)),
    ...                  covariance_type="diag")
    >>> component_summary([m], requested=5)["capped_classes"]
    [2]
    """
    return {"components_requested": int(requested),
            "components_effective": {str(m.label): m.components for m in mixtures},
            "capped_classes": [m.label for m in mixtures if m.components < requested],
            "raw_feature_classes": [m.label for m in mixtures if m.count <= requested]}


def encode_mixtures(mixtures: list[ClassMixture], *, dtype: torch.dtype = torch.float16) -> dict[str, torch.Tensor]:
    """The wire arrays: ``c{label}.weights [K]``, ``.means [K, d]``, ``.covariances`` (full: the upper triangle,
    ``[K, d(d+1)/2]``; diag ``[K, d]``; spherical ``[K]``) in ``dtype``, and ``c{label}.count`` (int32 ``[1]``)."""
    arrays = {}
    for m in mixtures:
        cov = torch.as_tensor(m.covariances)
        if m.covariance_type == "full":
            d = cov.shape[-1]
            rows, cols = torch.triu_indices(d, d)
            cov = cov[:, rows, cols]
        prefix = f"c{m.label}."
        arrays[prefix + "weights"] = torch.as_tensor(m.weights).to(dtype)
        arrays[prefix + "means"] = torch.as_tensor(m.means).to(dtype)
        arrays[prefix + "covariances"] = cov.to(dtype)
        arrays[prefix + "count"] = torch.tensor([m.count], dtype=_COUNT_DTYPE)
        if not all(bool(torch.isfinite(arrays[prefix + part]).all()) for part in ("weights", "means", "covariances")):
            raise ConfigError(f"class {m.label}'s mixture does not fit in {dtype} (largest finite value "
                              f"{torch.finfo(dtype).max:g}): its features are too large; use normalize=True (unit-norm "
                              "features) or scale the features down")
    return arrays


def decode_mixtures(arrays: dict[str, torch.Tensor], *, covariance: str, floor: float = 1e-6) -> list[ClassMixture]:
    """The inverse of :func:`encode_mixtures`, in float64: weights renormalised, full covariances re-symmetrised,
    diag and spherical variances floored at ``floor``. A full covariance is returned as decoded, and 16-bit rounding
    can leave it singular or slightly indefinite: :func:`sample_mixtures` then draws through its eigenvalues clipped
    at ``floor`` (``_sqrt_factor``); a caller using the matrices directly must do the same."""
    labels = sorted({int(name.split(".")[0][1:]) for name in arrays})
    mixtures = []
    for c in labels:
        prefix = f"c{c}."
        weights = arrays[prefix + "weights"].double().clamp_min(0).numpy()
        weights = weights / weights.sum() if weights.sum() > 0 else np.full(len(weights), 1.0 / len(weights))
        means = arrays[prefix + "means"].double().numpy()
        cov = arrays[prefix + "covariances"].double()
        if covariance == "full":
            k, d = means.shape
            rows, cols = torch.triu_indices(d, d)
            full = torch.zeros(k, d, d, dtype=torch.float64)
            full[:, rows, cols] = cov
            full = full + full.transpose(1, 2) - torch.diag_embed(torch.diagonal(full, dim1=1, dim2=2))
            matrices = full.numpy()
        else:
            matrices = cov.clamp_min(floor).numpy()
        mixtures.append(ClassMixture(label=c, count=int(arrays[prefix + "count"][0]), weights=weights, means=means,
                                     covariances=matrices, covariance_type=covariance))
    return mixtures


def _sqrt_factor(cov: np.ndarray, floor: float) -> np.ndarray:
    """A factor L with L L^T = cov (Cholesky; if that fails, eigenvalues clipped at ``floor``)."""
    try:
        return np.linalg.cholesky(cov)
    except np.linalg.LinAlgError:
        eigenvalues, eigenvectors = np.linalg.eigh((cov + cov.T) / 2)
        return eigenvectors * np.sqrt(np.clip(eigenvalues, floor, None))


def sample_mixtures(mixtures: list[ClassMixture], rng: np.random.Generator, *, samples_per_class: int | None = None,
                    floor: float = 1e-6) -> tuple[np.ndarray, np.ndarray]:
    """Synthetic ``(features [m, d] float32, labels [m] int64)``: ``count`` draws per class (or ``samples_per_class``),
    components chosen by a multinomial over the weights, rows shuffled (sklearn returns them grouped)."""
    xs, ys = [], []
    for m in mixtures:
        total = m.count if samples_per_class is None else samples_per_class
        if total <= 0:
            continue
        per_component = rng.multinomial(total, m.weights)
        d = m.means.shape[1]
        for k, n in enumerate(per_component):
            if n == 0:
                continue
            z = rng.standard_normal((n, d))
            if m.covariance_type == "full":
                draws = m.means[k] + z @ _sqrt_factor(m.covariances[k], floor).T
            else:
                draws = m.means[k] + z * np.sqrt(m.covariances[k])
            xs.append(draws.astype(np.float32))
            ys.append(np.full(n, m.label, dtype=np.int64))
    if not xs:
        d = mixtures[0].means.shape[1] if mixtures else 0
        return np.zeros((0, d), np.float32), np.zeros(0, np.int64)
    x, y = np.concatenate(xs), np.concatenate(ys)
    order = rng.permutation(len(y))
    return x[order], y[order]


# ---------------------------------------------------------------------------------------------------------------------
# The head.


class FeatureHead(nn.Module):
    """The classifier on frozen features: optional L2 normalisation (the clients' map), then ``body``.

    ``body`` is a linear layer ``d -> C`` by default, or any network (e.g. the ``feature_mlp`` target).
    """

    def __init__(self, dim: int, num_classes: int, *, normalize: bool = True, body: nn.Module | None = None) -> None:
        super().__init__()
        self.normalize = normalize
        self.body = body if body is not None else nn.Linear(dim, num_classes)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.body(l2_normalize(x) if self.normalize else x)


@dataclass(frozen=True)
class HeadFactory(ModelFactory):
    """A :class:`ModelFactory` for :class:`FeatureHead`, so existing methods (``fedavg``) can train the same head.

    ``name`` is ``"linear"`` or the registry name of a target network used as the head's body.
    """

    normalize: bool = True

    def __call__(self) -> nn.Module:
        dim = int(np.prod(self.input_shape))
        body = None if self.name == "linear" else ModelFactory(self.name, self.input_shape, self.num_classes)()
        return FeatureHead(dim, self.num_classes, normalize=self.normalize, body=body)


def head_factory(model_factory: ModelFactory, config: FedPFTConfig) -> HeadFactory:
    """The head a FedPFT run trains: linear, or the run's target network (``head="target"``)."""
    if len(model_factory.input_shape) != 1:
        raise ConfigError(f"FedPFT works on feature vectors (source 'features'), got inputs of shape "
                          f"{tuple(model_factory.input_shape)}; extract features with privfl.models.backbones first")
    name = "linear" if config.head == "linear" else model_factory.name
    return HeadFactory(name, tuple(model_factory.input_shape), model_factory.num_classes, normalize=config.normalize)


def train_head(head: nn.Module, x: Any, y: Any, *, lr: float, epochs: float, batch_size: int,
               rng: np.random.Generator, weight_decay: float = 0.0) -> float:
    """Train ``head`` in place on ``(x, y)`` for ``epochs`` passes of minibatch SGD; return the mean loss."""
    x = torch.as_tensor(x, dtype=torch.float32)
    y = torch.as_tensor(y, dtype=torch.long)
    if len(y) == 0:
        raise ConfigError("no samples to train the head on")
    steps = max(1, math.ceil(epochs * len(y) / min(batch_size, len(y))))
    return local_sgd(head, x, y, lr=lr, steps=steps, batch_size=batch_size, rng=rng, weight_decay=weight_decay)


# ---------------------------------------------------------------------------------------------------------------------
# The method.


@dataclass(frozen=True)
class FedPFTConfig(MethodConfig):
    """FedPFT's settings.

    Attributes:
        components: K, the Gaussians per (client, class) (capped at n_c).
        covariance: ``"full"``, ``"diag"`` or ``"spherical"``.
        normalize: L2-normalise features before fitting (and in the head). Required with DP.
        samples_per_class: synthetic draws per (client, class); ``None`` = the count the client sent.
        topology: ``"centralized"`` (one round, all clients to the server) or ``"decentralized"`` (a chain).
        head: ``"linear"`` or ``"target"`` (the run's target network, e.g. ``feature_mlp``).
        head_lr, head_epochs, head_batch_size, head_weight_decay: head training by minibatch SGD. Unit-norm features
            give small gradients, hence the large default learning rate. ``benchmarks/fedpft_mnist.py`` (which has
            no validation split) uses it as set, without tuning it; for a new backbone or dataset choose it on
            training clients' validation splits (``fedpft_baselines.select_on_validation``), never on test data.
        reg_covar, max_iter: EM settings (scikit-learn's defaults).
        dp_counts: DP-FedPFT's release (record-level privacy, ``RunConfig.privacy``): ``"public"`` (counts sent in
            the clear; replace-one within the public class histogram) or ``"noisy"`` (counts privatised too).
        dp_relation: DP-FedPFT's neighbouring relation: ``"replace_one"`` or ``"add_or_remove_one"`` (the latter
            needs ``dp_counts="noisy"``).

    DP-FedPFT is FedPFT under record-level privacy (``TrainingPrivacy(mode="record", epsilon=...)``): each training
    client sends one DP-GMM release at the run's (epsilon, delta), with K = 1 and unit-norm features.
    """

    components: int = 10
    covariance: str = "diag"
    normalize: bool = True
    samples_per_class: int | None = None
    topology: str = "centralized"
    head: str = "linear"
    head_lr: float = 20.0
    head_epochs: float = 50.0
    head_batch_size: int = 256
    head_weight_decay: float = 0.0
    reg_covar: float = 1e-6
    max_iter: int = 100
    dp_counts: str = "public"
    dp_relation: str = "replace_one"

    def __post_init__(self) -> None:
        check.require(isinstance(self.components, int) and not isinstance(self.components, bool)
                      and self.components >= 1, "components", self.components, "an integer >= 1")
        check.require(self.covariance in COVARIANCE_TYPES, "covariance", self.covariance,
                      f"one of {', '.join(COVARIANCE_TYPES)}")
        check.require(isinstance(self.normalize, bool), "normalize", self.normalize, "true or false")
        check.require(self.samples_per_class is None or (isinstance(self.samples_per_class, int)
                                                    and self.samples_per_class >= 1),
                      "samples_per_class", self.samples_per_class, "None or an integer >= 1")
        check.require(self.topology in TOPOLOGIES, "topology", self.topology, f"one of {', '.join(TOPOLOGIES)}")
        check.require(self.head in HEADS, "head", self.head, f"one of {', '.join(HEADS)}")
        check.require(is_finite(self.head_lr) and self.head_lr > 0, "head_lr", self.head_lr, "a finite number > 0")
        check.require(is_finite(self.head_epochs) and self.head_epochs > 0, "head_epochs", self.head_epochs,
                      "a finite number > 0")
        check.require(isinstance(self.head_batch_size, int) and self.head_batch_size >= 1, "head_batch_size",
                      self.head_batch_size, "an integer >= 1")
        check.require(is_finite(self.head_weight_decay) and self.head_weight_decay >= 0, "head_weight_decay",
                      self.head_weight_decay, "a finite number >= 0")
        check.require(is_finite(self.reg_covar) and self.reg_covar > 0, "reg_covar", self.reg_covar,
                      "a finite number > 0")
        check.require(isinstance(self.max_iter, int) and self.max_iter >= 1, "max_iter", self.max_iter,
                      "an integer >= 1")
        check.require(self.dp_counts in COUNTS_MODES, "dp_counts", self.dp_counts, f"one of {', '.join(COUNTS_MODES)}")
        check.require(self.dp_relation in ("replace_one", "add_or_remove_one"), "dp_relation", self.dp_relation,
                      "'replace_one' or 'add_or_remove_one'")
        check.require(not (self.dp_counts == "public" and self.dp_relation == "add_or_remove_one"), "dp_counts",
                      self.dp_counts,
                      "'noisy' with dp_relation='add_or_remove_one' (counts are private under add/remove)")

    def check_privacy(self, privacy: TrainingPrivacy, novel_privacy: NovelPrivacy) -> None:
        """DP-FedPFT (record level) releases one DP-GMM per client: K = 1 (EM-fitted mixtures are not DP),
        unit-norm features (the sensitivities need the unit ball), one hop (a chain would release twice)."""
        if privacy.mode != RECORD:
            return
        check.require(self.components == 1, "components", self.components,
                      "1 with DP (EM-fitted mixtures, K > 1, are not differentially private)")
        check.require(self.normalize, "normalize", self.normalize,
                      "true with DP (features must lie in the unit ball for the sensitivities to hold)")
        check.require(self.topology == "centralized", "topology", self.topology, "'centralized' with DP")

    def head_settings(self) -> dict[str, Any]:
        return {"lr": self.head_lr, "epochs": self.head_epochs, "batch_size": self.head_batch_size,
                "weight_decay": self.head_weight_decay}


def _features(x: torch.Tensor, config: FedPFTConfig) -> torch.Tensor:
    return l2_normalize(x.double()) if config.normalize else x.double()


class FedPFTStrategy(Strategy):
    """Receives mixtures (one message per client, once), samples synthetic features and trains the head."""

    def __init__(self, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self.heads = head_factory(self.model_factory, self.config)
        self.head_weights = weights_of(self.heads.init(self.seed))
        self.chain: list[int] = []
        self._last_replies: dict[int, Message] = {}
        if self.config.topology == "decentralized":
            self.train_stages = max(1, self.num_training_clients)

    def configure_train(self, round: int, client_ids: list[int]) -> dict[int, Message]:
        if round > 0:  # one-shot: later rounds send nothing and release nothing
            return {}
        config: dict[str, Scalar] = {"round": round}
        if self.config.topology == "centralized":
            return {cid: Message(config=config) for cid in client_ids}
        self.chain = list(client_ids)
        self._last_replies = {}
        return {self.chain[0]: Message(config=config)}

    def configure_stage(self, round: int, stage: int, replies: dict[int, Message]) -> dict[int, Message]:
        """Relay the previous hop's mixtures to the next client of the chain."""
        if replies:
            self._last_replies = replies
        if round > 0 or stage >= len(self.chain) or not replies:
            return {}
        (previous,) = replies.values()
        return {self.chain[stage]: Message(arrays=previous.arrays, config={"round": round, "hop": stage})}

    def synthetic_features(self, round: int, replies: dict[int, Message]) -> tuple[np.ndarray, np.ndarray]:
        """Step 3 of Algorithm 1, first half: decode every client's mixtures and draw the pooled synthetic set."""
        rng = derive_rng(self.seed, "fedpft_server", round)
        xs, ys = [], []
        for cid in sorted(replies):
            mixtures = decode_mixtures(replies[cid].arrays, covariance=self.config.covariance,
                                       floor=self.config.reg_covar)
            x, y = sample_mixtures(mixtures, rng, samples_per_class=self.config.samples_per_class,
                                   floor=self.config.reg_covar)
            if len(y):   # a client may send no class (DP-FedPFT with noisy counts drops those that round to 0)
                xs.append(x)
                ys.append(y)
        if not xs:
            raise ConfigError(f"round {round}: none of the {len(replies)} clients' messages holds a class to draw "
                              "synthetic features from, so there is nothing to train the head on")
        return np.concatenate(xs), np.concatenate(ys)

    def fit_head(self, round: int, x: np.ndarray, y: np.ndarray, **settings: Any) -> tuple[nn.Module, float]:
        """Step 3, second half: a fresh head trained on ``(x, y)``; ``settings`` override the config's head settings
        (e.g. ``lr``, for a learning rate chosen on training clients' validation splits). Returns (head, mean loss)."""
        head = self.heads.init(derive_seed(self.seed, "fedpft_head", round))
        loss = train_head(head, x, y, rng=derive_rng(self.seed, "fedpft_head_sgd", round),
                          **{**self.config.head_settings(), **settings})
        return head, loss

    def aggregate_train(self, round: int, replies: dict[int, Message]) -> dict[str, float]:
        replies = replies or self._last_replies
        if round > 0 or not replies:
            return {}
        x, y = self.synthetic_features(round, replies)
        head, loss = self.fit_head(round, x, y)
        self.head_weights = weights_of(head)
        self._last_replies = {}
        return {"train_loss": loss, "synthetic_samples": float(len(y))}

    def novel_request(self, client_id: int) -> Message:
        return Message(arrays=self.head_weights)

    def state_dict(self) -> dict[str, Any]:
        return {"head_weights": self.head_weights}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.head_weights = {k: v.clone() for k, v in state["head_weights"].items()}


class FedPFTClient(ClientProcedure):
    """Fits (or privately releases) per-class Gaussians of its features; in a chain, also merges what it received."""

    def workspace_model(self) -> nn.Module:
        if self._model is None:
            self._model = head_factory(self.model_factory, self.config)()
        return self._model

    def _mixtures(self, data: TrainingClient, ctx: ClientContext,
                  received: dict[str, torch.Tensor] | None
                  ) -> tuple[list[ClassMixture], tuple[torch.Tensor, torch.Tensor]]:
        """This client's mixtures, and the (normalised real + received synthetic) features they were fitted on."""
        cfg = self.config
        x, y = _features(data.x_train, cfg), data.y_train
        if received:
            synthetic_x, synthetic_y = sample_mixtures(decode_mixtures(received, covariance=cfg.covariance,
                                                                       floor=cfg.reg_covar), ctx.rng)
            x = torch.cat([x, torch.from_numpy(synthetic_x).double()])
            y = torch.cat([y, torch.from_numpy(synthetic_y)])
        return fit_class_mixtures(x, y, num_classes=self.model_factory.num_classes, components=cfg.components,
                                  covariance=cfg.covariance, seed=derive_seed(ctx.run_seed, "fedpft_client",
                                                                              ctx.client_id),
                                  reg_covar=cfg.reg_covar, max_iter=cfg.max_iter), (x, y)

    def train(self, data: TrainingClient, message: Message, state: ClientState, ctx: ClientContext) -> Release | None:
        if self.record_level:
            return self._private_release(data, ctx)
        mixtures, _ = self._mixtures(data, ctx, None)
        if self.config.topology == "decentralized":
            self._train_own_head(mixtures, data, state, ctx)
        return self._mixture_release(mixtures, ctx)

    def train_stage(self, stage: int, data: TrainingClient, message: Message, state: ClientState,
                    ctx: ClientContext) -> Release | None:
        """A hop of the chain: refit on own real features plus samples of the received mixtures, send on."""
        mixtures, (x, y) = self._mixtures(data, ctx, message.arrays)
        head = head_factory(self.model_factory, self.config).init(ctx.run_seed)
        train_head(head, x.float(), y, rng=ctx.rng, **self.config.head_settings())
        state.update({"head." + k: v for k, v in weights_of(head).items()})
        return self._mixture_release(mixtures, ctx)

    def _mixture_release(self, mixtures: list[ClassMixture], ctx: ClientContext) -> Release:
        """The non-private mixture message, with what the ``K_eff = min(K, n_c)`` cap did recorded beside it."""
        summary = component_summary(mixtures, self.config.components)
        if summary["capped_classes"]:
            logger.info("FedPFT client %s: K=%d capped at n_c for classes %s (K_eff %s); classes %s send raw features "
                        "as means", ctx.client_id, self.config.components, summary["capped_classes"],
                        {c: summary["components_effective"][str(c)] for c in summary["capped_classes"]},
                        summary["raw_feature_classes"])
        return Release(Message(arrays=encode_mixtures(mixtures)), purpose="gmm", metadata=summary)

    def _train_own_head(self, mixtures, data: TrainingClient, state: ClientState, ctx: ClientContext) -> None:
        head = head_factory(self.model_factory, self.config).init(ctx.run_seed)
        train_head(head, data.x_train, data.y_train, rng=ctx.rng, **self.config.head_settings())
        state.update({"head." + k: v for k, v in weights_of(head).items()})

    def planned_round_event(self) -> PrivacyEvent:
        """Record level: the one Gaussian event :func:`release_class_gaussians` records for this client's message,
        from the settings alone (the blocks' sensitivities follow from the bound, covariance type, counts and
        relation; no record enters)."""
        cfg = self.config
        return release_event(epsilon=whole_release_epsilon(self.privacy), delta=self.privacy.delta, bound=1.0,
                             covariance=cfg.covariance, relation=cfg.dp_relation, counts=cfg.dp_counts,
                             project="sphere")

    def _private_release(self, data: TrainingClient, ctx: ClientContext) -> Release:
        """DP-FedPFT: :func:`release_class_gaussians` on unit-norm features; the wire records its composed event."""
        cfg, privacy = self.config, self.privacy
        release = release_class_gaussians(
            _features(data.x_train, cfg), data.y_train, num_classes=self.model_factory.num_classes,
            epsilon=whole_release_epsilon(privacy), delta=privacy.delta, bound=1.0, covariance=cfg.covariance,
            components=1, counts=cfg.dp_counts, relation=cfg.dp_relation, eigenvalue_floor=cfg.reg_covar,
            project="sphere",
            **self.noise_source(ctx, "fedpft_dp_noise"))
        mixtures = []
        for cls in release.classes:
            count = max(0, int(round(float(cls.count))))
            if cls.mean is None or cls.covariance is None or count == 0:  # dropping a class is post-processing
                continue
            cov = cls.covariance.double().numpy()
            mixtures.append(ClassMixture(label=cls.label, count=count, weights=np.ones(1), means=cls.mean.numpy()[None],
                                         covariances=cov[None] if cov.ndim else cov.reshape(1),
                                         covariance_type=cfg.covariance))
        return Release(Message(arrays=encode_mixtures(mixtures)), purpose="dp_gmm", event=release.event,
                       metadata={**release.metadata(), "noise": privacy.noise})

    def evaluation_model(self, data: TrainingClient, message: Message, state: ClientState) -> nn.Module:
        own = {k[len("head."):]: v for k, v in state.items() if k.startswith("head.")}
        return self.model_from(own or message.arrays)

    def novel_model(self, novel: NovelClient, message: Message) -> nn.Module:
        return self.model_from(message.arrays)


register_method(
    "fedpft", strategy=FedPFTStrategy, client=FedPFTClient, config=FedPFTConfig,
    description="FedPFT: one-shot per-class Gaussian mixtures of frozen features; the server trains a head on samples "
                "(under record-level privacy: DP-FedPFT, K = 1)",
    privacy=FEDPFT_PRIVACY,
    smoke_settings={"components": 1, "head_epochs": 2.0},
    central_eval=None,
)
