"""One run of ``privfl attack reconstruct``, stage by stage: :func:`run_reconstruction_attack`.

The stages, in the order they run: the data (:func:`attacks.reconstruct_data.load_attack_data`); the guide decoder
(:func:`_fit_guide_decoder`) and the reconstructor (:func:`_train_reconstructor`); the decoder baselines
(:func:`_fit_baselines`); the sampling settings, chosen on the attacker's held-out pairs (:func:`_choose_sampling`);
per evaluation seed, every release attacked and scored (:func:`_attack_seed`, :func:`_attack_release`); then the rows
with their bootstrap intervals, the summary (:func:`_results_summary`) and the outputs
(:mod:`attacks.reconstruct_outputs`). The protocol step by step: docs/attacks.md, "privfl attack reconstruct".
"""

from __future__ import annotations

import math
import sys
import time
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path
from typing import Any

import numpy as np
import torch

from attacks.reconstruct_data import AttackData, load_attack_data
from attacks.reconstruct_outputs import ATTACK_NAMES, format_markdown, write_results, write_summary
from attacks.reconstruct_settings import AttackSettings, reconstructor_config

__all__ = ["run_reconstruction_attack"]


@dataclass
class _Attacker:
    """What the attacker brings to every release: its models, the sampling settings chosen for the reconstructor
    (``None`` without one), the metric and the prior of its post-processing."""

    reconstructor: Any
    decoders: dict[str, Any]
    guide_decoder: Any
    init_decoder: Any
    sampling: Any
    one_step_w: float
    lpips: Any
    prior: Any
    train_features: torch.Tensor


@dataclass
class _Evaluation:
    """What the evaluation seeds add up: per-image scores, one record per release, the protocol of each seed, the
    positions of its evaluated defender images, and the panels of the image grid (the first seed's)."""

    scored: list[Any] = field(default_factory=list)
    releases: list[dict[str, Any]] = field(default_factory=list)
    seeds: list[dict[str, Any]] = field(default_factory=list)
    kept: dict[int, np.ndarray] = field(default_factory=dict)
    panels: list[tuple[str, torch.Tensor]] = field(default_factory=list)


def _releases(settings: AttackSettings, features_d: torch.Tensor, yd: np.ndarray, num_classes: int, prior: Any,
              seed: int) -> list[Any]:
    """Every release the run attacks, in table order: raw; FedPFT; DP-FedPFT per epsilon (largest first), each
    mixture release read as ``settings.readings`` says; then the prior-only reading of DP-FedPFT."""
    from attacks.schemes import make_release, postprocess_release, prior_only_release

    releases, prior_only = [], None
    for scheme in settings.schemes:
        if scheme == "raw":
            releases.append(make_release("raw", features_d, yd, num_classes=num_classes, delta=settings.delta))
            continue
        for eps in (sorted(settings.eps, reverse=True) if scheme == "dp-fedpft" else (None,)):
            release = make_release(scheme, features_d, yd, num_classes=num_classes, epsilon=eps,
                                   delta=settings.delta, components=settings.components,
                                   covariance=settings.covariance, seed=seed, dp_noise=settings.dp_noise)
            if settings.readings in ("naive", "both"):
                releases.append(release)
            if settings.readings in ("post", "both"):
                releases.append(postprocess_release(release, prior, seed=seed))
            if scheme == "dp-fedpft" and prior_only is None:
                prior_only = prior_only_release(release, prior, seed=seed)
    return releases + ([prior_only] if prior_only is not None else [])


def _sampling_candidates(settings: AttackSettings) -> list[Any]:
    from attacks.reconstructor_config import SamplingSettings

    out = []
    for w in settings.guidance:
        variants = [((0.0, 1.0), 0.0)] if w == 1.0 else [(i, phi) for i in settings.guidance_intervals
                                                         for phi in settings.guidance_rescales]
        for interval, phi in variants:
            candidate = SamplingSettings(guidance_scale=w, guidance_interval=interval, guidance_rescale=phi,
                                         num_inference_steps=settings.ddim_steps)
            if candidate not in out:
                out.append(candidate)
    return out


