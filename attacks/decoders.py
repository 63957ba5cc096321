"""Decoder baselines of the reconstruction attack: maps from a feature to an image, fitted on the attacker's pairs.

Each is trained on the same ``(E(x), x)`` pairs of the attacker's own data and has its hyperparameters chosen on the
attacker's held-out pairs (mean squared error; never the defender's images). All return images ``[n, C, H, W]`` on
[0, 1]. Plain: :class:`RidgeDecoder`, :class:`MLPDecoder`, :class:`KNNDecoder` (``"nn"`` with ``ks=(1,)``),
:class:`ClassMeanDecoder`. Tuned, each choosing among its grid (:data:`TUNING_GRIDS`) and recording every
candidate's held-out MSE and CPU seconds (:class:`TunedDecoder`): ``"mlp-tuned"``, ``"conv"`` (:class:`ConvDecoder`),
``"mlp-ensemble"`` (:class:`EnsembleDecoder`), ``"random-features"`` (:class:`RandomFeaturesDecoder`).
:func:`fit_decoders` fits a list of them by name.

Example:
    >>> import torch
    >>> f, x = torch.eye(4), torch.rand(4, 1, 2, 2)
    >>> d = KNNDecoder(ks=(1,)).fit(f, x, torch.arange(4), f, x, torch.arange(4))
    >>> bool(torch.equal(d.decode(f, torch.arange(4)), x))
    True

See docs/attacks.md, "Decoder baselines".
"""

from __future__ import annotations

import copy
import math
import time
from collections.abc import Callable, Sequence
from typing import Any

import numpy as np
import torch
from torch import nn

from accounting.validation import is_int_at_least, is_real
from privfl.errors import ConfigError, TrainingDivergedError, check

