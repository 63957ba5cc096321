"""The deployment engine with the project's own commands: certificates, SuperLink, SuperNodes, ``flwr run``.

``privfl flower <command>`` (or ``python -m privfl.engines.flower.launch <command>``):

* ``certs DIR``: a certificate authority, the SuperLink's TLS certificate and key (for the hosts given), and one
  EC P-384 key pair per SuperNode for node authentication (OpenSSH format, as Flower reads them);
* ``superlink``: ``flower-superlink`` with TLS and SuperNode authentication on, this project's app dependencies
  not installed at run time (they are installed already: privfl itself);
* ``register``: ``flwr supernode register`` of nodes' public keys (only registered nodes may connect);
* ``supernode``: ``flower-supernode`` with TLS, its private key, and a node config naming its partition (or range of
  partitions) and the directory that keeps its clients' ledgers and states, started again while the SuperLink
  refuses it (a node restarted after it died); in process isolation (the default) with one long-lived ClientApp
  process beside it (:mod:`privfl.engines.flower.worker`) that runs every message, or, with ``--isolation
  subprocess``, Flower's fresh ClientApp process per message; it asks the SuperLink for work every ``--poll-s``
  seconds while idle (:mod:`privfl.engines.flower.supernode`);
* ``run``: ``flwr run`` of the privfl app (``app/`` beside this file) with a RunConfig JSON (e.g. the ``config.json``
  of a run directory), or with ``--serve-from`` a finished training run whose novel clients it serves, or with
  ``--resume`` a failed run, continued from its last checkpoint; it waits for the run's end, and its exit status
  says whether the run completed.

``register`` and ``supernode`` wait for the SuperLink to listen. The SuperLink is started with ``exec``: the process
id you start is the daemon's. ``supernode`` stays as the parent of the SuperNode and its ClientApp process and passes
SIGTERM and SIGINT on to them, so ``kill PID`` ends them too (on Linux so does ``kill -9 PID``).
Commands use ``$FLWR_HOME`` when set, else ``CERTS/flwr-home``; they set ``FLWR_DISABLE_UPDATE_CHECK=1`` and
``FLWR_DISABLE_RUNTIME_DEPENDENCY_INSTALLATION=1``. See ``README.md`` for a full session.
"""

from __future__ import annotations

import argparse
import datetime
import ipaddress
import json
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path
from typing import TYPE_CHECKING

from privfl.engines.flower import protocol as p
from privfl.engines.flower import supernode
from privfl.engines.flower.supervisor import (
    PUBLIC_KEY_ALREADY_IN_USE,
    Refusal,
    flower_code,
    flower_message,
    quietly,
    refusal_of,
    supervise_supernode,
)
from privfl.errors import ConfigError

if TYPE_CHECKING:
    from flwr.supercore.control import ControlHttpClient

APP_DIR = Path(__file__).resolve().parent / "app"
CONNECTION = "privfl"
CA_CERT, SERVER_CERT, SERVER_KEY = "ca.crt", "server.pem", "server.key"


def node_key(certs: Path, index: int) -> Path:
    """The private key file of SuperNode ``index`` (its public key is the same path with ``.pub``)."""
    return Path(certs) / f"node-{index}.key"


CA_KEY = "ca.key"
DATABASE = "superlink.db"


def node_indices(certs: Path) -> list[int]:
    """The indices of the SuperNode key pairs in ``certs``, in increasing order."""
    found = []
    for path in Path(certs).glob("node-*.key"):
        index = path.stem.removeprefix("node-")
        if index.isdigit():
            found.append(int(index))
    return sorted(found)


def _write_private(path: Path, data: bytes) -> None:
    """Write a private key readable and writable by its owner only (mode 0600 from the first byte)."""
    path.unlink(missing_ok=True)
    descriptor = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    with os.fdopen(descriptor, "wb") as f:
        f.write(data)
    path.chmod(0o600)


def _write_node_keys(out: Path, indices: list[int]) -> None:
    from cryptography.hazmat.primitives import serialization
    from cryptography.hazmat.primitives.asymmetric import ec

    for index in indices:
        key = ec.generate_private_key(ec.SECP384R1())
        path = node_key(out, index)
        _write_private(path, key.private_bytes(serialization.Encoding.PEM, serialization.PrivateFormat.OpenSSH,
                                               serialization.NoEncryption()))
        path.with_suffix(".pub").write_bytes(key.public_key().public_bytes(serialization.Encoding.OpenSSH,
                                                                            serialization.PublicFormat.OpenSSH))


