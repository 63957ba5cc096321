"""The privfl command: train, sweep, demo, report, ledger, features, datasets, attack (audit, reconstruct), flower.

A user error (an unknown name, a value out of range, unreadable data) exits with status 2 and one message that
names the bad value and the valid choices; it never prints a traceback. A fault inside privfl
(:class:`~privfl.errors.InternalError`) is a bug: it shows its traceback, asks for a report and exits with status 70
(``EX_SOFTWARE``); any other exception nothing expected keeps Python's traceback and exit status 1.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import sys
from pathlib import Path

from privfl.errors import InternalError, PrivflError
from privfl.helpformat import show_defaults

# (method, settings): the FedTTA paper's Table 4 learning rates for MNIST, with the stabilisers of the authors'
# code (without them FedProx and SCAFFOLD diverge on this protocol; see benchmarks/README.md).
_STABILISERS = {"weight_decay": 1e-4, "grad_clip": 10.0, "lr_decay": 0.99}
DEMO_METHODS = (
    ("fedavg", {"lr": 0.1, **_STABILISERS}),
    ("fedprox", {"lr": 0.3, "mu": 0.001, **_STABILISERS}),
    ("scaffold", {"lr": 0.1, "server_lr": 1.5, **_STABILISERS}),
)


def _parse_angles(text: str) -> tuple[float, ...]:
    try:
        return tuple(float(v) for v in text.split(",") if v.strip())
    except ValueError:
        raise argparse.ArgumentTypeError(f"angles must be comma-separated numbers (degrees), got {text!r}") from None


def _parse_option(text: str) -> tuple[str, object]:
    if "=" not in text:
        raise argparse.ArgumentTypeError(f"expected KEY=VALUE, got {text!r}")
    key, raw = text.split("=", 1)
    try:
        value = json.loads(raw)
    except json.JSONDecodeError:
        value = raw
    return key.strip(), value


def _add_federation_arguments(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("data and federation")
    g.add_argument("--dataset", default="mnist", help="data source (see `privfl datasets`)")
    g.add_argument("--data-root", default=None, help="folder holding torchvision-format data")
    g.add_argument("--download", action="store_true", help="let torchvision download missing data (needs internet)")
    g.add_argument("--source-option", action="append", type=_parse_option, default=[], metavar="KEY=VALUE",
                   help="a source setting, e.g. path=feats.npz for 'features' or dim=20 for 'synthetic'")
    g.add_argument("--partition", default="pathological", help="pathological, dirichlet or iid")
    g.add_argument("--clients", type=int, default=100, help="number of clients (training and novel together)")
    g.add_argument("--shards-per-client", type=int, default=2)
    g.add_argument("--alpha", type=float, default=0.1, help="Dirichlet concentration")
    g.add_argument("--novel-fraction", type=float, default=0.5, help="fraction of clients that are novel, in (0, 1)")
    g.add_argument("--split", default="merged",
                   help="merged (pool train and test), train_test (novel clients from the test split) or client_test "
                        "(each training client scored on its own IID part of the test split; no novel clients)")
    g.add_argument("--novel-clients", type=int, default=None, help="novel clients drawn from the test split")
    g.add_argument("--novel-partition", default=None)
    g.add_argument("--novel-alpha", type=float, default=None)
    g.add_argument("--novel-shards-per-client", type=int, default=None)
    g.add_argument("--val-fraction", type=float, default=0.15)
    g.add_argument("--max-samples", type=int, default=None, help="subsample the pool first (quick runs)")
    g.add_argument("--novel-blur-sigma", type=float, default=0.0)
    g.add_argument("--novel-blur-kernel", type=int, default=5)
    g.add_argument("--novel-rotation", type=float, default=0.0, help="degrees")
    g.add_argument("--train-angles", type=_parse_angles, default=(), help="rotated-MNIST angles, e.g. 0,30,60")
    g.add_argument("--novel-angles", type=_parse_angles, default=(), help="e.g. 15,45")
    g.add_argument("--angle-assignment", default="random",
                   help="random (each client's angle drawn uniformly) or balanced (contiguous equal blocks of ids)")


def _add_device_argument(p: argparse.ArgumentParser | argparse._ArgumentGroup, what: str, auto: str) -> None:
    """``--device`` (:data:`privfl.devices.DEVICES`, written out here so that ``--help`` does not import torch)."""
    p.add_argument("--device", default="cpu", choices=("auto", "cpu", "cuda"),
                   help=f"where {what}: cpu, cuda, or auto (CUDA {auto})")


def _add_training_arguments(p: argparse.ArgumentParser, fixed: dict[str, object] | None = None) -> None:
    """The training options; ``fixed`` gives method settings a value of the command's own (the demo's), where
    ``None`` would leave each method its own default."""
    fixed = fixed or {}
    g = p.add_argument_group("training")

    def method_setting(flag: str, kind: type, text: str, fedavg: str) -> None:
        dest = flag[2:].replace("-", "_")
        if dest in fixed:
            g.add_argument(flag, type=kind, default=fixed[dest], help=text)
        else:
            g.add_argument(flag, type=kind, default=None, help=f"{text} (default: the method's; FedAvg's {fedavg})")

    g.add_argument("--model", default="auto",
                   help="mlp2nn, lenet, fedtta_cnn, small_cnn, tanh_cnn, feature_mlp, linear or auto")
    g.add_argument("--features", default=None, choices=("scatter", "mobilenet_v2"),
                   help="a frozen feature stage in front of the model: scatter (ScatterNet, J=2, L=8, per-record "
                        "group norm) or mobilenet_v2 (ImageNet); features are computed once per input and cached; "
                        "use --model linear or feature_mlp on them (default: none, the raw inputs)")
    g.add_argument("--feature-option", action="append", type=_parse_option, default=[], metavar="KEY=VALUE",
                   help="a feature-stage option (scatter: J, L, groups; mobilenet_v2: input_size), repeatable")
    g.add_argument("--rounds", type=int, default=200)
    g.add_argument("--client-fraction", type=float, default=1.0, help="training clients per round, in (0, 1]")
    method_setting("--local-steps", int, "local minibatch SGD steps per round", "20")
    method_setting("--batch-size", int, "local minibatch size", "64")
    method_setting("--lr", float, "client learning rate", "0.1")
    g.add_argument("--mu", type=float, default=None, help="FedProx proximal coefficient")
    g.add_argument("--server-lr", type=float, default=None, help="server (global) learning rate")
    method_setting("--weight-decay", float, "local SGD weight decay", "0")
    method_setting("--grad-clip", float, "max L2 norm of each local step's gradient", "none")
    method_setting("--lr-decay", float, "round-r lr = lr * decay ** (r / 10)", "1.0")
    g.add_argument("--method-option", action="append", type=_parse_option, default=[], metavar="KEY=VALUE",
                   help="any other field of the method's config (VALUE read as JSON, else as text), e.g. "
                        "--method-option encoder=\"dp_deepset\" --method-option adapt=\"all\"; repeatable")
    g.add_argument("--eval-every", type=int, default=10)
    g.add_argument("--checkpoint-every", type=int, default=10)
    g.add_argument("--central-eval", action="store_true",
                   help="at every evaluation round, also score the server model on a central held-out set: the "
                        "novel clients' samples pooled, with the hidden labels (data no training client holds); "
                        "adds central_accuracy (%%) and central_loss to metrics.jsonl. Server-side: no client sends "
                        "anything for it and nothing is recorded as a release; never used for model selection. For "
                        "methods with one server model (the model a new client gets before using its data); "
                        "personalised methods and --split client_test are refused")
    g.add_argument("--select", default="best_val", help="best_val or last")
    g.add_argument("--seed", type=int, default=0)
    g.add_argument("--delta", type=float, default=1e-5, help="delta at which epsilon is reported")
    g.add_argument("--threads", type=int, default=None,
                   help="torch CPU threads (default: torch's choice; 1 is often faster on a busy 2-core machine, "
                        "and 1 with --workers above 1)")
    _add_device_argument(g, "the models compute", "where present and the method runs there")
    g.add_argument("--workers", type=int, default=1,
                   help="processes that train a round's clients, one thread each; the numbers are the one-thread "
                        "run's")
    g.add_argument("--no-progress", action="store_true")


def _add_privacy_arguments(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group(
        "privacy", "one mode protects every training client (any method; needs --select last); the novel-client "
                   "options protect what a novel client sends (the descriptor of ODPFL-HN, IT-PFL-HN and PeFLL)")
    g.add_argument("--dp-noise-multiplier", type=float, default=None,
                   help="record level: DP-SGD (and every other record-level mechanism) at this noise multiplier")
    g.add_argument("--dp-epsilon", type=float, default=None,
                   help="record level: the noise is calibrated so each training client ends the run at this epsilon")
    g.add_argument("--dp-max-grad-norm", type=float, default=None,
                   help="record level: per-sample L2 clip (default: 1.0)")
    g.add_argument("--dp-min-samples", type=int, default=None,
                   help="record level: the public lower bound on a training client's record count that bounds the "
                        "sensitivity of its means (default: 8); a client with fewer records is refused")
    g.add_argument("--dp-sampling-rate", type=float, default=None,
                   help="record level: the public Poisson rate of every DP-SGD step (default: batch size / "
                        "--dp-min-samples, at most 1); never a client's own record count, which is private")
    g.add_argument("--client-dp", default=None, choices=("central", "distributed", "local"),
                   help="client-level DP: central (trusted aggregator, Poisson sampling at --client-fraction), "
                        "distributed (noise shares summed under secure aggregation) or local (each client adds it)")
    g.add_argument("--client-dp-epsilon", type=float, default=None, help="client level: target epsilon over the run")
    g.add_argument("--client-dp-noise-multiplier", type=float, default=None,
                   help="client level: the noise multiplier instead of a target epsilon")
    g.add_argument("--client-dp-clip", default=None,
                   help="client level: L2 clip of a client's whole round (default: 1.0), or 'adaptive' (central only: "
                        "the clip follows the median update norm, Andrew et al. 2021)")
    g.add_argument("--client-dp-participations", type=int, default=None,
                   help="local/distributed: the most rounds a client releases in (default: from the schedule)")
    g.add_argument("--client-dp-shares", type=int, default=None,
                   help="distributed: noise shares per sum (default: the clients a round samples)")
    g.add_argument("--dp-noise", default=None, choices=("secure", "seeded", "hardened"),
                   help="noise source (default: secure): secure (OS-seeded), hardened (Opacus' secure-mode "
                        "sampler) or seeded (reproducible, research only)")
    g.add_argument("--novel-epsilon", type=float, default=None,
                   help="epsilon of a novel client's release (default: none, not private)")
    g.add_argument("--novel-bound", type=float, default=None,
                   help="L2 clip of each record's contribution to a novel client's release (default: 1.0); with "
                        "record-level DP also the descriptor bound of ODPFL-HN, IT-PFL-HN and PeFLL training clients")
    g.add_argument("--allow-large-delta", action="store_true",
                   help="run with a --delta at least one over the records of the smallest client (record level) or "
                        "over the training clients (client level), a guarantee that does not keep one of them from "
                        "being exposed whole (refused without this flag)")


def _privacy(args: argparse.Namespace):
    """The run's TrainingPrivacy and NovelPrivacy from the command line."""
    from privfl.privacy.training import NovelPrivacy, TrainingPrivacy, check_delta

    record = args.dp_noise_multiplier is not None or args.dp_epsilon is not None
    client = args.client_dp is not None
    record_only = [name for name in ("dp_max_grad_norm", "dp_min_samples", "dp_sampling_rate")
                   if getattr(args, name) is not None]
    client_only = [name for name in ("client_dp_epsilon", "client_dp_noise_multiplier", "client_dp_clip",
                                     "client_dp_participations", "client_dp_shares") if getattr(args, name) is not None]
    if record and client:
        raise PrivflError("give either record-level DP (--dp-noise-multiplier/--dp-epsilon) or client-level DP "
                          "(--client-dp), not both: one mode protects the training clients")
    if client_only and not client:
        raise PrivflError(f"--{client_only[0].replace('_', '-')} needs --client-dp central|distributed|local")
    if record_only and not record:
        raise PrivflError(f"--{record_only[0].replace('_', '-')} needs --dp-noise-multiplier or --dp-epsilon "
                          "(without them training clients release without DP)")
    check_delta(args.delta, "--delta")     # before the settings that take it, which would name it as their own
    common = {"delta": args.delta}
    if args.dp_noise is not None:
        if not (record or client):
            raise PrivflError("--dp-noise needs a privacy mode (--dp-noise-multiplier, --dp-epsilon or --client-dp)")
        common["noise"] = args.dp_noise
    if record:
        privacy = TrainingPrivacy(mode="record", epsilon=args.dp_epsilon, noise_multiplier=args.dp_noise_multiplier,
                                  clip=1.0 if args.dp_max_grad_norm is None else args.dp_max_grad_norm,
                                  **({} if args.dp_min_samples is None else {"min_samples": args.dp_min_samples}),
                                  sampling_rate=args.dp_sampling_rate, **common)
    elif client:
        clip = args.client_dp_clip
        if clip is not None and clip != "adaptive":
            try:
                clip = float(clip)
            except ValueError:
                raise PrivflError(f"--client-dp-clip must be a number > 0 or 'adaptive', got {clip!r}") from None
        privacy = TrainingPrivacy(mode=args.client_dp, epsilon=args.client_dp_epsilon,
                                  noise_multiplier=args.client_dp_noise_multiplier,
                                  clip=1.0 if clip is None else clip, participations=args.client_dp_participations,
                                  shares=args.client_dp_shares, **common)
    else:
        privacy = TrainingPrivacy()
    novel = NovelPrivacy(epsilon=args.novel_epsilon, delta=args.delta,
                         bound=1.0 if args.novel_bound is None else args.novel_bound)
    return privacy, novel


