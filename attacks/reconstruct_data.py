"""The data of one run of ``privfl attack reconstruct`` (protocol steps 1-3): :func:`load_attack_data` gives the
attacker's pairs ``(E(x), x)``, with the pairs held out of training, and one disjoint defender set per evaluation seed
(:class:`AttackData`), every feature from the frozen backbone followed by L2 normalisation.

The protocol step by step: docs/attacks.md, "privfl attack reconstruct".
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from attacks.reconstruct_settings import AttackSettings
from privfl.errors import ConfigError

__all__ = ["AttackData", "embed_images", "load_attack_data"]


@dataclass
class AttackData:
    """The attacker's pairs and the defender pools of one run (images on [0, 1] at the reconstruction size)."""

    attacker_images: torch.Tensor
    attacker_labels: np.ndarray
    attacker_features: torch.Tensor
    held_out: torch.Tensor
    train: torch.Tensor
    defender_images: dict[int, torch.Tensor]
    defender_labels: dict[int, np.ndarray]
    defender_features: dict[int, torch.Tensor]
    defender_indices: dict[int, np.ndarray]
    num_classes: int
    attacker_split: str
    defender_split: str

    def pairs(self) -> tuple[torch.Tensor, torch.Tensor, np.ndarray, torch.Tensor, torch.Tensor, np.ndarray]:
        """The attacker's training pairs and its held-out pairs, as the decoders fit on them: ``(features, images,
        labels)`` of the training pairs, then of the held-out ones."""
        fa, xa, ya, train, held = (self.attacker_features, self.attacker_images, self.attacker_labels, self.train,
                                   self.held_out)
        return fa[train], xa[train], ya[train], fa[held], xa[held], ya[held]


def _resize(images: np.ndarray, size: int) -> torch.Tensor:
    x = torch.as_tensor(images, dtype=torch.float32)
    if tuple(x.shape[2:]) != (size, size):
        x = torch.nn.functional.interpolate(x, size=(size, size), mode="bilinear", align_corners=False,
                                            antialias=True)
    return x.clamp(0, 1)


def embed_images(settings: AttackSettings, images: np.ndarray, name: str) -> torch.Tensor:
    from attacks.schemes import unit_features
    from privfl.models.backbones import extract_features, load_backbone

    options = {"input_size": settings.input_size} if settings.backbone == "mobilenet_v2" else {}
    backbone = load_backbone(settings.backbone, **options)
    return unit_features(lambda x: extract_features(backbone, x, dataset=name, progress=settings.progress))(images)


def load_attack_data(settings: AttackSettings) -> AttackData:
    """The attacker's pairs (with the held-out split) and one defender set per evaluation seed (protocol 1-3)."""
    from privfl.data import load_source

    source = load_source(settings.dataset, data_root=settings.data_root)
    if len(source.input_shape) != 3:
        raise ConfigError(f"dataset {settings.dataset!r} holds vectors {source.input_shape}, not images; the "
                          "reconstruction attack needs an image source (e.g. mnist)")
    if source.test is not None:
        attacker_pool, defender_pool = source.train, source.test
        a_all, d_all = np.arange(len(attacker_pool.x)), np.arange(len(defender_pool.x))
        splits = ("training split", "test split")
    else:  # two disjoint halves of the only split
        attacker_pool = defender_pool = source.train
        order = np.random.default_rng([settings.seed, 1]).permutation(len(source.train.x))
        a_all, d_all = np.sort(order[: len(order) // 2]), np.sort(order[len(order) // 2:])
        splits = ("first half of the only split", "second half")
    whole = settings.attacker_images is None or settings.attacker_images >= len(a_all)
    if settings.attacker_images is not None and settings.attacker_images > len(a_all):
        raise ConfigError(f"--attacker-images {settings.attacker_images}: {settings.dataset} has {len(a_all)} "
                          f"attacker images (use 'all')")
    a_idx = a_all if whole else np.sort(np.random.default_rng(settings.seed).permutation(a_all)[
        :settings.attacker_images])
    blocks = max(settings.seeds) + 1
    if blocks * settings.defender_images > len(d_all):
        raise ConfigError(f"--seeds {list(settings.seeds)} x --defender-images {settings.defender_images} need "
                          f"{blocks * settings.defender_images} disjoint defender images; {settings.dataset} has "
                          f"{len(d_all)}")
    permutation = np.random.default_rng([settings.seed, 3]).permutation(d_all)
    d_idx = {s: np.sort(permutation[s * settings.defender_images:(s + 1) * settings.defender_images])
             for s in settings.seeds}
    xa = np.asarray(attacker_pool.x[a_idx])
    tag = "all" if whole else f"{len(a_idx)}-seed{settings.seed}"
    features_a = embed_images(settings, xa, f"{settings.dataset}-train-{tag}")
    union = np.sort(np.concatenate(list(d_idx.values())))
    features_union = embed_images(settings, np.asarray(defender_pool.x[union]),
                            f"{settings.dataset}-test-{len(union)}-seed{settings.seed}")
    position = {int(i): k for k, i in enumerate(union)}
    order = np.random.default_rng([settings.seed, 2]).permutation(len(xa))
    if settings.validation_images >= len(xa):
        raise ConfigError(f"--validation-images ({settings.validation_images}) must leave training pairs out of the "
                          f"{len(xa)} attacker images")
    defender_images, defender_labels, defender_features = {}, {}, {}
    for s, idx in d_idx.items():
        rows = torch.as_tensor([position[int(i)] for i in idx])
        defender_images[s] = _resize(np.asarray(defender_pool.x[idx]), settings.image_size)
        defender_labels[s] = np.asarray(defender_pool.y[idx])
        defender_features[s] = features_union[rows]
    return AttackData(
        attacker_images=_resize(xa, settings.image_size), attacker_labels=np.asarray(attacker_pool.y[a_idx]),
        attacker_features=features_a, held_out=torch.as_tensor(np.sort(order[:settings.validation_images])),
        train=torch.as_tensor(np.sort(order[settings.validation_images:])), defender_images=defender_images,
        defender_labels=defender_labels, defender_features=defender_features, defender_indices=d_idx,
        num_classes=source.num_classes, attacker_split=splits[0], defender_split=splits[1])
