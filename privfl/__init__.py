"""privfl: federated learning for clients that arrive after training, with every client-to-server message crossing
a differential-privacy layer with formal accounting."""

__version__ = "0.1.0"
