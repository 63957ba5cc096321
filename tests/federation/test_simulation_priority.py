"""The simulation's clients train at this process's priority, not at the niceness Ray gives its workers."""

from __future__ import annotations

import os
import time

import pytest

pytest.importorskip("flwr")

from flwr.app import Context, MetricRecord, RecordDict  # noqa: E402
from flwr.app import Message as FlowerMessage  # noqa: E402
from flwr.clientapp import ClientApp  # noqa: E402
from flwr.serverapp import Grid, ServerApp  # noqa: E402

from privfl.engines.flower import FlowerOptions  # noqa: E402
from privfl.engines.flower.simulation import RAY_NICENESS, run_apps  # noqa: E402


def _niceness_of_the_client_processes(monkeypatch, setting: str | None) -> list[int]:
    if setting is None:
        monkeypatch.delenv(RAY_NICENESS, raising=False)
    else:
        monkeypatch.setenv(RAY_NICENESS, setting)
    client = ClientApp()

    @client.query()
    def query(message: FlowerMessage, context: Context) -> FlowerMessage:
        niceness = os.getpriority(os.PRIO_PROCESS, 0)
        return FlowerMessage(RecordDict({"m": MetricRecord({"niceness": niceness, "pid": os.getpid()})}),
                             reply_to=message)

    server = ServerApp()
    seen: list[int] = []

    @server.main()
    def main(grid: Grid, context: Context) -> None:
        nodes: list[int] = []
        deadline = time.monotonic() + 60
        while len(nodes) < 2 and time.monotonic() < deadline:     # the virtual nodes register as they start
            nodes = sorted(grid.get_node_ids())
            time.sleep(0.05)
        replies = grid.send_and_receive([FlowerMessage(RecordDict(), node, "query") for node in nodes])
        for reply in replies:
            assert reply.content["m"]["pid"] != os.getpid()        # answered by a Ray worker process
            seen.append(int(reply.content["m"]["niceness"]))

    run_apps(server, client, 2, FlowerOptions(max_actors=1, threads=1))
    assert len(seen) == 2, "the ServerApp got no reply from the two virtual nodes (see Flower's log)"
    return seen


def test_the_simulation_clients_run_at_this_process_niceness(monkeypatch):
    # Ray starts its workers at niceness 15 by default, which starves the clients on any loaded machine
    ours = os.getpriority(os.PRIO_PROCESS, 0)
    assert _niceness_of_the_client_processes(monkeypatch, None) == [ours, ours]
    assert RAY_NICENESS not in os.environ                                  # set for the simulation only


def test_a_niceness_the_user_set_for_ray_is_kept(monkeypatch):
    import flwr.simulation

    seen = []
    monkeypatch.setattr(flwr.simulation, "run_simulation", lambda **_: seen.append(os.environ.get(RAY_NICENESS)))
    monkeypatch.setenv(RAY_NICENESS, "7")
    run_apps(ServerApp(), ClientApp(), 2, FlowerOptions(max_actors=1, threads=1))
    assert seen == ["7"] and os.environ[RAY_NICENESS] == "7"
