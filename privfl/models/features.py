"""The frozen feature stage in front of any method's trained networks (``RunConfig.features``).

"Differentially private learning needs better features" (Tramer and Boneh, ICLR 2021): a fixed, data-independent
map from images to features, followed by a small trained head, learns far more under DP-SGD than an end-to-end
network, because the noise is spread over few coordinates and the features are already linearly separable. The stage
is chosen by name:

- ``"scatter"``: the 2-D scattering transform (Bruna and Mallat 2013; kymatio's ``ScatteringTorch2D``, J = 2, L = 8:
  81 x 7 x 7 features on 28 x 28 images), each record's features group-normalised by their own statistics (27 groups
  of 3 channels, no affine), as the ScatterNet models of Tramer and Boneh: a per-record map, so it spends no privacy
  and couples no records;
- ``"mobilenet_v2"`` (and any other image backbone of :data:`privfl.models.backbones.BACKBONES`): the ImageNet
  backbone's pooled features.

:func:`featurize` maps every client's inputs through the stage once (all clients' inputs in one call, cached on disk
by :func:`~privfl.models.backbones.extract_features`, keyed by the stage and a hash of the inputs) and returns the
federation with features in place of images. The stage is public (it depends on no client's data), so a federation
and everything downstream of it (methods, privacy layer, ledgers) is unchanged: the target network is a head on
features (``model="linear"`` or ``"feature_mlp"``).

    >>> stage = ScatterNet()
    >>> stage(torch.rand(2, 1, 28, 28)).shape
    torch.Size([2, 3969])
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Any

import numpy as np
import torch
from torch import nn

from privfl.errors import ConfigError, DataUnavailableError
from privfl.models.backbones import BACKBONES, Backbone, ImageBackbone, extract_features, load_backbone

#: The feature stages by name: ``"scatter"`` and the image backbones.
STAGES = ("scatter", "mobilenet_v2")


@functools.lru_cache(maxsize=4)
def _scattering(J: int, L: int, shape: tuple[int, int]) -> nn.Module:
    """kymatio's 2-D scattering (its filter bank takes about a second to build: built once per settings; it holds
    no state a call changes)."""
    # kymatio 0.3.0's ``kymatio.torch`` imports its 3-D frontend too, which needs ``scipy.special.sph_harm`` (gone
    # from recent SciPy); the 2-D frontend imports and runs on its own
    try:
        from kymatio.scattering2d.frontend.torch_frontend import ScatteringTorch2D
    except ImportError as error:
        raise DataUnavailableError(f"the 'scatter' feature stage needs kymatio (pip install 'kymatio>=0.3,<0.4'): "
                                   f"{error}") from None
    return ScatteringTorch2D(J=J, shape=shape, L=L)


class ScatterNet(Backbone):
    """The ScatterNet feature stage: scattering coefficients of order <= 2, group-normalised per record.

    ``J`` (scales), ``L`` (angles), ``groups`` (GroupNorm groups over the ``channels * (1 + J L + L^2 J (J-1) / 2)``
    coefficient maps, no affine), ``shape`` (the images' height and width). Features are flattened:
    ``channels * K * (H / 2^J) * (W / 2^J)``, 3969 for MNIST.
    """

    def __init__(self, *, J: int = 2, L: int = 8, groups: int = 27, shape: tuple[int, int] = (28, 28),
                 channels: int = 1) -> None:
        super().__init__()
        for name, value in (("J", J), ("L", L), ("groups", groups), ("channels", channels)):
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ConfigError(f"scatter {name} must be an integer >= 1, got {value!r}")
        height, width = (int(v) for v in shape)
        if height % 2 ** J or width % 2 ** J:
            raise ConfigError(f"scatter images of shape {height}x{width} cannot be subsampled by 2^J = {2 ** J}")
        self.J, self.L, self.groups, self.shape, self.channels = J, L, groups, (height, width), channels
        self.coefficients = channels * (1 + J * L + L * L * J * (J - 1) // 2)
        if self.coefficients % groups:
            raise ConfigError(f"scatter groups={groups} must divide the {self.coefficients} coefficient maps")
        self.scattering = _scattering(J, L, self.shape)
        self.name = "scatter"
        self.feature_dim = self.coefficients * (height // 2 ** J) * (width // 2 ** J)
        self.freeze()

    def preprocess(self, inputs: Any) -> torch.Tensor:
        x = torch.as_tensor(np.asarray(inputs) if not isinstance(inputs, torch.Tensor) else inputs,
                            dtype=torch.float32)
        if x.ndim == 3:
            x = x[:, None]
        if x.ndim != 4 or x.shape[1] != self.channels or tuple(x.shape[2:]) != self.shape:
            raise ConfigError(f"the scatter stage takes images of shape [N, {self.channels}, {self.shape[0]}, "
                              f"{self.shape[1]}], got {tuple(x.shape)}")
        return x.contiguous()

    def embed(self, batch: torch.Tensor) -> torch.Tensor:
        coefficients = self.scattering(batch)                       # [N, C, K, H / 2^J, W / 2^J]
        maps = coefficients.reshape(len(batch), self.coefficients, *coefficients.shape[-2:])
        return nn.functional.group_norm(maps, self.groups).flatten(1)

    def cache_key(self) -> dict[str, Any]:
        import kymatio

        return {"backbone": "scatter", "J": self.J, "L": self.L, "groups": self.groups, "shape": list(self.shape),
                "channels": self.channels, "normalisation": "group_norm per record, no affine",
                "kymatio": kymatio.__version__}


def load_stage(name: str, input_shape: tuple[int, ...], **options: Any) -> Backbone:
    """The feature stage ``name`` (:data:`STAGES`) for images of ``input_shape`` (``(C, H, W)``), with ``options``
    (``J``, ``L``, ``groups`` for ``"scatter"``; the backbone's options, e.g. ``input_size``, otherwise)."""
    if len(input_shape) != 3:
        raise ConfigError(f"a feature stage maps images, but the data are vectors of shape {tuple(input_shape)}; "
                          "use features=None")
    if name == "scatter":
        try:
            return ScatterNet(shape=(int(input_shape[1]), int(input_shape[2])), channels=int(input_shape[0]),
                              **options)
        except TypeError as error:
            raise ConfigError(f"feature stage 'scatter': {error}; its options are J, L and groups") from None
    if name not in BACKBONES:
        raise ConfigError(f"unknown feature stage {name!r}; valid: {', '.join(STAGES)}, or None for none")
    stage = load_backbone(name, **options)
    if not isinstance(stage, ImageBackbone):
        raise ConfigError(f"feature stage {name!r} embeds text, and the federation holds images")
    return stage


def featurize(federation: Any, name: str, options: dict[str, Any] | None = None, *, progress: bool = False,
              cache_dir: str | None = None) -> Any:
    """``federation`` (a :class:`~privfl.data.FederatedDataset`) with every training client's train and validation
    inputs and every novel client's inputs replaced by their features under the stage ``name``, computed in one call
    (cached on disk); labels, ids and partition unchanged, ``input_shape`` the features'."""
    stage = load_stage(name, tuple(federation.input_shape), **dict(options or {}))
    parts: list[torch.Tensor] = []
    for client in federation.training_clients:
        parts += [client.x_train, client.x_val]
    parts += [novel.x for novel in federation.novel_clients]
    features = torch.from_numpy(map_inputs(stage, torch.cat(parts), progress=progress, cache_dir=cache_dir))
    pieces = iter(torch.split(features, [len(p) for p in parts]))
    training = [dataclasses.replace(client, x_train=next(pieces), x_val=next(pieces))
                for client in federation.training_clients]
    novel = [type(c)(client_id=c.client_id, x=next(pieces)) for c in federation.novel_clients]
    return dataclasses.replace(federation, training_clients=training, novel_clients=novel,
                               input_shape=(stage.feature_dim,))


def map_inputs(stage: Backbone, x: torch.Tensor, *, progress: bool = False, cache_dir: str | None = None
               ) -> np.ndarray:
    """``stage``'s features of the images ``x`` (float32 ``[N, feature_dim]``), cached on disk."""
    return extract_features(stage, x, dataset="federation", cache_dir=cache_dir, batch_size=1000, progress=progress)


__all__ = ["STAGES", "ScatterNet", "featurize", "load_stage", "map_inputs"]
