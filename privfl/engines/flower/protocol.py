"""What the privfl ServerApp and ClientApp agree on: operations, message types, run-config keys, options.

Every Flower message carries the privfl :class:`~privfl.federation.messages.Message` of each client the node holds,
plus a header (a ``ConfigRecord`` under ``"privfl"``, :mod:`privfl.engines.flower.records`) naming the operation:
``hello``, ``train``, ``train_stage``, ``evaluate``, ``novel_request``, ``novel_model`` or ``ledger``. Every reply
that carries a release was recorded and saved in the node's ledger before it left the node. Entry points:
:class:`FlowerOptions`, :func:`auto_clients_per_node`, :func:`simulated_nodes`, :func:`node_partitions`.

The operations table, what reaches the server outside the ledger, and nodes holding several clients:
docs/federation.md, "The Flower protocol".
"""

from __future__ import annotations

import math
import os
from collections.abc import Mapping
from dataclasses import dataclass, replace
from typing import Any

import torch

from privfl.errors import ConfigError, PublicConfigError
from privfl.federation import spend

# operations -> Flower message types
MESSAGE_TYPES = {
    "hello": "query.hello",
    "train": "train",
    "train_stage": "train.stage",
    "evaluate": "evaluate",
    "novel_request": "query.novel_request",
    "novel_model": "query.novel_model",
    "ledger": "query.ledger",
}

#: The header key (and node ledger record metadata key) of the privfl run a message belongs to: the server names
#: its run in every message, and the node writes it into every record it makes, so a client's ledger (its lifetime,
#: across runs) tells each run's releases apart. A resumed run keeps its run id.
RUN_KEY = spend.RUN_KEY

# reply kinds
RELEASE, NOTHING, TELEMETRY = "release", "nothing", "telemetry"

#: What crosses to the server without a ledger record, by operation (telemetry replies) or ``"ledger"`` (a client's
#: ledger in a reply header), and what it carries.
OUTSIDE_LEDGER = {
    "evaluate": "a training client's score of its evaluation model on its validation split (sample count, correct "
                "count, loss sum), for the experimenter's model selection and report",
    "novel_model": "a novel client's score of its served model on its own labels (sample count, correct count, "
                   "loss sum), for the experimenter's report",
    "ledger": "a client's privacy ledger (its release events and metadata, for the summary's epsilons; DP-SGD's "
              "sampling rate q = batch_size / n gives n)",
}

# run-config keys (``[tool.flwr.app.config]`` of the app, or the simulation's defaults)
RUN_CONFIG = "privfl-config"        # the RunConfig as JSON
OUT = "out"                          # the run directory (server side)
OVERWRITE = "overwrite"
RESUME = "resume"                    # continue the run in ``out`` from its checkpoint (same privfl run id)
NODES_ROOT = "nodes-root"            # default parent of node directories ("" = each node names its own)
THREADS = "threads"                  # torch threads per ClientApp process (0 = leave torch's choice)
TIMEOUT = "timeout-s"                # seconds to wait for the replies of one exchange (> 0)
NODE_WAIT = "node-wait-s"            # seconds to wait for the nodes the run needs to connect
SERVE_FROM = "serve-from"            # a finished training run directory: serve its novel clients, do not train
SERVE_CLIENTS = "serve-clients"      # with serve-from: the novel client ids to serve ("" = every novel client)
CLIENTS_PER_NODE = "clients-per-node"  # simulation: virtual node i holds partitions i*k .. i*k+k-1 (default 1)
NUM_CLIENTS = "num-clients"          # with clients-per-node > 1: the number of partitions in all
VERBOSE = "verbose"                  # a ServerApp stopped by an operator's error logs its traceback too

# node-config keys (``flower-supernode --node-config``)
PARTITION_ID = "partition-id"
PARTITION_RANGE = "partition-range"  # "FIRST-LAST" (inclusive): the node holds several partitions (no partition-id)
NUM_PARTITIONS = "num-partitions"
NODE_DIR = "privfl-dir"              # where the node keeps its clients' ledgers and states
NODE_INDEX = "privfl-node"           # the node's key pair index (``privfl flower supernode --node I``), for messages

