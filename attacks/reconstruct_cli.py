"""``privfl attack reconstruct``: train (or reuse) a diffusion reconstructor and attack raw / FedPFT / DP-FedPFT
releases, beside decoder baselines, with per-image scores and bootstrap confidence intervals.

The protocol of the FedPFT paper, App. E: the attacker's images and the defenders' disjoint sets, the frozen
embedding, the reconstructor (:mod:`attacks.reconstructor`) and decoder baselines (:mod:`attacks.decoders`),
sampling settings chosen on held-out pairs, releases through each scheme (:mod:`attacks.schemes`), bootstrap
statistics (:mod:`attacks.statistics`) and the outputs in ``--out``. This module is the command line:
:func:`reconstruct_main`, :func:`build_parser`, :func:`settings_from_args`; the settings and presets are in
:mod:`attacks.reconstruct_settings`, the run in :mod:`attacks.reconstruct_run` (:func:`run_reconstruction_attack`).

Presets: ``--preset quick`` (a few minutes on a laptop CPU), ``--preset benchmark`` and ``--preset reduced``; options
on the command line override the preset's. Example::

    privfl attack reconstruct --preset quick --out runs/attack-quick

The protocol step by step: docs/attacks.md, "privfl attack reconstruct".
"""

from __future__ import annotations

import argparse
import copy
import shlex
import sys
from collections.abc import Sequence
from dataclasses import fields
from pathlib import Path
from typing import Any

import torch

from attacks.decoders import DECODERS
from attacks.reconstruct_run import run_reconstruction_attack
from attacks.reconstruct_settings import PRESETS, AttackSettings
from privfl.errors import ConfigError, PrivflError

__all__ = ["build_parser", "reconstruct_main", "settings_from_args"]


# -- argument types -------------------------------------------------------------------------------------------------

def _floats(text: str) -> tuple[float, ...]:
    if text.strip().lower() == "none":
        return ()
    try:
        return tuple(float(v) for v in text.split(",") if v.strip())
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected comma-separated numbers (or 'none'), got {text!r}") from None


def _ints(text: str) -> tuple[int, ...]:
    try:
        return tuple(int(v) for v in text.split(",") if v.strip())
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected comma-separated integers, got {text!r}") from None


def _intervals(text: str) -> tuple[tuple[float, float], ...]:
    try:
        pairs = [tuple(float(x) for x in v.split(":")) for v in text.split(",") if v.strip()]
    except ValueError:
        pairs = [()]
    if not pairs or any(len(p) != 2 for p in pairs):
        raise argparse.ArgumentTypeError(f"expected comma-separated LOW:HIGH fractions of T, e.g. 0:1,0.5:1, got "
                                         f"{text!r}")
    return tuple((low, high) for low, high in pairs)


def _names(text: str) -> tuple[str, ...]:
    return tuple(v.strip() for v in text.split(",") if v.strip())


def _dims(text: str) -> int | None:
    if text.strip().lower() == "none":
        return None
    try:
        return int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected an integer or 'none', got {text!r}") from None


def _optional(text: str) -> str | None:
    return None if text.strip().lower() == "none" else text.strip()


def _count(text: str) -> int | None:
    if text.strip().lower() == "all":
        return None
    try:
        return int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected an integer or 'all', got {text!r}") from None


_FLAGS = {"learning_rate": "lr"}


def _preset_epilog() -> str:
    lines = ["presets (options given on the command line override them):"]
    for name, values in PRESETS.items():
        text = ", ".join(f"--{_FLAGS.get(k, k.replace('_', '-'))} {_show(v)}" for k, v in values.items())
        lines.append(f"  {name}: {text}")
    return "\n".join(lines)


def _show(value: Any) -> str:
    if value is None:
        return "all"
    if isinstance(value, tuple):
        return ",".join(":".join(f"{x:g}" for x in v) if isinstance(v, tuple) else f"{v:g}" if isinstance(v, float)
                        else str(v) for v in value)
    return f"{value:g}" if isinstance(value, float) else str(value)


class _Defaults:
    """The defaults the parser gives: those of :class:`AttackSettings`, or none at all (``suppress``: the parser then
    tells which options the command line gave)."""

    def __init__(self, suppress: bool) -> None:
        self.suppress = suppress
        self.settings = AttackSettings(out="")

    def __call__(self, name: str) -> Any:
        """The default of setting ``name``."""
        return argparse.SUPPRESS if self.suppress else getattr(self.settings, name)

    def flag(self, value: Any) -> Any:
        """``value`` as the default of an option that is no setting of its own (a flag, the preset, the threads)."""
        return argparse.SUPPRESS if self.suppress else value


