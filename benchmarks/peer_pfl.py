"""privfl against Apple's pfl (pfl-research, ``pfl`` 0.6.0), side by side: the same client datasets, the same initial
weights, the same 2NN, one torch thread each, interleaved runs.

* W1, non-private FedAvg: MNIST's 60,000 training images over 1,000 IID clients (60 each), 500 clients a round,
  3 local SGD steps of batch 16 at lr 0.1, server SGD lr 1 momentum 0.9, 20 rounds.
* W2, central DP: W1 at epsilon 8, delta 1e-5 over 40 rounds at client rate 0.5, clip adaptive (initial 0.1, the
  median, log-space step 0.2, count noise sigma_b 25 = expected clients / 20; pfl's indicator noise is 2 sigma_b in its
  +-1 units, so the two split the round's budget alike).

privfl runs as a user runs it (:func:`privfl.experiment.train` into a run directory: ledgers, the hash-chained release
journal, checkpoints every 10 rounds); pfl runs its ``SimulatedBackend`` with ``FederatedAveraging``, central DP
through ``AdaptiveClippingGaussianMechanism`` over ``GaussianMechanism.from_privacy_accountant`` (its PLD accountant).
pfl pins dp-accounting 0.5.x (the project uses 0.6.0), so it runs in its own virtual environment, which this script
creates under ``runs/peer_pfl/venv`` (pip from the package index; torch is not installed twice: a ``.pth`` file puts
this interpreter's torch after the venv's own packages, so pfl sees its own dp-accounting and this torch).

What differs by design, and is left as each framework does it: pfl samples a fixed cohort of 500 with replacement and
its ``Dataset.iter`` makes one unshuffled pass (3 steps take a client's first 48 images), while privfl samples 500
without replacement (W1) or by Poisson at 0.5 (W2, as its accountant assumes) and draws shuffled batches; pfl
evaluates every cohort client at iteration 0. Per-round times leave out round 0 (pfl's evaluation, warm-up) and the
last round (the final evaluation); what remains counts everything a round does, privfl's checkpoint after round 10
and 20 (W2: and 30) included. Accuracy is on MNIST's 10,000 test images, computed here the same way for both.

    python benchmarks/peer_pfl.py [--quick] [--seeds 0 1 2] [--workloads w1 w2]

Each seed is one interleaved pair per workload (privfl then pfl, or pfl then privfl, alternating), so contention on a
shared machine hits both sides alike; ratios are privfl / pfl of CPU seconds per round. ``--quick``: one seed, 6 rounds
of W1 and 8 of W2 (timing only: their accuracies are not the benchmark's). Writes
``benchmarks/results/peer_pfl.json`` (``peer_pfl_quick.json`` with ``--quick``).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
WORK = ROOT / "runs" / "peer_pfl"
VENV = WORK / "venv"
RESULTS = ROOT / "benchmarks" / "results"
TARGET_RATIO = 0.8

#: The two workloads; everything not listed is the same in both.
WORKLOADS = {
    "w1": {"rounds": 20, "private": False},
    "w2": {"rounds": 40, "private": True},
}
QUICK_ROUNDS = {"w1": 6, "w2": 8}
CLIENTS, FRACTION, LOCAL_STEPS, BATCH, LR, SERVER_LR, MOMENTUM = 1000, 0.5, 3, 16, 0.1, 1.0, 0.9
EPSILON, DELTA = 8.0, 1e-5
CLIP_INITIAL, CLIP_QUANTILE, CLIP_LR = 0.1, 0.5, 0.2
COUNT_NOISE = CLIENTS * FRACTION / 20.0     # privfl's default sigma_b (the count of clients within the clip, 0/1 units)
#: The files of a run directory that record its releases: the journal, the ledgers, the checkpoint (which holds the
#: ledgers as they stood, beside the model): "the records" whose size the issue bounds.
RECORDS = ("releases.jsonl", "ledger.json", "checkpoint.pt")
PFL_REQUIREMENTS = ["pfl==0.6.0", "dp-accounting>=0.5,<0.6", "prv-accountant>=0.2,<0.3", "multiprocess>=0.70.15,<0.71"]


# -- the data both frameworks train on --------------------------------------------------------------------------------

def export_data(seed: int) -> Path:
    """privfl's federation for ``seed`` (1,000 IID clients of MNIST's training split; the test split as one held-out
    part) and privfl's initial 2NN weights for ``seed``, as one ``.npz`` the pfl side reads."""
    path = WORK / f"data_seed{seed}.npz"
    if path.exists():
        return path
    import numpy as np

    from privfl.config import build_method, run_federation

    config = privfl_config("w1", seed, rounds=1)
    federation = run_federation(config)
    strategy, _ = build_method(config, federation)      # non-private FedAvg: its weights are the initial 2NN's
    clients = federation.training_clients
    novel = federation.novel_clients[0]
    arrays = {
        "client_ids": np.array([c.client_id for c in clients]),
        "sizes": np.array([c.num_train for c in clients]),
        "x": np.concatenate([c.x_train.numpy() for c in clients]),
        "y": np.concatenate([c.y_train.numpy() for c in clients]),
        "x_test": novel.x.numpy(),
        "y_test": np.asarray(federation.novel_labels.labels(novel.client_id)),
        **{f"w_{k}": v.numpy() for k, v in strategy.weights.items()},
    }
    WORK.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(".tmp.npz")
    np.savez(tmp, **arrays)
    tmp.replace(path)
    return path


