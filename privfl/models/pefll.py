"""PeFLL's embedding network: one labelled example ``(x, y)`` -> a vector; a client's descriptor is their mean.

PeFLL (Scott, Zakerinia and Lampert, ICLR 2024; docs/papers.md, PeFLL) describes a client by
``v(S) = (1/|S|) sum_{(x, y) in S} phi(x, y)``, the plain mean of per-example embeddings, and a server-side
hypernetwork turns ``v`` into the client's model. Labels are inputs of ``phi``. Three variants (the first two are the
paper's, section 4 and Table 3, with the layer sizes of the authors' ``CNNEmbed`` and ``MLPEmbed``):

1. ``"cnn"`` (the paper's CNN embedding, CIFAR10/FEMNIST): the client LeNet (conv 5x5 16, conv 5x5 32, FC 120, FC 84)
   whose input gets ``C`` extra channels holding the one-hot label broadcast over every pixel (1 + 10 = 11 channels on
   MNIST), and whose last layer outputs ``d`` units with no non-linearity.
2. ``"linear"`` (the paper's "MLP" embedding, CIFAR100): one affine layer on the one-hot label only; the descriptor is
   then ``W h + b`` with ``h`` the batch's label frequencies (the image is ignored).
3. ``"mlp"`` (ours, for vector inputs where a CNN does not apply): ``[x, onehot(y)] -> 100 -> ReLU -> d``.

``d`` defaults to pFedHN's rule ``int(1 + N/4)`` with N the number of clients, as the authors' code sets it
(:func:`~privfl.models.hypernetwork.embedding_dim` with ``rule="pfedhn"``).

Every variant is per-example (no batch statistics, no cross-example operation), which is what the labelled
sensitivity argument of :mod:`privfl.privacy.labelled` needs: ``phi(x_j, y_j)`` depends on record j only.

>>> net = EmbeddingNetwork((1, 28, 28), 10, embed_dim=26)
>>> net.descriptor(torch.randn(5, 1, 28, 28), torch.tensor([0, 1, 2, 3, 4])).shape
torch.Size([26])
"""

from __future__ import annotations

import math

import torch
from torch import nn

from privfl.errors import ConfigError

EMBEDDING_KINDS = ("auto", "cnn", "linear", "mlp")


def resolve_kind(kind: str, input_shape: tuple[int, ...]) -> str:
    """``"auto"`` -> ``"cnn"`` for images ``(C, H, W)`` and ``"mlp"`` for vectors; other kinds are checked."""
    if kind not in EMBEDDING_KINDS:
        raise ConfigError(f"embedding kind must be one of {', '.join(EMBEDDING_KINDS)}, got {kind!r}")
    if kind == "auto":
        return "cnn" if len(input_shape) == 3 else "mlp"
    if kind == "cnn" and len(input_shape) != 3:
        raise ConfigError(f"embedding kind 'cnn' needs image inputs (channels, height, width), got input shape "
                          f"{tuple(input_shape)}; use 'mlp' or 'linear' for vectors")
    return kind