__all__ = ["DECODERS", "ENSEMBLE_MEMBERS", "TUNING_GRIDS", "ClassMeanDecoder", "ConvDecoder", "EnsembleDecoder",
           "KNNDecoder", "MLPDecoder", "RandomFeaturesDecoder", "RidgeDecoder", "TunedDecoder", "cross_fitted",
           "feature_similarity", "fit_decoders", "held_out_mse", "make_decoder"]


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
    held-out MSE; stops after ``patience`` epochs without improvement. ``dropout`` (after each hidden layer) and
    ``schedule="cosine"`` (the learning rate falls from ``learning_rate`` to 0 along a half cosine over ``epochs``
    epochs, per step; Loshchilov and Hutter 2017) are what the tuned MLP adds; the defaults (no dropout, a constant
    rate) are the project's first MLP.

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
                 folds: int = 0, dropout: float = 0.0, schedule: str = "constant",
                 device: str | torch.device = "cpu", progress: bool = False) -> None:
        for name, value in (("hidden", hidden), ("epochs", epochs), ("batch_size", batch_size),
                            ("patience", patience)):
            check.integer(value, name)
        check.positive(learning_rate, "learning_rate")
        if not is_real(dropout) or not 0 <= dropout < 1:
            raise ConfigError(f"dropout must be a probability in [0, 1), got {dropout!r}")
        if schedule not in ("constant", "cosine"):
            raise ConfigError(f"schedule must be constant or cosine, got {schedule!r}")
        if not is_int_at_least(folds, 0) or folds == 1:
            raise ConfigError(f"folds must be 0 (no cross-fitting) or at least 2, got {folds}")
        self.dropout: float = float(dropout)
        self.schedule: str = schedule
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
        self.details = {"hidden": self.hidden, "dropout": self.dropout, "schedule": self.schedule,
                        "epochs_run": len(history), "best_epoch": int(np.argmin(history)) + 1,
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

        # the global random state is left as it was; dropout draws from the stream the seed starts
        with torch.random.fork_rng(devices=[] if self.device.type == "cpu" else [self.device]):
            torch.manual_seed(self.seed)
            model = self._network(z.shape[1]).to(self.device)
            optimizer = torch.optim.AdamW(model.parameters(), lr=self.learning_rate, weight_decay=self.weight_decay)
            total = self.epochs * math.ceil(len(z) / self.batch_size)
            generator = torch.Generator().manual_seed(self.seed)
            history: list[float] = []
            best_state, best, waited, step = None, math.inf, 0, 0
            for _ in tqdm(range(self.epochs), desc=desc, unit="epoch", disable=not self.progress,
                          dynamic_ncols=True):
                model.train()
                order = torch.randperm(len(z), generator=generator).to(self.device)
                for start in range(0, len(z), self.batch_size):
                    index = order[start:start + self.batch_size]
                    if self.schedule == "cosine":
                        for group in optimizer.param_groups:
                            group["lr"] = self.learning_rate * 0.5 * (1 + math.cos(math.pi * step / total))
                    loss = nn.functional.mse_loss(model(z[index]), y[index])
                    optimizer.zero_grad(set_to_none=True)
                    loss.backward()
                    optimizer.step()
                    step += 1
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
                raise TrainingDivergedError(f"{desc}: no epoch reached a finite held-out MSE; lower learning_rate "
                                            f"(now {self.learning_rate!r})")
        model.load_state_dict(best_state)
        return model.eval(), history

    def _network(self, in_dim: int) -> nn.Module:
        """The network from a ``in_dim``-d standardised feature to the flattened image (on [0, 1])."""
        pixels = math.prod(self.shape)
        drop = [nn.Dropout(self.dropout)] if self.dropout else []
        return nn.Sequential(nn.Linear(in_dim, self.hidden), nn.SiLU(), *drop,
                             nn.Linear(self.hidden, self.hidden), nn.SiLU(), *drop,
                             nn.Linear(self.hidden, pixels), nn.Sigmoid())

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


class ConvDecoder(MLPDecoder):
    """An MLP trunk to a coarse grid, then transposed convolutions to the image (the images' side a multiple of 4).

    Standardised feature -> ``hidden`` (SiLU, dropout) -> ``channels`` x (H/4) x (W/4) (SiLU) -> a 4 x 4 stride-2
    transposed convolution to ``channels / 2`` x (H/2) x (W/2) (SiLU) -> another to C x H x W -> sigmoid (for MNIST
    at 28 px: a 7 x 7 grid). Trained as :class:`MLPDecoder` is (AdamW, MSE, schedule, early stopping on the held-out
    pairs); no cross-fitting.
    """

    name = "conv"

    def __init__(self, *, channels: int = 64, **options: Any) -> None:
        check.integer(channels, "channels")
        if channels < 2:
            raise ConfigError(f"channels must be >= 2, got {channels}")
        if options.get("folds"):
            raise ConfigError("the convolutional decoder has no cross-fitting (folds=0)")
        super().__init__(**options)
        self.channels = int(channels)

    def fit(self, features: Any, images: Any, labels: Any, held_features: Any, held_images: Any,
            held_labels: Any) -> ConvDecoder:
        shape = tuple(_tensor(images).shape[1:])
        if len(shape) != 3 or shape[1] % 4 or shape[2] % 4:
            raise ConfigError(f"the convolutional decoder needs images whose sides are multiples of 4, got {shape}")
        super().fit(features, images, labels, held_features, held_images, held_labels)
        self.details["channels"] = self.channels
        return self

    def _network(self, in_dim: int) -> nn.Module:
        c, h, w = self.shape
        drop = [nn.Dropout(self.dropout)] if self.dropout else []
        half = self.channels // 2
        return nn.Sequential(nn.Linear(in_dim, self.hidden), nn.SiLU(), *drop,
                             nn.Linear(self.hidden, self.channels * (h // 4) * (w // 4)), nn.SiLU(),
                             nn.Unflatten(1, (self.channels, h // 4, w // 4)),
                             nn.ConvTranspose2d(self.channels, half, 4, stride=2, padding=1), nn.SiLU(),
                             nn.ConvTranspose2d(half, c, 4, stride=2, padding=1), nn.Flatten(), nn.Sigmoid())


class RandomFeaturesDecoder(_StandardisingDecoder):
    """Ridge regression on random Fourier features of the standardised feature (Rahimi and Recht 2007).

    ``phi(z) = sqrt(2 / D) cos(W z / (b sqrt(d)) + u)`` with ``W`` standard normal ``[D, d]`` and ``u`` uniform on
    [0, 2 pi): ``phi(z) . phi(z')`` approximates the Gaussian kernel ``exp(-|z - z'|^2 / (2 b^2 d))`` of bandwidth
    ``b`` (a multiple of ``sqrt(d)``, the norm of a standardised feature). For each bandwidth, the ridge solutions
    for every penalty come from one eigendecomposition of the centred ``phi^T phi`` (float64); the pair (bandwidth,
    alpha) with the lowest held-out MSE is kept. Alphas are multiples of the mean diagonal of ``phi^T phi``.
    """

    name = "random-features"

    def __init__(self, *, features: int = 4096, bandwidths: Sequence[float] = (0.5, 1.0),
                 alphas: Sequence[float] = (1e-4, 1e-3, 1e-2, 1e-1), seed: int = 0, chunk: int = 4096) -> None:
        check.integer(features, "features")
        for label, values in (("bandwidths", bandwidths), ("alphas", alphas)):
            if not values or any(not is_real(v) or not v > 0
                                 for v in values):
                raise ConfigError(f"{label} must be one or more numbers > 0, got {values!r}")
        self.features, self.seed, self.chunk = int(features), int(seed), int(chunk)
        self.bandwidths = tuple(float(b) for b in bandwidths)
        self.alphas = tuple(float(a) for a in alphas)
        self.details: dict[str, Any] = {}

    def _phi(self, z: torch.Tensor, bandwidth: float) -> torch.Tensor:
        scale = 1.0 / (bandwidth * math.sqrt(z.shape[1]))
        return math.sqrt(2.0 / self.features) * torch.cos(z.float() @ self.projection * scale + self.phase)

    def fit(self, features: Any, images: Any, labels: Any, held_features: Any, held_images: Any,
            held_labels: Any) -> RandomFeaturesDecoder:
        f, x, hf, hx = self._standardised_pairs(features, images, labels, held_features, held_images, held_labels)
        g = torch.Generator().manual_seed(self.seed)
        self.projection = torch.randn(f.shape[1], self.features, generator=g)
        self.phase = 2 * math.pi * torch.rand(self.features, generator=g)
        held = self.standardise(hf)
        y = x.reshape(len(x), -1).double()
        self.image_mean = y.mean(0)
        scores: dict[str, float] = {}
        best: tuple[float, float, float, torch.Tensor, torch.Tensor] | None = None
        for b in self.bandwidths:
            gram = torch.zeros(self.features, self.features, dtype=torch.float64)
            total = torch.zeros(self.features, dtype=torch.float64)
            cross = torch.zeros(self.features, y.shape[1], dtype=torch.float64)
            for i in range(0, len(f), self.chunk):
                phi = self._phi(self.standardise(f[i:i + self.chunk]), b)
                gram += (phi.T @ phi).double()
                total += phi.double().sum(0)
                cross += (phi.T @ (y[i:i + self.chunk] - self.image_mean).float()).double()
            mean = total / len(f)
            gram -= len(f) * torch.outer(mean, mean)
            values, vectors = torch.linalg.eigh(gram)
            rotated = vectors.T @ cross
            held_phi = self._phi(held, b).double() - mean
            unit = float(gram.diagonal().mean())
            for a in self.alphas:
                weights = vectors @ (rotated / (values + a * unit)[:, None])
                mse = _mse(self._output(held_phi, weights), hx)
                scores[f"{b:g}/{a:g}"] = mse
                if best is None or mse < best[0]:
                    best = (mse, b, a, weights, mean)
        assert best is not None
        _, self.bandwidth, self.alpha, self.weights, self.phi_mean = best
        self.details = {"features": self.features, "bandwidth": self.bandwidth, "alpha": self.alpha,
                        "held_out_mse": scores}
        return self

    def _output(self, centred_phi: torch.Tensor, weights: torch.Tensor) -> torch.Tensor:
        out = centred_phi @ weights + self.image_mean
        return out.float().clamp(0, 1).reshape(len(centred_phi), *self.shape)

    def decode(self, features: Any, labels: Any = None) -> torch.Tensor:
        z = self.standardise(_tensor(features))
        return torch.cat([self._output(self._phi(z[i:i + self.chunk], self.bandwidth).double() - self.phi_mean,
                                       self.weights) for i in range(0, max(len(z), 1), self.chunk)])[:len(z)]


def cross_fitted(decoder: MLPDecoder, folds: int, *, name: str | None = None) -> MLPDecoder:
    """A fresh MLP decoder with ``decoder``'s settings (width, dropout, schedule, epochs, seed, ...) and ``folds``
    cross-fitted fold models: what a reconstructor reads when it is guided by the tuned MLP (its training pairs get
    out-of-fold estimates; its full model trains as ``decoder``'s did). ``name``: its name in tables."""
    if type(decoder) is not MLPDecoder:
        raise ConfigError(f"cross-fitting needs an MLP decoder, got {type(decoder).__name__}")
    out = MLPDecoder(hidden=decoder.hidden, epochs=decoder.epochs, learning_rate=decoder.learning_rate,
                     weight_decay=decoder.weight_decay, batch_size=decoder.batch_size, patience=decoder.patience,
                     seed=decoder.seed, folds=folds, dropout=decoder.dropout, schedule=decoder.schedule,
                     device=decoder.device, progress=decoder.progress)
    if name is not None:
        out.name = name
    return out


def held_out_mse(decoder: Any, held_features: Any, held_images: Any, held_labels: Any) -> float:
    """A fitted decoder's mean squared error on the attacker's held-out pairs (what every choice is made on)."""
    return _mse(decoder.decode(_tensor(held_features), held_labels), _tensor(held_images))


class TunedDecoder:
    """The candidate with the lowest held-out MSE among decoders built from a grid of configurations.

    Args:
        name: the decoder's name in tables.
        build: a fresh unfitted decoder from one configuration (a dict of options).
        grid: the configurations, tried in order.

    ``details["grid"]`` records every candidate: its configuration, held-out MSE, CPU seconds (process time) and
    its own details (e.g. the epochs it ran); ``details["chosen"]`` the configuration kept.
    """

    def __init__(self, name: str, build: Callable[[dict[str, Any]], Any], grid: Sequence[dict[str, Any]]) -> None:
        if not grid:
            raise ConfigError(f"the tuned decoder {name!r} needs at least one configuration")
        self.name, self.build, self.grid = name, build, [dict(c) for c in grid]
        self.details: dict[str, Any] = {}

    def fit(self, features: Any, images: Any, labels: Any, held_features: Any, held_images: Any,
            held_labels: Any) -> TunedDecoder:
        tried, best = [], None
        for config in self.grid:
            started = time.process_time()
            decoder = self.build(config).fit(features, images, labels, held_features, held_images, held_labels)
            mse = held_out_mse(decoder, held_features, held_images, held_labels)
            tried.append({"config": config, "held_out_mse": mse, "cpu_s": time.process_time() - started,
                          "details": {k: v for k, v in decoder.details.items() if k != "held_out_mse_per_epoch"}})
            if best is None or mse < best[0]:
                best = (mse, config, decoder)
        assert best is not None
        self.held_out_mse, self.config, self.decoder = best
        self.details = {"chosen": self.config, "held_out_mse": self.held_out_mse, "grid": tried}
        return self

    def decode(self, features: Any, labels: Any = None) -> torch.Tensor:
        return self.decoder.decode(features, labels)


class EnsembleDecoder:
    """The mean estimate of decoders that differ only in their seed (a seed ensemble).

    Args:
        name: the decoder's name in tables.
        build: a fresh unfitted decoder from a seed.
        seeds: one member per seed.
        first: an already fitted member for ``seeds[0]`` (its fit is not repeated; its CPU seconds are counted when
            its ``details`` hold ``cpu_s``).
    """

    def __init__(self, name: str, build: Callable[[int], Any], seeds: Sequence[int], *, first: Any = None) -> None:
        if not seeds:
            raise ConfigError(f"the ensemble {name!r} needs at least one seed")
        self.name, self.build, self.seeds, self.first = name, build, [int(s) for s in seeds], first
        self.details: dict[str, Any] = {}

    def fit(self, features: Any, images: Any, labels: Any, held_features: Any, held_images: Any,
            held_labels: Any) -> EnsembleDecoder:
        self.members, seconds = [], []
        for k, seed in enumerate(self.seeds):
            started = time.process_time()
            if k == 0 and self.first is not None:
                member = self.first
                seconds.append(float(self.first.details.get("cpu_s", 0.0)))
            else:
                member = self.build(seed).fit(features, images, labels, held_features, held_images, held_labels)
                seconds.append(time.process_time() - started)
            self.members.append(member)
        self.details = {"seeds": self.seeds, "reused_first_member": self.first is not None,
                        "member_held_out_mse": [held_out_mse(m, held_features, held_images, held_labels)
                                                for m in self.members],
                        "held_out_mse": held_out_mse(self, held_features, held_images, held_labels),
                        "member_cpu_s": seconds}
        return self

    def decode(self, features: Any, labels: Any = None) -> torch.Tensor:
        return torch.stack([m.decode(features, labels) for m in self.members]).mean(0)


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


#: Names of :func:`make_decoder`, in table order: the first decoders, then the tuned ones.
DECODERS = ("ridge", "mlp", "knn", "nn", "class-mean", "mlp-tuned", "conv", "mlp-ensemble", "random-features")

#: What each tuned decoder chooses from on the held-out pairs (``width``: a multiple of ``mlp_hidden``; the MLPs
#: train ``tuned_epochs`` epochs at most, AdamW with a cosine schedule, early stopping; ``random-features`` tries every
#: bandwidth and penalty of its one entry).
TUNING_GRIDS: dict[str, tuple[dict[str, Any], ...]] = {
    "mlp-tuned": ({"width": 1, "dropout": 0.2, "learning_rate": 1e-3},
                  {"width": 2, "dropout": 0.2, "learning_rate": 1e-3}),
    "conv": ({"width": 1, "channels": 64, "dropout": 0.1, "learning_rate": 1e-3},),
    "random-features": ({"bandwidths": (0.5, 1.0), "alphas": (1e-4, 1e-3, 1e-2, 1e-1)},),
}
#: Members of the MLP seed ensemble (the tuned MLP's configuration, seeds ``seed, seed + 1, ...``).
ENSEMBLE_MEMBERS = 3


def make_decoder(name: str, *, seed: int = 0, device: str | torch.device = "cpu", mlp_hidden: int = 1024,
                 mlp_epochs: int = 30, mlp_folds: int = 0, tuned_epochs: int = 10, random_features: int = 4096,
                 first: Any = None, progress: bool = False) -> Any:
    """A fresh decoder by name (one of :data:`DECODERS`); ``mlp_folds``: the MLP's cross-fitting folds;
    ``tuned_epochs``: the tuned MLPs' epochs (cosine schedule); ``random_features``: D of ``random-features``;
    ``first``: for ``mlp-ensemble``, the fitted ``mlp-tuned`` whose configuration it repeats over seeds (else it
    tunes its own first)."""
    if name == "ridge":
        return RidgeDecoder()
    if name == "mlp":
        return MLPDecoder(hidden=mlp_hidden, epochs=mlp_epochs, seed=seed, folds=mlp_folds, device=device,
                          progress=progress)

    def tuned_mlp(config: dict[str, Any], member_seed: int = seed, kind: type[MLPDecoder] = MLPDecoder) -> Any:
        options = {k: v for k, v in config.items() if k != "width"}
        return kind(hidden=int(config["width"] * mlp_hidden), epochs=tuned_epochs, schedule="cosine",
                    seed=member_seed, device=device, progress=progress, **options)

    if name == "mlp-tuned":
        return TunedDecoder(name, tuned_mlp, TUNING_GRIDS[name])
    if name == "conv":
        return TunedDecoder(name, lambda c: tuned_mlp(c, kind=ConvDecoder), TUNING_GRIDS[name])
    if name == "mlp-ensemble":
        tuned = first if first is not None else make_decoder("mlp-tuned", seed=seed, device=device,
                                                             mlp_hidden=mlp_hidden, tuned_epochs=tuned_epochs,
                                                             progress=progress)
        return _TunedEnsemble(tuned, lambda config, s: tuned_mlp(config, s), seed)
    if name == "random-features":
        return TunedDecoder(name, lambda c: RandomFeaturesDecoder(features=random_features, seed=seed, **c),
                            TUNING_GRIDS[name])
    if name == "knn":
        return KNNDecoder()
    if name == "nn":
        return KNNDecoder(ks=(1,), name="nn")
    if name == "class-mean":
        return ClassMeanDecoder()
    raise ConfigError(f"unknown decoder {name!r}; valid decoders: {', '.join(DECODERS)}")


class _TunedEnsemble(EnsembleDecoder):
    """The seed ensemble of the tuned MLP's chosen configuration: the tuned MLP (fitted first when it is not yet)
    is the member of seed ``seed``; the others repeat its configuration."""

    def __init__(self, tuned: TunedDecoder, build: Callable[[dict[str, Any], int], Any], seed: int) -> None:
        super().__init__("mlp-ensemble", lambda s: build(self.tuned.config, s),
                         [seed + k for k in range(ENSEMBLE_MEMBERS)])
        self.tuned = tuned

    def fit(self, features: Any, images: Any, labels: Any, held_features: Any, held_images: Any,
            held_labels: Any) -> EnsembleDecoder:
        if not self.tuned.details:
            started = time.process_time()
            self.tuned.fit(features, images, labels, held_features, held_images, held_labels)
            self.tuned.details["cpu_s"] = time.process_time() - started
        self.first = self.tuned
        super().fit(features, images, labels, held_features, held_images, held_labels)
        self.details["configuration"] = self.tuned.config
        return self


def fit_decoders(names: Sequence[str], features: Any, images: Any, labels: Any, held_features: Any,
                 held_images: Any, held_labels: Any, **options: Any) -> dict[str, Any]:
    """Fit every named decoder on the attacker's training pairs, choosing hyperparameters on its held-out pairs;
    each decoder's ``details["cpu_s"]`` is the process time of its fit (the MLP ensemble's counts its first member,
    the tuned MLP when that is fitted in the same call, whose own fit it reuses)."""
    fitted: dict[str, Any] = {}
    order = sorted(names, key=lambda n: n == "mlp-ensemble")   # the tuned MLP before the ensemble that reuses it
    for name in order:
        first = fitted.get("mlp-tuned") if name == "mlp-ensemble" else None
        started = time.process_time()
        decoder = make_decoder(name, first=first, **options).fit(features, images, labels, held_features,
                                                                 held_images, held_labels)
        decoder.details["cpu_s"] = time.process_time() - started + (
            float(first.details["cpu_s"]) if first is not None else 0.0)
        fitted[name] = decoder
    return {name: fitted[name] for name in names}