def _device_info(device: torch.device, reconstructor: Any) -> dict[str, Any]:
    info = {"device": str(device), "precision": reconstructor.precision_name, "torch": torch.__version__,
            "threads": torch.get_num_threads()}
    if device.type == "cuda":
        info["gpu"] = torch.cuda.get_device_name(device)
    return info


def _settings_record(settings: AttackSettings) -> dict[str, Any]:
    """The settings as the summary records them (tuples as lists)."""
    return {k: (list(v) if isinstance(v, tuple) else v) for k, v in asdict(settings).items()}


def _fit_guide_decoder(settings: AttackSettings, data: AttackData, options: dict[str, Any],
                       timings: dict[str, float]) -> tuple[Any, torch.Tensor | None]:
    """The decoder whose estimate the reconstructor reads beside x_t, fitted on the attacker's pairs, and its
    estimates of the training pairs; ``(None, None)`` when the reconstructor reads none (or there is none)."""
    from attacks.decoders import cross_fitted, make_decoder

    if settings.guide_decoder is None or settings.decoders_only:
        return None, None
    # The reconstructor reads this decoder's estimate of each image; a training pair's estimate leaves the pair
    # out, as a defender's feature never finds its own image among the attacker's.
    started, cpu = time.perf_counter(), time.process_time()
    pairs = data.pairs()
    if settings.guide_decoder == "mlp-tuned":
        # the tuned MLP's grid, then its chosen configuration again with the cross-fitted fold models
        tuned = make_decoder("mlp-tuned", **options).fit(*pairs)
        guide_decoder = cross_fitted(tuned.decoder, settings.guide_folds, name="mlp-tuned").fit(*pairs)
        guide_decoder.details = {**tuned.details, **guide_decoder.details}
    else:
        folds = settings.guide_folds if settings.guide_decoder == "mlp" else 0
        guide_decoder = make_decoder(settings.guide_decoder, **options, mlp_folds=folds).fit(*pairs)
    guide_decoder.details["cpu_s"] = time.process_time() - cpu
    guides = guide_decoder.decode(data.attacker_features[data.train], exclude=np.arange(len(data.train)))
    timings["guide_decoder_s"] = time.perf_counter() - started
    return guide_decoder, guides


def _train_reconstructor(settings: AttackSettings, data: AttackData, guides: torch.Tensor | None,
                         device: torch.device, command: str | None,
                         timings: dict[str, float]) -> tuple[Any, dict[str, Any]]:
    """The diffusion reconstructor, trained (or resumed, or loaded) on the attacker's training pairs, and the start
    of the run's summary; ``(None, summary)`` with ``--decoders-only``."""
    from attacks.reconstructor import train_or_resume

    if settings.decoders_only:   # no diffusion reconstructor: the decoders alone, on the same images and metrics
        return None, {"settings": _settings_record(settings),
                      "device": {"device": str(device), "precision": "float32", "torch": torch.__version__,
                                 "threads": torch.get_num_threads()},
                      "reconstructor": None, "timings_s": timings, "command": command}
    fa, xa, train = data.attacker_features, data.attacker_images, data.train
    config = reconstructor_config(settings, fa.shape[1], xa.shape[1])
    checkpoint = Path(settings.checkpoint) if settings.checkpoint else Path(settings.out) / "reconstructor.pt"
    started = time.perf_counter()
    reconstructor = train_or_resume(config, fa[train], xa[train], steps=settings.steps, checkpoint=checkpoint,
                                    guides=guides, device=device, precision=settings.precision, seed=settings.seed,
                                    checkpoint_every=settings.checkpoint_every, init_weights=settings.init_weights,
                                    made_by=command, progress=settings.progress)
    timings["reconstructor_call_s"] = time.perf_counter() - started
    return reconstructor, {"settings": _settings_record(settings), "device": _device_info(device, reconstructor),
                           "reconstructor": _reconstructor_record(reconstructor, config, checkpoint),
                           "timings_s": timings, "command": command}


