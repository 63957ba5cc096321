"""Novel clients of a chosen size and label mix, drawn from images that no training client holds.

The ODPFL-HN DP experiment (Amosy et al., section 7 and Fig. 5: a CIFAR-10 novel client's accuracy against the size
of its sample set, about 3000 samples at epsilon 0.3) needs novel clients far larger than any client of the
federation (about 500 samples each in the paper's 100-client split, which does not say how its larger clients were
built). Here they are drawn without replacement, with the novel client's class mix, from a held-out pool. When a
federation subsamples its training pool (``FederationSpec.max_samples``), the images it leaves out are such a pool:
no training client (and no novel client of the federation) holds them.

1. :func:`held_out_pool` rebuilds the federation's subsampling draw (the same stream of the same seed, as
   :func:`privfl.data.build_federation` makes it) and returns the complement, normalised like every client's inputs.
2. :class:`NovelPool` draws disjoint sample sets with given class proportions from it, without replacement, so a
   novel client's descriptor set and its evaluation set never share an image.
"""

from __future__ import annotations

import numpy as np
import torch

from privfl.data import FederationSpec, load_source
from privfl.data.federated import _prepare_inputs, _Streams
from privfl.errors import ConfigError


def held_out_pool(spec: FederationSpec, *, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    """``(x, y)``: the images of ``spec``'s training pool (the train split, or the merged pool) that
    ``build_federation(spec, seed=seed)`` left out by ``max_samples``; with ``split="train_test"`` and every training
    image used, the test split. Normalised float32 and int64 labels.

    Raises :class:`ConfigError` when the federation uses the whole pool (``max_samples`` unset or too large), or when
    ``spec`` shifts images (blur, rotation, concept-shift angles): the held-out images are returned unshifted, so they
    would silently not be the novel clients ``spec`` describes.
    """
    if spec.has_image_shift:
        raise ConfigError("held_out_pool returns unshifted images, but the federation shifts them (novel_blur_sigma="
                          f"{spec.novel_blur_sigma}, novel_rotation={spec.novel_rotation}, train_angles="
                          f"{list(spec.train_angles)}); draw held-out novel clients from an unshifted spec")
    source = load_source(spec.source, data_root=spec.data_root, download=spec.download, **spec.source_options)
    splits = [source.train] if source.test is None else [source.train, source.test]
    if spec.split == "merged":
        x, y = np.concatenate([s.x for s in splits]), np.concatenate([s.y for s in splits])
    else:
        x, y = source.train.x, source.train.y
        if (spec.max_samples is None or spec.max_samples >= len(y)) and source.test is not None:
            # every training image is a training client's: the held-out images are the test split's (the run's own
            # few novel clients are cut from it too; they train nothing, so sharing images with them biases nothing)
            test = source.test
            return (torch.from_numpy(_prepare_inputs(-1, test.x, source, 0.0, (0.0, 0))),
                    torch.from_numpy(test.y.astype(np.int64)))
    if spec.max_samples is None or spec.max_samples >= len(y):
        raise ConfigError(f"max_samples={spec.max_samples!r} leaves no held-out images: the training pool has "
                          f"{len(y)}; set max_samples below that to keep images no training client holds")
    rng = _Streams.from_seed(seed).subsample          # the first draw of this stream is the training pool's cap
    keep = np.sort(rng.choice(len(y), size=spec.max_samples, replace=False))
    rest = np.setdiff1d(np.arange(len(y)), keep)
    inputs = _prepare_inputs(-1, x[rest], source, 0.0, (0.0, 0))
    return torch.from_numpy(inputs), torch.from_numpy(y[rest].astype(np.int64))


class NovelPool:
    """Draws disjoint novel-client sample sets with fixed class proportions from ``(x, y)``.

    >>> pool = NovelPool(torch.zeros(10, 2), torch.tensor([0] * 5 + [1] * 5))
    >>> x, y = pool.draw({0: 0.6, 1: 0.4}, 5, np.random.default_rng(0))
    >>> sorted(y.tolist()), pool.remaining
    ([0, 0, 0, 1, 1], 5)
    """

    def __init__(self, x: torch.Tensor, y: torch.Tensor) -> None:
        self.x, self.y = x, y
        self._free = np.ones(len(y), dtype=bool)

    @property
    def remaining(self) -> int:
        """Images not drawn yet."""
        return int(self._free.sum())

    def counts(self, proportions: dict[int, float], n: int) -> dict[int, int]:
        """Per-class counts of a set of ``n`` with ``proportions`` (largest remainders, summing to n)."""
        total = sum(proportions.values())
        if n < 1 or total <= 0 or any(p < 0 for p in proportions.values()):
            raise ConfigError(f"need n >= 1 and non-negative proportions with a positive sum, got n={n}, "
                              f"proportions={proportions}")
        exact = {c: n * p / total for c, p in proportions.items()}
        counts = {c: int(v) for c, v in exact.items()}
        for c in sorted(exact, key=lambda c: counts[c] - exact[c])[: n - sum(counts.values())]:
            counts[c] += 1
        return counts

    def draw(self, proportions: dict[int, float], n: int, rng: np.random.Generator
             ) -> tuple[torch.Tensor, torch.Tensor]:
        """``n`` images with class proportions ``proportions`` (class -> weight), in random order; they are removed
        from the pool. Raises :class:`ConfigError` naming the class when the pool has too few of it left."""
        chosen = []
        for label, count in self.counts(proportions, n).items():
            free = np.flatnonzero(self._free & (self.y.numpy() == label))
            if len(free) < count:
                raise ConfigError(f"the held-out pool has {len(free)} images of class {label} left, {count} needed "
                                  "(use smaller sizes, fewer novel clients, or a smaller max_samples)")
            chosen.append(rng.choice(free, size=count, replace=False))
        index = rng.permutation(np.concatenate(chosen))
        self._free[index] = False
        return self.x[index], self.y[index]


__all__ = ["NovelPool", "held_out_pool"]
