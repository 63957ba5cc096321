"""Sensitivity certificates: an L2 sensitivity derived from the structure being released, with its written argument.

A certificate is never a constant typed in (invariant 3 of ``docs/invariants.md``): it is computed from the per-sample
clipping bound ``B``, the pooling (a mean), the number of samples, the neighbouring relation and whether the number of
samples is public, and it carries the proof sketch that justifies the value, so a reader of a ledger or a report can
check it.

Notation: ``v_i = clip_B(phi(x_i))`` with ``||v_i|| <= B`` (L2), and the released value is a mean of the ``v_i``.
"""

from __future__ import annotations

import math
import numbers
import secrets
import warnings
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import cast

import torch
from torch import nn

from accounting import NeighboringRelation
from privfl.devices import device_of
from privfl.errors import ConfigError


@dataclass(frozen=True)
class SensitivityCertificate:
    """An L2 sensitivity ``value`` of a released quantity, and why it holds.

    Attributes:
        value: the L2 sensitivity, in the units of the released value.
        relation: the neighbouring relation under which ``value`` bounds the change.
        n: the number of samples the value was derived for (for add/remove-one: a public lower bound on the size).
        n_public: whether ``n`` is treated as public (it may then enter the noise scale).
        bound: the per-sample L2 clipping bound ``B``.
        argument: the written proof sketch.
    """

    value: float
    relation: NeighboringRelation
    n: int
    n_public: bool
    bound: float
    argument: str


def check_bound(bound: object) -> float:
    """``bound`` (the per-sample L2 clipping radius) as a float; ConfigError unless finite and > 0."""
    if isinstance(bound, bool) or not isinstance(bound, numbers.Real) or not math.isfinite(bound) or bound <= 0:
        raise ConfigError(f"bound (per-sample L2 clipping radius) must be a finite number > 0, got {bound!r}")
    return float(bound)


def _check_count(name: str, n: object) -> int:
    if isinstance(n, bool) or not isinstance(n, numbers.Integral) or n < 1:
        raise ConfigError(f"{name} must be an int >= 1 (a mean of no samples is undefined), got {n!r}")
    return int(n)


def check_relation(relation: object) -> NeighboringRelation:
    """``relation`` as a :class:`NeighboringRelation`; :class:`ConfigError` listing the choices otherwise."""
    try:
        return NeighboringRelation(relation)
    except ValueError:
        valid = ", ".join(repr(r.value) for r in NeighboringRelation)
        raise ConfigError(f"relation must be one of {valid}, got {relation!r}") from None


def warn_if_delta_too_large(delta: float | None, n: int) -> None:
    """Warn when ``delta >= 1/n``: such a delta permits a mechanism that publishes one of the n records in the clear."""
    if delta is not None and delta >= 1.0 / n:
        warnings.warn(
            f"delta={delta!r} >= 1/n = 1/{n}: an (epsilon, delta)-DP mechanism with this delta may publish a whole "
            f"record in the clear; use delta << 1/n, e.g. delta <= min(1e-5, 1/(10 n)) = {min(1e-5, 0.1 / n):.3g}",
            UserWarning, stacklevel=3)