def _reconstructor_record(reconstructor: Any, config: Any, checkpoint: Path) -> dict[str, Any]:
    """What the summary records of the reconstructor: its size, training, losses and what names its weights."""
    from attacks.reconstructor import file_sha256

    losses = reconstructor.losses
    return {"parameters": reconstructor.num_parameters, "config": config.to_dict(),
            "steps": reconstructor.step, "train_seconds": reconstructor.train_seconds,
            "exported": reconstructor.exported,   # trained elsewhere, its exported weights loaded
            "initialised_from": reconstructor.initialised_from,   # fine-tuned from these weights
            "first_loss_mean_100": float(np.mean(losses[:100])) if losses else None,
            "final_loss_mean_100": float(np.mean(losses[-100:])) if losses else None,
            "loss_mean_per_1000_steps": [float(np.mean(losses[i:i + 1000])) for i in range(0, len(losses), 1000)],
            "checkpoint": checkpoint.name,
            # what names these weights: their EMA tensors' sha256, the file's as it is on disk, and the command that
            # trained them (None: weights that predate the record)
            "weights_sha256": reconstructor.weights_sha256(),
            "checkpoint_sha256": file_sha256(checkpoint) if checkpoint.is_file() else None,
            "made_by": reconstructor.made_by}


def _fit_baselines(settings: AttackSettings, data: AttackData, guide_decoder: Any, options: dict[str, Any],
                   timings: dict[str, float]) -> tuple[dict[str, Any], Any]:
    """The decoder baselines fitted on the attacker's pairs (the guide decoder reused among them), and the decoder
    whose estimates start decoder-guided draws."""
    from attacks.decoders import fit_decoders

    started = time.perf_counter()
    reused = settings.guide_decoder if guide_decoder is not None else None
    decoders = fit_decoders([b for b in settings.baselines if b != reused], *data.pairs(), **options)
    if reused is not None and reused in settings.baselines:
        decoders = {name: guide_decoder if name == settings.guide_decoder else decoders[name]
                    for name in settings.baselines}
    timings["decoders_s"] = time.perf_counter() - started
    return decoders, guide_decoder or decoders.get("mlp", decoders.get("ridge"))


def _choose_sampling(settings: AttackSettings, reconstructor: Any, data: AttackData, init_decoder: Any,
                     guide_decoder: Any) -> tuple[Any, float, dict[str, Any] | None]:
    """Sampling settings from the attacker's held-out pairs (protocol 5): guidance first, then decoder-guided
    initialisation, then the one-step posterior mean's guidance scale. Returns ``(chosen settings, one-step w, what
    the summary records of the choice)``; ``(None, 1.0, None)`` without a reconstructor."""
    from attacks.sampling_choice import select_one_step_guidance, select_sampling

    chosen = data.held_out[:settings.selection_images]
    features, images = data.attacker_features[chosen], data.attacker_images[chosen]
    labels = data.attacker_labels[chosen]
    held_guides = {} if guide_decoder is None else {"guide": guide_decoder.decode(features, labels)}
    if reconstructor is None:
        return None, 1.0, None
    best, guidance_scores = select_sampling(reconstructor, features, images, _sampling_candidates(settings),
                                            seed=settings.seed, progress=settings.progress, **held_guides)
    init_scores: list[dict[str, Any]] = []
    if init_decoder is not None and settings.init_strengths:
        candidates = [best] + [replace(best, init_strength=s) for s in settings.init_strengths]
        best, init_scores = select_sampling(reconstructor, features, images, candidates,
                                            init=held_guides["guide"] if init_decoder is guide_decoder else
                                            init_decoder.decode(features, labels), seed=settings.seed,
                                            progress=settings.progress, **held_guides)
    one_step_w = 1.0
    one_step_scores: list[dict[str, Any]] = []
    if settings.one_step_draws:
        one_step_w, one_step_scores = select_one_step_guidance(
            reconstructor, features, images, settings.one_step_guidance, draws=settings.one_step_draws,
            seed=settings.seed, **held_guides)
    return best, one_step_w, {
        "chosen": best.to_dict(), "label": best.label, "held_out_pairs": int(len(chosen)),
        "guidance_candidates": guidance_scores, "init_candidates": init_scores, "one_step_guidance": one_step_w,
        "one_step_candidates": one_step_scores,
        "init_decoder": None if init_decoder is None else init_decoder.name}


