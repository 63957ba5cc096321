"""A long-lived ClientApp process for a SuperNode in Flower's process isolation mode.

With ``--isolation process`` a Flower SuperNode keeps each message as a pending task for a process started apart to
claim; Flower ships no long-lived ClientApp process, so this module is one: :func:`serve` claims the node's ClientApp
tasks one after another and runs each in this process as ``flwr-clientapp`` would (:func:`run_task`), keeping its
imports and what :mod:`privfl.engines.flower.client_app` builds once per process between messages. Started by
``privfl flower supernode`` (:func:`privfl.engines.flower.launch.supervise_supernode`); :func:`main` is its command
line::

    python -m privfl.engines.flower.worker --runtime-api-address 127.0.0.1:9100 [--parent-pid PID]

Why privacy state stays on disk, and how the process is stopped: docs/federation.md, "The long-lived ClientApp
worker".
"""

from __future__ import annotations

import argparse
import logging
import signal
import sys
import threading
import time
from collections.abc import Callable
from typing import Any

#: The ClientApp module imported when the process starts, before the first message (the App names it).
PRELOAD = "privfl.engines.flower.client_app"

_log = logging.getLogger(__name__)


class Stop(Exception):
    """SIGTERM or SIGINT reached the process (or its parent ended): stop after pushing what can be pushed."""


def _runtime_client(address: str, interceptors: list[Any]):
    from flwr.supercore.retry import make_simple_http_retry_invoker
    from flwr.supercore.runtime import RuntimeHttpClient

    return RuntimeHttpClient.from_server_address(server_address=address, insecure=True, root_certificates=None,
                                                 interceptors=interceptors,
                                                 retry_invoker=make_simple_http_retry_invoker())


def _heartbeat_fn(client, lost: threading.Event) -> Callable[[], bool]:
    """Flower's task heartbeat, except that a task the SuperNode no longer accepts (the run stopped) marks the task
    lost instead of interrupting the process, which goes on serving later tasks."""
    import httpx
    from flwr.proto.runtime_pb2 import SendTaskHeartbeatRequest

    request = SendTaskHeartbeatRequest()

    def beat() -> bool:
        try:
            response = client.SendTaskHeartbeat(request)
        except httpx.TransportError:
            return False
        except httpx.HTTPStatusError as error:
            if error.response.status_code in (httpx.codes.SERVICE_UNAVAILABLE, httpx.codes.GATEWAY_TIMEOUT):
                return False
            lost.set()
            return True
        if not response.success:
            lost.set()
        return True

    return beat


