"""The ``privfl`` command's parser: one function per subcommand, each naming the options of its command
(:mod:`privfl.cli.commands`) with their defaults; the options several commands share are in
:mod:`privfl.cli.options`."""

from __future__ import annotations

import argparse

from privfl.cli.commands import (
    cmd_datasets,
    cmd_demo,
    cmd_features,
    cmd_ledger,
    cmd_report,
    cmd_sweep,
    cmd_train,
)
from privfl.cli.options import (
    add_device_argument,
    add_engine_arguments,
    add_federation_arguments,
    add_privacy_arguments,
    add_training_arguments,
    parse_epsilons,
    parse_numbers,
    parse_option,
)
from privfl.helpformat import show_defaults

#: The first line of ``privfl --help``.
DESCRIPTION = ("The privfl command: train, sweep, demo, report, ledger, features, datasets, attack (audit, "
               "reconstruct), flower.")

#: What ``add_subparsers`` returns.
Subparsers = argparse._SubParsersAction


def build_parser() -> argparse.ArgumentParser:
    """The parser of every subcommand; each sets ``func``, the command it runs."""
    parser = argparse.ArgumentParser(prog="privfl", description=DESCRIPTION)
    sub = parser.add_subparsers(dest="command", required=True)
    for add in (_add_train, _add_demo, _add_report, _add_ledger, _add_attack, _add_flower, _add_sweep, _add_features,
                _add_datasets):
        add(sub)
    return show_defaults(parser)


def _add_train(sub: Subparsers) -> None:
    p = sub.add_parser("train", help="train one method and serve its novel clients")
    p.add_argument("--method", default="fedavg", help="a registered method (fedavg, fedprox, scaffold, local, ...)")
    p.add_argument("--out", default=None, help="run directory to create")
    p.add_argument("--resume", default=None, metavar="RUN_DIR",
                   help="continue an interrupted run (its config.json sets everything; other run options are refused)")
    p.add_argument("--overwrite", action="store_true", help="replace a run already in --out")
    p.add_argument("--allow-overshoot", action="store_true",
                   help="with --resume: continue even where running again the rounds after the last checkpoint "
                        "takes a training client past its target epsilon (refused without it, saying by how much)")
    add_federation_arguments(p)
    add_training_arguments(p)
    add_privacy_arguments(p)
    add_engine_arguments(p)
    p.set_defaults(func=cmd_train, defaults_of=p.get_default)


def _add_demo(sub: Subparsers) -> None:
    p = sub.add_parser("demo", help="FedAvg vs FedProx vs SCAFFOLD on MNIST with novel clients")
    p.add_argument("--out", default="runs/demo")
    p.add_argument("--overwrite", action="store_true",
                   help="replace runs of other settings in OUT/<method> (the same settings are read back)")
    add_federation_arguments(p)
    add_training_arguments(p, fixed={"local_steps": 20, "batch_size": 64})
    add_privacy_arguments(p)
    p.set_defaults(func=cmd_demo, rounds=30)


def _add_report(sub: Subparsers) -> None:
    p = sub.add_parser("report", help="print the summary of one or more run directories")
    p.add_argument("run_dirs", nargs="+")
    p.set_defaults(func=cmd_report)


def _add_ledger(sub: Subparsers) -> None:
    p = sub.add_parser("ledger", help="epsilon per client from a run's recorded releases")
    p.add_argument("run_dir")
    p.add_argument("--delta", type=float, default=None, help="default: the run's delta")
    p.set_defaults(func=cmd_ledger)


def _add_attack(sub: Subparsers) -> None:
    p = sub.add_parser("attack", help="attacks and audits against what methods release")
    attack = p.add_subparsers(dest="attack", required=True)
    # `privfl attack audit ...` is handed to the audit's own parser in main(); listed here for --help.
    attack.add_parser("audit",
                      help="empirical epsilon lower bound for a mechanism (privatize, dp_gmm, classic, maxpool)")
    attack.add_parser("reconstruct", help="diffusion reconstruction attack on raw / FedPFT / DP-FedPFT releases "
                      "(PSNR, LPIPS, SSIM table and image grid)")


def _add_flower(sub: Subparsers) -> None:
    # `privfl flower ...` is handed to privfl.engines.flower.launch in main(); listed here for --help.
    sub.add_parser("flower", help="Flower deployment engine: certs, superlink, register, supernode, run")


