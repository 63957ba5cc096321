"""Target networks: the models that clients train and that the server aggregates or generates.

Every target is an ordinary ``nn.Module`` built from ``(input_shape, num_classes)``, so one class serves every
dataset of the right shape (no per-dataset classes). Each one can also run with weights supplied from outside
through :func:`functional_forward`, which the hypernetwork methods need.
"""

from __future__ import annotations

import math
from collections.abc import Mapping

import torch
from torch import nn
from torch.func import functional_call

from privfl.errors import ConfigError
from privfl.registry import Registry


def _flat_size(input_shape: tuple[int, ...]) -> int:
    return int(math.prod(input_shape))


class MLP2NN(nn.Module):
    """McMahan et al.'s "2NN": input -> 200 -> 200 -> classes with ReLU (199,210 parameters on MNIST)."""

    def __init__(self, input_shape: tuple[int, ...], num_classes: int, hidden: int = 200) -> None:
        super().__init__()
        self.fc1 = nn.Linear(_flat_size(input_shape), hidden)
        self.fc2 = nn.Linear(hidden, hidden)
        self.fc3 = nn.Linear(hidden, num_classes)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = torch.flatten(x, 1)
        x = torch.relu(self.fc1(x))
        x = torch.relu(self.fc2(x))
        return self.fc3(x)