def _method_settings(args: argparse.Namespace) -> dict:
    names = ("lr", "local_steps", "batch_size", "mu", "server_lr", "weight_decay", "grad_clip", "lr_decay")
    settings = {name: getattr(args, name) for name in names if getattr(args, name) is not None}
    for key, value in getattr(args, "method_option", []):
        if key in settings and settings[key] != value:
            raise PrivflError(f"--method-option {key}={value!r} contradicts --{key.replace('_', '-')} "
                              f"{settings[key]!r}; give it once")
        settings[key] = value
    return settings


def _federation_spec(args: argparse.Namespace):
    from privfl.data import FederationSpec

    return FederationSpec(
        source=args.dataset, source_options=dict(args.source_option), data_root=args.data_root,
        download=args.download, num_clients=args.clients, partition=args.partition,
        shards_per_client=args.shards_per_client, alpha=args.alpha, novel_fraction=args.novel_fraction,
        split=args.split, novel_clients=args.novel_clients, novel_partition=args.novel_partition,
        novel_alpha=args.novel_alpha, novel_shards_per_client=args.novel_shards_per_client,
        val_fraction=args.val_fraction, max_samples=args.max_samples, novel_blur_sigma=args.novel_blur_sigma,
        novel_blur_kernel=args.novel_blur_kernel, novel_rotation=args.novel_rotation,
        train_angles=args.train_angles, novel_angles=args.novel_angles, angle_assignment=args.angle_assignment,
    )


