"""Which torch device a run computes on: ``"cpu"``, ``"cuda"``, or ``"auto"`` (CUDA where present, else the CPU).

Models are built and initialised on the CPU, from the CPU generator, then moved, and every random draw of a run
(minibatch order, Poisson sampling, DP noise) comes from a CPU generator: a run on CUDA draws the numbers of the run
on the CPU, and differs from it only by the floating-point sums of the kernels. What crosses a message boundary
(weights, updates, client state) is kept on the CPU (:func:`privfl.methods.local_training.weights_of`).

One exception: a model with dropout layers (:class:`privfl.models.targets.FeatureMLP`, the head for ``features``
data) draws its masks where it computes, from the device's own seeded generator. Such a run on CUDA reproduces
itself, but not the CPU run's numbers; the synthetic and image targets have no dropout and give the CPU numbers.
"""

from __future__ import annotations

from collections.abc import Collection, Mapping

import torch

from privfl.errors import ConfigError

#: The device names a run accepts.
DEVICES = ("auto", "cpu", "cuda")
#: What a method that runs anywhere registers (:class:`privfl.methods.base.MethodSpec` ``devices``).
ANY_DEVICE = ("cpu", "cuda")


def check_device(name: object) -> str:
    """``name`` if it is one of :data:`DEVICES`, else a ConfigError naming it."""
    if name not in DEVICES:
        raise ConfigError(f"device must be one of {', '.join(DEVICES)}, got {name!r}")
    return str(name)


def resolve_device(name: str, *, runs_on: Collection[str] = ("cpu", "cuda")) -> str:
    """The device a run named ``name`` computes on, ``"cpu"`` or ``"cuda"``.

    ``"auto"`` is CUDA where torch finds it and the work ``runs_on`` it, else the CPU. ``"cuda"`` where torch finds
    no CUDA device is refused in one line naming the alternatives.
    """
    check_device(name)
    if name == "cpu":
        return "cpu"
    available = torch.cuda.is_available()
    if name == "auto":
        return "cuda" if available and "cuda" in runs_on else "cpu"
    if not available:
        raise ConfigError("device 'cuda' is not available here (torch finds no CUDA device): use device 'auto' "
                          "(CUDA where present, else the CPU) or 'cpu'")
    return "cuda"


def device_of(module: torch.nn.Module) -> torch.device:
    """The device of ``module``'s first parameter (or buffer); the CPU for a module with neither."""
    first = next(iter((*module.parameters(), *module.buffers())), None)
    return torch.device("cpu") if first is None else first.device


def on_cpu(tensors: Mapping[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """Detached copies of ``tensors`` on the CPU: what a message, a client's state or a checkpoint holds, wherever
    the tensors were computed."""
    return {k: v.detach().to("cpu", copy=True) for k, v in tensors.items()}


def on_device(tensors: Mapping[str, torch.Tensor], device: torch.device | str) -> dict[str, torch.Tensor]:
    """Copies of ``tensors`` on ``device``: a saved state brought back where its owner computes."""
    return {k: v.to(device, copy=True) for k, v in tensors.items()}