def privfl_config(workload: str, seed: int, *, rounds: int):
    from privfl.config import RunConfig
    from privfl.data import FederationSpec
    from privfl.privacy.training import TrainingPrivacy

    federation = FederationSpec(source="mnist", split="train_test", num_clients=CLIENTS, partition="iid",
                                val_fraction=0.0, novel_clients=1, novel_partition="iid")
    privacy = (TrainingPrivacy(mode="central", epsilon=EPSILON, delta=DELTA, clip="adaptive", clip_initial=CLIP_INITIAL,
                               clip_quantile=CLIP_QUANTILE, clip_lr=CLIP_LR, clip_count_noise=COUNT_NOISE)
               if WORKLOADS[workload]["private"] else TrainingPrivacy())
    return RunConfig(federation=federation, method="fedavg", model="mlp2nn", rounds=rounds, seed=seed,
                     method_config={"lr": LR, "local_steps": LOCAL_STEPS, "batch_size": BATCH, "server_lr": SERVER_LR,
                                    "server_momentum": MOMENTUM},
                     client_fraction=FRACTION, eval_every=rounds, checkpoint_every=10, select="last", delta=DELTA,
                     privacy=privacy)


def test_accuracy(weights: dict, x, y) -> float:
    """Accuracy (%) of the 2NN with ``weights`` (numpy or torch, by privfl's names) on ``(x, y)``."""
    import torch

    w = {k: torch.as_tensor(v) for k, v in weights.items()}
    with torch.no_grad():
        h = torch.flatten(torch.as_tensor(x), 1)
        h = torch.relu(h @ w["fc1.weight"].T + w["fc1.bias"])
        h = torch.relu(h @ w["fc2.weight"].T + w["fc2.bias"])
        logits = h @ w["fc3.weight"].T + w["fc3.bias"]
        return float((logits.argmax(1) == torch.as_tensor(y)).double().mean()) * 100.0


def per_round(starts: list[tuple[float, float]]) -> dict:
    """CPU and wall seconds of each round from the (cpu, wall) stamps at each round's start (and one after the last
    measured round): round 0 and the last round are not passed in."""
    cpu = [b[0] - a[0] for a, b in zip(starts, starts[1:], strict=False)]
    wall = [b[1] - a[1] for a, b in zip(starts, starts[1:], strict=False)]
    return {"cpu": cpu, "wall": wall, "cpu_mean": statistics.fmean(cpu), "wall_mean": statistics.fmean(wall)}


