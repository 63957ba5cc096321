"""Distributed DP's round sum under Flower's SecAgg+: the server gets the sum of the releases and never one release;
the sum is the in-process (simulated) one up to quantization; the ledgers are the in-process ones; a dropout is
refused; the parameters are checked and the run summary says how the sum was taken on each engine.

The tolerance of the comparisons. A node clips each value of its vector to [-R, R] (R, the round's clipping range,
is in the summary) and rounds it stochastically to a grid of step s = 2R / T (T = 2^22): less than one step per
value, nothing clipped (``quantization_clipped`` is 0). The nodes' errors add, so round 0's sum differs from the
in-process float64 sum of the same (seeded) releases by less than nodes * s per coordinate. Round 1 starts from
models that differ by less than that over the round's count, and its releases move by a comparable amount through 3
SGD steps at lr 0.1; the final weights are compared within 10 s (they differ by about one step).
"""

from __future__ import annotations

import dataclasses
import json
import math

import numpy as np
import pytest
import torch

flwr = pytest.importorskip("flwr")

from conftest import book_records, journal_records  # noqa: E402
from flower_loopback import LoopbackGrid  # noqa: E402
from flwr.app import Error  # noqa: E402
from flwr.app import Message as FlowerMessage  # noqa: E402
from flwr.common import bytes_to_ndarray  # noqa: E402
from flwr.common.secure_aggregation.secaggplus_constants import RECORD_KEY_CONFIGS, Key  # noqa: E402

from accounting import PrivacyBudget, PrivacyLedger  # noqa: E402
from privfl.config import RunConfig  # noqa: E402
from privfl.data import FederationSpec, build_federation  # noqa: E402
from privfl.engines.choice import flower_main  # noqa: E402
from privfl.engines.flower import FlowerOptions, secagg  # noqa: E402
from privfl.engines.flower.records import unpack  # noqa: E402
from privfl.engines.flower.simulation import num_clients, simulate, simulation_run_config  # noqa: E402
from privfl.engines.flower.transport import FlowerClientError  # noqa: E402
from privfl.errors import ConfigError  # noqa: E402
from privfl.experiment import train  # noqa: E402
from privfl.federation import RunDirectory  # noqa: E402
from privfl.federation.runtime import InProcessRuntime, SecureSum, sample_clients  # noqa: E402
from privfl.methods import get_method  # noqa: E402
from privfl.methods.base import Strategy  # noqa: E402
from privfl.methods.fedavg import FedAvgStrategy  # noqa: E402
from privfl.modes.wrappers import Aggregator, protect  # noqa: E402
from privfl.privacy.training import TrainingPrivacy  # noqa: E402

T = secagg.QUANTIZATION_RANGE


def _config(**overrides) -> RunConfig:
    # 9 training clients (5 a round) and 3 novel ones; noise seeded so that both engines draw the same shares
    spec = FederationSpec(source="synthetic", source_options={"num_samples": 1200, "dim": 10, "num_classes": 4},
                          num_clients=12, partition="dirichlet", alpha=1.0, novel_fraction=0.25)
    values = dict(federation=spec, method="fedavg", method_config={"lr": 0.1, "local_steps": 3, "batch_size": 16},
                  rounds=2, eval_every=2, checkpoint_every=2, select="last", client_fraction=0.5, seed=3,
                  privacy=TrainingPrivacy(mode="distributed", noise_multiplier=1.0, clip=1.0, noise="seeded"))
    values.update(overrides)
    return RunConfig(**values)


class _Seen:
    """What the server side handed the strategy (one secure sum per round, never the releases) and, in-process,
    each client's release by (round, client)."""

    def __init__(self, monkeypatch) -> None:
        self.sums: list[tuple[int, int, dict[str, torch.Tensor]]] = []
        self.releases: dict[tuple[int, int], torch.Tensor] = {}
        seen = self
        aggregate_sum, exchange = Aggregator.aggregate_sum, InProcessRuntime.exchange

        def record_sum(self, round, total):
            seen.sums.append((round, total.count, {k: v.clone() for k, v in total.arrays.items()}))
            return aggregate_sum(self, round, total)

        def refuse(self, round, replies):
            raise AssertionError("the aggregator of distributed DP was handed the releases themselves")

        def record_exchange(self, round, stage, messages):
            replies = exchange(self, round, stage, messages)
            for cid, message in replies.items():
                seen.releases[round, cid] = torch.cat([t.reshape(-1).double() for t in message.arrays.values()])
            return replies

        monkeypatch.setattr(Aggregator, "aggregate_sum", record_sum)
        monkeypatch.setattr(Aggregator, "aggregate_train", refuse)
        monkeypatch.setattr(InProcessRuntime, "exchange", record_exchange)


