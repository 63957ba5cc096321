"""Decoder baselines of the reconstruction attack: maps from a feature to an image, fitted on the attacker's pairs.

A diffusion reconstructor is credible only when it beats these on every metric: each is trained on the same
``(E(x), x)`` pairs of the attacker's own data and has its hyperparameters chosen on the attacker's held-out pairs
(mean squared error; never the defender's images). All return images ``[n, C, H, W]`` on [0, 1].

- :class:`RidgeDecoder`: linear least squares from standardised features to pixels with an L2 penalty alpha
  (closed form through the eigendecomposition of ``X^T X``, float64).
- :class:`MLPDecoder`: a two-hidden-layer MLP (SiLU, sigmoid output) trained with MSE by AdamW; the epoch with the
  lowest held-out MSE is kept (early stopping).
- :class:`KNNDecoder`: the average of the k attacker images whose features are most similar (cosine) to the
  released one; with ``ks=(1,)`` it is the nearest attacker image by feature (``"nn"``; a sharp image, as a
  generator's sample is, where the average is a blurred one).
- :class:`ClassMeanDecoder`: the attacker's mean image of the released label (what the label alone gives).

Regression decoders estimate the posterior mean ``E[x | E(x)]``, which is what PSNR rewards; that is why the
diffusion reconstructor reports the mean of its samples beside their medoid.

Example:
    >>> import torch
    >>> f, x = torch.eye(4), torch.rand(4, 1, 2, 2)
    >>> d = KNNDecoder(ks=(1,)).fit(f, x, torch.arange(4), f, x, torch.arange(4))
    >>> bool(torch.equal(d.decode(f, torch.arange(4)), x))
    True
"""

from __future__ import annotations

import copy
import math
from collections.abc import Sequence
from typing import Any

import numpy as np
import torch
from torch import nn

from accounting.validation import is_int_at_least, is_real
from privfl.errors import ConfigError, TrainingDivergedError, check

__all__ = ["DECODERS", "ClassMeanDecoder", "KNNDecoder", "MLPDecoder", "RidgeDecoder", "feature_similarity",
           "fit_decoders", "make_decoder"]


def _tensor(x: Any) -> torch.Tensor:
    return torch.as_tensor(np.asarray(x) if not isinstance(x, torch.Tensor) else x, dtype=torch.float32)


def _check(features: Any, images: Any, labels: Any) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    f, x = _tensor(features), _tensor(images)
    y = torch.as_tensor(np.asarray(labels), dtype=torch.long)
    if f.ndim != 2 or x.ndim != 4 or len(f) != len(x) or len(f) != len(y) or len(f) == 0:
        raise ConfigError(f"need [n, d] features, [n, C, H, W] images and [n] labels (n >= 1), got "
                          f"{tuple(f.shape)}, {tuple(x.shape)} and {tuple(y.shape)}")
    if not (torch.isfinite(f).all() and torch.isfinite(x).all()):
        raise ConfigError("features and images must be finite")
    return f, x, y


def _mse(a: torch.Tensor, b: torch.Tensor) -> float:
    return float(((a.double() - b.double()) ** 2).mean())


def _unit(f: torch.Tensor) -> torch.Tensor:
    return f / torch.linalg.vector_norm(f, dim=1, keepdim=True).clamp_min(1e-12)


def feature_similarity(features: Any, attacker_features: Any, *, chunk: int = 4096) -> torch.Tensor:
    """``[n, m]`` cosine similarities between released features and the attacker's (computed in chunks)."""
    f, a = _unit(_tensor(features)), _unit(_tensor(attacker_features))
    return torch.cat([f[i:i + chunk] @ a.T for i in range(0, len(f), chunk)]) if len(f) else f.new_zeros(0, len(a))