def _add_sweep(sub: Subparsers) -> None:
    p = sub.add_parser("sweep", help="privacy-utility sweep: train a method (ODPFL-HN) at several training-client "
                                     "epsilons, serve novel clients at several epsilons and sizes")
    p.add_argument("--out", default="runs/sweep", help="folder for the training run, sweep.csv/json and sweep.png")
    p.add_argument("--dataset", default="mnist")
    p.add_argument("--data-root", default=None)
    p.add_argument("--source-option", action="append", type=parse_option, default=[], metavar="KEY=VALUE",
                   help="a source setting, e.g. path=feats.npz for 'features'; repeatable")
    p.add_argument("--clients", type=int, default=50, help="training clients (pathological, 2 shards each)")
    p.add_argument("--max-samples", type=int, default=None,
                   help="training images, a random subset of the train split whose rest is the novel clients' "
                        "held-out pool (default: every training image; the pool is then the test split)")
    p.add_argument("--rounds", type=int, default=None, help="rounds of each training (default: 100)")
    p.add_argument("--client-fraction", type=float, default=0.2)
    p.add_argument("--features", default=None, choices=("scatter", "mobilenet_v2", "none"),
                   help="the frozen feature stage in front of the networks (default: scatter; none: raw images)")
    p.add_argument("--model", default=None,
                   help="the target network (default: linear, a head on the features; mlp2nn without them)")
    p.add_argument("--method", default="odpflhn", help="any registered method")
    p.add_argument("--method-option", action="append", type=parse_option, default=[], metavar="KEY=VALUE",
                   help="a setting of the method (replaces the sweep's ODPFL-HN defaults when given)")
    p.add_argument("--train-epsilons", type=parse_epsilons, default=(1.0, 3.0, 8.0, None),
                   help="training clients' record-level epsilons, one training each; inf = without DP "
                        "(default: 1,3,8,inf)")
    p.add_argument("--private-rounds", type=int, default=None,
                   help="rounds of each private training (default: as --rounds)")
    p.add_argument("--full-grid", action="store_true",
                   help="the full grid: private trainings for --rounds rounds, sizes 20,50,150,500,1000")
    p.add_argument("--train-clip", type=float, default=None,
                   help="training clients' per-record L2 clip (default: 0.1)")
    p.add_argument("--min-samples", type=int, default=None,
                   help="public lower bound on a training client's training split (default: 1020, what each of the "
                        "50 clients holds of MNIST's 60,000 training images after 15%% validation: equal shards make "
                        "it public by construction)")
    p.add_argument("--epsilons", type=parse_numbers(float), default=(0.1, 0.3, 1.0, 3.0),
                   help="novel clients' epsilons (default: 0.1,0.3,1,3)")
    p.add_argument("--delta", type=float, default=1e-5)
    p.add_argument("--bound", type=float, default=1.0, help="per-sample L2 clipping radius of phi")
    p.add_argument("--sizes", type=parse_numbers(int), default=None,
                   help="novel-client sizes (default: 50,500,1000; with --full-grid 20,50,150,500,1000)")
    p.add_argument("--novel-mixes", type=int, default=5, help="label mixes (novel clients) per size")
    p.add_argument("--eval-size", type=int, default=500, help="held-out test images per novel client")
    p.add_argument("--repeats", type=int, default=2, help="noise draws per (mix, size, epsilon)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--threads", type=int, default=None, help="torch CPU threads (1 on a shared machine)")
    add_device_argument(p, "the trainings compute", "where present and the method runs there")
    p.add_argument("--overwrite", action="store_true",
                   help="write into an OUT that holds another sweep's results, retraining trainings of other settings")
    p.add_argument("--reference", default=None, metavar="FILE",
                   help="a stored sweep.json to compare this run's figures with (default: the sweep of the same "
                        "settings under benchmarks/results/ beside the package, when there is one)")
    p.add_argument("--no-progress", action="store_true")
    p.set_defaults(func=cmd_sweep)


def _add_features(sub: Subparsers) -> None:
    p = sub.add_parser("features", help="write a frozen backbone's features of a data source to the .npz that the "
                                        "features source reads (FedPFT's input)")
    p.add_argument("--out", required=True, help="the .npz file to write (arrays x, y and x_test, y_test)")
    p.add_argument("--dataset", default="mnist", help="an image source (see `privfl datasets`)")
    p.add_argument("--backbone", default="mobilenet_v2", help="a frozen feature extractor of images")
    p.add_argument("--backbone-option", action="append", type=parse_option, default=[], metavar="KEY=VALUE",
                   help="a backbone setting, e.g. input_size=64 (pixels the images are resized to; default 224, and "
                        "64 is about ten times faster on a CPU); repeatable")
    p.add_argument("--data-root", default=None, help="folder holding torchvision-format data")
    p.add_argument("--download", action="store_true", help="let torchvision download missing data (needs internet)")
    p.add_argument("--source-option", action="append", type=parse_option, default=[], metavar="KEY=VALUE",
                   help="a source setting, e.g. split=letters for 'emnist'; repeatable")
    p.add_argument("--max-samples", type=int, default=None,
                   help="at most this many images of each split, a random subset (default: every image)")
    p.add_argument("--seed", type=int, default=0, help="seed of the --max-samples subset")
    p.add_argument("--batch-size", type=int, default=256, help="images per forward pass")
    add_device_argument(p, "the backbone computes", "where present")
    p.add_argument("--overwrite", action="store_true", help="replace an existing --out")
    p.add_argument("--no-progress", action="store_true")
    p.set_defaults(func=cmd_features)


def _add_datasets(sub: Subparsers) -> None:
    p = sub.add_parser("datasets", help="list every data source and whether it is available here")
    p.add_argument("--data-root", default=None)
    p.set_defaults(func=cmd_datasets)