def _attack_seed(settings: AttackSettings, data: AttackData, attacker: _Attacker, seed: int,
                 evaluation: _Evaluation, timings: dict[str, float]) -> None:
    """Evaluation seed ``seed``: its defender images less the near-duplicates of attacker images, every release of
    them attacked (:func:`_attack_release`), and the oracle nearest-attacker-image baseline."""
    from attacks.scoring import nearest_image_baseline
    from attacks.selection import near_duplicate_filter, nearest

    started = time.perf_counter()
    xa = data.attacker_images
    xd, fd, yd = data.defender_images[seed], data.defender_features[seed], data.defender_labels[seed]
    nearest_index, max_ssim = nearest(xd, xa, fast=True)
    kept, _ = near_duplicate_filter(xd, xa, fraction=settings.near_duplicate_fraction, max_ssim=max_ssim)
    timings[f"seed{seed}_near_duplicate_filter_s"] = time.perf_counter() - started
    targets = xd[torch.as_tensor(kept)]
    evaluation.kept[seed] = kept
    evaluation.seeds.append({"seed": seed, "defender_images": int(len(xd)), "evaluated": int(len(kept)),
                             "near_duplicates_removed": int(len(xd) - len(kept)),
                             "class_counts": np.bincount(yd, minlength=data.num_classes).tolist(),
                             "max_ssim_to_attacker_quartiles": [float(q) for q in
                                                                np.quantile(max_ssim, [0.25, 0.5, 0.75, 1.0])]})
    first = seed == settings.seeds[0]
    if first:
        evaluation.panels.append(("defender image", targets))
    for release in _releases(settings, fd, yd, data.num_classes, attacker.prior, seed):
        _attack_release(settings, attacker, release, targets, kept, seed, evaluation, first=first)
    baseline, matched_images = nearest_image_baseline(targets, xa, lpips=attacker.lpips, seed=seed,
                                                      nearest_index=nearest_index[kept])
    evaluation.scored += baseline
    if first:
        evaluation.panels.append(("no release: nearest attacker image by SSIM, oracle-matched", matched_images))


