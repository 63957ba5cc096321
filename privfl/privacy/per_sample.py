"""The clipped sum of per-sample gradients, sum_i clip(g_i, C), that one DP-SGD step adds noise to.

Three ways to compute it, all giving the same numbers (up to float rounding) and all clipping every record's whole
gradient (over every trained parameter jointly) to L2 norm ``C``: ``"fast"`` (book-keeping from per-layer activations
and output gradients, after Bu et al. 2023), ``"vmap"`` (``torch.func``) and ``"loop"`` (one backward pass per record).

Entry points: :class:`ClippedGradientSum`, :func:`cross_entropy_losses`, :func:`trained_parameters`,
:func:`flat_views`; :class:`FastPathUnsupported` says why the fast path does not apply.

How each path works, when the fast path applies, and the privacy assumption all paths share: docs/privacy.md,
"Per-sample clipped gradient sums".
"""

from __future__ import annotations

from collections.abc import Callable, Collection, Iterable, Sequence
from typing import Any

import torch
from torch import nn
from torch.func import functional_call, grad_and_value, vmap
from torch.nn.grad import conv2d_weight
from torch.overrides import TorchFunctionMode

from privfl.errors import ConfigError, InternalError

#: ``(model, x_batch, y_batch) -> losses of shape (B,)``: the loss of each record of the batch.
PerSampleLoss = Callable[[nn.Module, torch.Tensor, torch.Tensor], torch.Tensor]

#: The ways :class:`ClippedGradientSum` computes the clipped sum, fastest first.
PATHS: tuple[str, ...] = ("fast", "vmap", "loop")

#: Memory bound of the ``"vmap"`` path: records per chunk are chosen so that a chunk's per-sample gradients hold at
#: most this many numbers (16M floats, 64 MiB).
VMAP_CHUNK_NUMBERS = 1 << 24