def generate_certificates(directory: str | os.PathLike, *, hosts: tuple[str, ...] = ("127.0.0.1", "localhost"),
                          nodes: int = 2, days: int = 30, overwrite: bool = False) -> Path:
    """Write a CA (its certificate, and its private key ``ca.key`` kept for the operator), the SuperLink's
    certificate for ``hosts`` and ``nodes`` SuperNode key pairs into ``directory``.

    Private keys are written with mode 0600. A directory that already holds a CA is refused unless ``overwrite``:
    replacing it would replace every node key the SuperLink has registered (add nodes with :func:`add_nodes`).
    Nothing here is meant to be committed: generate them where they are used.
    """
    from cryptography import x509
    from cryptography.hazmat.primitives import hashes, serialization
    from cryptography.hazmat.primitives.asymmetric import rsa
    from cryptography.x509.oid import NameOID

    if not isinstance(nodes, int) or nodes < 0:
        raise ConfigError(f"nodes must be an integer >= 0, got {nodes!r}")
    out = Path(directory)
    existing = [name for name in (CA_CERT, CA_KEY, SERVER_CERT, SERVER_KEY) if (out / name).exists()]
    if (existing or node_indices(out)) and not overwrite:
        raise ConfigError(f"{out} already holds certificates or keys ({', '.join(existing) or 'node keys'}); "
                          "pass --overwrite to replace all of them (every SuperNode must then be registered again), "
                          "or --add-node N to add node key pairs")
    out.mkdir(parents=True, exist_ok=True)
    if overwrite:
        for index in node_indices(out):
            node_key(out, index).unlink()
            node_key(out, index).with_suffix(".pub").unlink(missing_ok=True)
    now = datetime.datetime.now(datetime.UTC)
    validity = (now - datetime.timedelta(minutes=5), now + datetime.timedelta(days=days))

    ca_key = rsa.generate_private_key(public_exponent=65537, key_size=2048)
    ca_name = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, "privfl test CA")])
    ca_cert = (x509.CertificateBuilder().subject_name(ca_name).issuer_name(ca_name).public_key(ca_key.public_key())
               .serial_number(x509.random_serial_number()).not_valid_before(validity[0])
               .not_valid_after(validity[1])
               .add_extension(x509.BasicConstraints(ca=True, path_length=None), critical=True)
               .sign(ca_key, hashes.SHA256()))
    server_key = rsa.generate_private_key(public_exponent=65537, key_size=2048)
    names: list[x509.GeneralName] = []
    for host in hosts:
        try:
            names.append(x509.IPAddress(ipaddress.ip_address(host)))
        except ValueError:
            names.append(x509.DNSName(host))
    server_cert = (x509.CertificateBuilder()
                   .subject_name(x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, hosts[0])]))
                   .issuer_name(ca_name).public_key(server_key.public_key())
                   .serial_number(x509.random_serial_number()).not_valid_before(validity[0])
                   .not_valid_after(validity[1])
                   .add_extension(x509.SubjectAlternativeName(names), critical=False)
                   .add_extension(x509.BasicConstraints(ca=False, path_length=None), critical=True)
                   .sign(ca_key, hashes.SHA256()))
    pem, traditional = serialization.Encoding.PEM, serialization.PrivateFormat.TraditionalOpenSSL
    (out / CA_CERT).write_bytes(ca_cert.public_bytes(pem))
    _write_private(out / CA_KEY, ca_key.private_bytes(pem, traditional, serialization.NoEncryption()))
    (out / SERVER_CERT).write_bytes(server_cert.public_bytes(pem))
    _write_private(out / SERVER_KEY, server_key.private_bytes(pem, traditional, serialization.NoEncryption()))
    _write_node_keys(out, list(range(nodes)))
    return out


