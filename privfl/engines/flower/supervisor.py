"""Keeping a SuperNode running (``privfl flower supernode``, :mod:`privfl.engines.flower.launch`): started again
while the SuperLink still counts its previous connection online, stopped at once with the reason when the SuperLink
refuses it (an unregistered key, another CA), its ClientApp worker restarted, and every process it started ended with
it; and reading Flower's error lines by their code.
"""

from __future__ import annotations

import collections
import os
import re
import signal
import subprocess
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from privfl.errors import ConfigError

_ANSI = re.compile(r"\x1b\[[0-9;]*m")
_CODE = re.compile(r"\[code: (\d+)\]")
#: Flower's error code for a public key the SuperLink knows already (``flwr.supercore.error.ApiErrorCode``), and for
#: a SuperNode the SuperLink refused to activate (its key unknown, or its previous connection still online).
PUBLIC_KEY_ALREADY_IN_USE, NODE_ACTIVATION_FAILED = 23, 2004


def flower_lines(text: str) -> list[str]:
    """The lines of a Flower command's output without colours, box borders and blank lines."""
    lines = [_ANSI.sub("", line).strip(" \t\u2502\u256d\u256e\u2570\u256f\u2500") for line in text.splitlines()]
    return [line.strip() for line in lines if line.strip()]


def flower_message(text: str) -> str:
    """The message of a Flower command's output on one line: its ``[code: N] ...`` line (what ``flwr`` prints in its
    error box, and a SuperNode before it exits), else its first line that names an error (not the box's title
    ``Error``), else its last line."""
    lines = [line for line in flower_lines(text) if not line.startswith("Using SuperLink")]
    for line in lines:
        if _CODE.search(line):
            return line[line.index("[code:"):]
    for line in lines:
        if ("rror" in line or "failed" in line) and line.strip("\u2500 ") not in ("Error", "ERROR"):
            return line
    return lines[-1] if lines else "no output"


def flower_code(text: str) -> int | None:
    """The error code in a Flower command's output (``[code: 23] Public key already in use.`` gives 23), or None."""
    found = _CODE.search(_ANSI.sub("", text))
    return int(found.group(1)) if found else None


def supervise_supernode(command: list[str], env: dict[str, str], *, rejoin_s: float, retry_s: float = 5.0,
                        worker: list[str] | None = None, worker_restarts: int = 3,
                        explain: Callable[[int, str], Refusal] | None = None) -> int:
    """Run the SuperNode ``command`` and start it again when it exits with an error within ``rejoin_s`` seconds of
    the first start: a node restarted after it died is refused while the SuperLink still counts its previous
    connection as online (until about two missed 30 s heartbeats), and Flower's SuperNode then exits. Returns the
    SuperNode's exit status.

    ``explain(status, output)`` says why the SuperNode exited, from its status and the end of what it wrote on
    stderr (which is passed on as it comes): a :class:`Refusal` that no retry mends (an unregistered key, a SuperLink
    certificate of another CA; :func:`refusal_of`) raises :class:`~privfl.errors.ConfigError` with its reason at
    once; any other is printed and the SuperNode started again.

    ``worker`` (a SuperNode in process isolation): the command of its long-lived ClientApp process
    (:func:`worker_command`), started beside each start of the SuperNode and stopped when the SuperNode exits; a
    ClientApp process that exits while its SuperNode runs is started again, and after ``worker_restarts`` such exits
    within a minute the SuperNode is stopped and the status is 1.

    No process is left behind: SIGTERM and SIGINT are passed on to the SuperNode and its ClientApp process, and this
    process waits for both; on Linux both are killed when this process dies any other way (SIGKILL included), and
    the ClientApp process ends when this process id goes away elsewhere too."""

    started = time.monotonic()
    state: dict[str, Any] = {"children": [], "stopping": False}

    def forward(signum: int, frame: Any) -> None:
        state["stopping"] = True
        for child in state["children"]:
            if child.poll() is None:
                child.send_signal(signum)

    previous = {signum: signal.signal(signum, forward) for signum in (signal.SIGTERM, signal.SIGINT)}
    try:
        return _supervise(command, env, state, started=started, rejoin_s=rejoin_s, retry_s=retry_s, worker=worker,
                          worker_restarts=worker_restarts, explain=explain)
    finally:
        for child in state["children"]:
            _stop_child(child)
        for signum, handler in previous.items():
            signal.signal(signum, handler)


def _die_with_parent() -> None:
    """In a child before it runs: SIGKILL when the parent dies (Linux ``PR_SET_PDEATHSIG``). A supervisor that is
    killed leaves a node that was killed too: the SuperNode does not sign off from the SuperLink as on SIGTERM, and
    the run sees a dead node, as it would had the whole node been killed."""
    import ctypes

    ctypes.CDLL(None, use_errno=True).prctl(1, signal.SIGKILL)       # 1 = PR_SET_PDEATHSIG