def build_parser(*, suppress: bool = False) -> argparse.ArgumentParser:
    """The parser of ``privfl attack reconstruct``; ``suppress=True`` leaves out every default (to tell which options
    the command line gave, so that they override a preset)."""
    default = _Defaults(suppress)
    p = argparse.ArgumentParser(
        prog="privfl attack reconstruct", formatter_class=_HelpFormatter, epilog=_preset_epilog(),
        description="Diffusion reconstruction attack on raw features, FedPFT and DP-FedPFT releases, beside decoder "
                    "baselines: PSNR / LPIPS / SSIM with bootstrap 95% intervals, per-image scores, an image grid "
                    "and a metrics plot. Defaults are shown without a preset.")
    for add in (_add_data_options, _add_release_options, _add_image_options, _add_reconstructor_options,
                _add_sampling_options, _add_decoder_options, _add_scoring_options, _add_runtime_options):
        add(p, default)
    return p


def _add_data_options(p: argparse.ArgumentParser, default: _Defaults) -> None:
    """The output folder, the preset, the image source and the frozen backbone."""
    p.add_argument("--out", required=True, help="output folder (tables, figures, reconstructor checkpoint)")
    p.add_argument("--preset", choices=tuple(PRESETS), default=default.flag(None),
                   help="a set of defaults (listed below)")
    p.add_argument("--dataset", default=default("dataset"), help="an image source of `privfl datasets`")
    p.add_argument("--data-root", default=default("data_root"), help="folder of torchvision-format data")
    p.add_argument("--backbone", default=default("backbone"), help="frozen feature extractor")
    p.add_argument("--input-size", type=int, default=default("input_size"), help="backbone input pixels")


def _add_release_options(p: argparse.ArgumentParser, default: _Defaults) -> None:
    """The schemes, their budget and noise, and how the attacker reads mixture releases."""
    p.add_argument("--schemes", type=_names, default=default("schemes"), help="comma-separated: raw,fedpft,dp-fedpft")
    p.add_argument("--eps", type=_floats, default=default("eps"), help="DP-FedPFT epsilons requested")
    p.add_argument("--delta", type=float, default=default("delta"), help="DP-FedPFT delta (public)")
    p.add_argument("--dp-noise", default=default("dp_noise"),
                   help="seeded (reproducible simulation of the defender), secure (OS randomness) or hardened "
                        "(secure, summed draws)")
    p.add_argument("--components", type=int, default=default("components"), help="FedPFT mixture components K")
    p.add_argument("--covariance", default=default("covariance"), help="full, diag or spherical")
    p.add_argument("--readings", default=default("readings"),
                   help="how mixture releases are read: post (the attacker's post-processing), naive (as "
                        "delivered) or both")
    p.add_argument("--prior-covariance", default=default("prior_covariance"),
                   help="the attacker's class covariance in the DP post-processing: full (principal directions) or "
                        "diag (per dimension)")


def _add_image_options(p: argparse.ArgumentParser, default: _Defaults) -> None:
    """How many attacker and defender images, and the seeds."""
    p.add_argument("--attacker-images", type=_count, default=default("attacker_images"),
                   help="attacker images from the training split (an integer, or all)")
    p.add_argument("--validation-images", type=int, default=default("validation_images"),
                   help="attacker pairs held out of training to choose sampling settings and decoder hyperparameters")
    p.add_argument("--defender-images", type=int, default=default("defender_images"),
                   help="defender images from the test split, per evaluation seed")
    p.add_argument("--seeds", type=_ints, default=default("seeds"),
                   help="evaluation seeds: each draws a disjoint defender set, release noise and samples")
    p.add_argument("--seed", type=int, default=default("seed"),
                   help="seed of what the attacker trains (held-out split, reconstructor, decoders)")


