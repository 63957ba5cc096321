"""What one Flower deployment reply costs to move, part by part (issue 45 item 4: the split of the deployment's cost
beyond in-process).

The setting is ``flower_overhead.py``'s at 100 clients per round: two SuperNodes, each replying once a round with
the packed model updates of its 50 clients (MNIST 2NN, 199,210 float32 parameters each: about 40 MB). A reply
travels ClientApp process -> SuperNode -> SuperLink -> ServerApp; Flower cuts it into objects (arrays in chunks of
``FLWR_PRIVATE_MAX_ARRAY_CHUNK_SIZE``, 5 MiB), names each by its SHA-256, pushes and pulls them one RPC per object
(2 at a time by default), and each receiver checks each object's hash. Timed here, each in this process, for one
reply of ``--clients`` client updates, the median of ``--repeats``:

* ``pack_s`` / ``unpack_s``: privfl's packing of the clients' messages into one ``RecordDict`` and back
  (:func:`privfl.engines.flower.records.pack`, :func:`~privfl.engines.flower.records.unpack`);
* ``deflate_s``: Flower's serialisation of that ``RecordDict`` into its objects (their bytes and SHA-256 ids), what
  the sender does once; ``inflate_s``: the ServerApp's inverse, checks included;
* ``hash_s``: one SHA-256 pass over every object's bytes, what each hop's check of a received object costs;
* ``grpc_s``: the objects sent over one loopback gRPC channel as Flower sends them (one unary RPC per object, 2 at
  a time; no TLS, which the deployment adds), received by a server that keeps them: one hop's transport.

A round of the deployment then costs, per reply, about ``pack + deflate + 3 x (grpc + hash) + inflate + unpack``
beside the in-process round's work; the rest of a measured round is polling and the per-message round trips
(``benchmarks/README.md``, Flower overhead).

    nice python benchmarks/flower_message_cost.py [--clients 50 5] [--repeats 5]

Writes benchmarks/results/flower_message_cost.json (command, setting, code revision).
"""

from __future__ import annotations

import argparse
import hashlib
import json
import platform
import statistics
import sys
import time
from concurrent import futures
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
RESULTS = ROOT / "benchmarks" / "results" / "flower_message_cost.json"
GRPC_OPTIONS = [("grpc.max_send_message_length", 512 * 2**20), ("grpc.max_receive_message_length", 512 * 2**20)]


def updates(clients: int) -> dict:
    """``clients`` messages shaped like FedAvg's 2NN weight changes on MNIST (seeded normal values)."""
    from privfl.federation import Message
    from privfl.models import build_model

    shapes = {k: v.shape for k, v in build_model("mlp2nn", (1, 28, 28), 10).state_dict().items()}
    generator = torch.Generator().manual_seed(0)
    return {cid: (Message(arrays={k: torch.randn(s, generator=generator) for k, s in shapes.items()},
                          metrics={"num_examples": 300.0, "loss": 0.5}), {})
            for cid in range(clients)}


def objects_of(records) -> tuple[str, dict[str, bytes]]:
    """Flower's objects of ``records``: the root's id and every object's bytes by id (what a push sends)."""
    from flwr.supercore.inflatable.inflatable_object import get_all_nested_objects

    nested = get_all_nested_objects(records)
    return records.object_id, {object_id: obj.deflate() for object_id, obj in nested.items()}


def grpc_hop(contents: dict[str, bytes], concurrency: int = 2) -> float:
    """Seconds to send every object of ``contents`` to a loopback gRPC server, one unary RPC each, ``concurrency``
    at a time (as Flower's object pushes)."""
    import grpc

    received: dict[int, bytes] = {}

    def keep(request: bytes, context) -> bytes:
        received[len(received)] = request
        return b""

    handler = grpc.method_handlers_generic_handler("bench.Objects", {
        "Push": grpc.unary_unary_rpc_method_handler(keep)})
    server = grpc.server(futures.ThreadPoolExecutor(max_workers=4), options=GRPC_OPTIONS)
    server.add_generic_rpc_handlers((handler,))
    port = server.add_insecure_port("127.0.0.1:0")
    server.start()
    try:
        with grpc.insecure_channel(f"127.0.0.1:{port}", options=GRPC_OPTIONS) as channel:
            push = channel.unary_unary("/bench.Objects/Push")
            push(b"warm-up")
            received.clear()
            started = time.perf_counter()
            with futures.ThreadPoolExecutor(max_workers=concurrency) as pool:
                list(pool.map(push, contents.values()))
            seconds = time.perf_counter() - started
    finally:
        server.stop(None)
    if sum(map(len, received.values())) != sum(map(len, contents.values())):
        raise RuntimeError("the gRPC hop lost bytes")
    return seconds


def measure(clients: int) -> dict:
    from flwr.supercore.inflatable.inflatable_utils import inflate_object_from_contents

    from privfl.engines.flower.records import pack, unpack

    items = updates(clients)
    timings: dict[str, float] = {}

    def timed(name: str, run):
        started = time.perf_counter()
        value = run()
        timings[name] = time.perf_counter() - started
        return value

    records = timed("pack_s", lambda: pack(items, {"op": "train"}))
    root, contents = timed("deflate_s", lambda: objects_of(records))
    timed("hash_s", lambda: [hashlib.sha256(content).hexdigest() for content in contents.values()])
    timings["grpc_s"] = grpc_hop(contents)
    inflated = timed("inflate_s", lambda: inflate_object_from_contents(root, dict(contents)))
    _, back = timed("unpack_s", lambda: unpack(inflated))
    if not all(torch.equal(back[cid][0].arrays[k], items[cid][0].arrays[k]) for cid in items
               for k in items[cid][0].arrays):
        raise RuntimeError("the reply did not survive the round trip")
    timings.update(objects=len(contents), megabytes=sum(map(len, contents.values())) / 1e6)
    return timings


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--clients", type=int, nargs="+", default=[50, 5],
                        help="client updates per reply (50: a node's at 100 clients per round)")
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--out", type=Path, default=RESULTS)
    args = parser.parse_args()
    torch.set_num_threads(1)
    from privfl.provenance import numerics

    rows = []
    for clients in args.clients:
        runs = [measure(clients) for _ in range(args.repeats)]
        row = {"clients_per_reply": clients, "objects": runs[0]["objects"], "megabytes": runs[0]["megabytes"]}
        for key in ("pack_s", "deflate_s", "hash_s", "grpc_s", "inflate_s", "unpack_s"):
            row[key] = statistics.median(r[key] for r in runs)
            row[f"{key[:-2]}_all_s"] = [r[key] for r in runs]
        row["reply_s"] = row["pack_s"] + row["deflate_s"] + 3 * (row["grpc_s"] + row["hash_s"]) + row["inflate_s"] \
            + row["unpack_s"]
        rows.append(row)
        print(json.dumps({k: v for k, v in row.items() if not k.endswith("_all_s")}), flush=True)
    results = {"setting": f"one Flower reply of FedAvg MNIST 2NN updates, 1 torch thread, median of {args.repeats}; "
                          "reply_s = pack + deflate + 3 x (grpc + hash) + inflate + unpack (3 hops: ClientApp -> "
                          "SuperNode -> SuperLink -> ServerApp), gRPC on loopback without TLS",
               "command": "nice python benchmarks/flower_message_cost.py " + " ".join(sys.argv[1:]),
               "machine": f"{platform.machine()}, shared with other jobs", "numerics": numerics(),
               "rows": rows}
    args.out.write_text(json.dumps(results, indent=2) + "\n")


if __name__ == "__main__":
    main()
