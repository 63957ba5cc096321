"""privfl messages <-> Flower records, written once for both directions.

A :class:`~privfl.federation.messages.Message` becomes a ``RecordDict`` of ``"arrays"``, ``"metrics"`` and
``"config"`` records plus the protocol header under ``"privfl"`` (:func:`to_records`, :func:`from_records`); tensors
keep their dtype and shape. :func:`pack` and :func:`unpack` carry the messages of a node's several clients in one
Flower message, their tensors in one byte array. Details: docs/federation.md, "Flower records".

>>> import torch
>>> message = Message(arrays={"w": torch.ones(2, dtype=torch.float64)}, metrics={"loss": 0.5}, config={"lr": 0.1})
>>> back, header = from_records(to_records(message, {"op": "train"}))
>>> back.arrays["w"].dtype, back.metrics, back.config, header
(torch.float64, {'loss': 0.5}, {'lr': 0.1}, {'op': 'train'})
>>> packed = pack({3: (message, {}), 5: (message, {"send_ledger": True})}, {"op": "train"})
>>> header, items = unpack(packed)
>>> header, sorted(items), items[5][1], torch.equal(items[3][0].arrays["w"], items[5][0].arrays["w"])
({'op': 'train'}, [3, 5], {'send_ledger': True}, True)
"""

from __future__ import annotations

import json
import math
from collections.abc import Mapping
from typing import Any

import torch
from flwr.app import ArrayRecord, ConfigRecord, MetricRecord, RecordDict

from privfl.errors import ConfigError, PublicConfigError
from privfl.federation.messages import Message

ARRAYS, METRICS, CONFIG, HEADER = "arrays", "metrics", "config", "privfl"
CLIENTS, MESSAGE_OF = "clients", "message_of"      # pack header: the client ids, and which message each one gets
BLOB, TENSORS = "blob", "tensors"   # pack: the tensors' bytes, and in the header JSON [[k, name, dtype, shape], ...]
_CONFIG_SCALARS = (bool, int, float, str, bytes)


def tensors_to_record(tensors: Mapping[str, torch.Tensor]) -> ArrayRecord:
    """An ``ArrayRecord`` of ``tensors`` (detached, on the CPU; dtype and shape kept)."""
    return ArrayRecord({name: t.detach().cpu() for name, t in tensors.items()})


def record_to_tensors(record: ArrayRecord) -> dict[str, torch.Tensor]:
    """The tensors of ``record``, in their original order, dtype and shape (writable, not sharing the buffer)."""
    return dict(record.to_torch_state_dict()) if len(record) else {}


def _arrays(records: RecordDict, key: str) -> ArrayRecord:
    record = records[key]
    if not isinstance(record, ArrayRecord):
        raise PublicConfigError(f"a message's record {key!r} is a {type(record).__name__}, not an ArrayRecord")
    return record


def _entries(records: RecordDict, key: str) -> dict[str, Any]:
    """A metric or config record's entries, as :func:`to_records` or :func:`pack` wrote them from a message."""
    return dict(records[key])


def _check_config(values: Mapping[str, Any], what: str) -> dict[str, Any]:
    for key, value in values.items():
        ok = isinstance(value, _CONFIG_SCALARS) or (
            isinstance(value, list) and value and all(isinstance(v, type(value[0])) for v in value)
            and isinstance(value[0], _CONFIG_SCALARS))
        if not ok:
            raise ConfigError(f"{what} value {key}={value!r} cannot travel in a Flower ConfigRecord; "
                              "use int, float, str, bool, bytes or a non-empty list of one of those")
    return dict(values)


def to_records(message: Message, header: Mapping[str, Any] | None = None) -> RecordDict:
    """``message`` (and the runtime's ``header``) as a Flower ``RecordDict``."""
    return RecordDict({
        ARRAYS: tensors_to_record(message.arrays),
        METRICS: MetricRecord(dict(message.metrics)),
        CONFIG: ConfigRecord(_check_config(message.config, "message config")),
        HEADER: ConfigRecord(_check_config(header or {}, "header")),
    })


def from_records(records: RecordDict) -> tuple[Message, dict[str, Any]]:
    """The privfl message and the runtime header carried by ``records`` (missing records read as empty)."""
    arrays = record_to_tensors(_arrays(records, ARRAYS)) if ARRAYS in records else {}
    metrics = _entries(records, METRICS) if METRICS in records else {}
    config = _entries(records, CONFIG) if CONFIG in records else {}
    header = _entries(records, HEADER) if HEADER in records else {}
    return Message(arrays=arrays, metrics=metrics, config=config), header


def state_to_records(state: Mapping[str, Any]) -> tuple[ArrayRecord, ConfigRecord]:
    """A client state (tensors, and plain scalars some procedures keep) as an ``ArrayRecord`` and a ``ConfigRecord``."""
    tensors = {k: v for k, v in state.items() if isinstance(v, torch.Tensor)}
    scalars = {k: v for k, v in state.items() if not isinstance(v, torch.Tensor)}
    return tensors_to_record(tensors), ConfigRecord(_check_config(scalars, "client state"))


def records_to_state(tensors: ArrayRecord, scalars: ConfigRecord) -> dict[str, Any]:
    """The inverse of :func:`state_to_records`."""
    return {**record_to_tensors(tensors), **dict(scalars)}