class RecordingGrid:
    """A Grid that keeps every message the server pushes and every reply it pulls, around ``inner``."""

    def __init__(self, inner) -> None:
        self.inner = inner
        self.pushed: list[FlowerMessage] = []
        self.pulled: list[FlowerMessage] = []

    def push_messages(self, messages):
        messages = list(messages)
        self.pushed.extend(messages)
        return self.inner.push_messages(messages)

    def pull_messages(self, message_ids):
        replies = list(self.inner.pull_messages(message_ids))
        self.pulled.extend(replies)
        return replies

    def __getattr__(self, name):
        return getattr(self.inner, name)


def _loopback(config, root, ranges, **kwargs):
    total = num_clients(config)
    nodes = {100 + i: {"partition-range": f"{a}-{b}", "num-partitions": total, "privfl-dir": str(root / f"n{i}")}
             for i, (a, b) in enumerate(ranges)}
    return RecordingGrid(LoopbackGrid(nodes, {"privfl-config": json.dumps(config.to_dict())}, **kwargs))


def _ledgers(run_dir):
    return sorted((cid, [(r["purpose"], r["round"], r["event"],
                          {k: v for k, v in r["metadata"].items() if k != "run"})   # Flower's run id
                         for r in held]) for cid, held in book_records(run_dir / "ledger.json").items())


def _weights(run_dir):
    return torch.load(RunDirectory(run_dir).path("checkpoint.pt"), weights_only=True)["runtime"]["strategy"]["inner"][
        "weights"]


def _train_replies(grid):
    """The replies to the train exchanges (Flower message type ``train``), in order."""
    return [r for r in grid.pulled if r.metadata.message_type == "train"]


def _assert_only_masked_vectors(grid, rounds, nodes_per_round):
    """No reply of a train exchange carries an array; the masked-vector stage's replies carry masked integer
    vectors (SecAgg+ configs), one per node and round."""
    replies = _train_replies(grid)
    assert replies and all(len(record) == 0 for r in replies for record in r.content.array_records.values())
    assert not any(key.startswith("m0.") for r in replies for key in r.content)      # no packed privfl reply
    masked = [r for r in replies if Key.MASKED_PARAMETERS in r.content.config_records[RECORD_KEY_CONFIGS]]
    assert len(masked) == sum(nodes_per_round) and len(nodes_per_round) == rounds
    for reply in masked:
        vector = [bytes_to_ndarray(b) for b in reply.content.config_records[RECORD_KEY_CONFIGS][Key.MASKED_PARAMETERS]]
        assert all(v.dtype == np.int64 and v.min() >= 0 and v.max() < secagg.MODULUS_RANGE for v in vector)
    return masked


def _assert_sums_match(flower_sums, inprocess_sums, rounds_summary):
    """One secure sum per round on both engines, of the same count; round 0's within nodes * 2R / T of the
    in-process sum (quantization, see the module docstring)."""
    assert [(r, n) for r, n, _ in flower_sums] == [(r, n) for r, n, _ in inprocess_sums]
    _, _, flower0 = flower_sums[0]
    _, _, inprocess0 = inprocess_sums[0]
    step = 2 * rounds_summary[0]["clipping_range"] / T
    worst = max(float((flower0[k] - inprocess0[k]).abs().max()) for k in inprocess0)
    assert worst < rounds_summary[0]["nodes"] * step + 1e-9
    assert worst > 0                       # the sum did go through quantization (not the releases in the clear)
    return step


@pytest.fixture(scope="module")
def inprocess(tmp_path_factory):
    """The in-process run of :func:`_config` (secure aggregation simulated), what its aggregator received, and
    each client's release."""
    out = tmp_path_factory.mktemp("inprocess")
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    with pytest.MonkeyPatch.context() as monkeypatch:
        seen = _Seen(monkeypatch)
        summary = train(_config(), str(out), progress=False)
    torch.set_num_threads(threads)
    return {"summary": summary, "dir": out, "sums": seen.sums, "releases": seen.releases}


def test_in_process_the_summary_says_the_secure_sum_was_simulated(inprocess):
    described = inprocess["summary"]["privacy"]["secure_aggregation"]
    assert described["protocol"] == "simulated" and "sees each of them" in described["description"]
    assert [(r, n) for r, n, _ in inprocess["sums"]] == [(0, 5), (1, 5)]