def add_nodes(directory: str | os.PathLike, count: int) -> list[int]:
    """Add ``count`` SuperNode key pairs to the certificates in ``directory``, numbered after the last one; return
    their indices. The CA, the SuperLink's certificate and the existing keys stay as they are."""
    out = Path(directory)
    if not isinstance(count, int) or count < 1:
        raise ConfigError(f"--add-node must be an integer >= 1 (key pairs to add), got {count!r}")
    if not (out / CA_CERT).exists():
        raise ConfigError(f"{out / CA_CERT} does not exist: create the certificates first (privfl flower certs {out})")
    first = max(node_indices(out), default=-1) + 1
    indices = list(range(first, first + count))
    _write_node_keys(out, indices)
    return indices


def require_files(*paths: Path) -> None:
    """Refuse, in one line, when a certificate or key file a command needs is missing."""
    missing = [str(path) for path in paths if not Path(path).is_file()]
    if missing:
        raise ConfigError(f"missing {', '.join(missing)}: create the certificates with privfl flower certs DIR "
                          "(--add-node N for more node keys), or pass the --certs directory that holds them")


def flower_env(certs: str | os.PathLike | None = None) -> dict[str, str]:
    """The environment for Flower's commands: ``FLWR_HOME`` (kept if set), no update check, no dependency installs,
    and this Python's scripts first on ``PATH`` (the SuperLink and SuperNode start ``flower-superexec`` by name)."""
    env = dict(os.environ)
    if "FLWR_HOME" not in env:
        if certs is None:
            raise ConfigError("set FLWR_HOME or pass --certs (FLWR_HOME defaults to CERTS/flwr-home)")
        env["FLWR_HOME"] = str(Path(certs).resolve() / "flwr-home")
    env["FLWR_DISABLE_UPDATE_CHECK"] = "1"
    env["FLWR_DISABLE_RUNTIME_DEPENDENCY_INSTALLATION"] = "1"
    scripts = str(Path(sys.executable).parent)
    env["PATH"] = scripts + os.pathsep + env.get("PATH", "")
    return env


def write_connection(env: dict[str, str], superlink: str, certs: Path) -> Path:
    """Write the Flower CLI's connection ``privfl`` (the SuperLink's address, TLS root) into ``$FLWR_HOME``."""
    home = Path(env["FLWR_HOME"])
    home.mkdir(parents=True, exist_ok=True)
    path = home / "config.toml"
    path.write_text(f'[superlink]\ndefault = "{CONNECTION}"\n\n[superlink.{CONNECTION}]\n'
                    f'address = "{superlink}"\nroot-certificates = "{(certs / CA_CERT).resolve()}"\n')
    return path


def _tool(name: str) -> str:
    found = shutil.which(name, path=str(Path(sys.executable).parent)) or shutil.which(name)
    if found is None:
        raise ConfigError(f"{name} is not installed here; install privfl with the flower extra: "
                          "pip install 'privfl[flower]'")
    return found


def superlink_command(certs: Path, address: str, database: str | None = None) -> list[str]:
    """``flower-superlink`` with TLS and SuperNode authentication; its state (registered nodes, runs) in the SQLite
    file ``database`` (default ``CERTS/superlink.db``, kept across restarts; ``:memory:`` keeps nothing)."""
    require_files(certs / CA_CERT, certs / SERVER_CERT, certs / SERVER_KEY)
    host, _, port = address.rpartition(":")
    if database is None:
        database = str((certs / DATABASE).resolve())
    command = [_tool("flower-superlink"), "--ssl-ca-certfile", str(certs / CA_CERT),
               "--ssl-certfile", str(certs / SERVER_CERT), "--ssl-keyfile", str(certs / SERVER_KEY),
               "--enable-supernode-auth", "--disable-runtime-dependency-installation",
               "--host", host, "--port", port]
    return command + ([] if database == ":memory:" else ["--database", database])


def wait_for_superlink(address: str, wait_s: float, *, poll_s: float = 0.5) -> float:
    """Wait until the SuperLink at ``address`` accepts TCP connections, at most ``wait_s`` seconds; return the
    seconds waited. A SuperLink started a moment ago takes a few seconds to listen."""
    import socket

    host, _, port = address.rpartition(":")
    if not host or not port.isdigit():
        raise ConfigError(f"--superlink must be HOST:PORT, got {address!r}")
    started = time.monotonic()
    while True:
        try:
            with socket.create_connection((host, int(port)), timeout=min(2.0, max(wait_s, 0.1))):
                return time.monotonic() - started
        except OSError as error:
            reason = error.strerror or type(error).__name__
        if time.monotonic() - started >= wait_s:
            raise ConfigError(f"the SuperLink at {address} did not accept connections within {wait_s:g} s "
                              f"(--wait-s; last: {reason}); start it first (privfl flower superlink --address "
                              f"{address}), or check the address")
        time.sleep(poll_s)