def _flat(message: Message) -> tuple[list[torch.Tensor], list[list[Any]]]:
    """``message``'s tensors as byte tensors, and per tensor its name, dtype and shape."""
    parts, index = [], []
    for name, tensor in message.arrays.items():
        tensor = tensor.detach().cpu().contiguous()
        parts.append(tensor.reshape(-1).view(torch.uint8) if tensor.numel() else torch.empty(0, dtype=torch.uint8))
        index.append([name, str(tensor.dtype).removeprefix("torch."), list(tensor.shape)])
    return parts, index


def _message_records(message: Message) -> dict[str, Any]:
    parts, index = _flat(message)
    return {METRICS: MetricRecord(dict(message.metrics)),
            CONFIG: ConfigRecord(_check_config(message.config, "message config")), BLOB: (parts, index)}


def pack(items: Mapping[int, tuple[Message, Mapping[str, Any]]], header: Mapping[str, Any], *,
         converted: dict[int, dict[str, Any]] | None = None) -> RecordDict:
    """One ``RecordDict`` carrying a message and a per-client header for each client id in ``items``, plus the
    ``header`` common to all of them. The same :class:`Message` object given to several clients is stored once;
    ``converted`` (``id(message)`` -> records) lets a caller share the conversion across packs."""
    content: dict[str, Any] = {}
    index: dict[int, int] = {}
    clients, message_of = [], []
    parts: list[torch.Tensor] = []
    tensors: list[list[Any]] = []
    for cid in sorted(items):
        message, client_header = items[cid]
        if id(message) not in index:
            k = index[id(message)] = len(index)
            records = converted.get(id(message)) if converted is not None else None
            if records is None:
                records = _message_records(message)
                if converted is not None:
                    converted[id(message)] = records
            content.update({f"m{k}.{name}": records[name] for name in (METRICS, CONFIG)})
            parts += records[BLOB][0]
            tensors += [[k, *entry] for entry in records[BLOB][1]]
        clients.append(int(cid))
        message_of.append(index[id(message)])
        if client_header:
            content[f"h{cid}"] = ConfigRecord(_check_config(client_header, "header"))
    common = _check_config(header, "header")
    if CLIENTS in common or MESSAGE_OF in common or TENSORS in common:
        raise PublicConfigError(f"header keys {CLIENTS!r}, {MESSAGE_OF!r} and {TENSORS!r} are reserved for the pack, "
                                f"got {sorted(common)}")
    if clients:
        common.update({CLIENTS: clients, MESSAGE_OF: message_of})
    if tensors:
        common[TENSORS] = json.dumps(tensors)
        content[BLOB] = ArrayRecord({BLOB: torch.cat(parts) if parts else torch.empty(0, dtype=torch.uint8)})
    content[HEADER] = ConfigRecord(common)
    return RecordDict(content)


def _unflatten(records: RecordDict, header: dict[str, Any]) -> dict[int, dict[str, torch.Tensor]]:
    """Per message index, its tensors (each in memory of its own), from the pack's byte array."""
    entries = json.loads(header.pop(TENSORS, "[]"))
    if not entries:
        return {}
    blob = torch.from_numpy(_arrays(records, BLOB)[BLOB].numpy())
    arrays: dict[int, dict[str, torch.Tensor]] = {}
    offset = 0
    for k, name, dtype, shape in entries:
        kind = getattr(torch, dtype, None)
        if not isinstance(kind, torch.dtype):
            raise PublicConfigError(f"a packed message names tensor {name!r} of unknown dtype {dtype!r}")
        size = math.prod(shape) * torch.empty(0, dtype=kind).element_size()
        if offset + size > blob.numel():
            raise PublicConfigError(f"a packed message's tensors need more than its {blob.numel()} bytes")
        arrays.setdefault(int(k), {})[name] = blob[offset:offset + size].clone().view(kind).reshape(shape)
        offset += size
    if offset != blob.numel():
        raise PublicConfigError(f"a packed message carries {blob.numel()} bytes of tensors, its header {offset}")
    return arrays


def unpack(records: RecordDict) -> tuple[dict[str, Any], dict[int, tuple[Message, dict[str, Any]]]]:
    """The common header and, per client id, its own copy of its message and its own header (inverse of
    :func:`pack`)."""
    header = _entries(records, HEADER) if HEADER in records else {}
    clients, message_of = header.pop(CLIENTS, []), header.pop(MESSAGE_OF, [])
    if len(clients) != len(message_of):
        raise PublicConfigError(f"a packed message lists {len(clients)} clients but {len(message_of)} message indices")
    arrays = _unflatten(records, header)
    decoded: dict[int, Message] = {}
    used: set[int] = set()
    items: dict[int, tuple[Message, dict[str, Any]]] = {}
    for cid, k in zip(clients, message_of):
        if k not in decoded:
            prefix = f"m{k}."
            if prefix + METRICS not in records:
                raise PublicConfigError(f"a packed message names message {k} for client {cid} but does not carry it")
            decoded[k] = Message(arrays=arrays.get(k, {}), metrics=_entries(records, prefix + METRICS),
                                 config=_entries(records, prefix + CONFIG))
        message = decoded[k].copy() if k in used else decoded[k]     # each client gets its own tensors
        used.add(k)
        items[int(cid)] = (message, dict(records[f"h{cid}"]) if f"h{cid}" in records else {})
    return header, items