def _attack_release(settings: AttackSettings, attacker: _Attacker, release: Any, targets: torch.Tensor,
                    kept: np.ndarray, seed: int, evaluation: _Evaluation, *, first: bool) -> None:
    """``release`` reconstructed by the diffusion model and by every decoder and scored against ``targets`` (the
    seed's evaluated defender images, at positions ``kept`` of the raw release); the first seed's releases also give
    rows of the image grid."""
    from attacks.schemes import feature_diagnostics
    from attacks.scoring import evaluate_decoder, evaluate_release

    started = time.perf_counter()
    index = None if release.set_level else kept
    k = settings.set_samples_per_feature if release.set_level else settings.samples_per_feature
    diffusion = None if attacker.reconstructor is None else evaluate_release(
        release, attacker.reconstructor, targets, lpips=attacker.lpips, seed=seed, samples_per_feature=k,
        one_step_draws=settings.one_step_draws, one_step_guidance=attacker.one_step_w, sampling=attacker.sampling,
        init_decoder=attacker.init_decoder, guide_decoder=attacker.guide_decoder, target_index=index,
        progress=settings.progress)
    evaluation.scored += [] if diffusion is None else diffusion.scored
    baselines = {name: evaluate_decoder(release, decoder, targets, lpips=attacker.lpips,
                                        attacker_features=attacker.train_features, seed=seed, target_index=index)
                 for name, decoder in attacker.decoders.items()}
    for decoded in baselines.values():
        evaluation.scored += decoded.scored
    shown = release.label if math.isinf(release.epsilon) or release.epsilon == 0 else \
        f"{release.label}, ε {release.epsilon:.3g}"
    if first:
        evaluation.panels += _release_panels(release, shown, diffusion, baselines)
    evaluation.releases.append({"seed": seed, "source": release.label, "scheme": release.scheme,
                                "set_level": release.set_level,
                                "epsilon": "inf" if math.isinf(release.epsilon) else release.epsilon,
                                "features": len(release.features), **release.details,
                                "feature_diagnostics": feature_diagnostics(release.features, attacker.prior),
                                "diffusion_s": 0.0 if diffusion is None else diffusion.seconds,
                                "decoders_s": sum(e.seconds for e in baselines.values()),
                                "total_s": time.perf_counter() - started})
    if settings.progress:
        print(f"seed {seed}, {shown}: done in {time.perf_counter() - started:.0f} s", file=sys.stderr)


def _release_panels(release: Any, shown: str, diffusion: Any,
                    baselines: dict[str, Any]) -> list[tuple[str, torch.Tensor]]:
    """The image grid's rows for ``release`` (named ``shown``): the diffusion estimates (the medoid only for a
    set-level release, labelled oracle-matched) and the MLP, tuned MLP and nearest-feature decoders (per-feature)."""
    panels = []
    matched = "" if not release.set_level else ", oracle-matched"
    for estimate, images in ({} if diffusion is None else diffusion.shown).items():
        if release.set_level and not estimate.startswith("medoid"):
            continue
        panels.append((f"{shown}: diffusion, {estimate}{matched}", images))
    for name in ("mlp", "mlp-tuned", "nn"):
        if name in baselines and not release.set_level:
            panels.append((f"{shown}: {ATTACK_NAMES[name]}", baselines[name].shown["-"]))
    return panels


def _results_summary(settings: AttackSettings, data: AttackData, attacker: _Attacker,
                     sampling: dict[str, Any] | None, evaluation: _Evaluation, rows: list[Any]) -> dict[str, Any]:
    """The summary's account of the protocol, the decoders, the sampling choice, the releases and the rows."""
    from attacks.schemes import feature_diagnostics

    top_sizes = {f"{100 * f:g}%": [s["evaluated"] and max(1, math.ceil(f * s["evaluated"] - 1e-9))
                                   for s in evaluation.seeds] for f in settings.top_fractions}
    guide_decoder = attacker.guide_decoder
    return {
        "protocol": {
            "attacker": f"{len(data.attacker_images)} images of the {settings.dataset} {data.attacker_split} "
                        f"({len(data.train)} train the reconstructor and the decoders, {len(data.held_out)} held out "
                        f"to choose their settings)",
            "defender": f"{settings.defender_images} images of the {settings.dataset} {data.defender_split} per "
                        f"seed, disjoint across seeds {list(settings.seeds)}",
            "seeds": evaluation.seeds,
            "top_k_sizes_per_seed": top_sizes,
            "embedding": f"{settings.backbone} (input {settings.input_size} px), L2-normalised",
            "images": f"{settings.image_size} x {settings.image_size}, [0, 1]",
            "metrics": "PSNR (data range 1), SSIM (Gaussian window sigma 1.5, population covariances), LPIPS "
                       "v0.1 AlexNet (pretrained; images upsampled to 64 px)",
            "intervals": f"percentile bootstrap, 95 %, {settings.bootstrap} resamples of the scored images within "
                         f"each seed, top-k selections redone per resample",
            "attacker_features": feature_diagnostics(data.attacker_features, attacker.prior),
        },
        "decoders": {name: decoder.details for name, decoder in attacker.decoders.items()},
        "guide_decoder": None if guide_decoder is None else {"name": guide_decoder.name, **guide_decoder.details},
        "sampling": sampling,
        "releases": evaluation.releases,
        "rows": [r.to_dict() for r in rows],
    }