def certify_mean_of_clipped(bound: float, n: int, relation: NeighboringRelation | str = NeighboringRelation.REPLACE_ONE,
                            n_public: bool = True, *, delta: float | None = None) -> SensitivityCertificate:
    """The L2 sensitivity of ``mean(v_1, ..., v_n)`` where every ``v_i`` is clipped to the L2 ball of radius ``bound``.

    **Replace-one, n public** (Lemma 2 of Amosy et al., the ODPFL-HN paper, proved in its App. D): neighbours ``D``,
    ``D'`` have the same size n and differ in one record, ``v_j`` against ``v_j'``. All other terms cancel, so
    ``mean(D) - mean(D') = (v_j - v_j') / n`` and ``||.|| <= (||v_j|| + ||v_j'||) / n <= 2B/n``. The bound is attained
    by ``v_j' = -v_j`` with ``||v_j|| = B``. Because ``n`` enters the noise scale, ``n`` must be public: the guarantee
    protects the records, not how many there are.

    **Add/remove-one, n public**: refused. Add/remove neighbours have sizes n and n-1, so "n is public" contradicts
    the relation; use replace-one (and document that n is public) or treat n as private.

    **Add/remove-one, n private** (``n_public=False``): let ``D`` have m records and ``D' = D`` minus ``v_x``, with
    ``S`` the sum of the m-1 shared records and ``mu = S/(m-1)`` their mean (m >= 2). Then
    ``mean(D) - mean(D') = (S + v_x)/m - S/(m-1) = (v_x - mu)/m``, and ``||mu|| <= B`` (a mean of vectors in the
    ball stays in it), so ``||mean(D) - mean(D')|| <= 2B/m``, attained by ``v_x = B e``, every other ``v_i = -B e``.
    This checks the standard bound ``||mean_m - mean_{m-1}|| <= 2B/m`` (m the size of the **larger** neighbour).
    The catch is that m is private: calibrating the noise to the actual m would make the noise scale itself differ
    between neighbours and leak m (docs/papers.md, ODPFL-HN, E5), and the bound over *all* sizes is ``2B/2 = B``.
    So here ``n`` must be a **public lower bound** on the dataset size: over every neighbouring pair whose larger
    dataset has m >= n records, ``2B/m <= 2B/n``, and ``2B/n`` is the certified value. The guarantee covers only
    datasets of at least n records; a client with fewer must not release (and not releasing is itself observable).

    Args:
        bound: the per-sample L2 clipping radius ``B`` (> 0).
        n: the number of samples (replace-one), or a public lower bound on it (add/remove-one); n >= 1, and n >= 2
            under add/remove-one (the smaller neighbour must be non-empty for its mean to exist).
        relation: ``"replace_one"`` or ``"add_or_remove_one"``.
        n_public: whether n is public; must be ``True`` for replace-one and ``False`` for add/remove-one.
        delta: if given, warn when ``delta >= 1/n``.

    >>> certify_mean_of_clipped(1.0, 100).value
    0.02
    """
    bound = check_bound(bound)
    n = _check_count("n", n)
    relation = check_relation(relation)
    warn_if_delta_too_large(delta, n)
    if relation is NeighboringRelation.REPLACE_ONE:
        if not n_public:
            raise ConfigError(
                "n_public=False with relation='replace_one': the noise scale 2*bound/n uses n, so n must be public "
                "under replace-one; pass n_public=True (and document it) or use relation='add_or_remove_one' with a "
                "public lower bound on n")
        argument = (f"replace-one, n={n} public: neighbours differ in one clipped vector, so the means differ by "
                    f"(v - v')/n with ||v||, ||v'|| <= B={bound}; hence ||diff|| <= 2B/n = {2 * bound / n:.6g} "
                    "(attained by v' = -v on the sphere)")
        return SensitivityCertificate(2 * bound / n, relation, n, True, bound, argument)
    if n_public:
        raise ConfigError(
            "relation='add_or_remove_one' with n_public=True: add/remove neighbours have n and n-1 samples, so n "
            "cannot be public under it; use relation='replace_one' (n public), or n_public=False with n a public "
            "lower bound on the dataset size")
    if n < 2:
        raise ConfigError(f"under add_or_remove_one the lower bound n must be >= 2 (the smaller neighbour must be "
                          f"non-empty), got n={n!r}")
    argument = (f"add/remove-one, n private with public lower bound {n}: for neighbours of sizes m and m-1 the means "
                f"differ by (v_x - mu_rest)/m with ||v_x||, ||mu_rest|| <= B={bound}, so ||diff|| <= 2B/m <= 2B/{n} "
                f"= {2 * bound / n:.6g} for every m >= {n}; the noise uses the public bound, never the private m")
    return SensitivityCertificate(2 * bound / n, relation, n, False, bound, argument)


def certify_mean_of_batch_means(bound: float, batch_sizes: Sequence[int],
                                relation: NeighboringRelation | str = NeighboringRelation.REPLACE_ONE, *,
                                delta: float | None = None) -> SensitivityCertificate:
    """The L2 sensitivity of ``(1/k) * sum_j mean(batch_j)`` for k batches of public sizes ``n_1 .. n_k``.

    Replace-one with the partition into batches independent of the data values (docs/papers.md, ODPFL-HN, E7): the
    replaced record lives in exactly one batch j, whose mean moves by at most ``2B/n_j``; the other batch means are
    unchanged, so the descriptor moves by at most ``2B/(k n_j)``, and the worst case over j is
    ``2B/(k * min_j n_j)``. This is attained (a record in the smallest batch, replaced by its antipode) and exceeds
    ``2B/n`` (n = sum n_j) whenever the sizes are unequal: a short last batch costs noise. Prefer one global mean.

    Add/remove-one is refused: adding a record changes the partition (sizes and membership), so no per-batch argument
    applies.
    """
    bound = check_bound(bound)
    relation = check_relation(relation)
    if isinstance(batch_sizes, (str, bytes)) or not isinstance(batch_sizes, Sequence) or not batch_sizes:
        raise ConfigError(f"batch_sizes must be a non-empty sequence of ints >= 1, got {batch_sizes!r}")
    sizes = [_check_count("every batch size", s) for s in batch_sizes]
    if relation is not NeighboringRelation.REPLACE_ONE:
        raise ConfigError("batch-averaged descriptors are certified only under relation='replace_one': under "
                          f"add/remove-one the batch partition itself changes, got relation={relation.value!r}")
    k, smallest, n = len(sizes), min(sizes), sum(sizes)
    warn_if_delta_too_large(delta, n)
    value = 2 * bound / (k * smallest)
    argument = (f"replace-one, batch sizes {sizes} public: one record lives in one batch j and moves its mean by at "
                f"most 2B/n_j, hence the mean of the {k} batch means by 2B/(k n_j) <= 2B/(k min n_j) = {value:.6g} "
                f"(B={bound})")
    return SensitivityCertificate(value, relation, n, True, bound, argument)