def test_on_the_simulation_engine_the_server_gets_the_sum_under_secagg_plus_and_never_a_release(
        tmp_path, inprocess, monkeypatch, one_thread):
    config = _config()
    seen = _Seen(monkeypatch)
    options = FlowerOptions(max_actors=1, threads=1, timeout_s=300)
    grids: list[RecordingGrid] = []

    def main(grid, values):
        grids.append(RecordingGrid(grid))
        return flower_main(grids[0], values, options=options)

    out = tmp_path / "flower"
    got = simulate(main, simulation_run_config(config, str(out), overwrite=False), num_clients(config), options)
    grid = grids[0]

    # (a) the strategy got one sum per round; the server received masked vectors, never a release
    described = got["privacy"]["secure_aggregation"]
    assert described["protocol"] == "SecAgg+" and len(described["rounds"]) == 2
    masked = _assert_only_masked_vectors(grid, 2, [r["nodes"] for r in described["rounds"]])
    # each node holds one client here: its masked vector, dequantized, is nowhere near that client's release
    # (the in-process one: seeded, the same numbers), as a uniform mask makes it
    clients_of = {}
    for message in grid.pushed:
        if message.metadata.message_type == "train" and "privfl" in message.content:
            header, items = unpack(message.content)
            clients_of[message.metadata.message_id] = (header["round"], sorted(items))
    for reply in masked:
        round, clients = clients_of[reply.metadata.reply_to_message_id]
        bound = described["rounds"][round]["clipping_range"]
        assert len(clients) == 1
        vector = [bytes_to_ndarray(b) for b in reply.content.config_records[RECORD_KEY_CONFIGS][Key.MASKED_PARAMETERS]]
        values = np.concatenate([v.reshape(-1) for v in vector[1:-1]]) * (2 * bound / T) - bound
        release = inprocess["releases"][round, clients[0]].numpy()
        assert values.shape == release.shape
        assert np.mean(np.abs(values - release) < 100 * 2 * bound / T) < 0.01

    # (b) the sums and the model are the in-process ones up to quantization
    step = _assert_sums_match(seen.sums, inprocess["sums"], described["rounds"])
    flower_weights, inprocess_weights = _weights(out), _weights(inprocess["dir"])
    assert max(float((flower_weights[k] - inprocess_weights[k]).abs().max()) for k in flower_weights) < 10 * step
    assert all(r["quantization_clipped"] == 0 for r in described["rounds"])
    metrics = RunDirectory(out).read_metrics()
    assert [m["quantization_clipped"] for m in metrics] == [0.0]        # evaluated (and logged) every 2 rounds

    # (c) the ledgers, kept on the nodes, are the in-process ones, and so are the epsilons
    assert _ledgers(out) == _ledgers(inprocess["dir"])
    assert got["privacy"]["epsilon_per_client"] == inprocess["summary"]["privacy"]["epsilon_per_client"]
    assert math.isfinite(got["privacy"]["epsilon_max_training"]) and got["privacy"]["epsilon_max_training"] > 0

    # the summary gives the protocol's parameters: every node shared with every other, all were needed to unmask
    assert described["num_shares"] == 1.0 and described["reconstruction_threshold"] == 1.0
    assert described["quantization_range"] == T and described["modulus_range"] == secagg.MODULUS_RANGE
    assert all(r["num_shares"] == r["reconstruction_threshold"] == r["nodes"] == 5 for r in described["rounds"])
    assert 0 < described["clip_probability_bound"] < 1e-3 * config.delta


def test_nodes_holding_several_clients_mask_the_sum_of_their_releases(tmp_path, inprocess, monkeypatch,
                                                                       task_identity, one_thread):
    config = _config()
    seen = _Seen(monkeypatch)
    grid = _loopback(config, tmp_path, [(0, 2), (3, 5), (6, 11)])
    got = flower_main(grid, {"privfl-config": json.dumps(config.to_dict()), "out": str(tmp_path / "flower")},
                      options=FlowerOptions(timeout_s=60, node_wait_s=5))
    rounds = got["privacy"]["secure_aggregation"]["rounds"]
    assert all(r["nodes"] <= 3 and r["clients_per_node_max"] >= 2 for r in rounds)
    _assert_only_masked_vectors(grid, 2, [r["nodes"] for r in rounds])
    step = _assert_sums_match(seen.sums, inprocess["sums"], rounds)
    flower_weights, inprocess_weights = _weights(tmp_path / "flower"), _weights(inprocess["dir"])
    assert max(float((flower_weights[k] - inprocess_weights[k]).abs().max()) for k in flower_weights) < 10 * step
    assert _ledgers(tmp_path / "flower") == _ledgers(inprocess["dir"])