#: Default limit for one exchange's replies: long enough for a node that trains many clients on a CPU, short enough
#: that a dead node ends the run with an error instead of hanging it.
DEFAULT_TIMEOUT_S = 1800.0


def _default_actors() -> int:
    # Half the cores, at least one: on a shared 2-core machine one client process trains at a time and the
    # server thread and the rest of the machine keep the other core.
    return max(1, (os.cpu_count() or 2) // 2)


@dataclass(frozen=True)
class FlowerOptions:
    """How a run uses Flower: resources per client, parallel client processes, waiting limits.

    ``cpus_per_client`` and ``gpus_per_client`` are Ray resources (a fraction of a GPU shares it); ``max_actors`` caps
    the client processes the simulation runs at once (default: half the CPU cores, at least 1). ``threads`` sets
    ``torch.set_num_threads`` in each client process (0 leaves torch's default). ``timeout_s`` bounds the wait for
    one exchange's replies (seconds; the nodes that did not answer are named in the error); ``None`` waits forever,
    so a dead node hangs the run: use it only where something else watches the run. ``node_wait_s`` bounds the wait
    for the nodes the run needs. The server asks the SuperLink for replies with exponential backoff, from
    ``poll_min_s`` up to ``poll_max_s`` between asks, back to ``poll_min_s`` whenever a reply arrives. A GPU share only
    reserves the device in Ray: privfl's client procedures compute on the CPU today.

    ``clients_per_node`` (simulation only) lets each virtual SuperNode hold that many clients, as a deployment
    SuperNode with a ``partition-range`` does: the server then sends one Flower message per node and round that packs
    the messages of its selected clients, so Flower's per-message cost (a Ray task, the SuperLink's bookkeeping, the
    simulation engine scanning every node for work) is paid per node, not per client. Each client keeps its own ledger
    and state files on its node; the numbers are the same as with one client per node. ``None`` (the default) lets
    each run choose it from its client count and the client processes (:func:`auto_clients_per_node`).

    ``secagg_num_shares`` and ``secagg_reconstruction_threshold``: the SecAgg+ parameters of distributed DP's round
    sum (:mod:`privfl.engines.flower.secagg`), as Flower's ``SecAggPlusWorkflow`` takes them: an int (an odd number
    of shares >= 3; a threshold below it) or a float, a fraction (of the round's nodes; of the shares). The defaults
    (1.0, 1.0) have every node share its secrets with every other and need all of them to unmask: a server colluding
    with fewer than all the other nodes learns nothing beyond the sum, and no dropout is recovered (privfl refuses a
    round with a dropout in any case, since its sum would lack noise).
    """

    cpus_per_client: float = 1.0
    gpus_per_client: float = 0.0
    max_actors: int | None = None
    threads: int = 1
    timeout_s: float | None = DEFAULT_TIMEOUT_S
    node_wait_s: float = 120.0
    poll_min_s: float = 0.002
    poll_max_s: float = 0.1
    clients_per_node: int | None = None
    secagg_num_shares: int | float = 1.0
    secagg_reconstruction_threshold: int | float = 1.0
    verbose: bool = False

    def __post_init__(self) -> None:
        def number(value: Any) -> bool:
            return isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)

        checks = [
            ("cpus_per_client", self.cpus_per_client, number(self.cpus_per_client) and self.cpus_per_client > 0,
             "a number > 0"),
            ("gpus_per_client", self.gpus_per_client, number(self.gpus_per_client) and self.gpus_per_client >= 0,
             "a number >= 0"),
            ("max_actors", self.max_actors, self.max_actors is None or (
                isinstance(self.max_actors, int) and self.max_actors >= 1), "None or an integer >= 1"),
            ("threads", self.threads, isinstance(self.threads, int) and self.threads >= 0, "an integer >= 0"),
            ("timeout_s", self.timeout_s, self.timeout_s is None or (number(self.timeout_s) and self.timeout_s > 0),
             "None or a number > 0"),
            ("node_wait_s", self.node_wait_s, number(self.node_wait_s) and self.node_wait_s >= 0, "a number >= 0"),
            ("poll_min_s", self.poll_min_s, number(self.poll_min_s) and self.poll_min_s > 0, "a number > 0"),
            ("poll_max_s", self.poll_max_s, number(self.poll_max_s) and self.poll_max_s >= self.poll_min_s,
             f"a number >= poll_min_s ({self.poll_min_s!r})"),
            ("clients_per_node", self.clients_per_node, self.clients_per_node is None or (
                isinstance(self.clients_per_node, int) and not isinstance(self.clients_per_node, bool)
                and self.clients_per_node >= 1), "None (chosen per run) or an integer >= 1"),
        ]
        for name, value, ok, valid in checks:
            if not ok:
                raise ConfigError(f"flower option {name} must be {valid}, got {value!r}")
        self._check_secagg()
        if self.gpus_per_client > 0 and not torch.cuda.is_available():
            raise ConfigError(f"flower option gpus_per_client={self.gpus_per_client!r} but no CUDA GPU is visible")

    def _check_secagg(self) -> None:
        """Flower's own checks of the SecAgg+ parameters, and one more: an even int of shares is refused (Flower's
        workflow adds one to it for the neighbourhoods but not for the nodes, which then cannot share)."""
        from flwr.server.workflow import SecAggPlusWorkflow

        shares, threshold = self.secagg_num_shares, self.secagg_reconstruction_threshold
        for name, value in (("secagg_num_shares", shares), ("secagg_reconstruction_threshold", threshold)):
            if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
                raise ConfigError(f"flower option {name} must be an int or a float, got {value!r}")
        if isinstance(shares, float) and not 0 < shares <= 1:
            raise ConfigError(f"flower option secagg_num_shares={shares!r} as a float is a fraction of the round's "
                              "nodes, in (0, 1]")
        if isinstance(shares, int) and shares > 1 and shares % 2 == 0:
            raise ConfigError(f"flower option secagg_num_shares={shares} must be odd (each node shares with itself "
                              f"and as many neighbours on each side), e.g. {shares + 1}, or a fraction like 1.0")
        try:
            SecAggPlusWorkflow(shares, threshold)
        except ValueError as error:
            raise ConfigError(f"flower options secagg_num_shares={shares!r}, secagg_reconstruction_threshold="
                              f"{threshold!r}: {error}") from None

    @property
    def actors(self) -> int:
        return self.max_actors if self.max_actors is not None else _default_actors()

    def backend_config(self) -> dict[str, Any]:
        """Flower's simulation ``backend_config``: Ray gets exactly ``actors * cpus_per_client`` CPUs, so Ray starts
        ``actors`` client processes and no more."""
        init_args: dict[str, Any] = {"num_cpus": max(1, math.ceil(self.actors * self.cpus_per_client)),
                                     "logging_level": "INFO" if self.verbose else "ERROR",
                                     "log_to_driver": self.verbose}
        if self.gpus_per_client > 0:
            init_args["num_gpus"] = torch.cuda.device_count()
        return {"client_resources": {"num_cpus": self.cpus_per_client, "num_gpus": self.gpus_per_client},
                "init_args": init_args}


    def for_clients(self, num_clients: int, *, secure: bool = False) -> FlowerOptions:
        """These options with ``clients_per_node`` chosen for a simulation of ``num_clients`` partitions when it is
        ``None`` (:func:`auto_clients_per_node`; ``secure``: the run sums its releases under SecAgg+)."""
        if self.clients_per_node is not None:
            return self
        return replace(self, clients_per_node=auto_clients_per_node(num_clients, self.actors, secure=secure))


