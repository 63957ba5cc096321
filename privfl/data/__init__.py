"""Offline data sources, partitions and federated datasets with labelled training and unlabelled novel clients.

Quick start:
    >>> from privfl.data import FederationSpec, build_federation
    >>> federation = build_federation(FederationSpec(source="synthetic", num_clients=10, partition="iid"), seed=0)
    >>> federation.novel_clients[0]
    NovelClient(client_id=1, num_samples=200)
"""

from privfl.data.federated import (
    FederatedDataset,
    FederationSpec,
    NovelClient,
    NovelLabels,
    TrainingClient,
    build_federation,
)
from privfl.data.label_shift import label_shift_kl
from privfl.data.partition import partition_dirichlet, partition_iid, partition_pathological
from privfl.data.sources import SOURCE_NAMES, ArraySplit, SourceData, SourceInfo, list_sources, load_source

__all__ = [
    "ArraySplit", "SourceData", "SourceInfo", "load_source", "list_sources", "SOURCE_NAMES",
    "partition_iid", "partition_pathological", "partition_dirichlet",
    "FederationSpec", "FederatedDataset", "TrainingClient", "NovelClient", "NovelLabels", "build_federation",
    "label_shift_kl",
]
