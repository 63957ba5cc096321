"""``flower-supernode`` that asks the SuperLink for work every ``--poll-s`` seconds while idle, instead of every 3 s.

Flower 1.41's SuperNode (``flwr.supernode.start_client_internal``) sleeps a fixed 3 s whenever it asks the SuperLink
for a message and gets none, and 0.5 s between looks at its own state while it waits for its ClientApp's reply. A
round's exchange reaches a node only at its next ask: the node asks right after sending its reply, too early for the
server's next message, and then 3 s later, so every stage of a round waited about 3 s on each node whatever the work.
This entry point runs Flower's own ``flower-supernode`` with those two sleeps shortened to ``--poll-s`` (the 0.5 s
one to at most that): the SuperLink gets one more ask per node every ``--poll-s`` seconds while the node is idle.
Nothing else changes. :func:`install` refuses to run against a Flower whose SuperNode no longer keeps its clock in
that module's ``time``, so a Flower upgrade cannot silently change what is patched.

    python -m privfl.engines.flower.supernode --poll-s 0.25 FLOWER-SUPERNODE-ARGUMENTS...
"""

from __future__ import annotations

import sys
import time
from typing import Any

from privfl.errors import ConfigError, InternalError, PrivflError

#: Flower 1.41's sleeps in ``flwr.supernode.start_client_internal``: after an empty ask, and while a reply is not ready.
IDLE_S, REPLY_WAIT_S = 3, 0.5
#: Seconds between asks while idle, by default (Flower's own: 3).
DEFAULT_POLL_S = 0.25


class PollingClock:
    """The ``time`` module as the SuperNode's loop sees it: its 3 s idle sleep takes ``poll_s``, its 0.5 s wait for a
    reply at most ``poll_s``; every other use of ``time`` is the module's own."""

    def __init__(self, poll_s: float) -> None:
        self.poll_s = poll_s

    def sleep(self, seconds: float) -> None:
        if seconds == IDLE_S:
            seconds = self.poll_s
        elif seconds == REPLY_WAIT_S:
            seconds = min(seconds, self.poll_s)
        time.sleep(seconds)

    def __getattr__(self, name: str) -> Any:
        return getattr(time, name)


def check_poll_s(poll_s: Any) -> float:
    """``poll_s`` as seconds between asks, refused unless in (0, 3]."""
    if isinstance(poll_s, bool) or not isinstance(poll_s, (int, float)) or not 0 < poll_s <= IDLE_S:
        raise ConfigError(f"--poll-s must be a number of seconds in (0, {IDLE_S}] (Flower's own: {IDLE_S}), got "
                          f"{poll_s!r}")
    return float(poll_s)


def install(poll_s: float) -> PollingClock:
    """Give Flower's SuperNode loop a :class:`PollingClock` of ``poll_s`` seconds."""
    from flwr.supernode import start_client_internal as loop

    poll_s = check_poll_s(poll_s)
    if loop.time is not time and not isinstance(loop.time, PollingClock):
        raise InternalError("flwr.supernode.start_client_internal no longer uses the time module as Flower 1.41 "
                            "does; the SuperNode's idle poll cannot be set (run flower-supernode itself)")
    clock = PollingClock(poll_s)
    loop.time = clock            # type: ignore[assignment]
    return clock


def main(argv: list[str] | None = None) -> None:
    args = list(sys.argv[1:] if argv is None else argv)
    if args[:1] != ["--poll-s"] or len(args) < 2:
        raise SystemExit("usage: python -m privfl.engines.flower.supernode --poll-s SECONDS FLOWER-SUPERNODE-ARGS")
    try:
        install(float(args[1]))
    except (ValueError, PrivflError) as error:
        raise SystemExit(f"privfl flower supernode: error: {error}") from None
    from flwr.supernode.cli.flower_supernode import flower_supernode

    sys.argv = ["flower-supernode", *args[2:]]
    flower_supernode()


if __name__ == "__main__":
    main()