#: How a SuperNode runs its ClientApp: ``process`` (the default), in one long-lived ClientApp process that
#: :func:`supervise_supernode` starts beside it and that keeps its imports and data between messages
#: (:mod:`privfl.engines.flower.worker`); ``subprocess``, Flower's default, in a fresh process per message.
ISOLATIONS = ("process", "subprocess")


def supernode_command(certs: Path, superlink: str, *, node: int, num_partitions: int, node_dir: str, port: int,
                      partition_id: int | None = None, partition_range: str | None = None,
                      host: str = "127.0.0.1", isolation: str = "process",
                      poll_s: float = supernode.DEFAULT_POLL_S) -> list[str]:
    """``flower-supernode`` for one partition (``partition_id``) or several (``partition_range="FIRST-LAST"``), in
    Flower's ``isolation`` mode (one of :data:`ISOLATIONS`; with ``process`` the SuperNode runs no ClientApp itself:
    start :func:`worker_command` beside it), asking the SuperLink for work every ``poll_s`` seconds while idle
    (:mod:`privfl.engines.flower.supernode`; Flower's own is 3 s)."""
    if isolation not in ISOLATIONS:
        raise ConfigError(f"--isolation must be one of {', '.join(ISOLATIONS)}, got {isolation!r}")
    poll_s = supernode.check_poll_s(poll_s)
    if (partition_id is None) == (partition_range is None):
        raise ConfigError(f"give exactly one of --partition-id and --partition-range, got {partition_id!r} and "
                          f"{partition_range!r}")
    held = f"{p.PARTITION_ID}={partition_id}" if partition_id is not None else \
        f'{p.PARTITION_RANGE}="{partition_range}"'
    config = f'{held} {p.NUM_PARTITIONS}={num_partitions} {p.NODE_DIR}="{node_dir}" {p.NODE_INDEX}={node}'
    p.node_partitions(_parse_node_config(config))        # refuse a bad range here, not in the ClientApp
    require_files(certs / CA_CERT, node_key(certs, node))
    _tool("flower-supernode")                             # Flower is installed here
    return [sys.executable, "-m", "privfl.engines.flower.supernode", "--poll-s", f"{poll_s:g}", "--superlink",
            superlink, "--root-certificates", str(certs / CA_CERT),
            "--auth-supernode-private-key", str(node_key(certs, node)), "--node-config", config,
            "--host", host, "--port", str(port), "--isolation", isolation]


def worker_command(host: str, port: int, parent_pid: int | None = None) -> list[str]:
    """The long-lived ClientApp process of a SuperNode in process isolation whose Runtime API listens at
    ``host:port`` (:mod:`privfl.engines.flower.worker`); it ends when ``parent_pid`` ends."""
    command = [sys.executable, "-m", "privfl.engines.flower.worker", "--runtime-api-address", f"{host}:{port}"]
    return command + ([] if parent_pid is None else ["--parent-pid", str(parent_pid)])


def _parse_node_config(text: str) -> dict:
    from flwr.common.config import parse_config_args  # as flower-supernode reads --node-config

    return parse_config_args([text])


