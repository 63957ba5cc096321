"""Worker processes for the in-process runtime: a round's clients trained in parallel, with the sequential numbers.

:class:`ClientWorkers` forks ``count`` processes once, after the runtime is built, so each holds the clients' data
and the method's client procedure as the parent built them (what a Flower node holding several clients holds).
For each stage the parent sends every sampled client its delivered message and working state, and receives the
client's release and new working state; a worker runs one client at a time, in whatever order the clients finish.

The numbers are those of the sequential loop: a client's computation is a function of its data, its message, its
working state and its context (:func:`privfl.federation.context.client_context` seeds torch's generator per client),
and the thread count, which decides the floating-point sums (:mod:`privfl.provenance`). A forked process cannot use
OpenMP threads its parent has used (libgomp's pool does not survive a fork: the child hangs in its first parallel
kernel), so each worker runs torch on one thread, and the parent must run on one too (:func:`check_threads`): the
run is then the sequential run at one thread, number for number. Torch's generator is left as the sequential loop
leaves it (in the state the last client by id left it in). The releases never pass a ledger here: the parent records
them, in increasing client id as the sequential loop does
(:meth:`privfl.federation.runtime.InProcessRuntime.exchange`), so the ledgers and the release journal are written in
the same order.

What crosses between the processes is tensors and plain values (:func:`_dumps`: a JSON header and the tensors' raw
bytes, nothing that names code to run), privacy events as their JSON dicts.
"""

from __future__ import annotations

import json
import multiprocessing
import os
import signal
import traceback
import weakref
from collections.abc import Mapping
from multiprocessing.connection import Connection, wait
from pathlib import Path
from typing import Any, cast

import torch

from accounting import PrivacyBudget, event_from_dict
from privfl.errors import ConfigError, InternalError, PrivflError
from privfl.federation.context import ClientState, client_context
from privfl.federation.messages import Message, Release


def check_workers(workers: object) -> int:
    """``workers`` as a count of processes, or a ConfigError naming the value."""
    if isinstance(workers, bool) or not isinstance(workers, int) or workers < 1:
        raise ConfigError(f"workers must be an integer >= 1 (processes that train a round's clients), got {workers!r}")
    return workers


def check_threads(workers: int) -> None:
    """Refuse ``workers > 1`` unless torch runs on one thread in this process (see the module's text)."""
    threads = torch.get_num_threads()
    if workers > 1 and threads != 1:
        raise ConfigError(f"workers={workers} trains each client on one thread in its own process, so the run's "
                          f"numbers are those of a one-thread run only if this process computes on one thread too, "
                          f"but torch uses {threads} here: call torch.set_num_threads(1) (privfl --threads 1), "
                          "or use workers=1")


def _dumps(value: Any) -> bytes:
    """``value`` (dicts, lists, tensors and plain scalars) as bytes: a JSON header, then each tensor's raw bytes.

    Faster than ``torch.save`` for what a client sends (no archive, no unpickler on the way back), and nothing in it
    can name code to run. Dict keys keep their type (a client id is an int)."""
    tensors: list[torch.Tensor] = []

    def plain(item: Any) -> Any:
        if isinstance(item, torch.Tensor):
            tensors.append(item.detach().cpu().contiguous())
            return {"t": len(tensors) - 1}
        if isinstance(item, dict):
            return {"d": [[plain(k), plain(v)] for k, v in item.items()]}
        if isinstance(item, (list, tuple)):
            return {"l": [plain(v) for v in item]}
        if item is None or isinstance(item, (bool, int, float, str)):
            return item
        raise InternalError(f"a worker message holds a {type(item).__name__}, not tensors and plain values")

    body = plain(value)
    layout = [[str(t.dtype).removeprefix("torch."), list(t.shape), t.numel() * t.element_size()] for t in tensors]
    header = json.dumps({"body": body, "tensors": layout}).encode()
    parts = [len(header).to_bytes(8, "little"), header]
    parts += [t.reshape(-1).view(torch.uint8).numpy().tobytes() for t in tensors]
    return b"".join(parts)


