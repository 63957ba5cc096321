"""A registry of set encoders by name, so methods and the CLI choose an encoder with a string.

Names: ``"deepset"`` (:class:`~privfl.models.set_encoders.DeepSetEncoder`, the ODPFL-HN mean/max DeepSet),
``"dp_deepset"`` (:class:`~privfl.models.set_encoders.DPDeepSetEncoder`, the only one
:func:`privfl.privacy.privatize` accepts), ``"dss"`` (:class:`~privfl.models.set_encoders.DSSEncoder`) and
``"set_transformer"`` (:class:`~privfl.models.set_encoders.SetTransformerEncoder`): the three encoders the ODPFL-HN
papers choose among (App. C), with the configurations of docs/papers.md, ODPFL-HN, U7.

>>> import torch
>>> enc = build_encoder("dp_deepset", (1, 28, 28), 12, hidden=16, clip=1.0)
>>> enc(torch.randn(30, 1, 28, 28)).shape
torch.Size([12])
"""

from __future__ import annotations

import inspect
from collections.abc import Sequence
from typing import Any

from torch import nn

from privfl.errors import ConfigError
from privfl.models.set_encoders import DeepSetEncoder, DPDeepSetEncoder, DSSEncoder, SetTransformerEncoder
from privfl.registry import Registry

ENCODERS: Registry[type[nn.Module]] = Registry("encoder", {
    "deepset": DeepSetEncoder,
    "dp_deepset": DPDeepSetEncoder,
    "dss": DSSEncoder,
    "set_transformer": SetTransformerEncoder,
})

#: Encoders whose structure (phi -> mean -> psi) :func:`privfl.privacy.privatize` can certify.
PRIVATIZABLE = ("dp_deepset",)


def encoder_options(name: str) -> list[str]:
    """The keyword options encoder ``name`` accepts (besides the input shape and ``output_dim``)."""
    cls = _lookup(name)
    params = inspect.signature(cls.__init__).parameters
    return sorted(p for p in params if p not in ("self", "input_dim", "input_shape", "output_dim"))


def build_encoder(name: str, input_shape: int | Sequence[int], output_dim: int, **options: Any) -> nn.Module:
    """The encoder ``name`` for samples of shape ``input_shape`` with descriptors of size ``output_dim``.

    Unknown names and options raise :class:`ConfigError` listing the valid ones.
    """
    cls = _lookup(name)
    valid = encoder_options(name)
    unknown = sorted(set(options) - set(valid))
    if unknown:
        raise ConfigError(f"encoder {name!r} has no option {', '.join(unknown)}; valid options: {', '.join(valid)}")
    shape = (input_shape,) if isinstance(input_shape, int) else tuple(input_shape)
    return cls(input_shape=shape, output_dim=output_dim, **options)


def _lookup(name: str) -> type[nn.Module]:
    return ENCODERS.lookup(name)


__all__ = ["ENCODERS", "PRIVATIZABLE", "build_encoder", "encoder_options"]