def _add_reconstructor_options(p: argparse.ArgumentParser, default: _Defaults) -> None:
    """The reconstructor's architecture, its training and its checkpoint."""
    p.add_argument("--image-size", type=int, default=default("image_size"), help="reconstruction resolution")
    p.add_argument("--block-channels", type=_ints, default=default("block_channels"), help="U-Net channels per level")
    p.add_argument("--layers-per-block", type=int, default=default("layers_per_block"),
                   help="U-Net residual blocks per level")
    p.add_argument("--no-mid-attention", dest="mid_attention", action="store_false", default=default.flag(True),
                   help="no self-attention in the U-Net's middle block")
    p.add_argument("--condition-dims", type=_dims, default=default("condition_dims"),
                   help="principal components the features are whitened to (none: per-dimension standardisation)")
    p.add_argument("--prediction-type", default=default("prediction_type"), help="v_prediction or epsilon")
    p.add_argument("--steps", type=int, default=default("steps"), help="reconstructor training steps (total)")
    p.add_argument("--batch-size", type=int, default=default("batch_size"), help="reconstructor batch size")
    p.add_argument("--lr", dest="learning_rate", type=float, default=default("learning_rate"),
                   help="reconstructor learning rate (AdamW)")
    p.add_argument("--cond-dropout", type=float, default=default("cond_dropout"), help="condition dropout probability")
    p.add_argument("--checkpoint", default=default("checkpoint"),
                   help="reconstructor checkpoint (none: OUT/reconstructor.pt); resumed when it exists; or weights "
                        "exported elsewhere (Reconstructor.export: evaluated, not trained; --steps as trained)")
    p.add_argument("--init-weights", default=default("init_weights"),
                   help="start a new reconstructor from these weights (a checkpoint or exported weights of the same "
                        "architecture) and fine-tune them for --steps steps")
    p.add_argument("--checkpoint-every", type=int, default=default("checkpoint_every"),
                   help="save the checkpoint every this many steps")
    p.add_argument("--train-only", action="store_true", default=default.flag(False),
                   help="stop after training the reconstructor")


def _add_sampling_options(p: argparse.ArgumentParser, default: _Defaults) -> None:
    """The sampling settings to choose from on the held-out pairs, and the samples drawn per feature."""
    p.add_argument("--guidance", type=_floats, default=default("guidance"),
                   help="classifier-free guidance scales w to choose from on the held-out pairs")
    p.add_argument("--guidance-intervals", type=_intervals, default=default("guidance_intervals"),
                   help="LOW:HIGH fractions of T where w > 1 applies (w = 1 elsewhere), to choose from")
    p.add_argument("--guidance-rescales", type=_floats, default=default("guidance_rescales"),
                   help="guidance rescale phi values to choose from (0: none)")
    p.add_argument("--init-strengths", type=_floats, default=default("init_strengths"),
                   help="decoder-guided initialisation strengths to try against none ('none': never)")
    p.add_argument("--selection-images", type=int, default=default("selection_images"),
                   help="held-out pairs the sampling settings are chosen on")
    p.add_argument("--ddim-steps", type=int, default=default("ddim_steps"), help="DDIM steps")
    p.add_argument("--samples-per-feature", type=int, default=default("samples_per_feature"),
                   help="samples per raw feature (medoid, mean, agreement; the paper: 10)")
    p.add_argument("--set-samples-per-feature", type=int, default=default("set_samples_per_feature"),
                   help="samples per feature of a set-level (mixture) release")
    p.add_argument("--one-step-draws", type=int, default=default("one_step_draws"),
                   help="pure-noise draws averaged by the diffusion's one-step posterior mean (its x_0 prediction "
                        "at t = T - 1, antithetic pairs; scored beside the medoid and the mean of the samples; 0: "
                        "not scored)")
    p.add_argument("--one-step-guidance", type=_floats, default=default("one_step_guidance"),
                   help="guidance scales w of the one-step posterior mean to choose from on the held-out pairs (by "
                        "mean PSNR)")


def _add_decoder_options(p: argparse.ArgumentParser, default: _Defaults) -> None:
    """The decoder baselines, the decoder the reconstructor reads, and the decoders' sizes."""
    p.add_argument("--baselines", type=_names, default=default("baselines"),
                   help="decoder baselines: " + ",".join(DECODERS))
    p.add_argument("--guide-decoder", type=_optional, default=default("guide_decoder"),
                   help="the decoder whose estimate the reconstructor reads beside x_t: knn, nn, mlp, mlp-tuned (the "
                        "tuned MLP's chosen configuration, cross-fitted) or none")
    p.add_argument("--guide-folds", type=int, default=default("guide_folds"),
                   help="cross-fitted MLPs whose out-of-fold estimates the reconstructor trains on (--guide-decoder "
                        "mlp or mlp-tuned)")
    p.add_argument("--mlp-hidden", type=int, default=default("mlp_hidden"), help="MLP decoder width")
    p.add_argument("--mlp-epochs", type=int, default=default("mlp_epochs"), help="MLP decoder epochs (at most)")
    p.add_argument("--tuned-epochs", type=int, default=default("tuned_epochs"),
                   help="epochs (at most; cosine schedule) of the tuned MLP, convolutional and ensemble decoders")
    p.add_argument("--random-features", type=int, default=default("random_features"),
                   help="random Fourier features D of the random-features ridge decoder")
    p.add_argument("--decoders-only", action="store_true", default=default.flag(False),
                   help="no diffusion reconstructor: fit and score the decoders only (same images and metrics)")