def _loads(data: bytes) -> Any:
    """The inverse of :func:`_dumps` (the tensors share one writable copy of ``data``)."""
    size = int.from_bytes(data[:8], "little")
    header = json.loads(data[8:8 + size])
    buffer = bytearray(memoryview(data)[8 + size:])
    tensors, offset = [], 0
    for dtype_name, shape, nbytes in header["tensors"]:
        dtype = getattr(torch, dtype_name)
        if nbytes == 0:
            tensors.append(torch.empty(shape, dtype=dtype))
        else:
            raw = torch.frombuffer(buffer, dtype=torch.uint8, count=nbytes, offset=offset)
            tensors.append(raw.view(dtype).reshape(shape))
        offset += nbytes

    def value(item: Any) -> Any:
        if isinstance(item, dict):
            if "t" in item:
                return tensors[item["t"]]
            if "d" in item:
                return {value(k): value(v) for k, v in item["d"]}
            return [value(v) for v in item["l"]]
        return item

    return value(header["body"])


def _message_dict(message: Message) -> dict[str, Any]:
    return {"arrays": message.arrays, "metrics": message.metrics, "config": message.config}


def _message(values: Mapping[str, Any]) -> Message:
    return Message(arrays=dict(values["arrays"]), metrics=dict(values["metrics"]), config=dict(values["config"]))


def release_to_dict(release: Release) -> dict[str, Any]:
    """``release`` as tensors and plain values (its event as :meth:`accounting.PrivacyEvent.to_dict`)."""
    return {"message": _message_dict(release.message), "purpose": release.purpose, "event": release.event.to_dict(),
            "metadata": dict(release.metadata), "audience": release.audience,
            "calibrated_for": None if release.calibrated_for is None else release.calibrated_for.to_dict()}


def release_from_dict(values: Mapping[str, Any]) -> Release:
    """The inverse of :func:`release_to_dict`."""
    budget = values["calibrated_for"]
    return Release(message=_message(values["message"]), purpose=values["purpose"],
                   event=event_from_dict(values["event"]), metadata=dict(values["metadata"]),
                   calibrated_for=None if budget is None else PrivacyBudget.from_dict(budget),
                   audience=values["audience"])


def _widen(connection: Connection) -> None:
    """Let the pipe under ``connection`` hold a whole model (up to the system's limit), so that a message is written
    in one go rather than in 64 KiB turns between the two processes, each waiting for the scheduler on a busy
    machine."""
    try:
        import fcntl

        limit = int(Path("/proc/sys/fs/pipe-max-size").read_text())
        fcntl.fcntl(connection.fileno(), fcntl.F_SETPIPE_SZ, min(limit, 64 << 20))
    except (ImportError, OSError, ValueError, AttributeError):
        pass   # only slower: the pipe keeps its default size


def _serve(tasks: Connection, replies: Connection, procedure: Any, clients: Mapping[int, Any],
           inherited: list[Connection]) -> None:
    """A worker's loop: a task in, the client's release and working state out, until the parent closes the pipe.

    ``inherited`` are the parent's pipe ends the fork copied into this process (its own task pipe's write end among
    them): they are closed first, since a pipe reads end-of-file only once every copy of its write end is closed,
    and a copy held here would keep this worker (or an earlier one) waiting after the parent closed its end.
    Ctrl-C reaches the whole process group; the parent alone decides (it finishes the round, then ends the
    workers), so a worker ignores it."""
    for connection in inherited:
        connection.close()
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    torch.set_num_threads(1)
    last: Message | None = None   # the message of the task before, which the parent may say is this one's too
    while True:
        try:
            task = _loads(tasks.recv_bytes())
        except EOFError:
            return
        try:
            cid, round, stage = int(task["client_id"]), int(task["round"]), int(task["stage"])
            working: ClientState = dict(task["state"])
            if task["message"] is not None:
                last = _message(task["message"])
            if last is None:
                raise InternalError("a task said it carried the message of the task before, but there was none")
            delivered = last.copy()   # each client gets its own copy, as from the wire
            ctx = client_context(int(task["seed"]), cid, round, stage)
            if stage == 0:
                release = procedure.train(clients[cid], delivered, working, ctx)
            else:
                release = procedure.train_stage(stage, clients[cid], delivered, working, ctx)
            reply = {"client_id": cid, "state": working, "generator": torch.default_generator.get_state(),
                     "release": None if release is None else release_to_dict(release)}
        except Exception as error:  # noqa: BLE001 -- handed to the parent, which raises it there
            reply = {"client_id": int(task.get("client_id", -1)), "error": type(error).__name__,
                     "text": str(error), "traceback": traceback.format_exc()}
        replies.send_bytes(_dumps(reply))