class _StandardisingDecoder:
    """A decoder that reads standardised features: ``fit`` checks both sets of pairs, then keeps the image shape
    and the attacker features' standardiser."""

    def _standardised_pairs(self, features: Any, images: Any, labels: Any, held_features: Any, held_images: Any,
                            held_labels: Any) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
        f, x, _ = _check(features, images, labels)
        hf, hx, _ = _check(held_features, held_images, held_labels)
        self.shape = tuple(x.shape[1:])
        self.standardise = _Standardiser(f)
        return f, x, hf, hx


class _Standardiser:
    """Per-dimension standardisation with the attacker's training statistics (std floored at 1 % of its mean)."""

    def __init__(self, features: torch.Tensor) -> None:
        f = features.double()
        self.mean = f.mean(0)
        std = f.std(0, unbiased=False)
        self.std = std.clamp_min(max(float(std.mean()) * 1e-2, 1e-8))

    def __call__(self, features: torch.Tensor) -> torch.Tensor:
        return (features.double() - self.mean) / self.std


class RidgeDecoder(_StandardisingDecoder):
    """Ridge regression from standardised features to pixels; alpha chosen on the held-out pairs.

    Args:
        alphas: candidate penalties, as multiples of the number of training pairs n (the diagonal of ``X^T X`` of
            standardised features is n).
    """

    name = "ridge"

    def __init__(self, alphas: Sequence[float] = (1e-4, 1e-3, 1e-2, 1e-1, 1.0)) -> None:
        if not alphas or any(not is_real(a) or not a > 0 for a in alphas):
            raise ConfigError(f"alphas must be one or more numbers > 0, got {alphas!r}")
        self.alphas = tuple(float(a) for a in alphas)
        self.details: dict[str, Any] = {}

    def fit(self, features: Any, images: Any, labels: Any, held_features: Any, held_images: Any,
            held_labels: Any) -> RidgeDecoder:
        f, x, hf, hx = self._standardised_pairs(features, images, labels, held_features, held_images, held_labels)
        z = self.standardise(f)
        y = x.reshape(len(x), -1).double()
        self.image_mean = y.mean(0)
        gram = z.T @ z
        cross = z.T @ (y - self.image_mean)
        values, vectors = torch.linalg.eigh(gram)
        rotated = vectors.T @ cross
        held = self.standardise(hf)
        scores = {}
        best = None
        for a in self.alphas:
            weights = vectors @ (rotated / (values + a * len(z))[:, None])
            mse = _mse(self._predict(held, weights), hx)
            scores[a] = mse
            if best is None or mse < scores[best[0]]:
                best = (a, weights)
        assert best is not None   # alphas is not empty
        self.alpha, self.weights = best
        self.details = {"alpha_over_n": self.alpha, "held_out_mse": {f"{a:g}": v for a, v in scores.items()}}
        return self

    def _predict(self, z: torch.Tensor, weights: torch.Tensor) -> torch.Tensor:
        out = z @ weights + self.image_mean
        return out.float().clamp(0, 1).reshape(len(z), *self.shape)

    def decode(self, features: Any, labels: Any = None) -> torch.Tensor:
        return self._predict(self.standardise(_tensor(features)), self.weights)