def _tensor_state(module: nn.Module) -> dict[str, tuple[str, torch.Tensor]]:
    """Every parameter and every buffer of ``module`` by qualified name, persistent or not, shared ones under each
    of their names: ``{name: ("parameter" | "buffer", tensor)}``. ``state_dict()`` would miss non-persistent
    buffers, where a layer can keep a running statistic just as well."""
    state: dict[str, tuple[str, torch.Tensor]] = {name: ("parameter", t)
                                                  for name, t in module.named_parameters(remove_duplicate=False)}
    state.update((name, ("buffer", t)) for name, t in module.named_buffers(remove_duplicate=False))
    return state


def _restore(module: nn.Module, kinds: dict[str, tuple[str, torch.Tensor]], values: dict[str, torch.Tensor]) -> None:
    """Put every original tensor back under its name, with its values from before, and drop names added since."""
    for name in set(_tensor_state(module)) - set(kinds):
        owner, _, leaf = name.rpartition(".")
        holder = module.get_submodule(owner)
        holder._parameters.pop(leaf, None)
        holder._buffers.pop(leaf, None)
    for name, (kind, tensor) in kinds.items():
        owner, _, leaf = name.rpartition(".")
        try:
            holder = module.get_submodule(owner)
        except AttributeError:   # the submodule itself is gone: nothing to put back into
            continue
        if kind == "parameter":   # recorded from named_parameters(): an nn.Parameter
            holder._parameters[leaf] = cast(nn.Parameter, tensor)
        else:
            holder._buffers[leaf] = tensor
        if tensor.shape == values[name].shape:
            tensor.copy_(values[name])


#: Records whose rows :func:`clipped_rows` computes again with every other record set to zero: the first and one drawn
#: by the OS CSPRNG.
CHECKED_RECORDS = 2


def _rows_read_others(one: Callable[..., torch.Tensor], inputs: tuple[torch.Tensor, ...], v: torch.Tensor
                      ) -> int | None:
    """The first of a few records (the first, and one drawn by the OS CSPRNG, which the code cannot predict) whose
    row changes when every *other* record of the batch is set to zero, same batch size, same positions, same path
    (vmap, or the per-record loop where vmap cannot batch); ``None`` when the rows agree. A computation that reads
    record i alone gives the same numbers either way (the kernels see the same shapes; equal to the bit in practice,
    compared to float rounding here); code that reaches around vmap to the whole batch, or keeps state from record to
    record, does not. One more pass of ``one`` over the batch."""
    n = len(v)
    if n < 2 or type(v) is not torch.Tensor:
        return None
    checked = sorted({0, 1 + secrets.randbelow(n - 1)})[:CHECKED_RECORDS]
    index = torch.tensor(checked, device=inputs[0].device)
    masked = []
    for t in inputs:
        kept = torch.zeros_like(t)
        kept[index] = t[index]
        masked.append(kept)
    try:
        w = torch.func.vmap(one)(*masked)
    except (RuntimeError, NotImplementedError):
        w = torch.stack([one(*record) for record in zip(*masked, strict=True)])
    if type(w) is not torch.Tensor or w.shape != v.shape:
        return checked[0]
    for i in checked:
        row, again = v[i].detach().reshape(-1).double(), w[i].detach().reshape(-1).double()
        finite = torch.isfinite(row)
        scale = float(row[finite].abs().max()) if bool(finite.any()) else 0.0
        if not torch.allclose(again, row, rtol=1e-6, atol=1e-7 * max(1.0, scale), equal_nan=True):
            return i
    return None