def cross_entropy_losses(model: nn.Module, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    """The default per-sample loss: cross-entropy (nats) of ``model(x)`` against integer labels ``y``, shape (B,)."""
    return nn.functional.cross_entropy(model(x), y, reduction="none")


class FastPathUnsupported(Exception):
    """The ``"fast"`` path cannot compute this model's and loss's per-sample gradients; ``str(exc)`` says why."""


# --- the fast path ----------------------------------------------------------------------------------------------------

# Tensor accessors that read a parameter without differentiating through it: harmless for the fast path.
_SAFE_DESCRIPTORS = frozenset(getattr(torch._C.TensorBase, name) for name in (
    "shape", "dtype", "device", "requires_grad", "is_leaf", "grad_fn", "ndim", "layout", "is_cuda", "data", "grad",
    "_version",
))
_SAFE_METHODS = frozenset(getattr(torch._C.TensorBase, name) for name in (
    "size", "dim", "numel", "detach", "stride", "is_contiguous", "data_ptr", "element_size", "__len__",
))


class _Layer:
    """One recorded ``F.linear`` / ``F.conv2d`` call on a trained weight and/or bias."""

    __slots__ = ("kind", "input", "output", "weight", "bias", "conv", "versions")

    def __init__(self, kind: str, input: torch.Tensor, output: torch.Tensor, weight: torch.Tensor | None,
                 bias: torch.Tensor | None, conv: tuple[Any, Any, Any] | None) -> None:
        self.kind = kind
        self.input = input.detach()
        self.output = output
        self.weight = weight     # the trained weight parameter, or None when it is frozen
        self.bias = bias         # the trained bias parameter, or None
        self.conv = conv         # (stride, padding, dilation) of a convolution
        self.versions = (input._version, output._version)


class _Capture(TorchFunctionMode):
    """Records every linear/conv call on a trained parameter; raises on any other use of one."""

    def __init__(self, trained: dict[int, str], batch: int) -> None:
        super().__init__()
        self.trained = trained
        self.batch = batch
        self.layers: list[_Layer] = []
        self.used: set[int] = set()

    def __torch_function__(self, func: Callable[..., Any], types: Collection[type], args: tuple[Any, ...] = (),
                           kwargs: dict[str, Any] | None = None) -> Any:
        kwargs = kwargs or {}
        if func is nn.functional.batch_norm and (kwargs.get("training") or (len(args) > 5 and args[5])):
            raise ConfigError("the model or loss normalises with batch statistics (batch_norm with training=True), "
                              "so each record's loss depends on the other records of the batch and no per-sample "
                              "sensitivity holds; use GroupNorm or LayerNorm, or batch norm in eval mode")
        if func is nn.functional.linear or func is nn.functional.conv2d:
            output = self._record(func, args, kwargs)
            if output is not None:
                return output
        elif func not in _SAFE_METHODS and getattr(func, "__self__", None) not in _SAFE_DESCRIPTORS:
            self._refuse_trained(func, args, kwargs)
        return func(*args, **kwargs)

    def _name(self, value: object) -> str | None:
        return self.trained.get(id(value)) if isinstance(value, torch.Tensor) else None

    def _refuse_trained(self, func: Callable[..., Any], args: tuple[Any, ...], kwargs: dict[str, Any]) -> None:
        for value in (*args, *kwargs.values()):
            values = value if isinstance(value, (list, tuple)) else (value,)
            for item in values:
                name = self._name(item)
                if name is not None:
                    raise FastPathUnsupported(
                        f"trained parameter {name!r} is used by {getattr(func, '__name__', func)!s}, not only as the "
                        "weight or bias of a linear or conv2d layer")

    def _record(self, func: Callable[..., Any], args: tuple[Any, ...],
                kwargs: dict[str, Any]) -> torch.Tensor | None:
        """Run and record a linear/conv call on a trained weight or bias; None if it uses no trained parameter."""
        names = ("input", "weight", "bias", "stride", "padding", "dilation", "groups")
        call = dict(zip(names, args))
        call.update(kwargs)
        weight, bias = call.get("weight"), call.get("bias")
        weight_name, bias_name = self._name(weight), self._name(bias)
        if weight_name is None and bias_name is None:
            self._refuse_trained(func, args, kwargs)
            return None
        op = "linear" if func is nn.functional.linear else "conv2d"
        x = call["input"]
        if self._name(x) is not None:
            raise FastPathUnsupported(f"trained parameter {self._name(x)!r} is the input of a {op} call")
        for name, param in ((weight_name, weight), (bias_name, bias)):
            if name is not None:
                if id(param) in self.used:
                    raise FastPathUnsupported(f"trained parameter {name!r} is used by more than one {op} call in one "
                                              "forward (weight sharing)")
                self.used.add(id(param))
        min_dim = 2 if op == "linear" else 4
        if x.dim() < min_dim or x.shape[0] != self.batch or (op == "conv2d" and x.dim() != 4):
            raise FastPathUnsupported(
                f"the {op} layer of {weight_name or bias_name!r} gets input of shape {tuple(x.shape)}, not "
                f"batch-first with batch size {self.batch}")
        conv = None
        if op == "conv2d":
            if int(call.get("groups", 1)) != 1:
                raise FastPathUnsupported(f"the conv2d layer of {weight_name or bias_name!r} is grouped "
                                          f"(groups={call.get('groups')})")
            padding = call.get("padding", 0)
            if isinstance(padding, str):
                raise FastPathUnsupported(f"the conv2d layer of {weight_name or bias_name!r} has padding="
                                          f"{padding!r}; give the padding as numbers")
            conv = (call.get("stride", 1), padding, call.get("dilation", 1))
        output: torch.Tensor = func(*args, **kwargs)
        self.layers.append(_Layer(op, x, output, weight if weight_name else None, bias if bias_name else None, conv))
        return output


def _pair(value: Any) -> tuple[int, int]:
    return (int(value), int(value)) if isinstance(value, int) else (int(value[0]), int(value[1]))


class _FastPath:
    """Per-layer norms and clipped sums from recorded activations and output gradients (see the module docstring)."""

    def __init__(self, model: nn.Module, params: dict[str, nn.Parameter], loss: PerSampleLoss) -> None:
        self.model = model
        self.loss = loss
        self.trained = {id(p): name for name, p in params.items()}
        self.probed = False

    def _probe(self, x: torch.Tensor, y: torch.Tensor) -> None:
        """Check once that every recorded layer's first dimension follows the batch size.

        The norms treat row i of a layer's input as record i's. A layout where dimension 0 is something else (time
        first, records folded together) passes the per-step check ``shape[0] == B`` whenever that dimension happens
        to equal B; on a batch one record shorter it cannot equal both B and B - 1. No gradient is formed.
        """
        with torch.no_grad(), _Capture(self.trained, len(x) - 1):
            try:
                _check_losses(self.loss(self.model, x[:-1], y[:-1]), len(x) - 1)
            except (FastPathUnsupported, ConfigError):
                raise
            except Exception as exc:  # noqa: BLE001 - the model does not run on other batch sizes
                raise FastPathUnsupported(f"the model fails on a batch of {len(x) - 1} records "
                                          f"({type(exc).__name__}: {exc})") from exc
        self.probed = True

    def __call__(self, x: torch.Tensor, y: torch.Tensor, max_grad_norm: float,
                 views: dict[int, torch.Tensor]) -> torch.Tensor:
        batch = len(x)
        if not self.probed and batch >= 2:
            self._probe(x, y)
        capture = _Capture(self.trained, batch)
        with capture:
            losses = self.loss(self.model, x, y)
        _check_losses(losses, batch)
        layers = [layer for layer in capture.layers if layer.output.requires_grad]
        for layer in layers:
            if (layer.input._version, layer.output._version) != layer.versions:
                raise FastPathUnsupported(
                    f"the output or input of the {layer.kind} layer of "
                    f"{self.trained[id(layer.weight if layer.weight is not None else layer.bias)]!r} is modified in "
                    "place after the layer (for example ReLU(inplace=True))")
        grads: Sequence[torch.Tensor | None]
        if layers and losses.requires_grad:
            grads = torch.autograd.grad(losses.sum(), [layer.output for layer in layers], allow_unused=True)
        else:
            grads = [None] * len(layers)
        # 1. per-sample squared norms, layer by layer.
        squared = torch.zeros(batch, dtype=losses.dtype, device=losses.device)
        pending: list[_Finish] = []
        for layer, grad_output in zip(layers, grads, strict=True):
            if grad_output is not None:
                pending.append(_layer_norms(layer, grad_output, squared))
        # A record whose gradient is not finite contributes nothing (a clipped contribution of norm 0 <= C): it is
        # left out and the step is taken again on the others; c_i * inf would make the whole sum NaN, an outcome
        # of one record's data that no noise covers.
        bad = ~torch.isfinite(squared)
        if bool(bad.any()):
            if bool(bad.all()):
                return losses.detach()
            self(x[~bad], y[~bad], max_grad_norm, views)
            return losses.detach()
        # 2. clip factors c_i = min(1, C / ||g_i||); a zero gradient gets c_i = 1 (C / 0 = inf).
        factors = (max_grad_norm / squared.sqrt()).clamp(max=1.0)
        # 3. sum_i c_i g_i into the flat gradient's views.
        for finish in pending:
            finish(factors, views)
        return losses.detach()


#: ``(clip factors [B], views) -> None``: adds one layer's clipped sum ``sum_i c_i g_i`` to the flat gradient's views.
_Finish = Callable[[torch.Tensor, dict[int, torch.Tensor]], None]


def _layer_norms(layer: _Layer, grad_output: torch.Tensor, squared: torch.Tensor) -> _Finish:
    """Add this layer's per-sample squared gradient norms to ``squared``; return the function that adds its clipped
    sum, given the clip factors, to the flat gradient's views."""
    if layer.kind == "conv2d":
        return _conv_norms(layer, grad_output, squared)
    if layer.input.dim() == 2:
        return _linear_2d_norms(layer.input, grad_output, layer.weight, layer.bias, squared)
    return _linear_nd_norms(layer.input, grad_output, layer.weight, layer.bias, squared)


def _squared_norms(per_sample: torch.Tensor) -> torch.Tensor:
    """Row-wise squared L2 norms of a (B, ...) tensor."""
    norms: torch.Tensor = torch.linalg.vector_norm(per_sample.reshape(len(per_sample), -1), dim=1)  # untyped in torch
    return norms.square()


def _gram_is_cheaper(positions: int, d_in: int, d_out: int) -> bool:
    """Gram matrices over T positions cost T^2 (d_in + d_out) a record; materialising g_i costs T d_in d_out."""
    return positions * (d_in + d_out) < d_in * d_out


def _linear_2d_norms(a: torch.Tensor, b: torch.Tensor, weight: torch.Tensor | None, bias: torch.Tensor | None,
                     squared: torch.Tensor) -> _Finish:
    """A linear layer on (B, d_in) inputs: g_i = b_i a_i^T, so ||g_i||^2 = ||a_i||^2 ||b_i||^2."""
    b_squared = _squared_norms(b)
    if weight is not None:
        squared.addcmul_(_squared_norms(a), b_squared)
    if bias is not None:
        squared.add_(b_squared)

    def finish(factors: torch.Tensor, views: dict[int, torch.Tensor]) -> None:
        if weight is not None:
            views[id(weight)].addmm_((b * factors.unsqueeze(1)).t(), a)
        if bias is not None:
            views[id(bias)].addmv_(b.t(), factors)

    return finish


def _linear_nd_norms(x: torch.Tensor, grad_output: torch.Tensor, weight: torch.Tensor | None,
                     bias: torch.Tensor | None, squared: torch.Tensor) -> _Finish:
    """A linear layer on (B, T..., d_in) inputs: g_i = sum_t b_it a_it^T."""
    batch, d_in, d_out = len(x), x.shape[-1], grad_output.shape[-1]
    a = x.reshape(batch, -1, d_in)                  # (B, T, d_in)
    b = grad_output.reshape(batch, -1, d_out)       # (B, T, d_out)
    bias_sum = b.sum(1) if bias is not None else None
    if bias_sum is not None:
        squared.add_(_squared_norms(bias_sum))
    per_sample = None
    if weight is not None:
        if _gram_is_cheaper(a.shape[1], d_in, d_out):
            squared.add_((torch.bmm(a, a.transpose(1, 2)) * torch.bmm(b, b.transpose(1, 2))).sum((1, 2)))
        else:
            per_sample = torch.bmm(b.transpose(1, 2), a).reshape(batch, -1)                # (B, d_out d_in)
            squared.add_(_squared_norms(per_sample))

    def add_weight(view: torch.Tensor, factors: torch.Tensor) -> None:
        scaled = (b * factors.view(-1, 1, 1)).reshape(-1, d_out)
        view.addmm_(scaled.t(), a.reshape(-1, d_in))

    return _summed_finish(weight, bias, bias_sum, per_sample, add_weight)


def _conv_norms(layer: _Layer, grad_output: torch.Tensor, squared: torch.Tensor) -> _Finish:
    """A conv2d layer: g_i = B_i U_i^T over the unfolded patches U_i of record i."""
    weight, bias, x = layer.weight, layer.bias, layer.input
    if layer.conv is None:
        raise InternalError("a conv2d layer was recorded without its (stride, padding, dilation): conv=None")
    stride, padding, dilation = (_pair(v) for v in layer.conv)
    batch, d_out = grad_output.shape[:2]
    bias_sum = grad_output.sum((2, 3)) if bias is not None else None                        # (B, d_out)
    if bias_sum is not None:
        squared.add_(_squared_norms(bias_sum))
    per_sample = None
    if weight is not None:
        positions, d_in = grad_output.shape[2] * grad_output.shape[3], weight[0].numel()
        if _gram_is_cheaper(positions, d_in, d_out):
            u = nn.functional.unfold(x, weight.shape[2:], dilation=dilation, padding=padding, stride=stride)
            b = grad_output.reshape(batch, d_out, -1)
            squared.add_((torch.bmm(u.transpose(1, 2), u) * torch.bmm(b.transpose(1, 2), b)).sum((1, 2)))
        else:
            per_sample = _conv_per_sample(x, grad_output, tuple(weight.shape), stride, padding, dilation)
            squared.add_(_squared_norms(per_sample))

    def add_weight(view: torch.Tensor, factors: torch.Tensor) -> None:
        assert weight is not None   # called only for a layer with a weight
        scaled = grad_output * factors.view(-1, 1, 1, 1)
        view.add_(conv2d_weight(  # type: ignore[no-untyped-call]  # torch.nn.grad is not annotated
            x, weight.shape, scaled, stride=stride, padding=padding, dilation=dilation))

    return _summed_finish(weight, bias, bias_sum, per_sample, add_weight)


def _summed_finish(weight: torch.Tensor | None, bias: torch.Tensor | None, bias_sum: torch.Tensor | None,
                   per_sample: torch.Tensor | None,
                   add_weight: Callable[[torch.Tensor, torch.Tensor], None]) -> _Finish:
    """The second pass of a layer whose records sum over positions: the bias from its per-record sums, the weight
    from its per-record gradients where they were formed, else by ``add_weight(view, factors)`` from the layer's
    inputs and output gradients."""

    def finish(factors: torch.Tensor, views: dict[int, torch.Tensor]) -> None:
        if bias_sum is not None:
            views[id(bias)].addmv_(bias_sum.t(), factors)
        if weight is None:
            return
        if per_sample is not None:
            views[id(weight)].view(-1).addmv_(per_sample.t(), factors)
        else:
            add_weight(views[id(weight)], factors)

    return finish


def _conv_per_sample(x: torch.Tensor, grad_output: torch.Tensor, weight_shape: tuple[int, ...],
                     stride: tuple[int, int], padding: tuple[int, int], dilation: tuple[int, int]) -> torch.Tensor:
    """Per-sample weight gradients of a conv2d layer, shape (B, d_out * d_in * kh * kw), by one grouped convolution.

    With few input channels the records become the groups of a convolution of the inputs (channels as the batch)
    with the output gradients as kernels (stride and dilation swap roles); otherwise the records become the groups
    of one grouped weight-gradient computation (Rochette et al. 2019, "Efficient per-example gradient computations
    in convolutional neural networks"). Both are exact; which is faster depends on the input channels.
    """
    batch, c_in = x.shape[:2]
    c_out, _, kh, kw = weight_shape
    if c_in < 8:
        kernels = grad_output.reshape(batch * c_out, 1, *grad_output.shape[2:])
        out = nn.functional.conv2d(x.transpose(0, 1), kernels, padding=padding, stride=dilation, dilation=stride,
                                   groups=batch)[:, :, :kh, :kw]                          # (c_in, B c_out, kh, kw)
        return out.reshape(c_in, batch, c_out, kh * kw).permute(1, 2, 0, 3).reshape(batch, -1)
    grouped = x.reshape(1, batch * c_in, *x.shape[2:])
    shape_only = x.new_empty((batch * c_out, c_in, kh, kw))
    weight_grad: torch.Tensor   # torch.ops is untyped
    _, weight_grad, _ = torch.ops.aten.convolution_backward(
        grad_output.reshape(1, batch * c_out, *grad_output.shape[2:]), grouped, shape_only, None, list(stride),
        list(padding), list(dilation), False, [0, 0], batch, [False, True, False])
    return weight_grad.reshape(batch, -1)


def _check_losses(losses: object, batch: int) -> None:
    if not isinstance(losses, torch.Tensor) or losses.shape != (batch,):
        shape = tuple(losses.shape) if isinstance(losses, torch.Tensor) else type(losses).__name__
        raise ConfigError(
            f"per_sample_loss must return one loss per record, a tensor of shape ({batch},) for a batch of {batch} "
            f"record(s), got {shape}; use reduction='none' (a mean over the batch would mix records)")


# --- the generic paths ------------------------------------------------------------------------------------------------

class _LossModule(nn.Module):
    """``forward(x, y) = loss(model, x, y)``, so :func:`torch.func.functional_call` can swap the model's parameters
    for the whole loss (which may call any method of the model, not only ``forward``)."""

    def __init__(self, model: nn.Module, loss: PerSampleLoss) -> None:
        super().__init__()
        self.model = model
        self.loss = loss

    def forward(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        return self.loss(self.model, x, y)


class _VmapPath:
    """Per-sample gradients by ``vmap(grad_and_value(loss of one record))``, clipped and summed chunk by chunk."""

    def __init__(self, model: nn.Module, params: dict[str, nn.Parameter], loss: PerSampleLoss) -> None:
        self.module = _LossModule(model, loss)
        self.params = params
        numbers = sum(p.numel() for p in params.values())
        self.chunk = max(1, VMAP_CHUNK_NUMBERS // max(1, numbers))

        def one_record(weights: dict[str, torch.Tensor], xi: torch.Tensor, yi: torch.Tensor) -> torch.Tensor:
            named = {f"model.{k}": v for k, v in weights.items()}
            losses: torch.Tensor = functional_call(self.module, named, (xi.unsqueeze(0), yi.unsqueeze(0)))
            _check_losses(losses, 1)
            return losses[0]

        self.per_sample = vmap(grad_and_value(one_record), in_dims=(None, 0, 0), randomness="different")

    def __call__(self, x: torch.Tensor, y: torch.Tensor, max_grad_norm: float,
                 views: dict[int, torch.Tensor]) -> torch.Tensor:
        weights = {k: p.detach() for k, p in self.params.items()}
        # Chunks are summed apart and added to the views only once all succeeded: a chunk that fails after others
        # were added must leave the views untouched, or the "loop" path taking over would count records twice.
        sums = {id(p): torch.zeros_like(p) for p in self.params.values()}
        losses = []
        for start in range(0, len(x), self.chunk):
            grads, values = self.per_sample(weights, x[start:start + self.chunk], y[start:start + self.chunk])
            _add_clipped(grads, self.params, max_grad_norm, sums)
            losses.append(values.detach())
        for key, total in sums.items():
            views[key].add_(total)
        return torch.cat(losses)


class _LoopPath:
    """Per-sample gradients one record at a time: the definition, for losses no transform handles."""

    def __init__(self, model: nn.Module, params: dict[str, nn.Parameter], loss: PerSampleLoss) -> None:
        self.model = model
        self.params = params
        self.loss = loss

    def __call__(self, x: torch.Tensor, y: torch.Tensor, max_grad_norm: float,
                 views: dict[int, torch.Tensor]) -> torch.Tensor:
        names, tensors = list(self.params), list(self.params.values())
        losses = []
        for i in range(len(x)):
            loss = self.loss(self.model, x[i:i + 1], y[i:i + 1])
            _check_losses(loss, 1)
            grads: Sequence[torch.Tensor | None]
            if loss.requires_grad:
                grads = torch.autograd.grad(loss[0], tensors, allow_unused=True)
            else:
                grads = [None] * len(tensors)
            per_sample = {name: (torch.zeros_like(p) if g is None else g).unsqueeze(0)
                          for name, p, g in zip(names, tensors, grads, strict=True)}
            _add_clipped(per_sample, self.params, max_grad_norm, views)
            losses.append(loss.detach())
        return torch.cat(losses)


def _add_clipped(per_sample: dict[str, torch.Tensor], params: dict[str, nn.Parameter], max_grad_norm: float,
                 views: dict[int, torch.Tensor]) -> None:
    """Clip each record's gradient (all parameters jointly) to ``max_grad_norm`` and add the sum to the views."""
    flat = {name: g.reshape(len(g), -1) for name, g in per_sample.items()}
    squared = sum(g.pow(2).sum(1) for g in flat.values())
    if not isinstance(squared, torch.Tensor):   # sum() of no gradients at all is the int 0
        raise ConfigError("the per-sample gradients to clip must cover at least one trained parameter, got none "
                          "(params is empty)")
    # a record whose gradient is not finite contributes nothing (norm 0 <= C), rather than NaN to everyone's sum
    bad = ~torch.isfinite(squared)
    factors = torch.where(bad, 0.0, (max_grad_norm / squared.sqrt()).clamp(max=1.0))
    for name, g in flat.items():
        g = torch.where(bad.unsqueeze(1), 0.0, g) if bool(bad.any()) else g
        views[id(params[name])].view(-1).addmv_(g.t(), factors)


# --- the public object ------------------------------------------------------------------------------------------------

#: ``(x_batch, y_batch, max_grad_norm, views) -> per-sample losses``: one path's way to add sum_i clip(g_i, C).
_Path = Callable[[torch.Tensor, torch.Tensor, float, dict[int, torch.Tensor]], torch.Tensor]

_PATH_CLASSES: dict[str, Callable[[nn.Module, dict[str, nn.Parameter], PerSampleLoss], _Path]] = {
    "fast": _FastPath, "vmap": _VmapPath, "loop": _LoopPath}


class ClippedGradientSum:
    """Adds ``sum_i clip(g_i, C)`` over a batch to a flat gradient, by the fastest path that handles the model.

    Args:
        model: the network; its ``params`` are the ones whose gradients are clipped and summed.
        params: the trained parameters by name (every other parameter is treated as a constant).
        per_sample_loss: ``(model, x_batch, y_batch) -> (B,)`` losses; the loss of record i must depend only on
            record i (the privacy assumption of the module docstring).
        path: "auto" (try "fast", then "vmap", then "loop", keeping the first that works), or one of
            :data:`PATHS` (a path that cannot handle the model raises :class:`ConfigError` naming why).

    After a call, :attr:`path` is the path used and :attr:`reason` says why a faster one was not (None when "fast"
    ran or a path was asked for).

    >>> model = nn.Linear(3, 2)
    >>> params = dict(model.named_parameters())
    >>> engine = ClippedGradientSum(model, params, cross_entropy_losses)
    >>> flat = torch.zeros(8)
    >>> _ = engine(torch.randn(4, 3), torch.tensor([0, 1, 0, 1]), 1.0, flat_views(params, flat))
    >>> engine.path, bool(flat.norm() <= 4.0)
    ('fast', True)
    """

    def __init__(self, model: nn.Module, params: dict[str, nn.Parameter], per_sample_loss: PerSampleLoss, *,
                 path: str = "auto") -> None:
        if path != "auto" and path not in PATHS:
            raise ConfigError(f"path must be 'auto' or one of {', '.join(PATHS)}, got {path!r}")
        self.model = model
        self.params = params
        self.per_sample_loss = per_sample_loss
        self.requested = path
        self.path = PATHS[0] if path == "auto" else path
        self.reason: str | None = None
        self._impl: _Path = _PATH_CLASSES[self.path](model, params, per_sample_loss)

    def __call__(self, x: torch.Tensor, y: torch.Tensor, max_grad_norm: float,
                 views: dict[int, torch.Tensor]) -> torch.Tensor:
        """Add the clipped sum of ``(x, y)``'s per-sample gradients to ``views`` (by ``id`` of each parameter, from
        :func:`flat_views`); return the per-sample losses (detached, shape (B,))."""
        while True:
            try:
                return self._impl(x, y, max_grad_norm, views)
            except FastPathUnsupported as exc:
                if self.requested != "auto":
                    raise ConfigError(f"DP-SGD path 'fast' cannot handle {type(self.model).__name__}: {exc}; "
                                      "use 'auto' to fall back to the generic per-sample paths") from exc
                self._downgrade("vmap", f"fast path: {exc}")
            except ConfigError:
                raise   # a loss or model the paths refuse alike (wrong loss shape, batch statistics)
            except Exception as exc:  # noqa: BLE001 - vmap cannot transform this loss: the loop can
                if self.path != "vmap" or self.requested != "auto":
                    raise
                self._downgrade("loop", f"{self.reason}; vmap: {type(exc).__name__}: {exc}")

    def _downgrade(self, path: str, reason: str) -> None:
        self.path, self.reason = path, reason
        self._impl = _PATH_CLASSES[path](self.model, self.params, self.per_sample_loss)


def flat_views(params: dict[str, nn.Parameter], flat: torch.Tensor) -> dict[int, torch.Tensor]:
    """Views of ``flat`` (length = total numel) shaped like each parameter, keyed by ``id(parameter)``, in order."""
    views, offset = {}, 0
    for p in params.values():
        views[id(p)] = flat[offset:offset + p.numel()].view_as(p)
        offset += p.numel()
    if offset != flat.numel():
        raise ValueError(f"flat gradient has {flat.numel()} numbers, the parameters {offset}")
    return views


def trained_parameters(model: nn.Module, params: Iterable[str | nn.Parameter] | None) -> dict[str, nn.Parameter]:
    """The parameters DP-SGD trains, by name: ``params`` (names or the model's own parameters), or every parameter
    with ``requires_grad`` when None. Raises :class:`ConfigError` naming anything that is not the model's."""
    named = dict(model.named_parameters())
    if params is None:
        chosen = {name: p for name, p in named.items() if p.requires_grad}
    else:
        by_id = {id(p): name for name, p in named.items()}
        chosen = {}
        for item in params:
            if isinstance(item, str):
                if item not in named:
                    raise ConfigError(f"params names {item!r}, which is not a parameter of {type(model).__name__}; "
                                      f"valid names: {', '.join(named)}")
                chosen[item] = named[item]
            elif isinstance(item, torch.Tensor) and id(item) in by_id:
                chosen[by_id[id(item)]] = item
            else:
                raise ConfigError(f"params must hold parameter names or parameters of {type(model).__name__}, "
                                  f"got {item!r:.80}")
    if not chosen:
        raise ConfigError(f"DP-SGD has no parameter to train in {type(model).__name__} (params={params!r:.80})")
    dtypes = {p.dtype for p in chosen.values()}
    if len(dtypes) != 1:
        raise ConfigError(f"DP-SGD trains parameters of one dtype (its noise is one flat draw), got "
                          f"{sorted(str(d) for d in dtypes)}")
    return chosen