class MLPDecoder(_StandardisingDecoder):
    """A two-hidden-layer MLP (standardised feature -> ``hidden`` -> ``hidden`` -> pixels, SiLU, sigmoid), MSE.

    Trains up to ``epochs`` epochs (AdamW, batch ``batch_size``) and keeps the weights of the epoch with the lowest
    held-out MSE; stops after ``patience`` epochs without improvement.

    Cross-fitting (``folds = K >= 2``): :meth:`fit` also trains K fold models, the k-th on every training pair
    outside the k-th of K disjoint parts (a seeded random split), with the same early stopping. ``decode(...,
    exclude=i)`` then estimates the image of the decoder's own training pair i with the fold model that never saw it
    (out-of-fold prediction, the "stacking" of Wolpert 1992), what a feature from outside the attacker's data gets
    from the full model. A diffusion reconstructor that reads the MLP's estimate trains on these; the full model's
    estimates of its own training images are far better than of any other image (MNIST benchmark: MSE 0.014 against
    0.024 held out), and a network trained on them would learn to trust the estimate too much. The fold models see
    (K - 1) / K of the pairs, so their estimates are slightly worse than the full model's an attack reads. The
    standardisation is the full training set's (feature statistics only, no images).
    """

    name = "mlp"

    def __init__(self, *, hidden: int = 1024, epochs: int = 30, learning_rate: float = 1e-3,
                 weight_decay: float = 1e-4, batch_size: int = 256, patience: int = 4, seed: int = 0,
                 folds: int = 0, device: str | torch.device = "cpu", progress: bool = False) -> None:
        for name, value in (("hidden", hidden), ("epochs", epochs), ("batch_size", batch_size),
                            ("patience", patience)):
            check.integer(value, name)
        check.positive(learning_rate, "learning_rate")
        if not is_int_at_least(folds, 0) or folds == 1:
            raise ConfigError(f"folds must be 0 (no cross-fitting) or at least 2, got {folds}")
        self.hidden, self.epochs, self.learning_rate = int(hidden), int(epochs), float(learning_rate)
        self.weight_decay, self.batch_size, self.patience = float(weight_decay), int(batch_size), int(patience)
        self.seed, self.folds, self.device, self.progress = int(seed), int(folds), torch.device(device), progress
        self.details: dict[str, Any] = {}
        self.fold_models: list[nn.Module] = []

    def fit(self, features: Any, images: Any, labels: Any, held_features: Any, held_images: Any,
            held_labels: Any) -> MLPDecoder:
        f, x, hf, hx = self._standardised_pairs(features, images, labels, held_features, held_images, held_labels)
        if self.folds > len(f):
            raise ConfigError(f"folds={self.folds} needs at least that many training pairs, got {len(f)}")
        z = self.standardise(f).float().to(self.device)
        y = x.reshape(len(x), -1).to(self.device)
        held = self.standardise(hf).float().to(self.device)
        self.model, history = self._train(z, y, held, hx, "mlp decoder")
        self.details = {"hidden": self.hidden, "epochs_run": len(history), "best_epoch": int(np.argmin(history)) + 1,
                        "held_out_mse_per_epoch": history}
        self.fold_models = []
        if self.folds:
            order = torch.randperm(len(f), generator=torch.Generator().manual_seed(self.seed))
            self.fold_of = order % self.folds   # pair i is in fold order[i] mod K: K disjoint random parts
            best = []
            for k in range(self.folds):
                inside = (self.fold_of != k).nonzero().squeeze(1).to(self.device)
                model, fold_history = self._train(z[inside], y[inside], held, hx, f"mlp fold {k + 1}/{self.folds}")
                self.fold_models.append(model)
                best.append(min(fold_history))
            self.details.update(folds=self.folds, fold_best_held_out_mse=best)
        return self

    def _train(self, z: torch.Tensor, y: torch.Tensor, held: torch.Tensor, hx: torch.Tensor,
               desc: str) -> tuple[nn.Module, list[float]]:
        """One MLP on ``(z, y)``, early-stopped on the held-out pairs: ``(model at its best epoch, held-out MSE per
        epoch)``."""
        from tqdm.auto import tqdm

        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(self.seed)
            model = nn.Sequential(nn.Linear(z.shape[1], self.hidden), nn.SiLU(),
                                  nn.Linear(self.hidden, self.hidden), nn.SiLU(),
                                  nn.Linear(self.hidden, y.shape[1]), nn.Sigmoid()).to(self.device)
        optimizer = torch.optim.AdamW(model.parameters(), lr=self.learning_rate, weight_decay=self.weight_decay)
        generator = torch.Generator().manual_seed(self.seed)
        history: list[float] = []
        best_state, best, waited = None, math.inf, 0
        for _ in tqdm(range(self.epochs), desc=desc, unit="epoch", disable=not self.progress, dynamic_ncols=True):
            model.train()
            order = torch.randperm(len(z), generator=generator).to(self.device)
            for start in range(0, len(z), self.batch_size):
                index = order[start:start + self.batch_size]
                loss = nn.functional.mse_loss(model(z[index]), y[index])
                optimizer.zero_grad(set_to_none=True)
                loss.backward()
                optimizer.step()
            model.eval()
            mse = _mse(self._predict(held, model).cpu(), hx)
            history.append(mse)
            if mse < best:
                best, best_state, waited = mse, copy.deepcopy(model.state_dict()), 0
            else:
                waited += 1
                if waited >= self.patience:
                    break
        if best_state is None:
            raise TrainingDivergedError(f"{desc}: no epoch reached a finite held-out MSE; lower learning_rate (now "
                                        f"{self.learning_rate!r})")
        model.load_state_dict(best_state)
        return model.eval(), history

    @torch.no_grad()
    def _predict(self, z: torch.Tensor, model: nn.Module | None = None) -> torch.Tensor:
        model = self.model if model is None else model
        return torch.cat([model(z[i:i + 4096]) for i in range(0, len(z), 4096)]).reshape(len(z), *self.shape)

    def decode(self, features: Any, labels: Any = None, *, exclude: Any = None) -> torch.Tensor:
        """The full model's estimates; ``exclude``: ``[n]`` for each feature, one of the decoder's own training pairs
        (``-1``: none) whose estimate must come from the fold model that never saw it (``folds >= 2`` only)."""
        z = self.standardise(_tensor(features)).float().to(self.device)
        skip = torch.full((len(z),), -1) if exclude is None else torch.as_tensor(np.asarray(exclude), dtype=torch.long)
        if skip.shape != (len(z),):
            raise ConfigError(f"exclude must hold one index (or -1) per feature, got shape {tuple(skip.shape)}")
        # Each row is predicted once: by the full model (fold -1), or by the fold model that never saw its pair.
        fold = torch.full_like(skip, -1)
        own = skip >= 0
        if bool(own.any()):
            if not self.fold_models:
                raise ConfigError("a leave-out estimate of the decoder's own training pairs needs cross-fitting: "
                                  "MLPDecoder(folds=K) with K >= 2")
            if int(skip.max()) >= len(self.fold_of):
                raise ConfigError(f"exclude indices must be below the {len(self.fold_of)} training pairs, got "
                                  f"{int(skip.max())}")
            fold[own] = self.fold_of[skip[own]]
        out = torch.empty(len(z), *self.shape, device=self.device)
        for k, model in [(-1, self.model), *enumerate(self.fold_models)]:
            rows = (fold == k).nonzero().squeeze(1).to(self.device)
            if len(rows):
                out[rows] = self._predict(z[rows], model)
        return out.float().cpu()