def run_task(address: str, token: str, installed: set[str]) -> str:
    """Run the ClientApp task that ``token`` names, in this process, as ``flwr-clientapp`` runs one; return its
    sub-status (``completed`` or ``failed``). A ClientApp exception becomes the error reply Flower sends (its text, as
    :func:`privfl.engines.flower.client_app.handle` lets it leave the node); the process goes on either way."""
    from flwr.app import Message
    from flwr.app.error import Error
    from flwr.cli.install import install_from_fab
    from flwr.clientapp.client_app import LoadClientAppError
    from flwr.clientapp.utils import get_load_client_app_fn
    from flwr.common.constant import ErrorCode, SubStatus
    from flwr.supercore.heartbeat import HeartbeatSender
    from flwr.supercore.interceptors import RuntimeTokenHttpInterceptor, RuntimeVersionHttpInterceptor
    from flwr.supernode.runtime.run_clientapp import pull_task_input, push_message, push_task_output

    client = _runtime_client(address, [RuntimeVersionHttpInterceptor(component_name="flwr-clientapp"),
                                       RuntimeTokenHttpInterceptor(token)])
    lost = threading.Event()
    heartbeat = HeartbeatSender(_heartbeat_fn(client, lost))
    message = context = reply = None
    sub_status, details = SubStatus.FAILED, "ClientApp task failed due to unknown reason"
    stopping = False
    try:
        heartbeat.start()
        message, context, run, fab = pull_task_input(client)
        if fab.hash_str not in installed:
            install_from_fab(fab.content, skip_prompt=True)
            installed.add(fab.hash_str)
        load = get_load_client_app_fn(default_app_ref="", app_path=None, multi_app=True)
        app = load(run.fab_id, run.fab_version, fab.hash_str)
        reply = app(message=message, context=context)
        sub_status, details = SubStatus.COMPLETED, ""
    except Stop:
        stopping = True
        details = "ClientApp process stopped"
    except Exception as error:          # as flwr-clientapp reports a ClientApp's exception
        code = ErrorCode.CLIENT_APP_RAISED_EXCEPTION
        reason = str(type(error)) + ":<'" + str(error) + "'>"
        if isinstance(error, LoadClientAppError):
            code, reason = ErrorCode.LOAD_CLIENT_APP_EXCEPTION, \
                "An exception was raised when attempting to load `ClientApp`"
        _log.error("the ClientApp raised an exception", exc_info=error)
        details = reason
        if message is not None:
            reply = Message(Error(code=code, reason=reason), reply_to=message)
    finally:
        try:
            if reply is not None and context is not None and not lost.is_set():
                push_message(client, reply, context)
            push_task_output(client=client, context=context, sub_status=sub_status, details=details)
        except Exception as error:
            _log.error("could not push the task's reply or status: %s", error)
        finally:
            if heartbeat.is_running:
                heartbeat.stop()
            client.close()
    if stopping:
        raise Stop()
    return sub_status


def serve(address: str, *, poll_s: float = 0.05, tasks: int | None = None,
          should_stop: Callable[[], bool] = lambda: False) -> int:
    """Claim and run the ClientApp tasks of the SuperNode whose Runtime API listens at ``address``, one at a time,
    polling every ``poll_s`` seconds while there is none; return the number run. Ends after ``tasks`` tasks (None:
    never), when ``should_stop()``, or on :class:`Stop`."""
    from flwr.common.constant import SubStatus  # noqa: F401  (fail here, at start, if Flower is missing)
    from flwr.proto.runtime_pb2 import AcquireTaskRequest
    from flwr.supercore.constant import TaskType
    from flwr.supercore.interceptors import RuntimeVersionHttpInterceptor

    poller = _runtime_client(address, [RuntimeVersionHttpInterceptor(component_name="SuperExec")])
    installed: set[str] = set()
    done = 0
    try:
        while (tasks is None or done < tasks) and not should_stop():
            claimed = poller.AcquireTask(AcquireTaskRequest(supported_task_types=[TaskType.CLIENT_APP.value]))
            if claimed.HasField("task") and claimed.token:
                run_task(address, claimed.token, installed)
                done += 1
            else:
                time.sleep(poll_s)
    finally:
        poller.close()
    return done


def _stop_on_signals() -> None:
    def stop(signum: int, frame: Any) -> None:
        raise Stop()

    for signum in (signal.SIGTERM, signal.SIGINT):
        signal.signal(signum, stop)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m privfl.engines.flower.worker",
                                     description=__doc__.splitlines()[0])
    parser.add_argument("--runtime-api-address", required=True, help="HOST:PORT of the SuperNode's Runtime API")
    parser.add_argument("--parent-pid", type=int, default=None, help="end when this process ends")
    parser.add_argument("--poll-s", type=float, default=0.05,
                        help="seconds between asks for a task while there is none (0.05)")
    args = parser.parse_args(argv)
    if not args.poll_s > 0:
        parser.error(f"--poll-s must be > 0 seconds, got {args.poll_s!r}")
    _stop_on_signals()
    if args.parent_pid is not None:
        from flwr.supercore.app_utils import start_parent_process_monitor

        start_parent_process_monitor(args.parent_pid)      # raises SIGINT here when the parent is gone
    try:
        __import__(PRELOAD)
        serve(args.runtime_api_address, poll_s=args.poll_s)
    except Stop:
        pass
    return 0


if __name__ == "__main__":
    sys.exit(main())