def _error(reply: Mapping[str, Any]) -> Exception:
    """A worker's error, to raise in the parent: a user error (a :class:`PrivflError`) as its own class and text,
    anything else as an :class:`InternalError` carrying the worker's traceback."""
    kinds, user_errors = [PrivflError], {}
    while kinds:
        kind = kinds.pop()
        user_errors[kind.__name__] = kind
        kinds += kind.__subclasses__()
    if reply["error"] in user_errors:
        return user_errors[reply["error"]](reply["text"])
    return InternalError(f"client {reply['client_id']} failed in a worker process with {reply['error']}: "
                        f"{reply['text']}\n--- worker traceback ---\n{reply['traceback']}")


def _stop(processes: list[Any], connections: list[Connection]) -> None:
    for connection in connections:
        connection.close()
    for process in processes:
        process.join(timeout=10)
        if process.is_alive():
            process.terminate()
            process.join()


class ClientWorkers:
    """``count`` forked processes that run client procedures on ``clients`` (by id) for the parent."""

    def __init__(self, count: int, procedure: Any, clients: Mapping[int, Any]) -> None:
        if "fork" not in multiprocessing.get_all_start_methods():
            raise ConfigError(f"workers={count} needs processes started by fork, which this platform "
                              f"({os.name}) lacks; use workers=1")
        context = multiprocessing.get_context("fork")
        self.count = check_workers(count)
        check_threads(count)
        self._connections: list[Connection] = []    # where each worker's replies arrive
        self._tasks: dict[Connection, Connection] = {}   # reply end -> where that worker's tasks go
        self._processes = []
        for _ in range(count):
            task_in, task_out = context.Pipe(duplex=False)
            reply_in, reply_out = context.Pipe(duplex=False)
            for end in (task_out, reply_out):
                _widen(end)
            inherited = [task_out, reply_in, *self._connections, *self._tasks.values()]
            process = context.Process(target=_serve, args=(task_in, reply_out, procedure, clients, inherited),
                                      daemon=True)
            process.start()
            task_in.close()
            reply_out.close()
            self._connections.append(reply_in)
            self._tasks[reply_in] = task_out
            self._processes.append(process)
        self._finalizer = weakref.finalize(self, _stop, self._processes, [*self._tasks.values(), *self._connections])

    def run(self, *, seed: int, round: int, stage: int, messages: Mapping[int, Message],
            states: Mapping[int, ClientState]) -> dict[int, tuple[Release | None, ClientState] | Exception]:
        """Each client of ``messages`` at ``stage`` of ``round`` on its delivered message and working state: its
        release (or ``None``) and its new working state, by client id. Torch's generator ends as the last client by
        id left it, as after the sequential loop.

        A message that is one object for several clients (a broadcast) crosses to a worker once per call.
        Clients are handed out in increasing id. When one fails, no later client is started, and the failure is its
        result (an exception, for the caller to raise where the sequential loop would have): every client before it
        has its result, as in the sequential loop; clients after it may have theirs too, to be ignored."""
        pending = sorted(messages)
        idle = list(self._connections)
        busy: dict[Connection, int] = {}
        results: dict[int, tuple[Release | None, ClientState] | Exception] = {}
        generators: dict[int, torch.Tensor] = {}
        failed = False
        sent: dict[Connection, int] = {}   # the message each worker holds from this call, by identity
        while pending or busy:
            while pending and idle and not failed:
                cid = pending.pop(0)
                connection = idle.pop()
                held = sent.get(connection) == id(messages[cid])
                sent[connection] = id(messages[cid])
                self._tasks[connection].send_bytes(_dumps({
                    "client_id": cid, "round": round, "stage": stage, "seed": seed, "state": dict(states[cid]),
                    "message": None if held else _message_dict(messages[cid])}))
                busy[connection] = cid
            if failed:
                pending = []
                if not busy:
                    break
            try:
                ready = cast(list[Connection], wait(list(busy)))   # typeshed: wait returns what it was given
            except KeyboardInterrupt:
                self.close()
                raise
            for connection in ready:
                cid = busy.pop(connection)
                try:
                    reply = _loads(connection.recv_bytes())
                except EOFError:
                    self.close()
                    raise InternalError(f"the worker process training client {cid} ended without answering "
                                        "(killed, or out of memory)") from None
                idle.append(connection)
                if "error" in reply:
                    results[cid], failed = _error(reply), True
                    continue
                release = None if reply["release"] is None else release_from_dict(reply["release"])
                results[cid] = (release, dict(reply["state"]))
                generators[cid] = reply["generator"]
        if generators and not failed:
            torch.default_generator.set_state(generators[max(generators)])
        return results

    def close(self) -> None:
        """End the worker processes (also done when this object is collected)."""
        self._finalizer()