def run_command(config_path: str | None, out: str, *, overwrite: bool = False,
                timeout_s: float = p.DEFAULT_TIMEOUT_S, node_wait_s: float = 120,
                serve_from: str | None = None, serve_clients: str = "", resume: bool = False,
                verbose: bool = False) -> list[str]:
    """``flwr run`` of the privfl app: train the RunConfig in ``config_path``, or, with ``serve_from`` (a finished
    training run directory on the SuperLink's machine), serve its novel clients (``serve_clients``: ids, "" = all;
    the RunConfig defaults to ``serve_from/config.json``), or, with ``resume``, continue the run in ``out`` from its
    last checkpoint (the RunConfig defaults to ``out/config.json``). ``verbose``: a run stopped by a node's failure
    or a refused setting logs its traceback, not only its one-line reason."""
    from privfl.config import RunConfig

    if resume and (serve_from is not None or overwrite):
        raise ConfigError("--resume continues a training run: it takes neither --serve-from nor --overwrite")
    if config_path is None:
        if resume:
            config_path = str(Path(out) / "config.json")
        elif serve_from is None:
            raise ConfigError("give --config (a RunConfig JSON), or --serve-from a finished training run")
        else:
            config_path = str(Path(serve_from) / "config.json")
    if not timeout_s > 0:
        raise ConfigError(f"--timeout-s must be > 0 seconds (a limit for one exchange's replies), got {timeout_s!r}")
    try:
        config = json.loads(Path(config_path).read_text())
    except OSError as error:
        raise ConfigError(f"cannot read the RunConfig {config_path}: {error.strerror}; give --config a RunConfig "
                          "JSON (e.g. a run directory's config.json)") from None
    except json.JSONDecodeError as error:
        raise ConfigError(f"{config_path} is not JSON ({error.msg} at line {error.lineno}); give --config a "
                          "RunConfig JSON (e.g. a run directory's config.json)") from None
    RunConfig.from_dict(config)        # refuse a bad config here, not in the ServerApp on the SuperLink's machine
    text = json.dumps(config).replace("'", "\\u0027")    # one TOML literal string
    settings = [f"{p.RUN_CONFIG}='{text}'", f'{p.OUT}="{Path(out).resolve()}"',
                f"{p.OVERWRITE}={'true' if overwrite else 'false'}", f"{p.TIMEOUT}={float(timeout_s)}",
                f"{p.NODE_WAIT}={float(node_wait_s)}", f"{p.RESUME}={'true' if resume else 'false'}",
                f"{p.VERBOSE}={'true' if verbose else 'false'}"]
    if serve_from is not None:
        settings += [f'{p.SERVE_FROM}="{Path(serve_from).resolve()}"', f'{p.SERVE_CLIENTS}="{serve_clients}"']
    command = [_tool("flwr"), "run", str(APP_DIR), CONNECTION]
    for setting in settings:
        command += ["--run-config", setting]
    return command



def register_nodes(env: dict[str, str], certs: Path, superlink: str, indices: list[int], *,
                   wait_s: float = 60.0) -> None:
    """``flwr supernode register`` of the public keys of nodes ``indices``, once the SuperLink listens (at most
    ``wait_s`` seconds, retrying a refused registration meanwhile). A key the SuperLink already knows (a SuperLink
    restarted on its database; Flower's code 23) counts as registered."""
    keys = [node_key(certs, index).with_suffix(".pub") for index in indices]
    require_files(certs / CA_CERT, *keys)
    write_connection(env, superlink, certs)
    deadline = time.monotonic() + wait_s
    wait_for_superlink(superlink, wait_s)
    for index, key in zip(indices, keys, strict=True):
        while True:
            done = subprocess.run([_tool("flwr"), "supernode", "register", str(key), CONNECTION], env=env,
                                  capture_output=True, text=True)
            output = done.stdout + done.stderr
            if done.returncode == 0:
                print(f"registered node {index} ({key})")
                break
            if flower_code(output) == PUBLIC_KEY_ALREADY_IN_USE:
                print(f"node {index} ({key}) is registered already")
                break
            if time.monotonic() > deadline:
                raise ConfigError(f"the SuperLink at {superlink} refused to register node {index} ({key}) for "
                                  f"{wait_s:g} s (--wait-s): {flower_message(output)}")
            time.sleep(1.0)


def run_id_of(output: str) -> int:
    """The run id ``flwr run --format json`` printed."""
    for line in reversed(output.splitlines()):
        try:
            payload = json.loads(line)
        except json.JSONDecodeError:
            continue
        if isinstance(payload, dict) and payload.get("run-id"):
            return int(payload["run-id"])
    try:
        payload = json.loads(output)
        return int(payload["run-id"])
    except (json.JSONDecodeError, KeyError, TypeError, ValueError):
        raise ConfigError(f"flwr run did not start a run: {flower_message(output)}") from None