def _start_child(command: list[str], env: dict[str, str], state: dict[str, Any], *,
                 tail: collections.deque[str] | None = None) -> subprocess.Popen:
    """Start ``command``; with ``tail``, its stderr is passed on to this process's line by line, and its last lines
    kept in ``tail`` (what Flower says before it exits)."""
    child = subprocess.Popen(command, env=env, stderr=None if tail is None else subprocess.PIPE,
                             preexec_fn=_die_with_parent if sys.platform.startswith("linux") else None)
    if tail is not None:
        import threading

        def relay(stream: Any) -> None:
            for raw in iter(stream.readline, b""):
                tail.append(raw.decode(errors="replace"))
                try:
                    sys.stderr.write(raw.decode(errors="replace"))
                    sys.stderr.flush()
                except (OSError, ValueError):
                    pass
            stream.close()

        reader = threading.Thread(target=relay, args=(child.stderr,), daemon=True)
        reader.start()
        state.setdefault("relays", {})[child.pid] = reader
    state["children"] = [c for c in state["children"] if c.poll() is None] + [child]
    return child


def _stop_child(child: subprocess.Popen, wait_s: float = 10.0) -> None:
    """SIGTERM, then SIGKILL after ``wait_s`` seconds; reaped either way."""
    if child.poll() is None:
        child.terminate()
        try:
            child.wait(timeout=wait_s)
        except subprocess.TimeoutExpired:
            child.kill()
            child.wait()


@dataclass(frozen=True)
class Refusal:
    """Why a SuperNode exited, in one line, and whether starting it again can help (``final``: it cannot)."""

    reason: str
    final: bool = False


def _supervise(command: list[str], env: dict[str, str], state: dict[str, Any], *, started: float, rejoin_s: float,
               retry_s: float, worker: list[str] | None, worker_restarts: int,
               explain: Callable[[int, str], Refusal] | None) -> int:
    attempt = 0
    while True:
        attempt += 1
        tail: collections.deque[str] = collections.deque(maxlen=200)
        node = _start_child(command, env, state, tail=tail)
        code = node.wait() if worker is None else _watch(node, worker, env, state, worker_restarts)
        relay = state.get("relays", {}).pop(node.pid, None)
        if relay is not None:
            relay.join(timeout=5)
        if state["stopping"] or code == 0:
            return code
        if state.get("worker_failed"):
            return 1
        refusal = explain(code, "".join(tail)) if explain is not None else \
            Refusal(f"the SuperNode exited with status {code} ({flower_message(''.join(tail))})")
        if refusal.final:
            raise ConfigError(refusal.reason)
        if time.monotonic() - started > rejoin_s:
            print(f"privfl flower: error: {refusal.reason} (attempt {attempt}); stopped retrying after {rejoin_s:g} s "
                  "(--rejoin-s)", file=sys.stderr, flush=True)
            return code
        print(f"privfl flower: {refusal.reason}: starting it again in {retry_s:g} s", file=sys.stderr, flush=True)
        time.sleep(retry_s)
        if state["stopping"]:
            return code


def refusal_of(code: int, output: str, *, env: dict[str, str], certs: Path, superlink: str, node: int) -> Refusal:
    """Why the SuperNode of node ``node`` (key pair ``node-<node>`` in ``certs``) exited with status ``code`` after
    writing ``output``: Flower says it in a line or two (a TLS verification failure, ``[code: 2004] Failed to activate
    SuperNode.``), and for a refused activation the SuperLink's list of nodes tells an unknown key (final) from a
    previous connection still counted as online (it lets go after two missed heartbeats: start again)."""
    from privfl.engines.flower.launch import CA_CERT, node_key  # launch imports this module

    said = flower_message(output)
    if "CERTIFICATE_VERIFY_FAILED" in output or "handshake error" in output:
        said = next((line for line in flower_lines(output) if "CERTIFICATE_VERIFY_FAILED" in line), said)
        return Refusal(f"the SuperLink at {superlink} presented a TLS certificate that {certs / CA_CERT} does not "
                       f"verify (Flower: {said}): pass the --certs directory whose {CA_CERT} signed the SuperLink's "
                       f"certificate (the one the SuperLink was started with)", final=True)
    if flower_code(output) != NODE_ACTIVATION_FAILED:
        return Refusal(f"the SuperNode exited with status {code} (Flower: {said})")
    key = node_key(certs, node).with_suffix(".pub")
    try:
        status, online_for = node_status(env, superlink, certs, key)
    except Exception as error:         # the Control API unreachable from here: say what Flower said, and retry
        return Refusal(f"the SuperLink at {superlink} refused to activate node {node} (Flower: {said}; asking it "
                       f"why failed: {type(error).__name__}: {str(error).splitlines()[0] if str(error) else ''})")
    if status in (None, "unregistered"):
        return Refusal(f"the SuperLink at {superlink} does not know node {node}'s public key {key} (Flower: {said}): "
                       f"register it first: privfl flower register --certs {certs} --superlink {superlink} {node}",
                       final=True)
    if status == "online":
        return Refusal(f"the SuperLink at {superlink} still counts node {node}'s previous connection as online "
                       f"(for about {max(online_for, 0):.0f} s more: it lets go after two missed heartbeats)")
    return Refusal(f"the SuperLink at {superlink} refused to activate node {node}, registered and {status} "
                   f"(Flower: {said})")


