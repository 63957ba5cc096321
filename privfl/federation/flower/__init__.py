"""privfl on Flower: the same methods on Flower's simulation engine (one machine) and deployment engine (many).

* :mod:`.records`: privfl messages <-> Flower ``ArrayRecord`` / ``MetricRecord`` / ``ConfigRecord``;
* :mod:`.client_app`: the ClientApp; a node holds one client, runs its procedure, and owns its ledger;
* :mod:`.server_app`: the ServerApp; :class:`FlowerRuntime` drives the method's strategy through the Grid inside
  the same training loop as the in-process runtime (:func:`privfl.experiment.train`);
* :mod:`.simulation`: ``privfl train --engine flower-sim``;
* :mod:`.launch`: certificates, keys, SuperLink, SuperNodes and ``flwr run`` for the deployment engine
  (``privfl flower ...``; see ``README.md`` beside this file).

Importing this package needs ``flwr`` (``pip install 'privfl[flower]'``).
"""

from privfl.federation.flower.protocol import FlowerOptions
from privfl.federation.flower.records import from_records, to_records

__all__ = ["FlowerOptions", "from_records", "to_records"]
