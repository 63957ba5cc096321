"""A short FedAvg run on the real MNIST: the whole path from the offline package to scored novel clients."""

import pytest

from privfl.config import RunConfig
from privfl.data import FederationSpec
from privfl.experiment import train


@pytest.mark.slow
def test_fedavg_on_real_mnist_learns_for_novel_clients(tmp_path):
    spec = FederationSpec(source="mnist", num_clients=20, partition="iid", novel_fraction=0.25, max_samples=8000)
    config = RunConfig(federation=spec, method="fedavg", method_config={"lr": 0.1, "local_steps": 20,
                                                                       "batch_size": 64},
                       model="mlp2nn", rounds=5, eval_every=5, seed=0)
    summary = train(config, str(tmp_path / "mnist"), progress=False)
    assert summary["novel"]["num_clients"] == 5 and summary["training_val"]["num_clients"] == 15
    # 5 rounds x 15 clients x 20 steps of a 2NN on IID MNIST: well above 85% (chance is 10%)
    assert summary["novel"]["accuracy_mean"] > 85.0
    assert summary["novel"]["accuracy_sem"] < 3.0
