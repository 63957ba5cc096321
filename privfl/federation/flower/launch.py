"""The deployment engine with the project's own commands: certificates, SuperLink, SuperNodes, ``flwr run``.

``privfl flower <command>`` (or ``python -m privfl.federation.flower.launch <command>``):

* ``certs DIR``: a certificate authority, the SuperLink's TLS certificate and key (for the hosts given), and one
  EC P-384 key pair per SuperNode for node authentication (OpenSSH format, as Flower reads them);
* ``superlink``: ``flower-superlink`` with TLS and SuperNode authentication on, this project's app dependencies
  not installed at run time (they are installed already: privfl itself);
* ``register``: ``flwr supernode register`` of nodes' public keys (only registered nodes may connect);
* ``supernode``: ``flower-supernode`` with TLS, its private key, and a node config naming its partition (or range of
  partitions) and the directory that keeps its clients' ledgers and states;
* ``run``: ``flwr run`` of the privfl app (``app/`` beside this file) with a RunConfig JSON (e.g. the ``config.json``
  of a run directory), or with ``--serve-from`` a finished training run whose novel clients it serves.

The daemons are started with ``exec``: the process id you start is the daemon's, so you can end it by that id.
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
from pathlib import Path

from privfl.errors import ConfigError
from privfl.federation.flower import protocol as p

APP_DIR = Path(__file__).resolve().parent / "app"
CONNECTION = "privfl"
CA_CERT, SERVER_CERT, SERVER_KEY = "ca.crt", "server.pem", "server.key"


def node_key(certs: Path, index: int) -> Path:
    """The private key file of SuperNode ``index`` (its public key is the same path with ``.pub``)."""
    return Path(certs) / f"node-{index}.key"


def generate_certificates(directory: str | os.PathLike, *, hosts: tuple[str, ...] = ("127.0.0.1", "localhost"),
                          nodes: int = 2, days: int = 30) -> Path:
    """Write a CA, the SuperLink's certificate for ``hosts`` and ``nodes`` SuperNode key pairs into ``directory``.

    Private keys are written with mode 0600. Nothing here is meant to be committed: generate them where they are used.
    """
    from cryptography import x509
    from cryptography.hazmat.primitives import hashes, serialization
    from cryptography.hazmat.primitives.asymmetric import ec, rsa
    from cryptography.x509.oid import NameOID

    if not isinstance(nodes, int) or nodes < 0:
        raise ConfigError(f"nodes must be an integer >= 0, got {nodes!r}")
    out = Path(directory)
    out.mkdir(parents=True, exist_ok=True)
    now = datetime.datetime.now(datetime.UTC)
    validity = (now - datetime.timedelta(minutes=5), now + datetime.timedelta(days=days))

    def write_private(path: Path, data: bytes) -> None:
        path.write_bytes(data)
        path.chmod(0o600)

    ca_key = rsa.generate_private_key(public_exponent=65537, key_size=2048)
    ca_name = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, "privfl test CA")])
    ca_cert = (x509.CertificateBuilder().subject_name(ca_name).issuer_name(ca_name).public_key(ca_key.public_key())
               .serial_number(x509.random_serial_number()).not_valid_before(validity[0])
               .not_valid_after(validity[1])
               .add_extension(x509.BasicConstraints(ca=True, path_length=None), critical=True)
               .sign(ca_key, hashes.SHA256()))
    server_key = rsa.generate_private_key(public_exponent=65537, key_size=2048)
    names = []
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
    pem = serialization.Encoding.PEM
    (out / CA_CERT).write_bytes(ca_cert.public_bytes(pem))
    (out / SERVER_CERT).write_bytes(server_cert.public_bytes(pem))
    write_private(out / SERVER_KEY, server_key.private_bytes(pem, serialization.PrivateFormat.TraditionalOpenSSL,
                                                             serialization.NoEncryption()))
    for index in range(nodes):
        key = ec.generate_private_key(ec.SECP384R1())
        path = node_key(out, index)
        write_private(path, key.private_bytes(pem, serialization.PrivateFormat.OpenSSH, serialization.NoEncryption()))
        path.with_suffix(".pub").write_bytes(key.public_key().public_bytes(serialization.Encoding.OpenSSH,
                                                                            serialization.PublicFormat.OpenSSH))
    return out


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
    host, _, port = address.rpartition(":")
    command = [_tool("flower-superlink"), "--ssl-ca-certfile", str(certs / CA_CERT),
               "--ssl-certfile", str(certs / SERVER_CERT), "--ssl-keyfile", str(certs / SERVER_KEY),
               "--enable-supernode-auth", "--disable-runtime-dependency-installation",
               "--host", host, "--port", port]
    return command + (["--database", database] if database else [])


def supernode_command(certs: Path, superlink: str, *, node: int, num_partitions: int, node_dir: str, port: int,
                      partition_id: int | None = None, partition_range: str | None = None,
                      host: str = "127.0.0.1") -> list[str]:
    """``flower-supernode`` for one partition (``partition_id``) or several (``partition_range="FIRST-LAST"``)."""
    if (partition_id is None) == (partition_range is None):
        raise ConfigError(f"give exactly one of --partition-id and --partition-range, got {partition_id!r} and "
                          f"{partition_range!r}")
    held = f"{p.PARTITION_ID}={partition_id}" if partition_id is not None else \
        f'{p.PARTITION_RANGE}="{partition_range}"'
    config = f'{held} {p.NUM_PARTITIONS}={num_partitions} {p.NODE_DIR}="{node_dir}"'
    p.node_partitions(_parse_node_config(config))        # refuse a bad range here, not in the ClientApp
    return [_tool("flower-supernode"), "--superlink", superlink, "--root-certificates", str(certs / CA_CERT),
            "--auth-supernode-private-key", str(node_key(certs, node)), "--node-config", config,
            "--host", host, "--port", str(port)]


def _parse_node_config(text: str) -> dict:
    from flwr.common.config import parse_config_args  # as flower-supernode reads --node-config

    return parse_config_args([text])


def run_command(config_path: str | None, out: str, *, overwrite: bool = False,
                timeout_s: float = p.DEFAULT_TIMEOUT_S, node_wait_s: float = 120, stream: bool = False,
                serve_from: str | None = None, serve_clients: str = "") -> list[str]:
    """``flwr run`` of the privfl app: train the RunConfig in ``config_path``, or, with ``serve_from`` (a finished
    training run directory on the SuperLink's machine), serve its novel clients (``serve_clients``: ids, "" = all;
    the RunConfig defaults to ``serve_from/config.json``)."""
    from privfl.config import RunConfig

    if config_path is None:
        if serve_from is None:
            raise ConfigError("give --config (a RunConfig JSON), or --serve-from a finished training run")
        config_path = str(Path(serve_from) / "config.json")
    if not timeout_s > 0:
        raise ConfigError(f"--timeout-s must be > 0 seconds (a limit for one exchange's replies), got {timeout_s!r}")
    config = json.loads(Path(config_path).read_text())
    RunConfig.from_dict(config)        # refuse a bad config here, not in the ServerApp on the SuperLink's machine
    text = json.dumps(config).replace("'", "\\u0027")    # one TOML literal string
    settings = [f"{p.RUN_CONFIG}='{text}'", f'{p.OUT}="{Path(out).resolve()}"',
                f"{p.OVERWRITE}={'true' if overwrite else 'false'}", f"{p.TIMEOUT}={float(timeout_s)}",
                f"{p.NODE_WAIT}={float(node_wait_s)}"]
    if serve_from is not None:
        settings += [f'{p.SERVE_FROM}="{Path(serve_from).resolve()}"', f'{p.SERVE_CLIENTS}="{serve_clients}"']
    command = [_tool("flwr"), "run", str(APP_DIR), CONNECTION]
    for setting in settings:
        command += ["--run-config", setting]
    return command + (["--stream"] if stream else [])



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
    import signal

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


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="privfl flower", description=__doc__.splitlines()[0])
    sub = parser.add_subparsers(dest="command", required=True)
    c = sub.add_parser("certs",
                       help="CA, SuperLink certificate and SuperNode key pairs (generated here, never committed)")
    c.add_argument("directory")
    c.add_argument("--nodes", type=int, default=2)
    c.add_argument("--host", action="append", default=None, help="SuperLink host name or IP (repeatable)")
    s = sub.add_parser("superlink", help="start a SuperLink (TLS, node authentication); exec, so PID = daemon")
    s.add_argument("--certs", required=True)
    s.add_argument("--address", default="127.0.0.1:9093", help="host:port of the SuperLink's APIs")
    s.add_argument("--database", default=None, help="SQLite file to keep the SuperLink's state (default: memory)")
    r = sub.add_parser("register", help="register SuperNode public keys with the SuperLink")
    r.add_argument("--certs", required=True)
    r.add_argument("--superlink", default="127.0.0.1:9093")
    r.add_argument("nodes", type=int, nargs="+", help="node indices (keys CERTS/node-<i>.pub)")
    n = sub.add_parser("supernode", help="start a SuperNode holding one partition or a range; exec, so PID = daemon")
    n.add_argument("--certs", required=True)
    n.add_argument("--superlink", default="127.0.0.1:9093")
    n.add_argument("--node", type=int, required=True, help="index of its key pair in CERTS")
    held = n.add_mutually_exclusive_group(required=True)
    held.add_argument("--partition-id", type=int, help="the one partition this node holds")
    held.add_argument("--partition-range", help="FIRST-LAST (inclusive): the partitions this node holds")
    n.add_argument("--num-partitions", type=int, required=True)
    n.add_argument("--node-dir", required=True, help="directory that keeps this node's ledgers")
    n.add_argument("--port", type=int, default=None, help="its local runtime API port (default 9100 + node)")
    f = sub.add_parser("run", help="flwr run of the privfl app: train a RunConfig JSON, or serve novel clients")
    f.add_argument("--certs", required=True)
    f.add_argument("--superlink", default="127.0.0.1:9093")
    f.add_argument("--config", default=None, help="RunConfig JSON (e.g. a run directory's config.json)")
    f.add_argument("--out", required=True, help="run (or serving) directory, on the SuperLink's machine")
    f.add_argument("--overwrite", action="store_true")
    f.add_argument("--timeout-s", type=float, default=p.DEFAULT_TIMEOUT_S,
                   help=f"limit for one exchange's replies, > 0 ({p.DEFAULT_TIMEOUT_S:g} s)")
    f.add_argument("--node-wait-s", type=float, default=120, help="wait this long for the nodes the run needs")
    f.add_argument("--serve-from", default=None,
                   help="a finished training run directory (on the SuperLink's machine): serve its novel clients "
                        "in a run of their own instead of training")
    f.add_argument("--serve-clients", default="", help="with --serve-from: novel client ids, e.g. 9,10 (all)")
    f.add_argument("--stream", action="store_true", help="show the run's log until it ends")
    args = parser.parse_args(argv)

    if args.command == "certs":
        out = generate_certificates(args.directory, hosts=tuple(args.host or ("127.0.0.1", "localhost")),
                                    nodes=args.nodes)
        print(f"wrote {CA_CERT}, {SERVER_CERT}, {SERVER_KEY} and {args.nodes} node key pairs to {out}")
        return 0
    certs = Path(args.certs)
    env = flower_env(certs)
    if args.command == "superlink":
        command = superlink_command(certs, args.address, args.database)
    elif args.command == "supernode":
        command = supernode_command(certs, args.superlink, node=args.node, partition_id=args.partition_id,
                                    partition_range=args.partition_range, num_partitions=args.num_partitions,
                                    node_dir=str(Path(args.node_dir).resolve()),
                                    port=args.port if args.port is not None else 9100 + args.node)
    elif args.command == "register":
        write_connection(env, args.superlink, certs)
        for index in args.nodes:
            subprocess.run([_tool("flwr"), "supernode", "register", str(node_key(certs, index).with_suffix(".pub")),
                            CONNECTION], env=env, check=True)
        return 0
    else:
        write_connection(env, args.superlink, certs)
        command = run_command(args.config, args.out, overwrite=args.overwrite, timeout_s=args.timeout_s,
                              node_wait_s=args.node_wait_s, stream=args.stream, serve_from=args.serve_from,
                              serve_clients=args.serve_clients)
        return subprocess.run(command, env=env).returncode
    os.execve(command[0], command, env)      # the daemon takes this process id


if __name__ == "__main__":
    sys.exit(main())
