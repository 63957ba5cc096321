"""privfl on Flower: the same methods on Flower's simulation engine (one machine) and deployment engine (many).

* :mod:`.records`: privfl messages <-> Flower ``ArrayRecord`` / ``MetricRecord`` / ``ConfigRecord``;
* :mod:`.client_app`: the ClientApp; a node holds one client (or several), runs its procedure, and owns its ledger;
* :mod:`.transport`: the server's end: one exchange as one Flower message per node through the Grid;
* :mod:`.nodes`: which node holds which client, found by saying hello as nodes connect;
* :mod:`.runtime`: :class:`~.runtime.FlowerRuntime`, the round loop of :class:`privfl.federation.runtime.Runtime`
  with each exchange on the nodes;
* :mod:`.secagg`: distributed DP's round sum under Flower's SecAgg+ (workflow on the server, mod on the nodes);
* :mod:`.server_app`: the ServerApp wrapper, and serving novel clients of a finished run;
* :mod:`.server`: the ServerApp that ``flwr run`` starts for the deployment engine (the loop of
  :func:`privfl.engines.choice.flower_main` in :func:`.server_app.make_server_app`);
* :mod:`.simulation`: Flower's simulation engine (``privfl train --engine flower-sim``);
* :mod:`.launch`: certificates, keys, SuperLink, SuperNodes and ``flwr run`` for the deployment engine
  (``privfl flower ...``; see ``README.md`` beside this file).

Apart from :mod:`.server`, this package imports nothing above the methods and the run config: which loop a ServerApp
runs is decided by :mod:`privfl.engines.choice`. Importing it needs ``flwr`` (``pip install 'privfl[flower]'``).
"""

from privfl.engines.flower.protocol import FlowerOptions
from privfl.engines.flower.records import from_records, to_records

__all__ = ["FlowerOptions", "from_records", "to_records"]