def test_the_values_quantization_clips_are_counted_under_the_mask(tmp_path, inprocess, monkeypatch, task_identity,
                                                                  one_thread):
    # a clipping range of C + sigma_s / 2 (k = 0.5 in place of ~8.5) clips many values: each node counts its own and
    # the count is summed securely with the vector; round 0's releases are the in-process ones (seeded)
    config = _config()
    monkeypatch.setattr(secagg, "quantization_sigmas", lambda secure, values: 0.5)
    grid = _loopback(config, tmp_path, [(i, i) for i in range(num_clients(config))])
    got = flower_main(grid, {"privfl-config": json.dumps(config.to_dict()), "out": str(tmp_path / "flower")},
                      options=FlowerOptions(timeout_s=60, node_wait_s=5))
    first = got["privacy"]["secure_aggregation"]["rounds"][0]
    expected = sum(int((release.abs() > first["clipping_range"]).sum())
                   for (round, _), release in inprocess["releases"].items() if round == 0)
    assert expected > 1000 and first["quantization_clipped"] == expected
    assert RunDirectory(tmp_path / "flower").read_metrics()[0]["quantization_clipped"] > 1000     # round 1's


def test_a_node_that_drops_after_sharing_its_keys_stops_the_run_before_the_sum_is_used(tmp_path, monkeypatch,
                                                                                        task_identity):
    # SecAgg+ could unmask the others' sum without the dropped node's release; that sum would lack a noise share
    config = _config()
    seen = _Seen(monkeypatch)
    training = [c.client_id for c in build_federation(config.federation, seed=config.seed).training_clients]
    client = sample_clients(training, config.client_fraction, seed=config.seed, round=0)[0]
    dropped = training.index(client)             # one node per partition: node 100 + i holds partition i

    def drop(message):
        configs = message.content.config_records.get(RECORD_KEY_CONFIGS)
        return message.metadata.dst_node_id == 100 + dropped and configs is not None \
            and configs.get(Key.STAGE) == "collect_masked_vectors"

    grid = _loopback(config, tmp_path, [(i, i) for i in range(num_clients(config))], drop=drop)
    with pytest.raises(FlowerClientError, match=r"1 of 5 nodes did not answer 'train \(SecAgg\+ "
                                                r"collect_masked_vectors\)' within 0.5 s"):
        flower_main(grid, {"privfl-config": json.dumps(config.to_dict()), "out": str(tmp_path / "flower")},
                    options=FlowerOptions(timeout_s=0.5, node_wait_s=5))
    assert seen.sums == []                              # nothing reached the strategy
    # the dropped node made its release (recorded before it left the node): a release made stays recorded
    ledger = PrivacyLedger.load(tmp_path / f"n{dropped}" / f"ledger-client-{client}.json")
    assert [(r.purpose, r.round) for r in ledger.records] == [("model_update", 0)]


class FailingUnmaskGrid(RecordingGrid):
    """A Grid on which the first node asked to unmask in round ``round`` (the round's SecAgg+ run, counted from 0)
    answers with an error: every masked vector of that round has reached the server, the sum is never taken."""

    def __init__(self, inner, round) -> None:
        super().__init__(inner)
        self.round = round
        self.unmasks = 0
        self.failing: dict[str, FlowerMessage] = {}

    def push_messages(self, messages):
        messages = list(messages)
        ids = list(super().push_messages(messages))
        stages = [m.content.config_records[RECORD_KEY_CONFIGS].get(Key.STAGE)
                  if RECORD_KEY_CONFIGS in m.content.config_records else None for m in messages]
        if "unmask" in stages:
            if self.unmasks == self.round:
                first = stages.index("unmask")
                self.failing[str(ids[first])] = messages[first]
            self.unmasks += 1
        return ids

    def pull_messages(self, message_ids):
        replies = list(self.inner.pull_messages(message_ids))
        replies = [FlowerMessage(Error(code=0, reason="the node failed to unmask"),
                                 reply_to=self.failing[r.metadata.reply_to_message_id])
                   if r.metadata.reply_to_message_id in self.failing else r for r in replies]
        self.pulled.extend(r for r in replies if not r.has_error())
        return replies