class KNNDecoder:
    """The mean of the k attacker images with the most similar features (cosine); k chosen on the held-out pairs."""

    def __init__(self, ks: Sequence[int] = (1, 2, 4, 8, 16, 32), *, name: str = "knn") -> None:
        if not ks or any(not is_int_at_least(k, 1) for k in ks):
            raise ConfigError(f"ks must be one or more integers >= 1, got {ks!r}")
        self.ks = tuple(int(k) for k in ks)
        self.name = name
        self.details: dict[str, Any] = {}

    def fit(self, features: Any, images: Any, labels: Any, held_features: Any, held_images: Any,
            held_labels: Any) -> KNNDecoder:
        f, x, _ = _check(features, images, labels)
        hf, hx, _ = _check(held_features, held_images, held_labels)
        if max(self.ks) > len(f):
            raise ConfigError(f"k = {max(self.ks)} needs at least that many attacker pairs, got {len(f)}")
        self.features, self.images = f, x
        neighbours = feature_similarity(hf, f).topk(max(self.ks), dim=1).indices
        scores = {k: _mse(x[neighbours[:, :k]].mean(1), hx) for k in self.ks}
        self.k = min(self.ks, key=lambda k: (scores[k], k))
        self.details = {"k": self.k, "held_out_mse": {str(k): v for k, v in scores.items()}}
        return self

    def decode(self, features: Any, labels: Any = None, *, exclude: Any = None, chunk: int = 1024) -> torch.Tensor:
        """The mean of the k nearest attacker images of each feature.

        ``exclude``: ``[n]`` for each feature, one of the decoder's own pairs to leave out (``-1``: none); decoding
        the decoder's own training features with ``exclude=arange(n)`` is the leave-one-out estimate, what a feature
        of an image outside the attacker's data gets.
        """
        f = _tensor(features)
        skip = None if exclude is None else torch.as_tensor(np.asarray(exclude), dtype=torch.long)
        if skip is not None and skip.shape != (len(f),):
            raise ConfigError(f"exclude must hold one index (or -1) per feature, got shape {tuple(skip.shape)}")
        out = []
        for start in range(0, len(f), chunk):
            similarity = feature_similarity(f[start:start + chunk], self.features)
            if skip is not None:
                rows = skip[start:start + chunk]
                mine = rows >= 0
                similarity[torch.arange(len(rows))[mine], rows[mine]] = -math.inf
            out.append(self.images[similarity.topk(self.k, dim=1).indices].mean(1))
        return torch.cat(out) if out else self.images[:0]