def _add_scoring_options(p: argparse.ArgumentParser, default: _Defaults) -> None:
    """The selections scored, the near-duplicates left out and the bootstrap."""
    p.add_argument("--top-fractions", type=_floats, default=default("top_fractions"),
                   help="attacker / oracle selection sizes per seed (the paper: 0.01)")
    p.add_argument("--near-duplicate-fraction", type=float, default=default("near_duplicate_fraction"),
                   help="share of defender images most similar to an attacker image left out of scoring")
    p.add_argument("--bootstrap", type=int, default=default("bootstrap"), help="bootstrap resamples per cell")


def _add_runtime_options(p: argparse.ArgumentParser, default: _Defaults) -> None:
    """Where and how the run computes."""
    p.add_argument("--device", default=default("device"),
                   help="auto (CUDA if visible, else CPU), cpu, cuda or cuda:N (an error if absent)")
    p.add_argument("--precision", default=default("precision"),
                   help="auto (mixed precision on CUDA, float32 on CPU), fp32, bf16 or fp16 (CUDA)")
    p.add_argument("--threads", type=int, default=default.flag(None),
                   help="torch CPU threads (none: torch's own choice)")
    p.add_argument("--no-progress", dest="progress", action="store_false", default=default.flag(True),
                   help="no progress bars")


class _HelpFormatter(argparse.ArgumentDefaultsHelpFormatter, argparse.RawDescriptionHelpFormatter):
    """Defaults after every option's help (lists as typed on the command line), and the preset list as written."""

    def _expand_help(self, action: argparse.Action) -> str:
        if isinstance(action.default, tuple) or (action.default is None and action.option_strings):
            action = copy.copy(action)
            action.default = "all" if action.dest == "attacker_images" and action.default is None else \
                "none" if action.default is None else _show(action.default)
        return super()._expand_help(action)

    def _get_help_string(self, action: argparse.Action) -> str | None:
        if action.required or isinstance(action, (argparse._StoreTrueAction, argparse._StoreFalseAction)):
            return action.help or ""   # a flag's "default" is the opposite of what it does: not worth printing
        return super()._get_help_string(action)


def settings_from_args(argv: Sequence[str]) -> tuple[AttackSettings, argparse.Namespace]:
    """Settings from the command line: the defaults, then the preset's, then the options given."""
    args = build_parser().parse_args(list(argv))
    given = vars(build_parser(suppress=True).parse_args(list(argv)))
    names = {f.name for f in fields(AttackSettings)}
    values: dict[str, Any] = {}
    if args.preset is not None:
        values.update(PRESETS[args.preset])
    values.update({k: v for k, v in given.items() if k in names})
    return AttackSettings(**values), args


def reconstruct_main(argv: Sequence[str] | None = None) -> int:
    """Entry point of ``privfl attack reconstruct``; returns the exit status (2 on a user error)."""
    settings, args = settings_from_args(sys.argv[1:] if argv is None else list(argv))
    try:
        if args.threads is not None:
            if args.threads < 1:
                raise ConfigError(f"--threads must be an integer >= 1, got {args.threads}")
            torch.set_num_threads(args.threads)
        command = "privfl attack reconstruct " + shlex.join(sys.argv[1:] if argv is None else list(argv))
        summary = run_reconstruction_attack(settings, command=command)
    except PrivflError as error:
        print(f"privfl: error: {error}", file=sys.stderr)
        return 2
    rec, dev = summary["reconstructor"], summary["device"]
    print(summary["table"], end="")
    print(f"device: {dev['device']} ({dev['precision']}); " + (
        "decoders only, no reconstructor" if rec is None else
        f"reconstructor: {rec['parameters']:,} parameters, {rec['steps']} steps, trained {rec['train_seconds']:.0f} s"
        + (f"; sampling: {summary['sampling']['label']}, one-step w {summary['sampling']['one_step_guidance']:g}"
           if summary.get("sampling") else "")))
    out = Path(settings.out)
    if settings.train_only and rec is not None:
        print(f"trained only: {out / 'attack_results.json'}, checkpoint {rec['checkpoint']}")
    else:
        print(f"results: {out / 'attack_results.md'} (.csv, .json), {out / 'per_image_scores.csv'}, figures: "
              f"{out / 'attack_grid.png'}, {out / 'attack_metrics.png'}")
    return 0


if __name__ == "__main__":  # pragma: no cover
    sys.exit(reconstruct_main())