class RunWatcher:
    """Asks the SuperLink for the status of runs through the Control API, as ``flwr ls --run-id`` does, over one
    connection (made again after an error)."""

    def __init__(self, env: dict[str, str]) -> None:
        self.env = env
        self._client: ControlHttpClient | None = None

    def _connect(self) -> ControlHttpClient:
        from flwr.cli.flower_config import read_superlink_connection
        from flwr.cli.utils import init_http_client_from_connection

        return quietly(self.env, lambda: init_http_client_from_connection(read_superlink_connection(CONNECTION)))

    def status(self, run_id: int) -> tuple[str, str]:
        """The status of Flower run ``run_id`` (``running``, ``finished:completed``, ``finished:failed``, ...) and
        its details (a failed ServerApp's exception)."""
        from flwr.proto.control_pb2 import ListRunsRequest

        if self._client is None:
            self._client = self._connect()
        try:
            response = self._client.ListRuns(ListRunsRequest(run_id=run_id))
        except BaseException:
            self.close()
            raise
        run = response.run_dict[run_id]
        return run.status.status + (f":{run.status.sub_status}" if run.status.sub_status else ""), \
            run.status.details

    def close(self) -> None:
        if self._client is not None:
            self._client.close()
            self._client = None

    def wait(self, run_id: int, *, poll_s: float = 2.0, lost_s: float = 60.0) -> tuple[str, str]:
        """Poll the status of run ``run_id`` until it is finished; return its status and details. A SuperLink that
        cannot be asked for ``lost_s`` seconds running gives the status ``unknown``."""
        failing_since = None
        try:
            while True:
                try:
                    state, details = self.status(run_id)
                    failing_since = None
                except Exception as error:          # the SuperLink restarting, or gone: retry, within lost_s
                    now = time.monotonic()
                    failing_since = failing_since or now
                    if now - failing_since > lost_s:
                        return "unknown", (f"the SuperLink did not answer for {lost_s:g} s "
                                           f"({type(error).__name__}: {error})")
                else:
                    if state.startswith("finished"):
                        return state, details
                time.sleep(poll_s)
        finally:
            self.close()


def run_and_wait(command: list[str], env: dict[str, str], *, out: str, stream: bool) -> int:
    """Start ``command`` (``flwr run``), say where to watch, follow the run's log with ``stream``, and wait until
    the run ends. Exit status: 0 when the run completed, 1 when it failed or stopped (the ServerApp's error is
    printed), 130 on Ctrl-C (the run goes on)."""
    started = subprocess.run(command + ["--format", "json"], env=env, capture_output=True, text=True)
    if started.returncode != 0:
        print(f"privfl flower: error: flwr run failed: {flower_message(started.stdout + started.stderr)}",
              file=sys.stderr)
        return started.returncode or 1
    run_id = run_id_of(started.stdout)
    print(f"privfl flower: started run {run_id}; its run directory: {out} (on the SuperLink's machine); follow its "
          f"log with: FLWR_HOME={env['FLWR_HOME']} flwr log {run_id} {CONNECTION} --stream", flush=True)
    follower = None
    if stream:
        follower = subprocess.Popen([_tool("flwr"), "log", str(run_id), CONNECTION, "--stream"], env=env)
    try:
        state, details = RunWatcher(env).wait(run_id)
    except KeyboardInterrupt:
        print(f"privfl flower: stopped waiting; run {run_id} goes on on the SuperLink (stop it with: flwr stop "
              f"{run_id} {CONNECTION})", file=sys.stderr)
        return 130
    finally:
        if follower is not None:
            try:
                follower.wait(timeout=10)
            except subprocess.TimeoutExpired:
                follower.terminate()
                follower.wait(timeout=10)
    if state == "finished:completed":
        print(f"privfl flower: run {run_id} completed; results in {out}")
        return 0
    print(f"privfl flower: error: run {run_id} did not complete ({state}): {details or 'no details'}",
          file=sys.stderr)
    return 1


def _resumable(out: Path) -> bool:
    """Whether ``out`` (when it is on this machine) holds a run that stopped after its first checkpoint."""
    from privfl.federation.rundir import RunDirectory

    run = RunDirectory(out)
    return run.path(RunDirectory.CHECKPOINT).is_file() and not run.path(RunDirectory.SUMMARY).exists()


def main(argv: list[str] | None = None) -> int:
    """``privfl flower COMMAND``; a user error prints one line and gives exit status 2."""
    from privfl.errors import PrivflError

    try:
        return _main(argv)
    except PrivflError as error:
        print(f"privfl flower: error: {error}", file=sys.stderr)
        return 2


