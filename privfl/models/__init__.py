"""Target networks, and (in later modules) set encoders, hypernetworks and pretrained backbones."""

from privfl.models.hypernetwork import HyperNetwork, backprop_weight_change, embedding_dim
from privfl.models.set_encoders import DeepSetEncoder, DPDeepSetEncoder, MaxPool, MeanMaxPool, MeanPool
from privfl.models.targets import MODELS, FedTTACNN, FeatureMLP, LeNet, MLP2NN, build_model, functional_forward

__all__ = ["HyperNetwork", "backprop_weight_change", "embedding_dim", "DeepSetEncoder", "DPDeepSetEncoder", "MaxPool",
           "MeanMaxPool", "MeanPool", "MODELS", "MLP2NN", "LeNet", "FedTTACNN", "FeatureMLP", "build_model",
           "functional_forward"]