class ClassMeanDecoder:
    """The attacker's mean training image of each label (needs the released labels)."""

    name = "class-mean"

    def __init__(self) -> None:
        self.details: dict[str, Any] = {}

    def fit(self, features: Any, images: Any, labels: Any, held_features: Any, held_images: Any,
            held_labels: Any) -> ClassMeanDecoder:
        _, x, y = _check(features, images, labels)
        _, hx, hy = _check(held_features, held_images, held_labels)
        self.classes = int(y.max()) + 1
        self.means = torch.stack([x[y == c].mean(0) if (y == c).any() else x.mean(0) for c in range(self.classes)])
        self.details = {"held_out_mse": _mse(self.decode(None, hy), hx)}
        return self

    def decode(self, features: Any, labels: Any = None) -> torch.Tensor:
        if labels is None:
            raise ConfigError("the class-mean decoder needs the released labels")
        y = torch.as_tensor(np.asarray(labels), dtype=torch.long)
        if len(y) and (int(y.min()) < 0 or int(y.max()) >= self.classes):
            raise ConfigError(f"labels must lie in [0, {self.classes}), got {int(y.min())}..{int(y.max())}")
        return self.means[y]


#: Names of :func:`make_decoder`, in table order.
DECODERS = ("ridge", "mlp", "knn", "nn", "class-mean")


def make_decoder(name: str, *, seed: int = 0, device: str | torch.device = "cpu", mlp_hidden: int = 1024,
                 mlp_epochs: int = 30, mlp_folds: int = 0, progress: bool = False) -> Any:
    """A fresh decoder by name (one of :data:`DECODERS`); ``mlp_folds``: the MLP's cross-fitting folds."""
    if name == "ridge":
        return RidgeDecoder()
    if name == "mlp":
        return MLPDecoder(hidden=mlp_hidden, epochs=mlp_epochs, seed=seed, folds=mlp_folds, device=device,
                          progress=progress)
    if name == "knn":
        return KNNDecoder()
    if name == "nn":
        return KNNDecoder(ks=(1,), name="nn")
    if name == "class-mean":
        return ClassMeanDecoder()
    raise ConfigError(f"unknown decoder {name!r}; valid decoders: {', '.join(DECODERS)}")


def fit_decoders(names: Sequence[str], features: Any, images: Any, labels: Any, held_features: Any,
                 held_images: Any, held_labels: Any, **options: Any) -> dict[str, Any]:
    """Fit every named decoder on the attacker's training pairs, choosing hyperparameters on its held-out pairs."""
    return {name: make_decoder(name, **options).fit(features, images, labels, held_features, held_images,
                                                    held_labels) for name in names}