def build_parser() -> argparse.ArgumentParser:
    """The ``privfl flower`` command line: certs, superlink, register, supernode, run."""
    from privfl.helpformat import show_defaults

    parser = argparse.ArgumentParser(prog="privfl flower", description=__doc__.splitlines()[0])
    sub = parser.add_subparsers(dest="command", required=True)
    c = sub.add_parser("certs",
                       help="CA, SuperLink certificate and SuperNode key pairs (generated here, never committed)")
    c.add_argument("directory")
    c.add_argument("--nodes", type=int, default=2)
    c.add_argument("--host", action="append", default=None, help="SuperLink host name or IP (repeatable)")
    c.add_argument("--overwrite", action="store_true",
                   help="replace the CA, the SuperLink's certificate and every node key in DIRECTORY")
    c.add_argument("--add-node", type=int, default=None, metavar="N",
                   help="add N node key pairs to DIRECTORY, numbered after the last; nothing else changes")
    s = sub.add_parser("superlink", help="start a SuperLink (TLS, node authentication); exec, so PID = daemon")
    s.add_argument("--certs", required=True)
    s.add_argument("--address", default="127.0.0.1:9093", help="host:port of the SuperLink's APIs")
    s.add_argument("--database", default=None,
                   help=f"SQLite file that keeps the SuperLink's state across restarts (registered nodes, runs); "
                        f"default CERTS/{DATABASE}; :memory: keeps nothing")
    r = sub.add_parser("register", help="register SuperNode public keys with the SuperLink")
    r.add_argument("--certs", required=True)
    r.add_argument("--superlink", default="127.0.0.1:9093")
    r.add_argument("--wait-s", type=float, default=60.0, help="wait this long for the SuperLink to listen, in seconds")
    r.add_argument("nodes", type=int, nargs="+", help="node indices (keys CERTS/node-<i>.pub)")
    n = sub.add_parser("supernode", help="start a SuperNode holding one partition or a range, and start it again "
                                         "if the SuperLink refuses it at first (kill PID ends it)")
    n.add_argument("--certs", required=True)
    n.add_argument("--superlink", default="127.0.0.1:9093")
    n.add_argument("--wait-s", type=float, default=60.0, help="wait this long for the SuperLink to listen, in seconds")
    n.add_argument("--rejoin-s", type=float, default=120.0,
                   help="start the SuperNode again while it exits with an error within this many seconds (a node "
                        "restarted after it died is refused until the SuperLink lets its previous connection go)")
    n.add_argument("--node", type=int, required=True, help="index of its key pair in CERTS")
    held = n.add_mutually_exclusive_group(required=True)
    held.add_argument("--partition-id", type=int, help="the one partition this node holds")
    held.add_argument("--partition-range", help="FIRST-LAST (inclusive): the partitions this node holds")
    n.add_argument("--num-partitions", type=int, required=True)
    n.add_argument("--node-dir", required=True, help="directory that keeps this node's ledgers")
    n.add_argument("--port", type=int, default=None, help="its local runtime API port (default 9100 + node)")
    n.add_argument("--poll-s", type=float, default=supernode.DEFAULT_POLL_S,
                   help="while idle, ask the SuperLink for work every this many seconds (Flower's own: 3)")
    n.add_argument("--isolation", choices=ISOLATIONS, default="process",
                   help="process (default): one long-lived ClientApp process, started and stopped with the "
                        "SuperNode, runs every message; subprocess: as Flower does unless told otherwise, a fresh "
                        "ClientApp process per message (seconds of imports each)")
    f = sub.add_parser("run", help="flwr run of the privfl app: train a RunConfig JSON, or serve novel clients; "
                                   "waits for the run's end (exit status 0 only when it completed)")
    f.add_argument("--certs", required=True)
    f.add_argument("--superlink", default="127.0.0.1:9093")
    f.add_argument("--config", default=None, help="RunConfig JSON (e.g. a run directory's config.json)")
    f.add_argument("--out", default=None, help="run (or serving) directory, on the SuperLink's machine")
    f.add_argument("--resume", default=None, metavar="RUN_DIR",
                   help="continue the run in RUN_DIR (on the SuperLink's machine) from its last checkpoint, after a "
                        "failure: restart the nodes that died first (same key and node directory)")
    f.add_argument("--overwrite", action="store_true")
    f.add_argument("--timeout-s", type=float, default=p.DEFAULT_TIMEOUT_S,
                   help="limit for one exchange's replies, in seconds, > 0")
    f.add_argument("--node-wait-s", type=float, default=120,
                   help="wait this long for the nodes the run needs, in seconds")
    f.add_argument("--serve-from", default=None,
                   help="a finished training run directory (on the SuperLink's machine): serve its novel clients "
                        "in a run of their own instead of training")
    f.add_argument("--serve-clients", default=None,
                   help="with --serve-from: novel client ids, e.g. 9,10 (default: all of them)")
    f.add_argument("--stream", action="store_true", help="show the run's log (one line per round) until it ends")
    f.add_argument("--verbose", action="store_true",
                   help="a run stopped by a node's failure or a refused setting logs its traceback too, not only the "
                        "one line that names the node (--node I and its partitions) or the setting")
    f.add_argument("--wait-s", type=float, default=60.0, help="wait this long for the SuperLink to listen, in seconds")
    return show_defaults(parser)