def _score_records(evaluation: _Evaluation, data: AttackData) -> list[dict[str, Any]]:
    """The lines of ``per_image_scores.csv``: every per-image score with its defender image, as its index in the
    source's split."""
    records = []
    for s in evaluation.scored:
        images = data.defender_indices[s.seed][evaluation.kept[s.seed]]
        for record in s.records():
            target = record["index"] if record["unit"] == "target" else record["matched"]
            record["defender_image"] = int(images[target])
            records.append(record)
    return records


def run_reconstruction_attack(settings: AttackSettings, *, command: str | None = None) -> dict[str, Any]:
    """Run the whole attack (see the module docstring); returns the JSON-able summary it also writes. ``command``
    (how this run was started) is recorded in the summary and, when this run trains the reconstructor, in its
    checkpoint, so exported weights name the command that made them."""
    from attacks.metrics import LPIPS
    from attacks.reconstructor_config import resolve_device
    from attacks.schemes import AttackerPrior
    from attacks.scoring import rows_from_scores

    settings.validate()
    device = resolve_device(settings.device)
    out = Path(settings.out)
    out.mkdir(parents=True, exist_ok=True)
    timings: dict[str, float] = {}
    wall = time.perf_counter()
    lpips = LPIPS(device=device)  # fail early (missing weights) before any training

    started = time.perf_counter()
    data = load_attack_data(settings)
    timings["data_and_features_s"] = time.perf_counter() - started
    options: dict[str, Any] = dict(seed=settings.seed, device=device, mlp_hidden=settings.mlp_hidden,
                                   mlp_epochs=settings.mlp_epochs, tuned_epochs=settings.tuned_epochs,
                                   random_features=settings.random_features, progress=settings.progress)
    guide_decoder, guides = _fit_guide_decoder(settings, data, options, timings)
    reconstructor, summary = _train_reconstructor(settings, data, guides, device, command, timings)
    if settings.train_only and reconstructor is not None:
        summary["table"] = ""
        write_summary(out, summary)
        return summary
    decoders, init_decoder = _fit_baselines(settings, data, guide_decoder, options, timings)
    started = time.perf_counter()
    best, one_step_w, sampling = _choose_sampling(settings, reconstructor, data, init_decoder, guide_decoder)
    timings["sampling_selection_s"] = time.perf_counter() - started

    prior = AttackerPrior.fit(data.attacker_features, data.attacker_labels, num_classes=data.num_classes,
                              full_covariance=settings.prior_covariance == "full")
    attacker = _Attacker(reconstructor=reconstructor, decoders=decoders, guide_decoder=guide_decoder,
                         init_decoder=init_decoder, sampling=best, one_step_w=one_step_w, lpips=lpips, prior=prior,
                         train_features=data.attacker_features[data.train])
    evaluation = _Evaluation()
    for seed in settings.seeds:
        _attack_seed(settings, data, attacker, seed, evaluation, timings)
    started = time.perf_counter()
    rows = rows_from_scores(evaluation.scored, top_fractions=settings.top_fractions, n_boot=settings.bootstrap,
                            boot_seed=settings.seed)
    timings["bootstrap_s"] = time.perf_counter() - started
    timings["wall_s"] = time.perf_counter() - wall
    summary.update(_results_summary(settings, data, attacker, sampling, evaluation, rows))
    write_results(out, summary, rows, _score_records(evaluation, data), evaluation.panels)
    summary["table"] = format_markdown(rows)
    return summary
