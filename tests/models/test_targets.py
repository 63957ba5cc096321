import pytest
import torch

from privfl.errors import ConfigError
from privfl.models import build_model, functional_forward


def count(model):
    return sum(p.numel() for p in model.parameters())


@pytest.mark.parametrize("name,shape,classes,params", [
    ("mlp2nn", (1, 28, 28), 10, 199_210),          # McMahan et al.'s 2NN on MNIST
    ("fedtta_cnn", (1, 28, 28), 10, 1_663_370),    # FedTTA's CNN on Fashion-MNIST
    ("fedtta_cnn", (3, 32, 32), 10, 2_156_490),    # and on CIFAR-10
    # conv1 3*16*25+16, conv2 16*32*25+32, fc 800*120+120, 120*84+84, 84*10+10
    ("lenet", (3, 32, 32), 10, 1216 + 12832 + 96120 + 10164 + 850),
    # Liu et al.'s (NeurIPS 2022) MNIST CNN: conv1 1*32*9+32, conv2 32*64*9+64, fc 64*5*5*10+10
    ("small_cnn", (1, 28, 28), 10, 320 + 18_496 + 16_010),
])
def test_parameter_counts(name, shape, classes, params):
    model = build_model(name, shape, classes)
    assert count(model) == params
    assert model(torch.zeros(2, *shape)).shape == (2, classes)


def test_feature_mlp_shape():
    model = build_model("feature_mlp", (1280,), 10)
    assert model(torch.zeros(3, 1280)).shape == (3, 10)
    assert count(model) == 1280 * 500 + 500 + 500 * 500 + 500 + 500 * 10 + 10


def test_functional_forward_matches_and_carries_gradients():
    torch.manual_seed(0)
    model = build_model("mlp2nn", (1, 28, 28), 10)
    x = torch.randn(4, 1, 28, 28)
    supplied = {k: v.detach().clone().requires_grad_(True) for k, v in model.named_parameters()}
    out = functional_forward(model, supplied, x)
    assert torch.allclose(out, model(x))
    out.sum().backward()
    assert all(w.grad is not None and w.grad.abs().sum() > 0 for w in supplied.values())
    # other weights give other outputs: the supplied tensors are really used
    doubled = {k: 2 * v.detach() for k, v in supplied.items()}
    assert not torch.allclose(functional_forward(model, doubled, x), out)


def test_bad_model_arguments_name_the_value():
    with pytest.raises(ConfigError, match="unknown model 'resnet'.*mlp2nn"):
        build_model("resnet", (1, 28, 28), 10)
    with pytest.raises(ConfigError, match=r"\(784,\)"):
        build_model("lenet", (784,), 10)
