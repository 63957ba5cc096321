"""Hypernetworks: a descriptor ``e`` -> the weights of a target network, for every target without per-dataset classes.

The architecture is pFedHN's ``CNNHyper`` (Shamsian et al. 2021, ``experiments/pfedhn/models.py`` of
``AvivSham/pFedHN``; the ODPFL-HN papers' three hidden layers of 100 units and a linear head per target weight
tensor, App. C), made generic: a trunk ``Linear(d_e, h)`` followed by ``n_hidden`` blocks of ``ReLU, Linear(h, h)``
(no activation before the heads), then one linear head per tensor of the target's ``named_parameters()``, reshaped to
that tensor's shape.

A head costs ``(h + 1) * numel`` parameters, so per-tensor heads reach hundreds of millions of parameters on large
targets (a 1.5 M-parameter feature MLP needs about 150 M). Above ``chunk_threshold`` target parameters the
:class:`HyperNetwork` switches to a *chunked* generator (von Oswald et al. 2020): the target's flattened weights are
cut into chunks of ``chunk_size``; a learned chunk embedding is concatenated to the trunk's output and one shared head
emits each chunk, so the head costs ``(h + c + 1) * chunk_size`` whatever the target's size.

Generated weights are a dict keyed like ``target.named_parameters()``; run the target on them with
:func:`privfl.models.targets.functional_forward`, and gradients reach the hypernetwork and the descriptor.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import torch
from torch import nn

from privfl.errors import ConfigError

#: Target size (parameters) above which :class:`HyperNetwork` uses the chunked generator unless told otherwise.
CHUNK_THRESHOLD = 1_000_000


def _positive_int(name: str, value: object) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ConfigError(f"{name} must be an int >= 1, got {value!r}")
    return value


def target_shapes(target: nn.Module, names: Sequence[str] | None = None) -> dict[str, torch.Size]:
    """The trainable tensors of ``target`` by name, in ``named_parameters()`` order (what a hypernetwork emits);
    only those in ``names`` when given."""
    shapes = {name: p.shape for name, p in target.named_parameters()
              if p.requires_grad and (names is None or name in names)}
    if not shapes:
        raise ConfigError(f"target {type(target).__name__} has no trainable parameters to generate"
                          + ("" if names is None else f" among {list(names)}"))
    return shapes


#: Which part of the target a hypernetwork generates (the rest is shared by every client and trained by averaging
#: the clients' weight changes): ``"all"``, ``"head"`` (the last layer's weight and bias), ``"head_bias"`` (the last
#: layer's bias: a per-client shift of the logits, a learned label prior).
GENERATED_PARTS = ("all", "head", "head_bias")


def generated_names(target: nn.Module, part: str) -> list[str]:
    """The names of ``target``'s trainable tensors that a hypernetwork generating ``part`` (:data:`GENERATED_PARTS`)
    emits, in ``named_parameters()`` order. The last layer is the module owning the last trainable tensor.

    >>> from privfl.models import build_model
    >>> generated_names(build_model("mlp2nn", (1, 28, 28), 10), "head")
    ['fc3.weight', 'fc3.bias']
    """
    names = list(target_shapes(target))
    if part == "all":
        return names
    if part not in GENERATED_PARTS:
        raise ConfigError(f"generated must be one of {', '.join(GENERATED_PARTS)}, got {part!r}")
    owner = names[-1].rpartition(".")[0]
    head = [n for n in names if n.rpartition(".")[0] == owner]
    if part == "head":
        return head
    bias = [n for n in head if n.rpartition(".")[2] == "bias"]
    if not bias:
        raise ConfigError(f"generated='head_bias' needs a bias in the target's last layer ({owner}), which has "
                          f"{head}; use 'head' or 'all'")
    return bias


def embedding_dim(num_clients: int, *, rule: str = "quarter") -> int:
    """The descriptor size rule of the papers: the ODPFL-HN papers' d_e = N/4 (App. C), as ``floor(N/4)``
    ("quarter", at least 1), or pFedHN's code's ``int(1 + N/4)`` ("pfedhn"), which PeFLL's code also uses."""
    _positive_int("num_clients", num_clients)
    if rule == "quarter":
        return max(1, num_clients // 4)
    if rule == "pfedhn":
        return int(1 + num_clients / 4)
    raise ConfigError(f"embedding dimension rule must be 'quarter' or 'pfedhn', got {rule!r}")


class DescriptorStandardizer(nn.Module):
    """A fixed affine map ``e -> (e - shift) / scale`` in front of a hypernetwork, fitted to training descriptors.

    Descriptors of label-shifted clients can differ by only a few hundredths in absolute terms (a mean of vectors in
    the unit ball), which a hypernetwork trunk initialised for O(1) inputs barely resolves: it then learns one model
    for everybody and the descriptor stops mattering. :meth:`fit` sets ``shift`` to the mean of the training
    clients' descriptors and ``scale`` to their root-mean-square spread around it (one number for all coordinates),
    so the trunk sees between-client differences of order 1.

    **Isotropic on purpose.** A per-coordinate standard deviation would divide coordinates along which the training
    clients hardly differ by a tiny number, and a private descriptor's Gaussian noise (isotropic, of one sigma in
    every coordinate) would be blown up exactly there. One scale for all coordinates multiplies signal and noise
    alike, so the signal-to-noise ratio the hypernetwork sees is the one the release has.

    **Privacy.** It is applied on the server to descriptors already released and its statistics come from training
    clients' descriptors (released without privacy, recorded as such), so it is post-processing: it changes no
    private release's guarantee. ``shift`` and ``scale`` are buffers (saved with the hypernetwork, not trained by
    gradient steps).

    Args:
        embed_dim: descriptor size.
        min_scale: lower bound on ``scale`` (in descriptor units), so near-identical training descriptors cannot
            make the map blow up.

    >>> standardizer = DescriptorStandardizer(2)
    >>> standardizer.fit(torch.tensor([[0.0, 1.0], [2.0, 1.0]]))
    >>> standardizer.shift.tolist(), round(float(standardizer.scale), 4)
    ([1.0, 1.0], 0.7071)
    """

    shift: torch.Tensor   # buffers (register_buffer)
    scale: torch.Tensor

    def __init__(self, embed_dim: int, *, min_scale: float = 1e-3) -> None:
        super().__init__()
        self.embed_dim = _positive_int("embed_dim", embed_dim)
        if not (isinstance(min_scale, (int, float)) and math.isfinite(min_scale) and min_scale > 0):
            raise ConfigError(f"min_scale must be a finite number > 0, got {min_scale!r}")
        self.min_scale = float(min_scale)
        self.register_buffer("shift", torch.zeros(self.embed_dim))
        self.register_buffer("scale", torch.ones(()))

    @torch.no_grad()
    def fit(self, descriptors: torch.Tensor) -> None:
        """Set ``shift`` and ``scale`` from training descriptors ``[m, embed_dim]`` (``m >= 2``; with fewer the map
        is left as it is: one descriptor has no spread)."""
        if descriptors.ndim != 2 or descriptors.shape[1] != self.embed_dim:
            raise ConfigError(f"descriptors must have shape [m, {self.embed_dim}], got {tuple(descriptors.shape)}")
        if not bool(torch.isfinite(descriptors).all()):
            raise ConfigError("descriptors to fit the standardizer contain NaN/inf")
        if len(descriptors) < 2:
            return
        d = descriptors.to(self.shift.dtype)
        shift = d.mean(dim=0)
        spread = (d - shift).pow(2).sum(dim=1).mean().div(self.embed_dim).sqrt()
        self.shift.copy_(shift)
        self.scale.copy_(torch.clamp(spread, min=self.min_scale))

    def forward(self, descriptor: torch.Tensor) -> torch.Tensor:
        return (descriptor - self.shift) / self.scale

    @torch.no_grad()
    def batch_gradients(self, descriptors: torch.Tensor, grads: torch.Tensor) -> torch.Tensor:
        """The descriptor gradients ``grads`` ``[r, embed_dim]`` (of a loss through this map, statistics held
        fixed) turned into the gradients with the statistics differentiated too, computed from the ``r``
        descriptors ``[r, embed_dim]`` themselves, as batch normalisation does over its batch.

        Why: the statistics are refitted to the training descriptors, so a shift common to every client, or a change
        of their overall scale, is undone by the next fit and never changes what the hypernetwork sees. The
        fixed-statistics gradient does not know that: its average over clients is generally not 0, and an encoder
        following it drifts along those directions without bound (a softmax phi then saturates on one prototype
        and every client gets the same descriptor). The batch form removes exactly these components. With
        ``e_k = (m_k - mu) / s``, ``mu`` the mean and ``s`` the isotropic spread of the batch, and ``h_k`` the
        fixed-statistics gradients::

            dL/dm_k = h_k - mean_j h_j - e_k * sum_j <h_j, e_j> / (r * embed_dim)

        (the sum of the results over k is 0, and so is their projection on the batch's own spread). Fewer than 2
        descriptors have no spread: ``grads`` is returned unchanged.
        """
        if descriptors.shape != grads.shape or descriptors.ndim != 2 or descriptors.shape[1] != self.embed_dim:
            raise ConfigError(f"descriptors and grads must both have shape [r, {self.embed_dim}], got "
                              f"{tuple(descriptors.shape)} and {tuple(grads.shape)}")
        r = len(descriptors)
        if r < 2:
            return grads.clone()
        centred = descriptors - descriptors.mean(dim=0)
        spread = centred.pow(2).sum(dim=1).mean().div(self.embed_dim).sqrt().clamp_min(self.min_scale)
        e = centred / spread
        return grads - grads.mean(dim=0) - e * (grads * e).sum() / (r * self.embed_dim)

    def extra_repr(self) -> str:
        return f"embed_dim={self.embed_dim}, min_scale={self.min_scale}"


class HyperNetwork(nn.Module):
    """Maps a descriptor ``[embed_dim]`` to a dict of target weights named like ``target.named_parameters()``.

    Args:
        target: the target network (only its parameter names and shapes are read).
        embed_dim: descriptor dimension d_e.
        hidden_dim: trunk width (100 in the papers).
        n_hidden: number of ``ReLU, Linear(h, h)`` blocks after the first layer (3 in the papers).
        spectral_norm: wrap every trunk and head linear layer in spectral normalisation (off in the papers).
        chunked: ``None`` chooses by size (chunked above :data:`CHUNK_THRESHOLD` target parameters); ``True`` /
            ``False`` force the generator.
        chunk_size: weights emitted per chunk by the chunked generator.
        chunk_embed_dim: size of the learned per-chunk embedding.
        standardize: put a :class:`DescriptorStandardizer` (attribute ``standardizer``) in front of the trunk; its
            statistics are set by calling ``hnet.standardizer.fit(training_descriptors)``. Off by default (pFedHN's
            learned embeddings need none).
        generated: the names of the target tensors to emit (:func:`generated_names`); ``None``: every trainable one.

    >>> from privfl.models import build_model
    >>> target = build_model("mlp2nn", (1, 28, 28), 10)
    >>> hnet = HyperNetwork(target, embed_dim=25)
    >>> weights = hnet(torch.randn(25))
    >>> list(weights) == [n for n, _ in target.named_parameters()] and weights["fc1.weight"].shape == (200, 784)
    True
    """

    def __init__(self, target: nn.Module, *, embed_dim: int, hidden_dim: int = 100, n_hidden: int = 3,
                 spectral_norm: bool = False, chunked: bool | None = None, chunk_size: int = 10_000,
                 chunk_embed_dim: int = 16, standardize: bool = False,
                 generated: Sequence[str] | None = None) -> None:
        super().__init__()
        self.embed_dim = _positive_int("embed_dim", embed_dim)
        self.standardizer = DescriptorStandardizer(self.embed_dim) if standardize else None
        hidden_dim = _positive_int("hidden_dim", hidden_dim)
        if isinstance(n_hidden, bool) or not isinstance(n_hidden, int) or n_hidden < 0:
            raise ConfigError(f"n_hidden must be an int >= 0, got {n_hidden!r}")
        if chunked not in (None, True, False):
            raise ConfigError(f"chunked must be None (by size), True or False, got {chunked!r}")
        self.shapes = target_shapes(target, generated)
        self.num_target_params = sum(math.prod(s) for s in self.shapes.values())
        self.chunked = self.num_target_params > CHUNK_THRESHOLD if chunked is None else chunked
        wrap = nn.utils.parametrizations.spectral_norm if spectral_norm else (lambda layer: layer)

        layers: list[nn.Module] = [wrap(nn.Linear(self.embed_dim, hidden_dim))]
        for _ in range(n_hidden):
            layers += [nn.ReLU(), wrap(nn.Linear(hidden_dim, hidden_dim))]
        self.trunk = nn.Sequential(*layers)

        if self.chunked:
            self.chunk_size = _positive_int("chunk_size", chunk_size)
            _positive_int("chunk_embed_dim", chunk_embed_dim)
            self.num_chunks = math.ceil(self.num_target_params / self.chunk_size)
            self.chunk_embeddings = nn.Parameter(torch.randn(self.num_chunks, chunk_embed_dim) / chunk_embed_dim ** 0.5)
            self.chunk_head = wrap(nn.Linear(hidden_dim + chunk_embed_dim, self.chunk_size))
        else:
            # nn.ModuleDict keys cannot contain "."; heads are stored under escaped names, emitted under real ones.
            self.heads = nn.ModuleDict({
                _key(name): wrap(nn.Linear(hidden_dim, math.prod(shape))) for name, shape in self.shapes.items()
            })

    def forward(self, descriptor: torch.Tensor) -> dict[str, torch.Tensor]:
        """``descriptor`` ``[embed_dim]`` -> ``{name: tensor of the target's shape}`` (graph kept to both)."""
        if descriptor.shape != (self.embed_dim,):
            raise ConfigError(f"descriptor must have shape ({self.embed_dim},), got {tuple(descriptor.shape)}")
        if self.standardizer is not None:
            descriptor = self.standardizer(descriptor)
        features = self.trunk(descriptor)
        if not self.chunked:
            return {name: self.heads[_key(name)](features).reshape(shape) for name, shape in self.shapes.items()}
        rows = torch.cat([features.expand(self.num_chunks, -1), self.chunk_embeddings], dim=1)
        flat = self.chunk_head(rows).reshape(-1)[: self.num_target_params]
        out, start = {}, 0
        for name, shape in self.shapes.items():
            size = math.prod(shape)
            out[name] = flat[start:start + size].reshape(shape)
            start += size
        return out


def backprop_weight_change(hnet: HyperNetwork, descriptor: torch.Tensor, change: dict[str, torch.Tensor]
                           ) -> tuple[dict[str, torch.Tensor], torch.Tensor]:
    """The pFedHN chain rule: gradients of the hypernetwork's parameters and of the descriptor from a weight change.

    ``change`` is ``w_before - w_after`` of the client's local training ("before minus after", the sign of pFedHN's
    code; the ODPFL-HN paper's Algorithm 1 prints the opposite sign with a descent step, which moves *away* from the
    locally improved weights; docs/papers.md, ODPFL-HN, E1). Used as ``grad_outputs`` of the vector-Jacobian product
    through ``w = hnet(e)``, it plays the role of dL/dw: after one plain SGD step at learning rate eta it is exactly
    ``eta * dL/dw``, so the returned gradients are ``eta`` times the true gradients of L(hnet(e)).

    Returns ``({parameter name: gradient}, gradient with respect to the descriptor)``, on the hypernetwork's device
    (``descriptor`` and ``change`` may be on the CPU); nothing is modified.
    """
    device = next(iter(hnet.parameters())).device      # the inputs go where the hypernetwork computes
    leaf = descriptor.detach().to(device).requires_grad_(True)
    generated = hnet(leaf)
    missing = sorted(set(generated) - set(change))
    if missing:
        raise ConfigError(f"weight change lacks the generated tensors {missing}")
    names = [n for n, p in hnet.named_parameters() if p.requires_grad]
    params = [p for p in hnet.parameters() if p.requires_grad]
    grads = torch.autograd.grad(list(generated.values()), [*params, leaf],
                                grad_outputs=[change[k].to(v.device, v.dtype) for k, v in generated.items()],
                                allow_unused=True)
    param_grads = {n: torch.zeros_like(p) if g is None else g
                   for n, p, g in zip(names, params, grads[:-1], strict=True)}
    return param_grads, grads[-1]


class RoundGradientMean:
    """One round's mean hypernetwork gradient over the clients that finish it, holding one running sum.

    ODPFL-HN and PeFLL chain-rule each client's weight change through the hypernetwork when it arrives (stage 2),
    because the descriptor's gradient goes back down in that stage; but the server step averages only over the
    clients that also answer the round's last stage. Holding every client's hypernetwork gradient until then costs a
    hypernetwork-sized tensor per client (the MNIST 2NN's heads are 63 MB: 3 GB at 50 clients a round).

    Kept instead: the sum of the gradients, added in ascending client id, and each client's (descriptor, weight
    change), the size of the target model. If the clients that finish are exactly those added, :meth:`mean` divides
    the sum by their count: a copy of the first gradient, in-place additions in ascending id, an in-place division,
    the operations of averaging the held gradients, so the mean is the same to the last bit. If some did not finish,
    the gradients of those that did are computed again from their kept changes (the hypernetwork has not moved since;
    the computation is the same and so is its result) and averaged the same way.
    """

    def __init__(self, hnet: HyperNetwork) -> None:
        self.hnet = hnet
        self._sum: dict[str, torch.Tensor] | None = None
        self._inputs: dict[int, tuple[torch.Tensor, dict[str, torch.Tensor]]] = {}

    def __contains__(self, client_id: int) -> bool:
        return client_id in self._inputs

    def add(self, client_id: int, descriptor: torch.Tensor, change: dict[str, torch.Tensor]) -> torch.Tensor:
        """Chain-rule ``change`` at ``descriptor`` (:func:`backprop_weight_change`), add the hypernetwork gradient to
        the sum and return the descriptor's gradient. Clients must come in ascending id, once each."""
        if self._inputs and client_id <= max(self._inputs):
            raise ValueError(f"client {client_id} added after client {max(self._inputs)}: the sum's order (ascending "
                             f"client id) is what makes the mean repeatable")
        grads, descriptor_grad = backprop_weight_change(self.hnet, descriptor, change)
        self._accumulate(grads)
        self._inputs[client_id] = (descriptor, change)
        return descriptor_grad

    def _accumulate(self, grads: dict[str, torch.Tensor]) -> None:
        if self._sum is None:
            self._sum = {k: g.clone() for k, g in grads.items()}   # never an alias of anything the caller holds
        else:
            for k, total in self._sum.items():
                total.add_(grads[k])

    def inputs(self, client_id: int) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
        """The (descriptor, weight change) kept for ``client_id``: its own gradient is
        ``backprop_weight_change(hnet, *inputs(client_id))`` (central DP clips each client's gradient)."""
        return self._inputs[client_id]

    def mean(self, client_ids: list[int]) -> dict[str, torch.Tensor]:
        """The mean gradient over ``client_ids`` (each added before); the round's sum is consumed."""
        ids = sorted(client_ids)
        unknown = sorted(set(ids) - set(self._inputs))
        if not ids or unknown:
            raise ValueError(f"mean over clients {ids}: need a non-empty subset of the added clients "
                             f"{sorted(self._inputs)} (not added: {unknown})")
        if ids != list(self._inputs):
            self._sum = None
            for cid in ids:
                self._accumulate(backprop_weight_change(self.hnet, *self._inputs[cid])[0])
        total, self._sum, self._inputs = self._sum, None, {}
        assert total is not None   # ids is non-empty and each of its changes was accumulated
        return {k: v.div_(len(ids)) for k, v in total.items()}


def _key(name: str) -> str:
    return name.replace(".", "__")


__all__ = ["CHUNK_THRESHOLD", "GENERATED_PARTS", "DescriptorStandardizer", "HyperNetwork", "RoundGradientMean",
           "backprop_weight_change", "embedding_dim", "generated_names", "target_shapes"]
