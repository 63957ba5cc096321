"""What each ``privfl`` subcommand does: ``cmd_<name>(args) -> exit status`` for train, demo, report, ledger, sweep,
features and datasets (their options: :mod:`privfl.cli.parsers`). Each imports what it runs inside itself, so the
parser is built without torch."""

from __future__ import annotations

import argparse
import math
import sys
from pathlib import Path

from privfl.cli.options import engine_settings_of, method_settings_of, run_config_of
from privfl.errors import PrivflError

# (method, settings): the FedTTA paper's Table 4 learning rates for MNIST, with the stabilisers of the authors'
# code (without them FedProx and SCAFFOLD diverge on this protocol; see benchmarks/README.md).
_STABILISERS = {"weight_decay": 1e-4, "grad_clip": 10.0, "lr_decay": 0.99}
DEMO_METHODS = (
    ("fedavg", {"lr": 0.1, **_STABILISERS}),
    ("fedprox", {"lr": 0.3, "mu": 0.001, **_STABILISERS}),
    ("scaffold", {"lr": 0.1, "server_lr": 1.5, **_STABILISERS}),
)


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
        config = run_config_of(args, args.method, method_settings_of(args))
        summary = run(config, args.out, overwrite=args.overwrite, progress=not args.no_progress,
                      **engine_settings_of(args))
        out = args.out
    print(comparison_table([summary]))
    print(f"run directory: {out}")
    return 0


def _demo_settings(args: argparse.Namespace) -> list[tuple[str, dict]]:
    """Each demo method's settings: the demo's own (:data:`DEMO_METHODS`) with every method setting the user gave on
    top, for each method that has it (``--mu`` is FedProx's alone); a setting no demo method has is refused rather
    than ignored."""
    from privfl.methods import METHODS

    given = method_settings_of(args)
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
    configs = [(method, run_config_of(args, method, settings)) for method, settings in _demo_settings(args)]
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