def _run_config(args: argparse.Namespace, method: str, settings: dict):
    from privfl.config import RunConfig
    from privfl.methods import get_method
    from privfl.privacy.training import RECORD

    privacy, novel_privacy = _privacy(args)
    spec = get_method(method)
    if args.novel_bound is not None and not (spec.novel_privacy is None and (
            novel_privacy.private or privacy.mode == RECORD)):
        raise PrivflError(f"--novel-bound {args.novel_bound:g} would do nothing in this run of {method}: it clips what "
                          "a novel client releases with --novel-epsilon (ODPFL-HN, IT-PFL-HN; PeFLL's unseen clients), "
                          "and with record-level DP the descriptors of those methods' training clients; give "
                          "--novel-epsilon or record-level DP with one of them, or drop --novel-bound")
    return RunConfig(
        federation=_federation_spec(args), method=method, method_config=settings, model=args.model,
        rounds=args.rounds, client_fraction=args.client_fraction, eval_every=args.eval_every,
        checkpoint_every=args.checkpoint_every, select=args.select, seed=args.seed, delta=args.delta,
        privacy=privacy, novel_privacy=novel_privacy, workers=args.workers, device=args.device,
        features=args.features, features_options=dict(args.feature_option),
        allow_large_delta=args.allow_large_delta, central_eval=args.central_eval,
    )