class EmbeddingNetwork(nn.Module):
    """``phi(x, y)``: per-example embeddings ``[n, embed_dim]`` of labelled examples (see the module docstring).

    Args:
        input_shape: one example's shape, ``(C, H, W)`` or ``(D,)``.
        num_classes: C, the size of the one-hot label.
        embed_dim: d, the descriptor size.
        kind: ``"auto"``, ``"cnn"``, ``"linear"`` or ``"mlp"``.
        hidden: width of the ``"mlp"`` variant's hidden layer.
    """

    def __init__(self, input_shape: tuple[int, ...], num_classes: int, *, embed_dim: int, kind: str = "auto",
                 hidden: int = 100) -> None:
        super().__init__()
        if isinstance(embed_dim, bool) or not isinstance(embed_dim, int) or embed_dim < 1:
            raise ConfigError(f"embed_dim must be an int >= 1, got {embed_dim!r}")
        if isinstance(num_classes, bool) or not isinstance(num_classes, int) or num_classes < 2:
            raise ConfigError(f"num_classes must be an int >= 2, got {num_classes!r}")
        self.input_shape = tuple(int(s) for s in input_shape)
        self.num_classes = num_classes
        self.embed_dim = embed_dim
        self.kind = resolve_kind(kind, self.input_shape)
        if self.kind == "cnn":
            channels, height, width = self.input_shape
            h, w = ((height - 4) // 2 - 4) // 2, ((width - 4) // 2 - 4) // 2
            if h < 1 or w < 1:
                raise ConfigError(f"the 'cnn' embedding needs images of at least 16x16, got {self.input_shape}")
            self.conv1 = nn.Conv2d(channels + num_classes, 16, 5)
            self.conv2 = nn.Conv2d(16, 32, 5)
            self.fc1 = nn.Linear(32 * h * w, 120)
            self.fc2 = nn.Linear(120, 84)
            self.fc3 = nn.Linear(84, embed_dim)
        elif self.kind == "linear":
            self.fc = nn.Linear(num_classes, embed_dim)
        else:
            self.fc1 = nn.Linear(math.prod(self.input_shape) + num_classes, hidden)
            self.fc2 = nn.Linear(hidden, embed_dim)

    def _check(self, x: torch.Tensor, y: torch.Tensor) -> None:
        if not isinstance(x, torch.Tensor) or tuple(x.shape[1:]) != self.input_shape:
            got = tuple(x.shape) if isinstance(x, torch.Tensor) else type(x).__name__
            raise ConfigError(f"x must have shape [n, {', '.join(map(str, self.input_shape))}], got {got}")
        if not isinstance(y, torch.Tensor) or y.shape != (x.shape[0],) or y.dtype not in (torch.int64, torch.int32):
            raise ConfigError(f"y must be an int64 or int32 tensor of shape [{x.shape[0]}] aligned with x, got "
                              + (f"shape {tuple(y.shape)}, dtype {y.dtype}" if isinstance(y, torch.Tensor)
                                 else type(y).__name__))

    def check_labels(self, y: torch.Tensor) -> None:
        """:class:`ConfigError` unless every label lies in ``0 .. num_classes - 1``."""
        if len(y) and (int(y.min()) < 0 or int(y.max()) >= self.num_classes):
            raise ConfigError(f"labels must lie in 0..{self.num_classes - 1}, got range "
                              f"[{int(y.min())}, {int(y.max())}]")

    def forward(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        """Per-example embeddings ``phi(x_j, y_j)``, shape ``[n, embed_dim]`` (row j depends on example j only).

        Label values are not range-checked here (that would break ``torch.func.vmap``); :meth:`descriptor` and
        :mod:`privfl.privacy.labelled` check them with :meth:`check_labels`. An out-of-range label gets a zero one-hot.
        """
        self._check(x, y)
        onehot = (y.long()[:, None] == torch.arange(self.num_classes, device=y.device)).to(x.dtype)
        if self.kind == "linear":
            return self.fc(onehot)
        if self.kind == "mlp":
            return self.fc2(torch.relu(self.fc1(torch.cat([x.flatten(1), onehot], dim=1))))
        planes = onehot[:, :, None, None].expand(-1, -1, *x.shape[2:])
        z = nn.functional.max_pool2d(torch.relu(self.conv1(torch.cat([x, planes], dim=1))), 2)
        z = nn.functional.max_pool2d(torch.relu(self.conv2(z)), 2)
        z = torch.relu(self.fc1(z.flatten(1)))
        return self.fc3(torch.relu(self.fc2(z)))

    def descriptor(self, x: torch.Tensor, y: torch.Tensor, *, bound: float | None = None) -> torch.Tensor:
        """``v = (1/n) sum_j clip_B(phi(x_j, y_j))``, shape ``[embed_dim]`` (graph kept to the parameters).

        1. per-example embeddings ``phi(x_j, y_j)``;
        2. with ``bound`` B, each row is projected onto the L2 ball of radius B (``v * min(1, B/||v||)``): the clipping
           a private release needs (the embedding's last layer is linear and unbounded), used in training as well so
           training and private serving see the same function;
        3. the true mean over the n examples: divided by n, not by twice the number of batches as the authors' code
           does (docs/papers.md, PeFLL, E1).
        """
        self.check_labels(y)
        return clipped_rows(self(x, y), bound).mean(dim=0)


def clipped_rows(rows: torch.Tensor, bound: float | None) -> torch.Tensor:
    """Each row of ``rows`` ``[n, d]`` projected onto the L2 ball of radius ``bound`` (unchanged if ``None``)."""
    if bound is None:
        return rows
    norms = rows.norm(dim=1, keepdim=True)
    return rows * torch.clamp(bound / norms.clamp_min(1e-12), max=1.0)


__all__ = ["EMBEDDING_KINDS", "EmbeddingNetwork", "clipped_rows", "resolve_kind"]