def stamp() -> tuple[float, float]:
    return time.process_time(), time.perf_counter()


# -- privfl's side ---------------------------------------------------------------------------------------------------

def run_privfl(workload: str, seed: int, rounds: int) -> dict:
    import shutil

    sys.path.insert(0, str(ROOT))
    import torch

    torch.set_num_threads(1)
    from privfl.experiment import build_runtime, train
    from privfl.federation.rundir import RunDirectory

    config = privfl_config(workload, seed, rounds=rounds)
    out = WORK / f"privfl_{workload}_seed{seed}"
    shutil.rmtree(out, ignore_errors=True)
    starts: list[tuple[float, float]] = []
    held: dict = {}

    def factory(config, federation):
        runtime = build_runtime(config, federation)
        run_round = runtime.run_round

        def timed(round: int):
            starts.append(stamp())
            return run_round(round)

        runtime.run_round = timed
        held["runtime"] = runtime
        return runtime

    began = stamp()
    train(config, str(out), progress=False, runtime_factory=factory)
    ended = stamp()
    runtime = held["runtime"]
    weights = runtime.strategy.inner.weights if hasattr(runtime.strategy, "inner") else runtime.strategy.weights
    data = __import__("numpy").load(export_data(seed))
    run_dir = RunDirectory(out)
    sizes = {name: run_dir.path(name).stat().st_size for name in RunDirectory.FILES if run_dir.path(name).exists()}
    result = {"framework": "privfl", "workload": workload, "seed": seed, "rounds": rounds,
              "per_round": per_round(starts[1:]), "total_cpu_s": ended[0] - began[0],
              "total_wall_s": ended[1] - began[1], "accuracy": test_accuracy(weights, data["x_test"], data["y_test"]),
              "files_bytes": sizes, "records_bytes": sum(sizes.get(name, 0) for name in RECORDS)}
    if WORKLOADS[workload]["private"]:
        strategy = runtime.strategy
        result.update(noise_multiplier=strategy.noise_multiplier, update_multiplier=strategy.update_multiplier,
                      epsilon=max(runtime.ledgers().epsilons(DELTA).values()), final_clip=strategy.clip)
    return result


def run_floor(workload: str, seed: int, rounds: int) -> dict:
    """The floor under both frameworks (W1's work and nothing else, written by hand): each round 500 clients sampled
    as privfl samples them, each loading the global weights, taking 3 SGD steps on privfl's batches, and keeping its
    weight change; then their weighted mean and the server's momentum step. No messages, records or checks: what any
    loop that trains these clients one after another and averages their changes exactly must spend."""
    sys.path.insert(0, str(ROOT))
    import torch

    torch.set_num_threads(1)
    from privfl.config import run_federation
    from privfl.federation.runtime import sample_clients
    from privfl.federation.seeding import derive_rng
    from privfl.methods.local_training import minibatches
    from privfl.models import build_model

    federation = run_federation(privfl_config(workload, seed, rounds=rounds))
    clients = {c.client_id: c for c in federation.training_clients}
    torch.manual_seed(seed)
    model = build_model("mlp2nn", federation.input_shape, federation.num_classes)
    params = list(model.parameters())
    weights = [p.detach().clone() for p in params]
    momentum = None
    starts: list[tuple[float, float]] = []
    began = stamp()
    for round in range(rounds):
        starts.append(stamp())
        changes, counts = [], []
        for cid in sample_clients(sorted(clients), FRACTION, seed=seed, round=round):
            data = clients[cid]
            with torch.no_grad():
                for p, w in zip(params, weights, strict=True):
                    p.copy_(w)
            for index in minibatches(data.num_train, BATCH, LOCAL_STEPS, derive_rng(seed, "client_train", round, cid)):
                batch = torch.from_numpy(index)
                loss = torch.nn.functional.cross_entropy(model(data.x_train[batch]), data.y_train[batch])
                for p in params:
                    p.grad = None
                loss.backward()
                with torch.no_grad():
                    for p in params:
                        p.add_(p.grad, alpha=-LR)
            with torch.no_grad():
                changes.append([p.detach() - w for p, w in zip(params, weights, strict=True)])
            counts.append(float(data.num_train))
        total = sum(counts)
        mean = [sum(change[i] * (n / total) for change, n in zip(changes, counts, strict=True))
                for i in range(len(params))]
        momentum = mean if momentum is None else [MOMENTUM * m + c for m, c in zip(momentum, mean, strict=True)]
        weights = [w + SERVER_LR * m for w, m in zip(weights, momentum, strict=True)]
    ended = stamp()
    return {"framework": "floor", "workload": workload, "seed": seed, "rounds": rounds,
            "per_round": per_round(starts[1:]), "total_cpu_s": ended[0] - began[0], "total_wall_s": ended[1] - began[1]}