def _main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)

    if args.command == "certs":
        if args.add_node is not None:
            added = add_nodes(args.directory, args.add_node)
            print(f"added node key pairs {', '.join(map(str, added))} to {args.directory} (register them: "
                  f"privfl flower register --certs {args.directory} {' '.join(map(str, added))})")
            return 0
        out = generate_certificates(args.directory, hosts=tuple(args.host or ("127.0.0.1", "localhost")),
                                    nodes=args.nodes, overwrite=args.overwrite)
        print(f"wrote {CA_CERT}, {CA_KEY}, {SERVER_CERT}, {SERVER_KEY} and {args.nodes} node key pairs to {out} "
              f"(keep {CA_KEY} and the node keys private)")
        return 0
    certs = Path(args.certs)
    if not certs.is_dir():
        raise ConfigError(f"--certs {certs} is not a directory; create it with privfl flower certs {certs}")
    env = flower_env(certs)
    if args.command == "superlink":
        command = superlink_command(certs, args.address, args.database)
    elif args.command == "supernode":
        port = args.port if args.port is not None else 9100 + args.node
        command = supernode_command(certs, args.superlink, node=args.node, partition_id=args.partition_id,
                                    partition_range=args.partition_range, num_partitions=args.num_partitions,
                                    node_dir=str(Path(args.node_dir).resolve()), port=port,
                                    isolation=args.isolation, poll_s=args.poll_s)
        wait_for_superlink(args.superlink, args.wait_s)
        worker = worker_command("127.0.0.1", port, os.getpid()) if args.isolation == "process" else None

        def explain(code: int, output: str) -> Refusal:
            return refusal_of(code, output, env=env, certs=certs, superlink=args.superlink, node=args.node)

        return supervise_supernode(command, env, rejoin_s=args.rejoin_s, worker=worker, explain=explain)
    elif args.command == "register":
        register_nodes(env, certs, args.superlink, args.nodes, wait_s=args.wait_s)
        return 0
    else:
        if (args.out is None) == (args.resume is None):
            raise ConfigError(f"give --out (a new run's directory) or --resume RUN_DIR (a failed run's), got --out "
                              f"{args.out!r} and --resume {args.resume!r}")
        require_files(certs / CA_CERT)
        write_connection(env, args.superlink, certs)
        wait_for_superlink(args.superlink, args.wait_s)
        out = args.out or args.resume
        command = run_command(args.config, out, overwrite=args.overwrite, timeout_s=args.timeout_s,
                              node_wait_s=args.node_wait_s, serve_from=args.serve_from,
                              serve_clients=args.serve_clients or "", resume=args.resume is not None,
                              verbose=args.verbose)
        code = run_and_wait(command, env, out=out, stream=args.stream)
        if code == 0 and args.serve_from is None and (Path(out) / "summary.json").is_file():
            from privfl.evaluation import comparison_table
            from privfl.federation.spend import run_summary

            # the run's table, its epsilons recomputed from its ledger, when its directory is on this machine
            print(comparison_table([run_summary(out)]))
        if code == 1 and args.serve_from is None and _resumable(Path(out)):
            from privfl.federation.runtime import how_to_continue

            print(f"privfl flower: {how_to_continue('flower-deployment', out, certs=certs, superlink=args.superlink)}",
                  file=sys.stderr)
        return code
    os.execve(command[0], command, env)      # the daemon takes this process id


if __name__ == "__main__":
    sys.exit(main())