def node_status(env: dict[str, str], superlink: str, certs: Path, public_key: Path) -> tuple[str | None, float]:
    """The SuperLink's status of the node registered with ``public_key`` (an OpenSSH public key file):
    ``registered``, ``online``, ``offline``, ``unregistered``, or None when no node has that key; and for an online
    node the seconds until the SuperLink counts it offline without a heartbeat."""
    from cryptography.hazmat.primitives import serialization
    from flwr.proto.control_pb2 import ListNodesRequest
    from flwr.supercore.primitives.asymmetric import public_key_to_bytes

    wanted = public_key_to_bytes(serialization.load_ssh_public_key(public_key.read_bytes()))  # type: ignore[arg-type]
    client = control_client(env, superlink, certs)
    try:
        response = client.ListNodes(ListNodesRequest())
    finally:
        client.close()
    for info in response.nodes_info:
        if info.public_key == wanted:
            return info.status, (info.online_until - time.time() if info.HasField("online_until") else 0.0)
    return None, 0.0


def quietly(env: dict[str, str], make: Callable[[], Any]) -> Any:
    """``make()`` with ``FLWR_HOME`` from ``env`` and Flower's chatter on stdout and stderr silenced."""
    import contextlib
    import io

    previous = os.environ.get("FLWR_HOME")
    os.environ["FLWR_HOME"] = env["FLWR_HOME"]
    try:
        with contextlib.redirect_stdout(io.StringIO()), contextlib.redirect_stderr(io.StringIO()):
            return make()
    finally:
        if previous is None:
            os.environ.pop("FLWR_HOME", None)
        else:
            os.environ["FLWR_HOME"] = previous


def control_client(env: dict[str, str], superlink: str, certs: Path) -> Any:
    """A client of the SuperLink's Control API at ``superlink`` (TLS rooted in ``certs/ca.crt``), as Flower's CLI
    makes one, without a connection file."""
    from flwr.cli.typing import SuperLinkConnection
    from flwr.cli.utils import init_http_client_from_connection

    from privfl.engines.flower.launch import CA_CERT, CONNECTION  # launch imports this module

    connection = SuperLinkConnection(name=CONNECTION, address=superlink,
                                     root_certificates=str((certs / CA_CERT).resolve()))
    return quietly(env, lambda: init_http_client_from_connection(connection))


def _watch(node: subprocess.Popen, worker: list[str], env: dict[str, str], state: dict[str, Any],
           restarts: int) -> int:
    """Run the ClientApp process beside the SuperNode ``node`` until the SuperNode exits; return its status."""
    helper = _start_child(worker, env, state)
    exits: list[float] = []
    try:
        while True:
            try:
                return node.wait(timeout=0.2)
            except subprocess.TimeoutExpired:
                pass
            code = helper.poll()
            if code is None or state["stopping"]:
                continue
            now = time.monotonic()
            exits = [t for t in exits if now - t < 60] + [now]
            if len(exits) > restarts:
                print(f"privfl flower: error: the ClientApp process exited with status {code}, {len(exits)} times "
                      "within a minute; stopping the SuperNode", file=sys.stderr, flush=True)
                state["worker_failed"] = True
                _stop_child(node)
                return node.wait()
            print(f"privfl flower: the ClientApp process exited with status {code}; starting it again",
                  file=sys.stderr, flush=True)
            helper = _start_child(worker, env, state)
    finally:
        _stop_child(helper)


# -- local sessions: what a test or benchmark needs to start a deployment on one machine and end it ------------------


def free_port() -> int:
    """A TCP port on 127.0.0.1 that is free now (the OS's choice)."""
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def descendants(pid: int) -> list[int]:
    """Process ids below ``pid`` (Flower's SuperExec, ServerApp and ClientApp processes), read from ``/proc``
    (empty where there is no ``/proc``)."""
    children: dict[int, list[int]] = {}
    proc = Path("/proc")
    if not proc.exists():
        return []
    for entry in proc.iterdir():
        if entry.name.isdigit():
            try:
                ppid = int((entry / "stat").read_text().rsplit(")", 1)[1].split()[1])
            except (OSError, IndexError, ValueError):
                continue
            children.setdefault(ppid, []).append(int(entry.name))
    found, stack = [], [pid]
    while stack:
        for child in children.get(stack.pop(), []):
            found.append(child)
            stack.append(child)
    return found


def end_processes(processes: list[subprocess.Popen]) -> None:
    """End every process started here, and everything it started, by process id (terminate, then kill after 10 s;
    the descendants are listed before their parent ends, so none is orphaned and missed)."""

    for process in processes:
        below = descendants(process.pid)
        process.terminate()
        try:
            process.wait(timeout=10)
        except subprocess.TimeoutExpired:
            process.kill()
            process.wait(timeout=10)
        for pid in below:
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