@torch.no_grad()
def clipped_rows(module: nn.Module, one: Callable[..., torch.Tensor], inputs: tuple[torch.Tensor, ...], bound: float,
                 *, name: str) -> torch.Tensor:
    """``[n, d]`` in float64: row i is ``one(inputs[0][i], inputs[1][i], ...)`` (a flat vector) computed on record i
    alone, set to 0 if not finite, then projected onto the L2 ball of radius ``bound`` (``v * min(1, bound/||v||)``):
    the ``v_i`` every certificate here bounds.

    Record i alone: ``torch.func.vmap`` (an op vmap cannot batch: one record after another), with ``module`` in
    eval mode for the call (train-mode BatchNorm would couple the records; its mode is restored). That v_i depends on
    x_i only also needs ``module`` (the code ``one`` runs, called ``name`` in errors) to keep no state from record to
    record, and the clipping to see real tensors. Checked, and refused with :class:`ConfigError` before anything is
    released:

    - before the call, a parameter or buffer of ``module`` holding NaN or inf (named as such: weights that are not
      finite, a diverged or damaged model from the server, make every row 0 and the release meaningless);
    - after the call, a parameter or buffer that changed: every one of ``named_parameters()`` and
      ``named_buffers()``, **persistent or not** (``state_dict()`` omits non-persistent buffers, and a running maximum
      kept in one would go unseen), compared by identity (the same tensor object under the same name, none added or
      removed) and by value. The state is restored before the error;
    - an output that is not a plain ``torch.Tensor`` (a subclass can change what the norm computes);
    - a row that changes when every other record is set to zero (checked for the first record and one drawn by the
      OS CSPRNG): code that reads the whole batch through vmap's wrapper, or keeps state in a plain attribute from
      record to record.

    The code is trusted, its weights need not be: what arbitrary code can hide from these checks (state kept for a
    later call: :class:`~privfl.privacy.privatize.PrivateEncoder` runs a fresh copy of phi and psi per release)
    is not seen.
    """
    device = device_of(module)
    inputs = tuple(t.to(device) for t in inputs)     # the records go where the module computes
    kinds = _tensor_state(module)
    for key, (kind, tensor) in kinds.items():
        if tensor.is_floating_point() and not bool(torch.isfinite(tensor).all()):
            raise ConfigError(f"{name} has a {kind} with NaN or inf values before it ran ({key}): its weights are not "
                              "finite (a diverged or damaged model), so its outputs say nothing; nothing was released "
                              "or recorded")
    values = {key: tensor.clone() for key, (_, tensor) in kinds.items()}
    was_training = module.training
    module.eval()
    try:
        try:
            v = torch.func.vmap(one)(*inputs)
        except (RuntimeError, NotImplementedError):
            v = torch.stack([one(*record) for record in zip(*inputs, strict=True)])
        alone = _rows_read_others(one, inputs, v)
    finally:
        module.train(was_training)
    after = _tensor_state(module)
    changed = sorted(set(kinds) ^ set(after)) + [
        key for key, (kind, tensor) in kinds.items() if key in after and (
            after[key][1] is not tensor or after[key][0] != kind or tensor.shape != values[key].shape
            or not torch.equal(tensor, values[key]))]
    if changed:
        _restore(module, kinds, values)
        raise ConfigError(f"{name} changed its state while it ran ({changed[0]}): state kept across records couples "
                          "them, so their mean has no 2*bound/n sensitivity; nothing was released or recorded")
    if type(v) is not torch.Tensor:
        raise ConfigError(f"{name} returned a {type(v).__name__}, not a plain torch.Tensor: a tensor subclass can "
                          "change what clipping computes; nothing was released or recorded")
    if alone is not None:
        _restore(module, kinds, values)
        raise ConfigError(f"{name} gave record {alone} a different output when the other records were set to zero: its "
                          "output reads other records (code that reaches around vmap, or state kept from record to "
                          "record), so their mean has no 2*bound/n sensitivity; nothing was released or recorded")
    v = v.to(torch.float64)
    v = torch.where(torch.isfinite(v).all(dim=1, keepdim=True), v, torch.zeros_like(v))
    return v * torch.clamp(bound / v.norm(dim=1, keepdim=True), max=1.0)  # norm 0 -> inf -> 1


__all__ = ["SensitivityCertificate", "certify_mean_of_batch_means", "certify_mean_of_clipped", "check_relation",
           "clipped_rows"]
