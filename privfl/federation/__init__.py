"""The wire: messages, the release choke point, runtimes, seeded sampling, run directories and checkpoints."""

from privfl.federation.context import ClientContext, ClientState
from privfl.federation.messages import Message, Release
from privfl.federation.rundir import RunDirectory
from privfl.federation.runtime import InProcessRuntime, sample_clients
from privfl.federation.wire import Wire

__all__ = ["ClientContext", "ClientState", "Message", "Release", "RunDirectory", "InProcessRuntime",
           "sample_clients", "Wire"]