class LeNet(nn.Module):
    """LeNet-5 style CNN for 3x32x32 inputs: conv 16 and 32 (5x5, max-pool 2), FC 120 and 84."""

    def __init__(self, input_shape: tuple[int, ...], num_classes: int) -> None:
        super().__init__()
        channels, height, width = _image_shape(input_shape, "lenet")
        self.conv1 = nn.Conv2d(channels, 16, 5)
        self.conv2 = nn.Conv2d(16, 32, 5)
        h, w = ((height - 4) // 2 - 4) // 2, ((width - 4) // 2 - 4) // 2
        if h < 1 or w < 1:
            raise ConfigError(f"lenet needs images of at least 16x16, got input shape {tuple(input_shape)}")
        self.fc1 = nn.Linear(32 * h * w, 120)
        self.fc2 = nn.Linear(120, 84)
        self.fc3 = nn.Linear(84, num_classes)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = nn.functional.max_pool2d(torch.relu(self.conv1(x)), 2)
        x = nn.functional.max_pool2d(torch.relu(self.conv2(x)), 2)
        x = torch.flatten(x, 1)
        x = torch.relu(self.fc1(x))
        x = torch.relu(self.fc2(x))
        return self.fc3(x)


class FedTTACNN(nn.Module):
    """The McMahan et al. CNN as FedTTA's code builds it: conv 5x5 32 and 64 (padding 2, max-pool 2), FC 512.

    No BatchNorm anywhere (which matters for TENT). 1,663,370 parameters on 1x28x28 with 10 classes. ``conv`` sets
    the two conv layers' channels (HeteroFedTTA's small and big CNNs: 16/32 and 64/128).
    """

    def __init__(self, input_shape: tuple[int, ...], num_classes: int, hidden: int = 512,
                 conv: tuple[int, int] = (32, 64)) -> None:
        super().__init__()
        channels, height, width = _image_shape(input_shape, "fedtta_cnn")
        first, second = conv
        self.conv1 = nn.Conv2d(channels, first, 5, padding=2)
        self.conv2 = nn.Conv2d(first, second, 5, padding=2)
        self.fc1 = nn.Linear(second * (height // 4) * (width // 4), hidden)
        self.fc2 = nn.Linear(hidden, num_classes)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = nn.functional.max_pool2d(torch.relu(self.conv1(x)), 2)
        x = nn.functional.max_pool2d(torch.relu(self.conv2(x)), 2)
        x = torch.flatten(x, 1)
        return self.fc2(torch.relu(self.fc1(x)))


class TanhCNN(nn.Module):
    """The small end-to-end CNN of private MNIST training (Papernot et al. 2021, "Tempered Sigmoid Activations for
    Deep Learning with Differential Privacy"; the end-to-end baseline of Tramer and Boneh 2021): conv 8x8 16 (stride 2,
    padding 2), max-pool 2 (stride 1), conv 4x4 32 (stride 2), max-pool 2 (stride 1), FC 32, FC classes, tanh after
    every hidden layer. 26,010 parameters on 1x28x28 with 10 classes."""

    def __init__(self, input_shape: tuple[int, ...], num_classes: int) -> None:
        super().__init__()
        channels, height, width = _image_shape(input_shape, "tanh_cnn")
        if (height, width) != (28, 28):
            raise ConfigError(f"model 'tanh_cnn' is laid out for 28x28 images, got {height}x{width}")
        self.features = nn.Sequential(nn.Conv2d(channels, 16, 8, stride=2, padding=2), nn.Tanh(),
                                      nn.MaxPool2d(2, stride=1), nn.Conv2d(16, 32, 4, stride=2), nn.Tanh(),
                                      nn.MaxPool2d(2, stride=1))
        self.classifier = nn.Sequential(nn.Linear(32 * 4 * 4, 32), nn.Tanh(), nn.Linear(32, num_classes))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.classifier(torch.flatten(self.features(x), 1))


class SmallCNN(nn.Module):
    """The MNIST CNN of Liu, Hu, Wu and Smith ("On Privacy and Personalization in Cross-Silo Federated Learning",
    NeurIPS 2022; github kenziyuliu/private-cross-silo-fl, ``model_utils.py``): conv 3x3 32 and 64 (no padding,
    ReLU, max-pool 2 each), then one linear layer. 34,826 parameters on 1x28x28 with 10 classes; no normalisation
    layer, so DP-SGD can clip each record's gradient."""

    def __init__(self, input_shape: tuple[int, ...], num_classes: int) -> None:
        super().__init__()
        channels, height, width = _image_shape(input_shape, "small_cnn")
        self.conv1 = nn.Conv2d(channels, 32, 3)
        self.conv2 = nn.Conv2d(32, 64, 3)
        h, w = ((height - 2) // 2 - 2) // 2, ((width - 2) // 2 - 2) // 2
        if h < 1 or w < 1:
            raise ConfigError(f"small_cnn needs images of at least 10x10, got input shape {tuple(input_shape)}")
        self.fc = nn.Linear(64 * h * w, num_classes)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = nn.functional.max_pool2d(torch.relu(self.conv1(x)), 2)
        x = nn.functional.max_pool2d(torch.relu(self.conv2(x)), 2)
        return self.fc(torch.flatten(x, 1))


class Linear(nn.Module):
    """A linear head on features (or flattened inputs): input -> classes; the ScatterNet + linear model of Tramer
    and Boneh (2021), with the feature stage in front (:mod:`privfl.models.features`)."""

    def __init__(self, input_shape: tuple[int, ...], num_classes: int) -> None:
        super().__init__()
        self.fc = nn.Linear(_flat_size(input_shape), num_classes)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc(torch.flatten(x, 1))


class FeatureMLP(nn.Module):
    """A head for precomputed features: input -> 500 -> 500 -> classes, ReLU and dropout 0.2."""

    def __init__(self, input_shape: tuple[int, ...], num_classes: int, hidden: int = 500, dropout: float = 0.2) -> None:
        super().__init__()
        self.net = nn.Sequential(
            nn.Flatten(),
            nn.Linear(_flat_size(input_shape), hidden),
            nn.ReLU(),
            nn.Dropout(dropout),
            nn.Linear(hidden, hidden),
            nn.ReLU(),
            nn.Dropout(dropout),
            nn.Linear(hidden, num_classes),
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.net(x)


def _image_shape(input_shape: tuple[int, ...], name: str) -> tuple[int, int, int]:
    if len(input_shape) != 3:
        raise ConfigError(
            f"model {name!r} needs image inputs of shape (channels, height, width), got {tuple(input_shape)}; "
            "use 'mlp2nn' or 'feature_mlp' for vector inputs"
        )
    return int(input_shape[0]), int(input_shape[1]), int(input_shape[2])


MODELS: Registry[type[nn.Module]] = Registry("model", {
    "mlp2nn": MLP2NN,
    "lenet": LeNet,
    "fedtta_cnn": FedTTACNN,
    "small_cnn": SmallCNN,
    "feature_mlp": FeatureMLP,
    "linear": Linear,
    "tanh_cnn": TanhCNN,
})


def build_model(name: str, input_shape: tuple[int, ...], num_classes: int) -> nn.Module:
    """Build the target network ``name`` for inputs of ``input_shape`` and ``num_classes`` classes."""
    model = MODELS.lookup(name)
    if num_classes < 2:
        raise ConfigError(f"num_classes must be >= 2, got {num_classes}")
    return model(tuple(input_shape), num_classes)


def functional_forward(model: nn.Module, weights: Mapping[str, torch.Tensor], x: torch.Tensor) -> torch.Tensor:
    """Run ``model`` on ``x`` with ``weights`` (names as in ``model.named_parameters()``) instead of its own.

    Gradients flow into ``weights``, which is what lets a hypernetwork be trained through the target.
    """
    return functional_call(model, dict(weights), (x,))
