"""Flower's retries of an object that is not uploaded yet, from 0.05 s instead of 1 s.

Flower 1.41 hands a receiver a message as soon as its sender has announced it, before the sender has pushed the
message's objects (its arrays, in 5 MiB chunks): a SuperNode sends its reply, then uploads it
(``flwr.supernode.start_client_internal._push_messages``), and the ServerApp that pulls the reply at once finds some of
its objects missing. ``flwr.supercore.inflatable.inflatable_utils.pull_objects`` then waits 1 s (plus or minus 20%)
before it asks again, doubling up to 10 s: a reply of 40 MB (50 clients' MNIST 2NN updates) that takes a fraction of
a second to upload cost the round a second or more of waiting. :func:`install` starts the retries at
:data:`INITIAL_BACKOFF_S` in this process (the ServerApp's, a SuperNode's); they still double, to Flower's cap, and
the number of tries per object is Flower's. It refuses a Flower whose ``pull_objects`` no longer takes
``initial_backoff``, so an upgrade cannot silently change what is set.
"""

from __future__ import annotations

from privfl.errors import InternalError

#: Flower 1.41's first wait for an object not uploaded yet (``PULL_INITIAL_BACKOFF``), and privfl's.
FLOWER_INITIAL_BACKOFF_S, INITIAL_BACKOFF_S = 1.0, 0.05


def install(initial_backoff_s: float = INITIAL_BACKOFF_S) -> None:
    """Start this process's retries of objects not uploaded yet at ``initial_backoff_s`` seconds."""
    from flwr.supercore.inflatable import inflatable_utils

    defaults = inflatable_utils.pull_objects.__kwdefaults__ or {}
    if "initial_backoff" not in defaults:
        raise InternalError("flwr.supercore.inflatable.inflatable_utils.pull_objects no longer takes initial_backoff "
                            "as Flower 1.41 does; its retry wait cannot be set")
    defaults["initial_backoff"] = float(initial_backoff_s)