def _add_engine_arguments(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("engine")
    g.add_argument("--engine", default="inprocess", choices=("inprocess", "flower-sim"),
                   help="inprocess or flower-sim (Flower's simulation engine; needs privfl[flower])")
    g.add_argument("--flower-cpus-per-client", type=float, default=1.0, help="Ray CPUs per client process")
    g.add_argument("--flower-gpus-per-client", type=float, default=0.0, help="Ray GPU share per client process")
    g.add_argument("--flower-actors", type=int, default=None,
                   help="client processes at once (default: half the CPU cores, at least 1)")
    g.add_argument("--flower-threads", type=int, default=1, help="torch threads per client process")
    g.add_argument("--flower-clients-per-node", type=int, default=None,
                   help="clients each virtual SuperNode holds: more means fewer, larger Flower messages (default: "
                        "about 4 nodes per client process, ceil(clients / (4 x actors)); 1 with distributed DP)")


def _engine_settings(args: argparse.Namespace) -> dict:
    if args.engine == "inprocess":
        return {"engine": "inprocess"}
    from privfl.engines.flower import FlowerOptions

    return {"engine": args.engine, "flower_options": FlowerOptions(
        cpus_per_client=args.flower_cpus_per_client, gpus_per_client=args.flower_gpus_per_client,
        max_actors=args.flower_actors, threads=args.flower_threads, clients_per_node=args.flower_clients_per_node)}


def cmd_train(args: argparse.Namespace) -> int:
    from privfl.engines.choice import run
    from privfl.evaluation import comparison_table
    from privfl.federation import RunDirectory

    if args.resume:
        # the run continues as its config.json says: an option that would change it is refused, not ignored
        kept = {"resume", "no_progress", "threads", "func", "defaults_of", "command", "allow_overshoot"}
        given = sorted(f"--{name.replace('_', '-')}" for name, value in vars(args).items()
                       if name not in kept and value != args.defaults_of(name))
        if given:
            raise PrivflError(f"--resume continues {args.resume} as its config.json says; {', '.join(given)} would be "
                              "ignored: drop them, or start a new run with --out")
        if RunDirectory(args.resume).path(RunDirectory.SUMMARY).exists():
            print(f"{args.resume} holds a finished run: nothing to resume (its novel clients are not served again, "
                  "which would release their data again); its summary:")
        summary = run(None, args.resume, resume=True, progress=not args.no_progress,
                      allow_overshoot=args.allow_overshoot)
        out = args.resume
    else:
        if args.allow_overshoot:
            raise PrivflError("--allow-overshoot lets a resumed run (--resume RUN_DIR) pass its target epsilon; a new "
                              "run plans its noise for the target and cannot pass it: drop it")
        if not args.out:
            raise PrivflError("--out RUN_DIR is required for a new run (or --resume RUN_DIR to continue one)")
        config = _run_config(args, args.method, _method_settings(args))
        summary = run(config, args.out, overwrite=args.overwrite, progress=not args.no_progress,
                      **_engine_settings(args))
        out = args.out
    print(comparison_table([summary]))
    print(f"run directory: {out}")
    return 0


def _demo_settings(args: argparse.Namespace) -> list[tuple[str, dict]]:
    """Each demo method's settings: the demo's own (:data:`DEMO_METHODS`) with every method setting the user gave on
    top, for each method that has it (``--mu`` is FedProx's alone); a setting no demo method has is refused rather
    than ignored."""
    from privfl.methods import METHODS

    given = _method_settings(args)
    fields = {method: set(METHODS[method].config().to_dict()) for method, _ in DEMO_METHODS}
    unknown = sorted(key for key in given if not any(key in names for names in fields.values()))
    if unknown:
        raise PrivflError(f"the demo's methods ({', '.join(fields)}) have no setting {', '.join(unknown)}; "
                          f"valid: {', '.join(sorted(set().union(*fields.values())))}")
    return [(method, {**settings, **{k: v for k, v in given.items() if k in fields[method]}})
            for method, settings in DEMO_METHODS]


def cmd_demo(args: argparse.Namespace) -> int:
    from privfl.evaluation import comparison_table
    from privfl.experiment import check_reusable, train_once
    from privfl.federation import RunDirectory

    out = Path(args.out)
    configs = [(method, _run_config(args, method, settings)) for method, settings in _demo_settings(args)]
    # every refusal before the first training: a run or a sweep in --out itself, or a method's directory holding
    # another run (the same settings are read back, an interrupted run continued)
    folder = RunDirectory(out)
    if not args.overwrite and (folder.path(RunDirectory.CONFIG).exists() or folder.occupant() == "a sweep"):
        raise PrivflError(f"{out} already holds {folder.occupant() or 'a run'}; choose another --out, or pass "
                          "--overwrite to replace it")
    for method, config in configs:
        check_reusable(config, RunDirectory(out / method), overwrite=args.overwrite)
    summaries = [train_once(config, str(out / method), overwrite=args.overwrite, progress=not args.no_progress)
                 for method, config in configs]
    table = comparison_table(summaries)
    out.mkdir(parents=True, exist_ok=True)
    (out / "comparison.txt").write_text(table + "\n")
    print(f"\nNovel-client accuracy (%), {args.dataset}, {args.clients} clients, novel fraction {args.novel_fraction}, "
          f"{args.rounds} rounds, seed {args.seed}:\n")
    print(table)
    print(f"\nrun directories: {args.out}/<method>; table: {args.out}/comparison.txt")
    return 0


def cmd_report(args: argparse.Namespace) -> int:
    """The summaries of run directories side by side, finished or not (an unfinished run's epsilons recomputed from
    its recorded releases), each with its directory and noise source."""
    from privfl.evaluation import comparison_table
    from privfl.federation.spend import run_summary

    summaries = [run_summary(d) for d in args.run_dirs]
    print(comparison_table(summaries))
    for summary in summaries:
        for warning in summary.get("warnings", []):
            print(f"privfl: warning: {summary['run_dir']}: {warning}", file=sys.stderr)
    return 0


def cmd_ledger(args: argparse.Namespace) -> int:
    """Epsilon per client recomputed by the accountant from the releases a run recorded (releases.jsonl, beside
    ledger.json and the last checkpoint's ledgers), finished or not."""
    from collections import Counter

    from privfl.evaluation.report import format_epsilon, trust_model
    from privfl.federation import RunDirectory
    from privfl.federation.spend import read_lifetime, read_spend

    if args.delta is not None and not (math.isfinite(args.delta) and 0 < args.delta < 1):
        raise PrivflError(f"--delta must be a probability in (0, 1), got {args.delta}")
    spend = read_spend(args.run_dir, args.delta)
    book, delta = spend.book, spend.delta
    for warning in spend.warnings:
        print(f"privfl: warning: {warning}", file=sys.stderr)
    # A Flower run's clients keep their ledgers on their nodes across runs: ledger.json holds this run's releases,
    # node-ledgers.json every record the nodes held at the run's end, from which each client's lifetime epsilon
    # (and the earlier runs it includes) is recomputed at --delta.
    found = read_lifetime(args.run_dir, delta)
    lifetime, lifetime_source, lifetime_warnings = found if found is not None else ({}, "", [])
    for warning in lifetime_warnings:
        print(f"privfl: warning: {warning}", file=sys.stderr)
    print(f"run {spend.root}: {spend.status}; recomputed from {', '.join(spend.sources) or 'no file (no release)'}")
    print(f"epsilon at delta={delta:g} ({book.accountant} accountant), {len(book)} clients with releases"
          + (f" in run {lifetime['run_id']}" if lifetime.get("run_id") else ""))
    if lifetime:
        earlier = lifetime.get("earlier_runs") or []
        print("lifetime: every release of the client on its node, this run's and "
              + (f"earlier runs' ({', '.join(earlier)})" if earlier else "no earlier run's")
              + f"; from {lifetime_source}")
    lifetime_eps = lifetime.get("epsilon_per_client", {})
    summary = RunDirectory(args.run_dir).read_json(RunDirectory.SUMMARY) \
        if RunDirectory(args.run_dir).path(RunDirectory.SUMMARY).exists() else {}
    secure = ((summary.get("privacy") or {}).get("secure_aggregation") if isinstance(summary, dict) else None)
    print(f"{'client':>6}  {'releases':>8}  {'epsilon':>8}  " + (f"{'lifetime':>8}  " if lifetime else "")
          + f"{'mode':<11}  {'relation':<32}  {'trust':<28}  purposes")
    epsilons = spend.epsilons()     # recomputed, or what summary.json states where larger (a warning says so)
    ids = set(book) | set(epsilons) | {int(c) for c in lifetime_eps}
    for client_id in sorted(ids, key=lambda c: (isinstance(c, str), c if isinstance(c, int) else 0, str(c))):
        records = book[client_id].records if client_id in book else []
        purposes = Counter(record.purpose for record in records)
        listed = ", ".join(f"{name} x{count}" for name, count in sorted(purposes.items()))
        modes = sorted({str(r.metadata["mode"]) for r in records if "mode" in r.metadata}) or ["-"]
        relations = sorted({str(r.metadata.get("relation") or r.event.relation.value) for r in records
                            if r.event.relation is not None}) or ["none (not private)"]
        # whom the epsilon holds against: the training mode's trust model; a release without a mode is a novel
        # client's, noised on the client
        private = [r for r in records if r.event.relation is not None]
        trusts = sorted({trust_model(str(r.metadata["mode"]) if "mode" in r.metadata else "local", secure)
                         for r in private}) or [trust_model(None)]
        epsilon = epsilons.get(client_id, 0.0)
        total = lifetime_eps.get(str(client_id))
        print(f"{client_id!s:>6}  {len(records):>8}  {format_epsilon(epsilon):>8}  "
              + (f"{format_epsilon(float(total)) if total is not None else '-':>8}  " if lifetime else "")
              + f"{'/'.join(modes):<11}  {'; '.join(relations):<32}  {'; '.join(trusts):<28}  {listed}")
    return 0


def _parse_numbers(kind):
    def parse(text: str) -> tuple:
        try:
            return tuple(kind(v) for v in text.split(",") if v.strip())
        except ValueError:
            raise argparse.ArgumentTypeError(f"expected comma-separated {kind.__name__}s, got {text!r}") from None
    return parse


def cmd_sweep(args: argparse.Namespace) -> int:
    """Train a method at each training epsilon, serve novel clients at several (epsilon, n); print the tables."""
    import dataclasses

    from privfl.evaluation.reference import reference_report
    from privfl.sweep import FULL_SIZES, PRIVATE_ROUNDS, SIZES, SweepConfig, format_table, run_sweep

    if args.full_grid and args.private_rounds is not None:
        raise PrivflError(f"--private-rounds {args.private_rounds} would be ignored: under --full-grid every private "
                          "training runs --rounds rounds; drop one of them")
    private_rounds = None if args.full_grid else (PRIVATE_ROUNDS if args.private_rounds is None
                                                  else args.private_rounds)
    given = {name: getattr(args, name) for name in ("rounds", "train_clip", "min_samples", "model")
             if getattr(args, name) is not None}
    if args.features is not None:
        given["features"] = None if args.features == "none" else args.features
        given.setdefault("model", "auto" if args.features == "none" else "linear")
    config = SweepConfig(dataset=args.dataset, data_root=args.data_root, source_options=dict(args.source_option),
                         clients=args.clients, max_samples=args.max_samples, client_fraction=args.client_fraction,
                         method=args.method, method_config=dict(args.method_option) or None,
                         train_epsilons=args.train_epsilons, private_rounds=private_rounds,
                         epsilons=args.epsilons, delta=args.delta, bound=args.bound,
                         sizes=args.sizes or (FULL_SIZES if args.full_grid else SIZES),
                         novel_mixes=args.novel_mixes, eval_size=args.eval_size,
                         repeats=args.repeats, seed=args.seed, device=args.device, **given)
    result = run_sweep(config, args.out, progress=not args.no_progress, overwrite=args.overwrite)
    rounds = (f"{config.rounds} rounds per training" if config.private_rounds in (None, config.rounds) else
              f"{config.rounds} rounds without DP, {config.private_rounds} per private training")
    stage = f" on {config.features} features ({config.model})" if config.features else ""
    print(f"\n{args.method} on {args.dataset}{stage}, {rounds}; novel clients' accuracy (%) +- SEM "
          f"over label mixes and noise draws (novel release: delta={args.delta:g}, bound={args.bound:g}, "
          f"replace-one, n public):\n")
    print(format_table(result))
    # the figures stored in the repository for these settings, and whether this run reproduced them
    print("\n" + reference_report(result, args.reference, defaults=dataclasses.asdict(SweepConfig())))
    print(f"\nwall time {result['wall_s']:.0f} s; results: {args.out}/sweep.csv, sweep.json, sweep.png; "
          f"training runs: {', '.join(t['training']['directory'] for t in result['trainings'].values())}")
    return 0


def _parse_epsilons(text: str) -> tuple[float | None, ...]:
    """Comma-separated epsilons, ``inf`` (or ``none``) for a training without DP."""
    values: list[float | None] = []
    for part in (p.strip() for p in text.split(",") if p.strip()):
        if part.lower() in ("inf", "none"):
            values.append(None)
            continue
        try:
            values.append(float(part))
        except ValueError:
            raise argparse.ArgumentTypeError(f"expected comma-separated epsilons or inf, got {text!r}") from None
    return tuple(values)


#: The most bytes of resized images ``privfl features`` hands the backbone at once (float32).
FEATURE_BATCH_BYTES = 512 * 2 ** 20


def cmd_features(args: argparse.Namespace) -> int:
    """Write a frozen backbone's features of a data source's images to the ``.npz`` the ``features`` source reads
    (``x``, ``y``, and ``x_test``, ``y_test`` where the source has a test split)."""
    import io

    import numpy as np

    from privfl.data import load_source
    from privfl.devices import resolve_device
    from privfl.errors import StorageError, check_writable, is_storage_fault, storage_message
    from privfl.federation.rundir import atomic_write_bytes
    from privfl.models.backbones import ImageBackbone, extract_features, load_backbone

    out = Path(args.out)
    if out.suffix != ".npz":
        raise PrivflError(f"--out must name a .npz file (what the features source reads), got {str(out)!r}")
    check_writable(out, "--out")                 # before the work, not after it
    if out.exists() and not args.overwrite:
        raise PrivflError(f"{out} exists; choose another --out, or pass --overwrite to replace it")
    if args.batch_size < 1:
        raise PrivflError(f"--batch-size must be an integer >= 1, got {args.batch_size}")
    if args.max_samples is not None and args.max_samples < 1:
        raise PrivflError(f"--max-samples must be an integer >= 1 (images per split), got {args.max_samples}")
    device = resolve_device(args.device)
    backbone = load_backbone(args.backbone, **dict(args.backbone_option))
    if not isinstance(backbone, ImageBackbone):
        raise PrivflError(f"backbone {args.backbone!r} embeds text, and every data source holds images or vectors; "
                          "use an image backbone (mobilenet_v2)")
    batch_bytes = args.batch_size * backbone.channels * backbone.input_size ** 2 * 4
    if batch_bytes > FEATURE_BATCH_BYTES:      # the images alone; the backbone's activations are many times more
        most = max(1, FEATURE_BATCH_BYTES // (backbone.channels * backbone.input_size ** 2 * 4))
        raise PrivflError(f"--batch-size {args.batch_size} images of {backbone.input_size}x{backbone.input_size} "
                          f"pixels take {batch_bytes / 2**30:.1f} GiB a batch before the backbone's activations; use "
                          f"--batch-size {most} or less, or a smaller input_size")
    source = load_source(args.dataset, data_root=args.data_root, download=args.download, **dict(args.source_option))
    if not source.is_image:
        raise PrivflError(f"source {args.dataset!r} holds vectors of shape {source.input_shape}, not images: "
                          f"{args.backbone} takes images (mnist, fashion_mnist, cifar10, ...; see privfl datasets)")
    backbone.to(device)
    rng = np.random.default_rng(args.seed)
    arrays = {}
    for suffix, split in (("", source.train), ("_test", source.test)):
        if split is None:
            continue
        index = np.arange(len(split.y))
        if args.max_samples is not None and len(index) > args.max_samples:
            index = np.sort(rng.choice(len(index), size=args.max_samples, replace=False))
        arrays["x" + suffix] = extract_features(backbone, split.x[index], dataset=f"{args.dataset}{suffix}",
                                                use_cache=False, batch_size=args.batch_size,
                                                progress=not args.no_progress)
        arrays["y" + suffix] = np.asarray(split.y[index], dtype=np.int64)
    buffer = io.BytesIO()
    np.savez(buffer, **arrays)  # type: ignore[arg-type]  # mypy matches **arrays to the stub's allow_pickle: bool
    try:
        atomic_write_bytes(out, buffer.getvalue())
    except OSError as error:      # the disk filled (or the folder turned read-only) while the features were made
        if not is_storage_fault(error):
            raise
        raise StorageError(f"cannot write --out {out}: {storage_message(error)}; free space (or choose another "
                           "--out), then run it again") from None
    shapes = ", ".join(f"{key} {tuple(value.shape)}" for key, value in arrays.items())
    print(f"{out}: {args.backbone} features of {args.dataset} on {device} ({shapes}); train on them with: privfl train "
          f"--method fedpft --dataset features --source-option path={out}")
    return 0


def cmd_datasets(args: argparse.Namespace) -> int:
    from privfl.data import list_sources

    infos = list_sources(data_root=args.data_root)
    width = max(len(i.name) for i in infos)
    for info in infos:
        print(f"{info.name.ljust(width)}  {'available' if info.available else 'missing  '}  {info.detail}")
    return 0


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="privfl", description=__doc__.splitlines()[0])
    sub = parser.add_subparsers(dest="command", required=True)

    p = sub.add_parser("train", help="train one method and serve its novel clients")
    p.add_argument("--method", default="fedavg", help="a registered method (fedavg, fedprox, scaffold, local, ...)")
    p.add_argument("--out", default=None, help="run directory to create")
    p.add_argument("--resume", default=None, metavar="RUN_DIR",
                   help="continue an interrupted run (its config.json sets everything; other run options are refused)")
    p.add_argument("--overwrite", action="store_true", help="replace a run already in --out")
    p.add_argument("--allow-overshoot", action="store_true",
                   help="with --resume: continue even where running again the rounds after the last checkpoint "
                        "takes a training client past its target epsilon (refused without it, saying by how much)")
    _add_federation_arguments(p)
    _add_training_arguments(p)
    _add_privacy_arguments(p)
    _add_engine_arguments(p)
    p.set_defaults(func=cmd_train, defaults_of=p.get_default)

    p = sub.add_parser("demo", help="FedAvg vs FedProx vs SCAFFOLD on MNIST with novel clients")
    p.add_argument("--out", default="runs/demo")
    p.add_argument("--overwrite", action="store_true",
                   help="replace runs of other settings in OUT/<method> (the same settings are read back)")
    _add_federation_arguments(p)
    _add_training_arguments(p, fixed={"local_steps": 20, "batch_size": 64})
    _add_privacy_arguments(p)
    p.set_defaults(func=cmd_demo, rounds=30)

    p = sub.add_parser("report", help="print the summary of one or more run directories")
    p.add_argument("run_dirs", nargs="+")
    p.set_defaults(func=cmd_report)

    p = sub.add_parser("ledger", help="epsilon per client from a run's recorded releases")
    p.add_argument("run_dir")
    p.add_argument("--delta", type=float, default=None, help="default: the run's delta")
    p.set_defaults(func=cmd_ledger)

    p = sub.add_parser("attack", help="attacks and audits against what methods release")
    attack = p.add_subparsers(dest="attack", required=True)
    # `privfl attack audit ...` is handed to the audit's own parser in main(); listed here for --help.
    attack.add_parser("audit",
                      help="empirical epsilon lower bound for a mechanism (privatize, dp_gmm, classic, maxpool)")
    attack.add_parser("reconstruct", help="diffusion reconstruction attack on raw / FedPFT / DP-FedPFT releases "
                      "(PSNR, LPIPS, SSIM table and image grid)")

    # `privfl flower ...` is handed to privfl.engines.flower.launch in main(); listed here for --help.
    sub.add_parser("flower", help="Flower deployment engine: certs, superlink, register, supernode, run")

    p = sub.add_parser("sweep", help="privacy-utility sweep: train a method (ODPFL-HN) at several training-client "
                                     "epsilons, serve novel clients at several epsilons and sizes")
    p.add_argument("--out", default="runs/sweep", help="folder for the training run, sweep.csv/json and sweep.png")
    p.add_argument("--dataset", default="mnist")
    p.add_argument("--data-root", default=None)
    p.add_argument("--source-option", action="append", type=_parse_option, default=[], metavar="KEY=VALUE",
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
    p.add_argument("--method-option", action="append", type=_parse_option, default=[], metavar="KEY=VALUE",
                   help="a setting of the method (replaces the sweep's ODPFL-HN defaults when given)")
    p.add_argument("--train-epsilons", type=_parse_epsilons, default=(1.0, 3.0, 8.0, None),
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
    p.add_argument("--epsilons", type=_parse_numbers(float), default=(0.1, 0.3, 1.0, 3.0),
                   help="novel clients' epsilons (default: 0.1,0.3,1,3)")
    p.add_argument("--delta", type=float, default=1e-5)
    p.add_argument("--bound", type=float, default=1.0, help="per-sample L2 clipping radius of phi")
    p.add_argument("--sizes", type=_parse_numbers(int), default=None,
                   help="novel-client sizes (default: 50,500,1000; with --full-grid 20,50,150,500,1000)")
    p.add_argument("--novel-mixes", type=int, default=5, help="label mixes (novel clients) per size")
    p.add_argument("--eval-size", type=int, default=500, help="held-out test images per novel client")
    p.add_argument("--repeats", type=int, default=2, help="noise draws per (mix, size, epsilon)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--threads", type=int, default=None, help="torch CPU threads (1 on a shared machine)")
    _add_device_argument(p, "the trainings compute", "where present and the method runs there")
    p.add_argument("--overwrite", action="store_true",
                   help="write into an OUT that holds another sweep's results, retraining trainings of other settings")
    p.add_argument("--reference", default=None, metavar="FILE",
                   help="a stored sweep.json to compare this run's figures with (default: the sweep of the same "
                        "settings under benchmarks/results/ beside the package, when there is one)")
    p.add_argument("--no-progress", action="store_true")
    p.set_defaults(func=cmd_sweep)

    p = sub.add_parser("features", help="write a frozen backbone's features of a data source to the .npz that the "
                                        "features source reads (FedPFT's input)")
    p.add_argument("--out", required=True, help="the .npz file to write (arrays x, y and x_test, y_test)")
    p.add_argument("--dataset", default="mnist", help="an image source (see `privfl datasets`)")
    p.add_argument("--backbone", default="mobilenet_v2", help="a frozen feature extractor of images")
    p.add_argument("--backbone-option", action="append", type=_parse_option, default=[], metavar="KEY=VALUE",
                   help="a backbone setting, e.g. input_size=64 (pixels the images are resized to; default 224, and "
                        "64 is about ten times faster on a CPU); repeatable")
    p.add_argument("--data-root", default=None, help="folder holding torchvision-format data")
    p.add_argument("--download", action="store_true", help="let torchvision download missing data (needs internet)")
    p.add_argument("--source-option", action="append", type=_parse_option, default=[], metavar="KEY=VALUE",
                   help="a source setting, e.g. split=letters for 'emnist'; repeatable")
    p.add_argument("--max-samples", type=int, default=None,
                   help="at most this many images of each split, a random subset (default: every image)")
    p.add_argument("--seed", type=int, default=0, help="seed of the --max-samples subset")
    p.add_argument("--batch-size", type=int, default=256, help="images per forward pass")
    _add_device_argument(p, "the backbone computes", "where present")
    p.add_argument("--overwrite", action="store_true", help="replace an existing --out")
    p.add_argument("--no-progress", action="store_true")
    p.set_defaults(func=cmd_features)

    p = sub.add_parser("datasets", help="list every data source and whether it is available here")
    p.add_argument("--data-root", default=None)
    p.set_defaults(func=cmd_datasets)
    return show_defaults(parser)


def main(argv: list[str] | None = None) -> int:
    """The ``privfl`` command. A Ctrl-C anywhere, even while torch is still being imported, ends it with
    ``privfl: interrupted`` and exit status 130, never a traceback (long work saves what it has first)."""
    try:
        return _main(sys.argv[1:] if argv is None else list(argv))
    except KeyboardInterrupt:
        print("privfl: interrupted", file=sys.stderr)
        return 130


def _main(argv: list[str]) -> int:
    # a Ctrl-C anywhere below ends in main's one line (long work saves what it has first)
    if argv[:1] == ["flower"]:
        from privfl.engines.flower.launch import main as flower_main

        return flower_main(argv[1:])
    if argv[:2] == ["attack", "audit"]:
        from attacks.audit import audit_main

        return audit_main(argv[2:])
    if argv[:2] == ["attack", "reconstruct"]:
        from attacks.reconstruct_cli import reconstruct_main

        return reconstruct_main(argv[2:])
    args = build_parser().parse_args(argv)
    for name in ("lr", "mu", "server_lr", "weight_decay", "grad_clip", "lr_decay", "alpha", "novel_fraction",
                 "client_fraction", "delta"):
        value = getattr(args, name, None)
        if isinstance(value, float) and not math.isfinite(value):
            print(f"privfl: error: --{name.replace('_', '-')} must be a finite number, got {value}", file=sys.stderr)
            return 2
    from privfl.experiment import RunInterrupted
    from privfl.memory import reuse_freed_memory

    reuse_freed_memory()   # large per-round tensors from the heap, not fresh page-faulted mmaps (privfl.memory)
    threads = getattr(args, "threads", None)
    if threads is None and getattr(args, "workers", 1) > 1:
        threads = 1   # each worker computes on one thread, and this process must too (privfl.federation.workers)
    if threads is not None:
        if threads < 1:
            print(f"privfl: error: --threads must be an integer >= 1, got {threads}", file=sys.stderr)
            return 2
        import torch

        torch.set_num_threads(threads)
    from accounting import BudgetExceededError

    try:
        return args.func(args)
    except RunInterrupted as interrupted:
        print(f"privfl: {interrupted}", file=sys.stderr)
        return 130
    except PrivflError as error:
        print(f"privfl: error: {error}", file=sys.stderr)
        return 2
    except BudgetExceededError as refused:    # a release refused before it was sent: nothing was lost
        print(f"privfl: refused: {refused}", file=sys.stderr)
        return 2
    except BrokenPipeError:  # output piped into a command that stopped reading (e.g. head)
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        return 0
    except InternalError:
        return report_bug()


#: Exit status of a fault inside privfl (``EX_SOFTWARE`` of BSD's sysexits.h).
EXIT_INTERNAL = 70


def report_bug() -> int:
    """Print the exception being handled with its traceback and a request to report it; return
    :data:`EXIT_INTERNAL`."""
    import traceback

    traceback.print_exc()
    print("privfl: internal error: this is a bug in privfl, not a problem with your input; please report it with "
          "the traceback above and the command you ran", file=sys.stderr)
    return EXIT_INTERNAL


if __name__ == "__main__":
    sys.exit(main())