def privfl_accountant(z: float, rounds: int) -> dict:
    """privfl's epsilon for ``rounds`` Poisson-subsampled Gaussian rounds at noise multiplier ``z`` and its own
    calibrated z for epsilon 8."""
    sys.path.insert(0, str(ROOT))
    from accounting import SelfComposedEvent, epsilon
    from privfl.privacy.training import TrainingPrivacy, central_noise_multiplier, central_round_event

    own = central_noise_multiplier(TrainingPrivacy(mode="central", epsilon=EPSILON, delta=DELTA, clip="adaptive"),
                                   sampling_probability=FRACTION, rounds=rounds)
    return {"epsilon_at_z": epsilon(SelfComposedEvent(central_round_event(z, FRACTION), rounds), DELTA),
            "calibrated_z": own}


# -- pfl's side (runs in pfl's venv: imports neither privfl nor the project's dp-accounting) ---------------------------

def _client_arrays(data) -> dict:
    """``{client id: (x, y)}`` of an exported federation (the clients' rows lie one after another)."""
    import numpy as np

    offsets = np.concatenate([[0], np.cumsum(data["sizes"])])
    x, y = data["x"], data["y"]
    return {cid: (x[offsets[i]:offsets[i + 1]], y[offsets[i]:offsets[i + 1]])
            for i, cid in enumerate(data["client_ids"].tolist())}


