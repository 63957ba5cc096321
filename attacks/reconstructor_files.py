"""The reconstructor's files: its checkpoint (resumes training) and its exported weights (sampling only), and the
fingerprints that tie them to their training data.

Entry points: :func:`read_state` (either file, checked), :func:`save_atomically`, :func:`data_fingerprint`,
:func:`summarise_training_data` (what exported weights are checked against, within :data:`FEATURE_TOLERANCE`) and
:func:`state_weights_sha256`. What each file holds: docs/attacks.md, "The diffusion reconstructor".
"""

from __future__ import annotations

import hashlib
import os
from pathlib import Path
from typing import Any

import numpy as np
import torch

from privfl.errors import ConfigError

__all__ = ["CHECKPOINT_FORMAT", "EXPORT_FORMAT", "FEATURE_TOLERANCE", "check_format", "data_fingerprint", "read_state",
           "save_atomically", "state_weights_sha256", "summarise_training_data"]

CHECKPOINT_FORMAT = 3
#: The ``format`` of :meth:`~attacks.reconstructor.Reconstructor.export`'s file.
EXPORT_FORMAT = "ema-weights-1"
#: Largest difference allowed between the per-dimension means, and between the per-dimension standard deviations,
#: of the features exported weights were trained on and the features they are evaluated with (absolute; unit-norm
#: features of a few hundred dimensions have entries of order 0.03, a device's rounding differences are about 1e-6).
FEATURE_TOLERANCE = 1e-4


def data_fingerprint(*arrays: Any) -> str:
    """sha256 of ``arrays`` in order (shapes, dtypes and bytes; ``None`` skipped), e.g. the training pairs and the
    decoder's estimates: a checkpoint is reused only on the same data."""
    hasher = hashlib.sha256()
    for array in (a for a in arrays if a is not None):
        a = np.ascontiguousarray(array.detach().cpu().numpy() if isinstance(array, torch.Tensor) else array)
        hasher.update(f"{a.dtype}{a.shape}".encode())
        hasher.update(a.tobytes())
    return hasher.hexdigest()


def read_state(path: str | os.PathLike) -> dict[str, Any]:
    """A checkpoint's or exported weights' contents (``torch.load(weights_only=True)``), else a ConfigError."""
    state = torch.load(Path(path), map_location="cpu", weights_only=True)
    if not isinstance(state, dict) or "config" not in state:
        raise ConfigError(f"{path} is not a reconstructor checkpoint or exported weights")
    check_format(state)
    return state


def check_format(state: dict[str, Any]) -> None:
    """Refuse a checkpoint or exported weights of a format this code does not read."""
    if state.get("format") not in (CHECKPOINT_FORMAT, EXPORT_FORMAT):
        raise ConfigError(f"unsupported reconstructor checkpoint format {state.get('format')!r} (this code reads "
                          f"{CHECKPOINT_FORMAT} and {EXPORT_FORMAT!r}; train a new reconstructor)")


def state_weights_sha256(state: dict[str, Any]) -> str:
    """The sha256 of a state's EMA weights (what a fine-tuned reconstructor names its source by)."""
    return data_fingerprint(*state["ema"].values())


def summarise_training_data(features: torch.Tensor, images: torch.Tensor) -> dict[str, Any]:
    """What exported weights are checked against: the images' fingerprint, the pair count and the features'
    per-dimension mean and (population) standard deviation in float64."""
    f = features.double()
    return {"pairs": len(features), "images": data_fingerprint(images),
            "feature_mean": f.mean(0), "feature_std": f.std(0, unbiased=False)}


def save_atomically(state: dict[str, Any], path: str | os.PathLike) -> Path:
    """``torch.save`` to a temporary file in the same folder, then ``os.replace``."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    temporary = path.with_name(path.name + ".tmp")
    torch.save(state, temporary)
    os.replace(temporary, path)
    return path