#: Virtual SuperNodes per client process that :func:`auto_clients_per_node` aims for.
NODES_PER_ACTOR = 4


def auto_clients_per_node(num_clients: int, actors: int, *, secure: bool = False) -> int:
    """The clients each virtual SuperNode of a simulation holds when ``--flower-clients-per-node`` is not given.

    Rule: ``ceil(num_clients / (NODES_PER_ACTOR * actors))``, so a simulation has about ``NODES_PER_ACTOR`` = 4 virtual
    nodes per client process (``actors``, Ray's client processes): few nodes, since Flower pays its per-message cost
    (a Ray task, the SuperLink's bookkeeping, the engine scanning every node for work every 0.1 s) per node and
    exchange, not per client; and several per process, so a round's sampled clients spread over all the processes.
    A run whose releases are summed under SecAgg+ (``secure``, distributed DP) keeps one client per node: its nodes
    are the parties of the protocol, and a round needs at least two. The choice depends only on its arguments; the
    numbers of a run do not depend on it.
    """
    if not isinstance(num_clients, int) or num_clients < 1 or not isinstance(actors, int) or actors < 1:
        raise ConfigError(f"auto_clients_per_node needs num_clients >= 1 and actors >= 1 (integers), got "
                          f"{num_clients!r} and {actors!r}")
    if secure:
        return 1
    return -(-num_clients // (NODES_PER_ACTOR * actors))


def simulated_nodes(num_clients: int, clients_per_node: int) -> int:
    """Virtual SuperNodes a simulation needs for ``num_clients`` partitions at ``clients_per_node`` each."""
    return -(-num_clients // clients_per_node)


def node_partitions(node_config: Mapping[str, Any],
                    run_config: Mapping[str, Any] | None = None) -> tuple[list[int], int]:
    """The partitions a node holds and the number of partitions, from its node config.

    Either ``partition-id`` (one partition; what Flower's simulation engine sets) or ``partition-range`` (a string
    ``"FIRST-LAST"``, both included: one SuperNode holds several clients), with ``num-partitions``.

    With ``clients-per-node`` k > 1 in the run config (the simulation's grouping, see :class:`FlowerOptions`), the
    node with ``partition-id`` i of ``num-partitions`` nodes holds partitions ``i*k`` to ``min(i*k + k, P) - 1``, where
    ``P`` is the run config's ``num-clients``; the number of partitions returned is ``P``.
    """
    per_node = (run_config or {}).get(CLIENTS_PER_NODE, 1)
    if per_node != 1 and node_config.get(PARTITION_ID) is not None:
        total = (run_config or {}).get(NUM_CLIENTS)
        if not isinstance(per_node, int) or isinstance(per_node, bool) or per_node < 1 \
                or not isinstance(total, int) or isinstance(total, bool) or total < 1:
            raise PublicConfigError(f"run config {CLIENTS_PER_NODE}={per_node!r}, {NUM_CLIENTS}={total!r} is "
                                    "invalid: both must be integers >= 1")
        node, count = node_config.get(PARTITION_ID), node_config.get(NUM_PARTITIONS)
        if count != simulated_nodes(total, per_node) or not isinstance(node, int) or not 0 <= node < count:
            raise PublicConfigError(f"node config {PARTITION_ID}={node!r}, {NUM_PARTITIONS}={count!r} does not fit "
                                    f"{CLIENTS_PER_NODE}={per_node} and {NUM_CLIENTS}={total}: there must be "
                                    f"{simulated_nodes(total, per_node)} nodes, numbered from 0")
        return list(range(node * per_node, min(total, (node + 1) * per_node))), total
    single, span = node_config.get(PARTITION_ID), node_config.get(PARTITION_RANGE)
    count = node_config.get(NUM_PARTITIONS)
    if not isinstance(count, int) or isinstance(count, bool) or count < 1:
        raise PublicConfigError(f"node config {NUM_PARTITIONS}={count!r} is invalid: it must be an integer >= 1")
    if (single is None) == (span is None):
        raise PublicConfigError(f"node config needs exactly one of {PARTITION_ID} (one partition) and "
                                f"{PARTITION_RANGE} (\"FIRST-LAST\", several), got {PARTITION_ID}={single!r}, "
                                f"{PARTITION_RANGE}={span!r}")
    if single is not None:
        if not isinstance(single, int) or isinstance(single, bool) or not 0 <= single < count:
            raise PublicConfigError(f"node config {PARTITION_ID}={single!r}, {NUM_PARTITIONS}={count!r} is invalid: "
                                    f"they must be integers with 0 <= {PARTITION_ID} < {NUM_PARTITIONS}")
        return [single], count
    first, _, last = str(span).partition("-")
    try:
        lo, hi = int(first), int(last)
    except ValueError:
        lo, hi = -1, -1
    if not 0 <= lo <= hi < count:
        raise PublicConfigError(f"node config {PARTITION_RANGE}={span!r}, {NUM_PARTITIONS}={count!r} is invalid: it "
                                f"must be \"FIRST-LAST\" with 0 <= FIRST <= LAST < {NUM_PARTITIONS}, e.g. \"0-49\"")
    return list(range(lo, hi + 1)), count
