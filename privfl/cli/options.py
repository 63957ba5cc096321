"""The options several ``privfl`` commands share, and how a command's parsed options become the objects a run takes.

Argument groups: :func:`add_federation_arguments` (data and partition), :func:`add_training_arguments` (method
settings), :func:`add_privacy_arguments` (the run's privacy mode), :func:`add_engine_arguments` and
:func:`add_device_argument`. Builders: :func:`privacy_of` (a :class:`~privfl.privacy.training.TrainingPrivacy`),
:func:`federation_spec_of`, :func:`method_settings_of`, :func:`run_config_of` (a :class:`~privfl.config.RunConfig`)
and :func:`engine_settings_of`. Value parsers for ``type=``: :func:`parse_option` (``KEY=VALUE``),
:func:`parse_angles`, :func:`parse_numbers`, :func:`parse_epsilons`. Everything heavy is imported inside the builders,
so ``privfl --help`` stays fast.
"""

from __future__ import annotations

import argparse
import json

from privfl.errors import PrivflError


def parse_angles(text: str) -> tuple[float, ...]:
    try:
        return tuple(float(v) for v in text.split(",") if v.strip())
    except ValueError:
        raise argparse.ArgumentTypeError(f"angles must be comma-separated numbers (degrees), got {text!r}") from None


def parse_option(text: str) -> tuple[str, object]:
    if "=" not in text:
        raise argparse.ArgumentTypeError(f"expected KEY=VALUE, got {text!r}")
    key, raw = text.split("=", 1)
    try:
        value = json.loads(raw)
    except json.JSONDecodeError:
        value = raw
    return key.strip(), value


def add_federation_arguments(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("data and federation")
    g.add_argument("--dataset", default="mnist", help="data source (see `privfl datasets`)")
    g.add_argument("--data-root", default=None, help="folder holding torchvision-format data")
    g.add_argument("--download", action="store_true", help="let torchvision download missing data (needs internet)")
    g.add_argument("--source-option", action="append", type=parse_option, default=[], metavar="KEY=VALUE",
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
    g.add_argument("--train-angles", type=parse_angles, default=(), help="rotated-MNIST angles, e.g. 0,30,60")
    g.add_argument("--novel-angles", type=parse_angles, default=(), help="e.g. 15,45")
    g.add_argument("--angle-assignment", default="random",
                   help="random (each client's angle drawn uniformly) or balanced (contiguous equal blocks of ids)")


def add_device_argument(p: argparse.ArgumentParser | argparse._ArgumentGroup, what: str, auto: str) -> None:
    """``--device`` (:data:`privfl.devices.DEVICES`, written out here so that ``--help`` does not import torch)."""
    p.add_argument("--device", default="cpu", choices=("auto", "cpu", "cuda"),
                   help=f"where {what}: cpu, cuda, or auto (CUDA {auto})")


def add_training_arguments(p: argparse.ArgumentParser, fixed: dict[str, object] | None = None) -> None:
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
    g.add_argument("--feature-option", action="append", type=parse_option, default=[], metavar="KEY=VALUE",
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
    g.add_argument("--method-option", action="append", type=parse_option, default=[], metavar="KEY=VALUE",
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
    add_device_argument(g, "the models compute", "where present and the method runs there")
    g.add_argument("--workers", type=int, default=1,
                   help="processes that train a round's clients, one thread each; the numbers are the one-thread "
                        "run's")
    g.add_argument("--no-progress", action="store_true")


def add_privacy_arguments(p: argparse.ArgumentParser) -> None:
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


def privacy_of(args: argparse.Namespace):
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


def method_settings_of(args: argparse.Namespace) -> dict:
    names = ("lr", "local_steps", "batch_size", "mu", "server_lr", "weight_decay", "grad_clip", "lr_decay")
    settings = {name: getattr(args, name) for name in names if getattr(args, name) is not None}
    for key, value in getattr(args, "method_option", []):
        if key in settings and settings[key] != value:
            raise PrivflError(f"--method-option {key}={value!r} contradicts --{key.replace('_', '-')} "
                              f"{settings[key]!r}; give it once")
        settings[key] = value
    return settings


def federation_spec_of(args: argparse.Namespace):
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


def run_config_of(args: argparse.Namespace, method: str, settings: dict):
    from privfl.config import RunConfig
    from privfl.methods import get_method
    from privfl.privacy.training import RECORD

    privacy, novel_privacy = privacy_of(args)
    spec = get_method(method)
    if args.novel_bound is not None and not (spec.novel_privacy is None and (
            novel_privacy.private or privacy.mode == RECORD)):
        raise PrivflError(f"--novel-bound {args.novel_bound:g} would do nothing in this run of {method}: it clips what "
                          "a novel client releases with --novel-epsilon (ODPFL-HN, IT-PFL-HN; PeFLL's unseen clients), "
                          "and with record-level DP the descriptors of those methods' training clients; give "
                          "--novel-epsilon or record-level DP with one of them, or drop --novel-bound")
    return RunConfig(
        federation=federation_spec_of(args), method=method, method_config=settings, model=args.model,
        rounds=args.rounds, client_fraction=args.client_fraction, eval_every=args.eval_every,
        checkpoint_every=args.checkpoint_every, select=args.select, seed=args.seed, delta=args.delta,
        privacy=privacy, novel_privacy=novel_privacy, workers=args.workers, device=args.device,
        features=args.features, features_options=dict(args.feature_option),
        allow_large_delta=args.allow_large_delta, central_eval=args.central_eval,
    )


def add_engine_arguments(p: argparse.ArgumentParser) -> None:
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


def engine_settings_of(args: argparse.Namespace) -> dict:
    if args.engine == "inprocess":
        return {"engine": "inprocess"}
    from privfl.engines.flower import FlowerOptions

    return {"engine": args.engine, "flower_options": FlowerOptions(
        cpus_per_client=args.flower_cpus_per_client, gpus_per_client=args.flower_gpus_per_client,
        max_actors=args.flower_actors, threads=args.flower_threads, clients_per_node=args.flower_clients_per_node)}


def parse_numbers(kind):
    def parse(text: str) -> tuple:
        try:
            return tuple(kind(v) for v in text.split(",") if v.strip())
        except ValueError:
            raise argparse.ArgumentTypeError(f"expected comma-separated {kind.__name__}s, got {text!r}") from None
    return parse


def parse_epsilons(text: str) -> tuple[float | None, ...]:
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

