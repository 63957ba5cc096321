"""Target networks, and (in later modules) set encoders, hypernetworks and pretrained backbones."""

from privfl.models.hypernetwork import HyperNetwork, backprop_weight_change, embedding_dim
from privfl.models.set_encoders import DeepSetEncoder, DPDeepSetEncoder, MaxPool, MeanMaxPool, MeanPool
from privfl.models.targets import MLP2NN, MODELS, FeatureMLP, FedTTACNN, LeNet, build_model, functional_forward

__all__ = ["HyperNetwork", "backprop_weight_change", "embedding_dim", "DeepSetEncoder", "DPDeepSetEncoder", "MaxPool",
           "MeanMaxPool", "MeanPool", "MODELS", "MLP2NN", "LeNet", "FedTTACNN", "FeatureMLP", "build_model",
           "functional_forward"]