def run_pfl(workload: str, seed: int, rounds: int) -> dict:
    import numpy as np
    import torch

    torch.set_num_threads(1)
    from pfl.aggregate.simulate import SimulatedBackend
    from pfl.algorithm import FederatedAveraging, NNAlgorithmParams
    from pfl.callback.base import TrainingProcessCallback
    from pfl.data.dataset import Dataset
    from pfl.data.federated_dataset import FederatedDataset
    from pfl.data.sampling import get_user_sampler
    from pfl.hyperparam import NNEvalHyperParams, NNTrainHyperParams
    from pfl.metrics import Metrics
    from pfl.model.pytorch import PyTorchModel

    data = np.load(WORK / f"data_seed{seed}.npz")
    users = _client_arrays(data)

    class TwoNN(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.fc1 = torch.nn.Linear(int(np.prod(data["x"].shape[1:])), 200)
            self.fc2 = torch.nn.Linear(200, 200)
            self.fc3 = torch.nn.Linear(200, 10)

        def forward(self, inputs):
            h = torch.relu(self.fc1(torch.flatten(inputs, 1)))
            return self.fc3(torch.relu(self.fc2(h)))

        def loss(self, inputs, labels, eval=False):   # noqa: A002 (pfl's signature)
            self.eval() if eval else self.train()
            return torch.nn.functional.cross_entropy(self(inputs), labels.long())

        @torch.no_grad()
        def metrics(self, inputs, labels, eval=True):   # noqa: A002
            from pfl.metrics import Weighted
            self.eval()
            logits = self(inputs)
            n = len(labels)
            loss = float(torch.nn.functional.cross_entropy(logits, labels.long(), reduction="sum"))
            correct = float((logits.argmax(1) == labels.long()).sum())
            return {"loss": Weighted(loss, n), "accuracy": Weighted(correct, n)}

    np.random.seed(seed)      # pfl's random sampler and its seeds draw from numpy's global state
    torch.manual_seed(seed)
    module = TwoNN()
    module.load_state_dict({k[2:]: torch.from_numpy(data[k]) for k in data.files if k.startswith("w_")})
    model = PyTorchModel(model=module, local_optimizer_create=torch.optim.SGD,
                         central_optimizer=torch.optim.SGD(module.parameters(), lr=SERVER_LR, momentum=MOMENTUM))
    federated = FederatedDataset(lambda cid: Dataset(users[cid], user_id=cid), get_user_sampler("random", list(users)))
    cohort = int(round(FRACTION * CLIENTS))
    postprocessors = []
    result: dict = {}
    if WORKLOADS[workload]["private"]:
        mechanism, result["noise_multiplier"] = _pfl_central_dp(rounds, cohort)
        postprocessors.append(mechanism)
    backend = SimulatedBackend(training_data=federated, val_data=None, postprocessors=postprocessors)
    starts: list[tuple[float, float]] = []

    class Stamps(TrainingProcessCallback):
        def after_central_iteration(self, aggregate_metrics, model, *, central_iteration):
            starts.append(stamp())     # the end of round r is the start of round r + 1
            return False, Metrics()

    algorithm = FederatedAveraging()
    params = NNAlgorithmParams(central_num_iterations=rounds, evaluation_frequency=rounds + 1,
                               train_cohort_size=cohort, val_cohort_size=0)
    train_params = NNTrainHyperParams(local_learning_rate=LR, local_num_epochs=None, local_num_steps=LOCAL_STEPS,
                                      local_batch_size=BATCH)
    began = stamp()
    algorithm.run(algorithm_params=params, backend=backend, model=model, model_train_params=train_params,
                  model_eval_params=NNEvalHyperParams(local_batch_size=None), callbacks=[Stamps()])
    ended = stamp()
    weights = {k: v.detach() for k, v in module.state_dict().items()}
    result.update({"framework": "pfl", "workload": workload, "seed": seed, "rounds": rounds,
                   # stamps[r] ends round r: rounds 1 .. R-2 lie between stamps[0] and stamps[R-2]
                   "per_round": per_round(starts[:-1]), "total_cpu_s": ended[0] - began[0],
                   "total_wall_s": ended[1] - began[1], "accuracy": test_accuracy(weights, data["x_test"],
                                                                                  data["y_test"])})
    return result


def _pfl_central_dp(rounds: int, cohort: int) -> tuple[object, float]:
    """W2's mechanism in pfl: adaptive clipping around the Gaussian mechanism its PLD accountant calibrates; and the
    noise multiplier it chose."""
    from pfl.privacy import CentrallyAppliedPrivacyMechanism, GaussianMechanism, PLDPrivacyAccountant
    from pfl.privacy.adaptive_clipping import AdaptiveClippingGaussianMechanism

    accountant = PLDPrivacyAccountant(num_compositions=rounds, sampling_probability=cohort / CLIENTS,
                                      mechanism="gaussian", epsilon=EPSILON, delta=DELTA)
    mechanism = AdaptiveClippingGaussianMechanism(
        make_gaussian_mechanism=lambda clip: GaussianMechanism.from_privacy_accountant(
            accountant=accountant, clipping_bound=clip),
        initial_clipping_bound=CLIP_INITIAL, clipping_indicator_noise_stddev=2 * COUNT_NOISE,
        adaptive_clipping_norm_quantile=CLIP_QUANTILE, log_space_step_size=CLIP_LR)
    assert isinstance(mechanism, CentrallyAppliedPrivacyMechanism)
    return mechanism, float(accountant.cohort_noise_parameter)


def pfl_accountant(z: float, rounds: int) -> dict:
    """pfl's PLD accountant: its epsilon for noise multiplier ``z`` and its calibrated z for epsilon 8."""
    from pfl.privacy import PLDPrivacyAccountant

    at_z = PLDPrivacyAccountant(num_compositions=rounds, sampling_probability=FRACTION, mechanism="gaussian",
                                noise_parameter=z, delta=DELTA)
    own = PLDPrivacyAccountant(num_compositions=rounds, sampling_probability=FRACTION, mechanism="gaussian",
                               epsilon=EPSILON, delta=DELTA)
    return {"epsilon_at_z": float(at_z.epsilon), "calibrated_z": float(own.noise_parameter)}


# -- pfl's environment ------------------------------------------------------------------------------------------------

def venv_python() -> Path:
    return VENV / "bin" / "python"


def ensure_pfl_venv() -> Path:
    """pfl's own virtual environment (created once): pfl and its pinned dp-accounting from the package index, numpy
    and scipy at this interpreter's versions, and this interpreter's torch through a ``.pth`` file placed after the
    venv's own packages."""
    python = venv_python()
    check = [str(python), "-c", "import pfl, torch, dp_accounting, numpy; "
             f"assert dp_accounting.__file__.startswith({str(VENV)!r})"]
    if python.exists() and subprocess.run(check, capture_output=True).returncode == 0:
        return python
    import numpy
    import scipy
    import torch

    print(f"creating pfl's virtual environment in {VENV} (pip, a minute)", flush=True)
    subprocess.run([sys.executable, "-m", "venv", "--clear", str(VENV)], check=True)
    subprocess.run([str(python), "-m", "pip", "install", "--quiet", "--disable-pip-version-check",
                    *PFL_REQUIREMENTS, f"numpy=={numpy.__version__}", f"scipy=={scipy.__version__}"], check=True)
    site = subprocess.run([str(python), "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"],
                          check=True, capture_output=True, text=True).stdout.strip()
    torch_site = str(Path(torch.__file__).resolve().parents[1])
    # "zz": .pth files are read in name order and each appends to sys.path: the venv's own packages stay first
    Path(site, "zz_project_torch.pth").write_text(torch_site + "\n")
    subprocess.run(check, check=True)
    return python


# -- the driver -------------------------------------------------------------------------------------------------------

def child(framework: str, workload: str, seed: int, rounds: int) -> dict:
    cmd = [str(venv_python()) if framework == "pfl" else sys.executable, __file__, "--child", framework,
           "--workload", workload, "--seed", str(seed), "--rounds", str(rounds)]
    env = {**os.environ, "OMP_NUM_THREADS": "1", "MKL_NUM_THREADS": "1"}
    if framework == "pfl":
        env.pop("PYTHONPATH", None)
    done = subprocess.run(cmd, capture_output=True, text=True, env=env, cwd=str(ROOT))
    if done.returncode != 0:
        raise RuntimeError(f"{framework} {workload} seed {seed} failed:\n{done.stderr[-4000:]}")
    return json.loads(done.stdout.strip().splitlines()[-1])


def spread(values: list[float]) -> str:
    return f"{min(values):.3f}-{max(values):.3f}" if len(values) > 1 else f"{values[0]:.3f}"


def summarize(runs: list[dict], workloads: list[str], accountants: dict) -> dict:
    summary = {}
    for w in workloads:
        mine = {r["seed"]: r for r in runs if r["workload"] == w and r["framework"] == "privfl"}
        theirs = {r["seed"]: r for r in runs if r["workload"] == w and r["framework"] == "pfl"}
        seeds = sorted(set(mine) & set(theirs))
        cpu_ratios = [mine[s]["per_round"]["cpu_mean"] / theirs[s]["per_round"]["cpu_mean"] for s in seeds]
        wall_ratios = [mine[s]["per_round"]["wall_mean"] / theirs[s]["per_round"]["wall_mean"] for s in seeds]
        med = {name: statistics.median(side[s]["per_round"][key] for s in seeds)
               for name, side in (("privfl", mine), ("pfl", theirs)) for key in ("cpu_mean",)}
        summary[w] = {
            "pairs": len(seeds),
            "cpu_s_per_round_median": med,
            "wall_s_per_round_median": {name: statistics.median(side[s]["per_round"]["wall_mean"] for s in seeds)
                                        for name, side in (("privfl", mine), ("pfl", theirs))},
            "cpu_ratio_median": statistics.median(cpu_ratios), "cpu_ratio_pairs": cpu_ratios,
            "wall_ratio_median": statistics.median(wall_ratios), "wall_ratio_pairs": wall_ratios,
            "accuracy": {"privfl": [mine[s]["accuracy"] for s in seeds], "pfl": [theirs[s]["accuracy"] for s in seeds]},
            "privfl_records_bytes": [mine[s]["records_bytes"] for s in seeds],
            "privfl_files_bytes": mine[seeds[0]]["files_bytes"] if seeds else {},
        }
        floor = {r["seed"]: r for r in runs if r["workload"] == w and r["framework"] == "floor"}
        if floor and seeds:
            summary[w]["floor_cpu_s_per_round_median"] = statistics.median(floor[s]["per_round"]["cpu_mean"]
                                                                           for s in floor)
            summary[w]["floor_over_pfl_pairs"] = [floor[s]["per_round"]["cpu_mean"] / theirs[s]["per_round"]["cpu_mean"]
                                                  for s in seeds if s in floor]
            summary[w]["floor_over_pfl"] = statistics.median(summary[w]["floor_over_pfl_pairs"])
        if WORKLOADS[w]["private"] and seeds:
            summary[w]["noise_multiplier"] = {"privfl": mine[seeds[0]]["noise_multiplier"],
                                              "pfl": theirs[seeds[0]]["noise_multiplier"]}
            summary[w]["privfl_epsilon_spent"] = max(mine[s]["epsilon"] for s in seeds)
    if accountants:
        summary["accountants"] = accountants
    return summary


def report(summary: dict, workloads: list[str]) -> str:
    lines = ["| workload | pairs | privfl CPU s/round | pfl CPU s/round | CPU ratio (median, spread) | "
             "wall ratio (median, spread) | floor CPU s/round (floor / pfl) | accuracy privfl | accuracy pfl | "
             "privfl records |",
             "|---|---|---|---|---|---|---|---|---|---|"]
    for w in workloads:
        s = summary[w]
        acc = {k: ", ".join(f"{a:.2f}" for a in v) for k, v in s["accuracy"].items()}
        floor = (f"{s['floor_cpu_s_per_round_median']:.3f} ({s['floor_over_pfl']:.3f})" if "floor_over_pfl" in s
                 else "-")
        lines.append(f"| {w} | {s['pairs']} | {s['cpu_s_per_round_median']['privfl']:.3f} | "
                     f"{s['cpu_s_per_round_median']['pfl']:.3f} | {s['cpu_ratio_median']:.3f} "
                     f"({spread(s['cpu_ratio_pairs'])}) | {s['wall_ratio_median']:.3f} "
                     f"({spread(s['wall_ratio_pairs'])}) | {floor} | {acc['privfl']} | {acc['pfl']} | "
                     f"{max(s['privfl_records_bytes']) / 1e6:.2f} MB |")
    if "accountants" in summary:
        a = summary["accountants"]
        lines.append(f"\naccountants at z = {a['z']:.4f} ({a['rounds']} rounds, q = {FRACTION}, delta = {DELTA:g}): "
                     f"privfl epsilon {a['privfl']['epsilon_at_z']:.4f}, pfl epsilon {a['pfl']['epsilon_at_z']:.4f}; "
                     f"calibrated z for epsilon {EPSILON:g}: privfl {a['privfl']['calibrated_z']:.4f}, "
                     f"pfl {a['pfl']['calibrated_z']:.4f}")
    return "\n".join(lines)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="one seed, 6 rounds of W1 and 8 of W2 (timing only)")
    parser.add_argument("--seeds", nargs="+", type=int, default=None, help="one interleaved pair per seed (0 1 2)")
    parser.add_argument("--workloads", nargs="+", default=list(WORKLOADS), choices=list(WORKLOADS))
    parser.add_argument("--child", choices=["privfl", "pfl", "floor", "privfl-accountant", "pfl-accountant"],
                        help=argparse.SUPPRESS)
    parser.add_argument("--workload", help=argparse.SUPPRESS)
    parser.add_argument("--seed", type=int, help=argparse.SUPPRESS)
    parser.add_argument("--rounds", type=int, help=argparse.SUPPRESS)
    parser.add_argument("--z", type=float, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        run = {"privfl": lambda: run_privfl(args.workload, args.seed, args.rounds),
               "pfl": lambda: run_pfl(args.workload, args.seed, args.rounds),
               "floor": lambda: run_floor(args.workload, args.seed, args.rounds),
               "privfl-accountant": lambda: privfl_accountant(args.z, args.rounds),
               "pfl-accountant": lambda: pfl_accountant(args.z, args.rounds)}[args.child]
        print(json.dumps(run()))
        return 0
    sys.path.insert(0, str(ROOT))
    seeds = args.seeds if args.seeds is not None else ([0] if args.quick else [0, 1, 2])
    ensure_pfl_venv()
    runs = []
    for index, seed in enumerate(seeds):
        export_data(seed)
        for w in args.workloads:
            rounds = QUICK_ROUNDS[w] if args.quick else WORKLOADS[w]["rounds"]
            sides = ["privfl", "pfl", *(["floor"] if not WORKLOADS[w]["private"] else [])]
            turn = (index + args.workloads.index(w)) % len(sides)       # each side first in turn
            for framework in sides[turn:] + sides[:turn]:
                result = child(framework, w, seed, rounds)
                runs.append(result)
                accuracy = f", accuracy {result['accuracy']:.2f}" if "accuracy" in result else ""
                print(f"{w} seed {seed} {framework:6s}: {result['per_round']['cpu_mean']:.3f} CPU s/round, "
                      f"{result['per_round']['wall_mean']:.3f} wall s/round{accuracy}", flush=True)
    accountants = {}
    private = [w for w in args.workloads if WORKLOADS[w]["private"]]
    if private:
        rounds = QUICK_ROUNDS[private[0]] if args.quick else WORKLOADS[private[0]]["rounds"]
        z = next(r["noise_multiplier"] for r in runs if r["framework"] == "privfl" and r["workload"] == private[0])
        accountants = {"z": z, "rounds": rounds}
        for framework in ("privfl", "pfl"):
            python = str(venv_python()) if framework == "pfl" else sys.executable
            out = subprocess.run([python, __file__, "--child", f"{framework}-accountant", "--z", repr(z),
                                  "--rounds", str(rounds)], check=True, capture_output=True, text=True, cwd=str(ROOT))
            accountants[framework] = json.loads(out.stdout.strip().splitlines()[-1])
    summary = summarize(runs, args.workloads, accountants)
    text = report(summary, args.workloads)
    print("\n" + text)
    for w in args.workloads:
        ok = summary[w]["cpu_ratio_median"] <= TARGET_RATIO
        floor = summary[w].get("floor_over_pfl")
        print(f"{w}: privfl / pfl CPU per round {summary[w]['cpu_ratio_median']:.3f} "
              f"({'at or below' if ok else 'above'} the target {TARGET_RATIO})"
              + (f"; the hand-written floor / pfl {floor:.3f}" if floor is not None else ""))
    sys.path.insert(0, str(ROOT))
    from privfl.provenance import numerics

    RESULTS.mkdir(exist_ok=True)
    name = "peer_pfl_quick.json" if args.quick else "peer_pfl.json"
    (RESULTS / name).write_text(json.dumps({"summary": summary, "runs": runs, "seeds": seeds, "quick": args.quick,
                                            "target_ratio": TARGET_RATIO, "numerics": numerics(ROOT)}, indent=1)
                                + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