def test_a_secagg_run_that_fails_after_a_round_journals_every_release_whose_masked_vector_arrived(tmp_path,
                                                                                               one_thread):
    # On the simulation engine, a node fails in round 1's unmask stage: both rounds' masked vectors (and the ledger
    # records beside them) reached the server. The run directory's journal and ledger.json hold every release the
    # clients made, as their node ledgers do, though the server never saw a release.
    config = _config()
    options = FlowerOptions(max_actors=1, threads=1, timeout_s=300)
    grids: list[FailingUnmaskGrid] = []

    def main(grid, values):
        grids.append(FailingUnmaskGrid(grid, round=1))
        return flower_main(grids[0], values, options=options)

    out = tmp_path / "flower"
    with pytest.raises(FlowerClientError, match=r"failed in 'train \(SecAgg\+ unmask\)': .*the node failed to "
                                                r"unmask"):
        simulate(main, simulation_run_config(config, str(out), overwrite=False), num_clients(config), options)
    assert grids[0].unmasks == 2 and not (out / "summary.json").exists()
    _assert_only_masked_vectors(grids[0], 2, [5, 5])             # still no release reached the server

    def listed(records):
        return [(r["purpose"], r["round"], r["event"], r["metadata"]) for r in records]

    on_nodes = {}
    for path in sorted((out / "nodes").glob("partition-*/ledger-client-*.json")):
        ledger = json.loads(path.read_text())
        on_nodes[ledger["client_id"]] = listed(ledger["records"])
    journaled: dict[int, list] = {}
    for cid, record in journal_records(out / "releases.jsonl"):
        journaled.setdefault(cid, []).extend(listed([record]))
    in_ledger = {cid: listed(held) for cid, held in book_records(out / "ledger.json").items()}
    rounds = sorted(r for records in on_nodes.values() for _, r, _, _ in records)
    assert rounds == [0] * 5 + [1] * 5                           # 5 clients a round released, in both rounds
    assert journaled == on_nodes and in_ledger == on_nodes


def test_the_secagg_parameters_and_the_quantization_range_are_checked():
    with pytest.raises(ConfigError, match="secagg_num_shares=4 must be odd"):
        FlowerOptions(secagg_num_shares=4)
    with pytest.raises(ConfigError, match=r"secagg_num_shares=1.5 as a float is a fraction .* in \(0, 1\]"):
        FlowerOptions(secagg_num_shares=1.5)
    with pytest.raises(ConfigError, match="reconstruction_threshold.*must be less than `num_shares`"):
        FlowerOptions(secagg_num_shares=5, secagg_reconstruction_threshold=5)
    assert FlowerOptions(secagg_num_shares=5, secagg_reconstruction_threshold=3).secagg_num_shares == 5

    # k is the least number of share sigmas with (1 + e^eps) * values * 2 Phi(-k) <= delta / 1000
    def secure(epsilon):
        return SecureSum(like={"w": torch.zeros(10)}, bound=1.0, noise_std=0.5,
                         calibrated_for=PrivacyBudget(epsilon, 1e-5))

    for epsilon, values in ((1.0, 10 ** 4), (30.0, 10 ** 9)):
        k = secagg.quantization_sigmas(secure(epsilon), values)
        added = (1 + math.exp(epsilon)) * values * math.erfc(k / math.sqrt(2))
        assert added == pytest.approx(1e-5 * secagg.CLIP_DELTA_FRACTION, rel=1e-6)
    assert secagg.clipping_range(secure(1.0), 4, 8.0) == 4 * 1.0 + 8.0 * 2 * 0.5
    with pytest.raises(ConfigError, match="epsilon=800 cannot be quantized for SecAgg\\+ within its delta"):
        secagg.quantization_sigmas(secure(800.0), 10)


def test_distributed_dp_refuses_a_method_whose_contributions_are_not_its_releases():
    # the server never sees a release under secure aggregation, so a contribution derived from one cannot be summed
    class Derived(FedAvgStrategy):
        def contributions(self, round, replies):
            for cid in sorted(replies):
                yield cid, {k: 2 * v for k, v in replies[cid].arrays.items()}

    derived = dataclasses.replace(get_method("fedavg"), strategy=Derived)
    privacy = TrainingPrivacy(mode="distributed", noise_multiplier=1.0)
    with pytest.raises(ConfigError, match="derives its contributions from its clients' messages"):
        protect(derived, None, None, privacy, rounds=2, client_fraction=0.5, seed=0, num_training_clients=9)
    assert Derived.contributions is not Strategy.contributions
