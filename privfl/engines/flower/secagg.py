"""Distributed DP's round sum on Flower, under Flower's SecAgg+ (Bell et al. 2020).

In distributed mode each sampled training client clips its release to C and adds a share of the round's noise;
every client's ledger records the event of the round's sum, which holds for an observer of that sum only. On Flower
the sum is taken under SecAgg+ with Flower's own code (:class:`flwr.server.workflow.SecAggPlusWorkflow` on the
server, :func:`flwr.client.mod.secaggplus_mod` on each node); :func:`node_stage` runs the privfl train exchange for a
node's clients and masks the sum of their releases. :class:`SecAggPlus` holds the protocol's parameters
(:func:`quantization_sigmas`, :func:`clipping_range`, :func:`count_cap`).

What the server learns, dropouts, quantization, why the accounting holds and the precision of the sum (cited below
as "the module docstring"): docs/privacy.md, "Distributed DP on Flower: SecAgg+".
"""

from __future__ import annotations

import json
import math
from collections.abc import Callable, Mapping
from statistics import NormalDist
from typing import Any

import numpy as np
import torch
from flwr.app import ArrayRecord, ConfigRecord, Context, RecordDict
from flwr.app import Message as FlowerMessage
from flwr.client.mod import secaggplus_mod
from flwr.common import Code, FitIns, FitRes, Parameters, Status, ndarrays_to_parameters, parameters_to_ndarrays
from flwr.common.secure_aggregation.secaggplus_constants import RECORD_KEY_CONFIGS, Key, Stage
from flwr.compat.common import recorddict_compat as compat
from flwr.server.compat.grid_client_proxy import GridClientProxy
from flwr.server.compat.legacy_context import LegacyContext
from flwr.server.workflow import SecAggPlusWorkflow
from flwr.server.workflow.constant import MAIN_CONFIGS_RECORD, MAIN_PARAMS_RECORD
from flwr.server.workflow.constant import Key as WorkflowKey

from privfl.engines.flower import protocol as p
from privfl.engines.flower.records import unpack
from privfl.engines.flower.transport import FlowerClientError, GridTransport
from privfl.errors import ConfigError, InternalError, PublicConfigError
from privfl.federation.messages import Message
from privfl.federation.runtime import ReleaseSum, SecureSum, add_releases

#: Flower's defaults: values are quantized to [0, T] and masked modulo M, so at most M / T - 1 nodes can be summed.
QUANTIZATION_RANGE = 2 ** 22
MODULUS_RANGE = 2 ** 32
#: The part of delta the clipping of quantization may add to the ledgers' guarantee, at most (see the docstring).
CLIP_DELTA_FRACTION = 1e-3

# keys of the privfl header of a secure train exchange (the node needs them to build its vector)
SECURE_ARRAYS = "secure_arrays"      # JSON [[name, shape], ...]: what each release is, in the order summed
CLIPPING_RANGE = "clipping_range"    # R
COUNT_CAP = "count_cap"              # a node reports its clipped count in units of R / COUNT_CAP, at most COUNT_CAP
#: What the masked-vector reply carries of each client's reply header beside the masked sum: the release's kind,
#: purpose and ledger record (the server journals it as it does an unmasked reply's, ``FlowerRuntime._arrived``).
RELEASE_HEADER = ("kind", "purpose", "record")


def quantization_sigmas(secure: SecureSum, values: int) -> float:
    """k, the noise standard deviations between a node's bound and its clipping range: the least k with
    (1 + e^epsilon) values 2 Phi(-k) <= delta / 1000, where ``values`` bounds the values a run quantizes and
    (epsilon, delta) is what each release is calibrated for (``secure.calibrated_for``). Refused where no float
    reaches it (epsilon in the hundreds)."""
    budget = secure.calibrated_for
    log_one_plus = budget.epsilon + math.log1p(math.exp(-budget.epsilon))      # log(1 + e^epsilon), no overflow
    log_tail = math.log(budget.delta * CLIP_DELTA_FRACTION) - log_one_plus - math.log(2 * max(values, 1))
    if log_tail < math.log(1e-300):
        raise ConfigError(f"distributed DP calibrated for epsilon={budget.epsilon:g} cannot be quantized for "
                          "SecAgg+ within its delta: the bound on what clipping adds to delta, (1 + e^epsilon) times "
                          "the clipping probability, needs a probability below 1e-300; use a smaller epsilon (more "
                          "noise), or the in-process engine")
    return -NormalDist().inv_cdf(math.exp(log_tail))


def clipping_range(secure: SecureSum, per_node: int, sigmas: float) -> float:
    """R for nodes that each sum at most ``per_node`` releases: per_node C + k sqrt(per_node) sigma_s."""
    return per_node * secure.bound + sigmas * math.sqrt(per_node) * secure.noise_std


def count_cap(nodes: int) -> int:
    """The most clipped values a node reports exactly: it sends min(count, cap) in units R / cap, and the sum of
    ``nodes`` such values, each rounded by less than 2R / T, still rounds to the exact total when
    cap <= T / (8 nodes)."""
    return max(1, QUANTIZATION_RANGE // (8 * nodes))


class SecAggPlus:
    """The server's end: sums a round's releases under SecAgg+ through ``transport`` (see the module docstring).

    ``secure``: what is summed (from the strategy); ``values``: at most how many values the run quantizes (rounds
    times training clients times values per release), for :func:`quantization_sigmas`.
    """

    def __init__(self, transport: GridTransport, options: p.FlowerOptions, secure: SecureSum, *, values: int) -> None:
        self.transport = transport
        self.options = options
        self.sigmas = quantization_sigmas(secure, values)
        self.clip_probability_bound = values * math.erfc(self.sigmas / math.sqrt(2))   # values 2 Phi(-k)
        self.rounds: list[dict[str, Any]] = []     # per round: nodes, shares, threshold, clipping range, clipped

    def describe(self) -> dict[str, Any]:
        """The summary's ``privacy.secure_aggregation`` on Flower."""
        return {
            "protocol": "SecAgg+",
            "description": "Flower's SecAggPlusWorkflow and secaggplus_mod: the server received each round's sum of "
                           "releases only (and the count of values quantization clipped), never a single release; "
                           "it learned which nodes took part; a node that failed or was silent stopped the run "
                           "before its round's sum was used",
            "num_shares": self.options.secagg_num_shares,
            "reconstruction_threshold": self.options.secagg_reconstruction_threshold,
            "quantization_range": QUANTIZATION_RANGE, "modulus_range": MODULUS_RANGE,
            "clipping_range": "per round: clients per node * clip + quantization_sigmas * sqrt(clients per node) * "
                              "share sigma",
            "quantization_sigmas": self.sigmas, "clip_probability_bound": self.clip_probability_bound,
            "rounds": list(self.rounds)}

    def sum(self, outgoing: Mapping[int, tuple[Message, dict[str, Any]]], op: str, header: dict[str, Any],
            secure: SecureSum, round: int) -> ReleaseSum:
        """Send each client its message in the masked-vector stage of one SecAgg+ run over the nodes that hold
        them, and return the sum of their releases."""
        held = self.transport.by_node(outgoing)
        nodes = len(held)
        if nodes < 2:
            raise ConfigError(f"round {round} samples clients {sorted(outgoing)}, all on one node: SecAgg+ sums "
                              "the vectors of at least 2 nodes; hold the clients on more nodes (clients_per_node, "
                              "partition-range) or sample more of them")
        if nodes * QUANTIZATION_RANGE >= MODULUS_RANGE:
            raise ConfigError(f"round {round} sums {nodes} nodes under SecAgg+, whose sum of values in "
                              f"[0, {QUANTIZATION_RANGE}] overflows modulo {MODULUS_RANGE} beyond "
                              f"{MODULUS_RANGE // QUANTIZATION_RANGE - 1} nodes; group clients on fewer nodes")
        per_node = max(len(clients) for clients in held.values())
        bound = clipping_range(secure, per_node, self.sigmas)
        cap = count_cap(nodes)
        arrays = json.dumps([[name, list(t.shape)] for name, t in secure.like.items()])
        contents = self.transport.pack(outgoing, op, {**header, SECURE_ARRAYS: arrays, CLIPPING_RANGE: bound,
                                                      COUNT_CAP: cap})
        grid = _Grid(self.transport, op)
        receiver = _Receiver([GridClientProxy(nid, self.transport.grid, 0) for nid in sorted(contents)])
        workflow = _Workflow(contents, num_shares=self.options.secagg_num_shares,
                             reconstruction_threshold=self.options.secagg_reconstruction_threshold,
                             max_weight=1.0, clipping_range=bound, quantization_range=QUANTIZATION_RANGE,
                             modulus_range=MODULUS_RANGE, timeout=None)
        state = RecordDict({MAIN_CONFIGS_RECORD: ConfigRecord({WorkflowKey.CURRENT_ROUND: round}),
                            MAIN_PARAMS_RECORD: ArrayRecord()})
        # _Grid and _Receiver stand in for the Grid and Strategy classes Flower names, with the methods it calls
        workflow(grid, LegacyContext(Context(run_id=0, node_id=0, node_config={}, state=state, run_config={}),  # type: ignore[arg-type]
                                     strategy=receiver))  # type: ignore[arg-type]
        if receiver.mean is None or receiver.results != nodes:
            raise FlowerClientError(f"SecAgg+ stopped in round {round} without the sum of all {nodes} nodes (it "
                                    f"summed {receiver.results}): a node's keys or shares were missing (see Flower's "
                                    "log); the round's sum is not used")
        *values, clipped = [np.asarray(v, dtype=np.float64) * nodes for v in receiver.mean]   # the mean, times n
        if len(values) != len(secure.like):
            raise InternalError(f"SecAgg+ summed {len(values)} arrays, the releases hold {len(secure.like)}")
        total = {name: torch.from_numpy(np.ascontiguousarray(v)).reshape(tuple(t.shape))
                 for (name, t), v in zip(secure.like.items(), values, strict=True)}
        count = int(np.rint(float(clipped.reshape(-1)[0]) * cap / bound))
        self.rounds.append({"round": round, "nodes": nodes, "clients_per_node_max": per_node,
                            "num_shares": workflow.resolved["num_shares"],
                            "reconstruction_threshold": workflow.resolved["reconstruction_threshold"],
                            "clipping_range": bound, "quantization_clipped": count})
        return ReleaseSum(arrays=total, count=len(outgoing), metrics={"quantization_clipped": float(count)})


class _Workflow(SecAggPlusWorkflow):
    """Flower's SecAgg+ workflow for one round: the masked-vector stage carries each node's packed privfl train
    message (in place of a legacy ``FitIns``), and the number of shares and the threshold it resolved are kept."""

    def __init__(self, contents: Mapping[int, RecordDict], **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self.contents = contents
        self.resolved: dict[str, int] = {}

    def collect_masked_vectors_stage(self, grid, context, state) -> bool:
        self.resolved = {"num_shares": int(state.num_shares), "reconstruction_threshold": int(state.threshold)}
        state.nid_to_fitins = {nid: self.contents[nid] for nid in state.nid_to_fitins}
        return super().collect_masked_vectors_stage(grid, context, state)


class _Receiver:
    """The legacy strategy the workflow calls: it names the nodes (``configure_fit``) and keeps the aggregate
    (``aggregate_fit``), which the workflow hands as the mean over the nodes (each weighs 1)."""

    def __init__(self, proxies: list[GridClientProxy]) -> None:
        self.proxies = proxies
        self.mean: list[np.ndarray] | None = None
        self.results = 0

    def configure_fit(self, server_round, parameters, client_manager):
        return [(proxy, FitIns(Parameters(tensors=[], tensor_type=""), {})) for proxy in self.proxies]

    def aggregate_fit(self, server_round, results, failures):
        if failures:     # the transport raises first: the workflow never sees a failure
            raise InternalError(f"SecAgg+ reported failures {failures!r}")
        self.results = len(results)
        self.mean = parameters_to_ndarrays(results[0][1].parameters) if results else None
        return None, {}


class _Grid:
    """What the workflow sends through: privfl's transport, which raises on a failed or silent node rather than
    handing the workflow fewer replies (a dropout is refused, see the module docstring)."""

    def __init__(self, transport: GridTransport, op: str) -> None:
        self.transport = transport
        self.op = op

    def send_and_receive(self, messages, *, timeout: float | None = None) -> list[FlowerMessage]:
        messages = list(messages)
        stage = messages[0].content.config_records[RECORD_KEY_CONFIGS][Key.STAGE] if messages else ""
        return list(self.transport.deliver(messages, f"{self.op} (SecAgg+ {stage})").values())


# -- the node's end ---------------------------------------------------------------------------------------------------


def carries_secagg(message: FlowerMessage) -> bool:
    """Whether ``message`` is a stage of SecAgg+ (a secure train exchange)."""
    return RECORD_KEY_CONFIGS in message.content.config_records


def node_stage(message: FlowerMessage, context: Context,
               protocol: Callable[[FlowerMessage, Context], FlowerMessage]) -> FlowerMessage:
    """A node's answer to a SecAgg+ stage, by Flower's ``secaggplus_mod``; in the masked-vector stage ``protocol``
    (the privfl ClientApp's handling) runs the train exchange the message packs, and the node's vector is the sum of
    its clients' releases, in the order the header names, then its count of values the clipping range clips."""
    if message.content.config_records[RECORD_KEY_CONFIGS].get(Key.STAGE) != Stage.COLLECT_MASKED_VECTORS:
        return secaggplus_mod(message, context, _no_exchange)
    return secaggplus_mod(message, context, lambda m, c: _summed_release(m, c, protocol))


def _no_exchange(message: FlowerMessage, context: Context) -> FlowerMessage:
    raise InternalError("secaggplus_mod asked for the node's vector outside the masked-vector stage")


def _summed_release(message: FlowerMessage, context: Context,
                    protocol: Callable[[FlowerMessage, Context], FlowerMessage]) -> FlowerMessage:
    header, _ = unpack(message.content)
    reply = protocol(message, context)             # each release recorded in its client's ledger on this node
    _, replies = unpack(reply.content)
    silent = sorted(cid for cid, (_, reply_header) in replies.items() if reply_header.get("kind") != p.RELEASE)
    if silent:
        raise PublicConfigError(f"clients {silent} released nothing in a secure train exchange: the sum needs every "
                                "sampled client's release")
    like = {name: torch.zeros(tuple(shape)) for name, shape in json.loads(header[SECURE_ARRAYS])}
    total = add_releases({cid: body for cid, (body, _) in replies.items()}, like)
    bound, cap = float(header[CLIPPING_RANGE]), int(header[COUNT_CAP])
    values = [total[name].numpy() for name in like]
    if not all(np.isfinite(v).all() for v in values):
        raise ValueError("a release summed on this node is not finite")    # quantization would make it garbage
    clipped = sum(int(np.count_nonzero(np.abs(v) > bound)) for v in values)
    values.append(np.array([min(clipped, cap) * bound / cap], dtype=np.float64))
    fitres = FitRes(status=Status(code=Code.OK, message=""), parameters=ndarrays_to_parameters(values),
                    num_examples=1, metrics={})
    content = compat.fitres_to_recorddict(fitres, keep_input=False)
    for cid, (_, reply_header) in replies.items():     # each release's ledger record, as an unmasked reply has it
        content[f"h{cid}"] = ConfigRecord({key: reply_header[key] for key in RELEASE_HEADER})
    return FlowerMessage(content, reply_to=message)
