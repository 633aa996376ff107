"""DCP's global `.metadata`, assembled from pieces every rank pickles itself.

DCP's coordinator builds `.metadata` on rank 0 from every rank's plan and write results and
pickles it there: at 1024 ranks ViT-bigG-14 has ~3 M chunks, so rank 0 alone spends minutes
unpickling plans and pickling dataclasses (~20 us per chunk each way). Here each rank pickles
its own chunks and storage records, and rank 0 only concatenates bytes, so the file stock DCP
readers load (`dcp.load`, `dcp_to_torch_save`) costs rank 0 O(world) joins, not O(chunks) objects.

The file is one valid pickle, built from standard opcodes (protocol 2):

    PROTO 2
    [prelude] POP               classes and field names every piece refers to, memo 1..k
    [[], [], ..., {}] POP       one empty chunk list per tensor key (sorted), then the storage
                                dict: memo k+2.., so every rank knows their indices
    Metadata(...)               rank 0's skeleton: keys, sizes, dtypes; its chunk lists and
                                storage dict are the memoised ones above (BINGET)
    rank 0's piece ... rank W-1's piece
    STOP

A rank's piece is, per tensor key it holds chunks of, `LONG_BINGET list` and the appends pickle
writes for a list of the rank's chunks (`MARK chunk... APPENDS` per thousand), `POP`; then
`LONG_BINGET dict`, the setitems of its storage records (`MARK key value... SETITEMS`), `POP`: it
extends the objects the skeleton already holds, in rank order, which is DCP's own order. Pieces
are pickled with the real pickler in fast mode (no memo writes) over a memo preloaded with the
prelude, so they never disturb the skeleton's memo and each object is pickled exactly as pickle
would; a list or dict is pickled whole and its opening opcode dropped, one dump a key. `assemble` checks the memo
layout it relies on; the tests load the result with DCP's own readers and compare it with the
metadata DCP's coordinator writes.
"""

from __future__ import annotations

import io
import pickle
import struct
from collections.abc import Iterable
from typing import Any

import torch
from torch.distributed.checkpoint.filesystem import _StorageInfo
from torch.distributed.checkpoint.metadata import (
    BytesStorageMetadata,
    ChunkStorageMetadata,
    Metadata,
    MetadataIndex,
    TensorStorageMetadata,
)

PROTOCOL = 2
_CLASSES = (ChunkStorageMetadata, MetadataIndex, _StorageInfo)
# Interned field names: the same objects as the keys of the instances' state dicts.
_PRELUDE: list[Any] = [
    *_CLASSES,
    torch.Size,
    *dict.fromkeys(f for cls in _CLASSES for f in cls.__dataclass_fields__),
]
_POP, _STOP = b"0", b"."
_EMPTY_LIST, _EMPTY_DICT = b"]", b"}"


def _get(index: int) -> bytes:
    return b"j" + struct.pack("<I", index)  # LONG_BINGET


def tensor_keys(metadata: Metadata) -> list[str]:
    """The keys whose chunk lists pieces extend, in the order every rank numbers them."""
    return sorted(k for k, v in metadata.state_dict_metadata.items() if isinstance(v, TensorStorageMetadata))


def _list_index(position: int) -> int:
    """Memo index of the position-th chunk list (the prelude list is 0, its items 1..k, the
    list of lists k+1); the position after the last list is the storage dict."""
    return len(_PRELUDE) + 2 + position


class PiecePickler:
    """Pickles a rank's piece: fast mode over a memo that holds only the prelude."""

    def __init__(self) -> None:
        probe = pickle.Pickler(io.BytesIO(), PROTOCOL)
        probe.dump(_PRELUDE)
        self._memo = probe.memo.copy()

    def additions(self, container: list | dict) -> bytes:
        """The opcodes that fill `container` once it is on the stack: its pickle without the
        PROTO, the EMPTY_LIST or EMPTY_DICT that creates it, and the STOP."""
        buffer = io.BytesIO()
        pickler = pickle.Pickler(buffer, PROTOCOL)
        pickler.fast = True
        pickler.memo = self._memo
        pickler.dump(container)
        data = buffer.getbuffer()
        if data[2:3] not in (_EMPTY_LIST, _EMPTY_DICT):  # what pickle has always written first
            raise AssertionError(f"pickle opened a {type(container).__name__} with {bytes(data[2:3])!r}")
        return data[3:-1].tobytes()


def rank_piece(local: Metadata, keys: list[str], *, pickler: PiecePickler | None = None) -> bytes:
    """This rank's contribution: its chunks of each tensor key and its storage records.

    `local` is the rank's own metadata (its chunks only); `keys` is `tensor_keys` of the
    global skeleton, the same on every rank."""
    pickler = pickler or PiecePickler()
    position = {key: i for i, key in enumerate(keys)}
    out = []
    for key, value in local.state_dict_metadata.items():
        if isinstance(value, TensorStorageMetadata) and value.chunks:
            if key not in position:
                raise KeyError(f"{key!r} is not a tensor key of the checkpoint's skeleton")
            out += [_get(_list_index(position[key])), pickler.additions(value.chunks), _POP]
    if local.storage_data:
        out += [_get(_list_index(len(keys))), pickler.additions(dict(local.storage_data)), _POP]
    return b"".join(out)


def skeleton(global_meta: Metadata) -> tuple[bytes, list[str]]:
    """Rank 0's head of the file: prelude, the memoised lists and dict, the Metadata holding
    them; `global_meta` gives every key's size and dtype (its chunks and storage are ignored).
    Returns the bytes and the tensor keys in the order pieces number them."""
    keys = tensor_keys(global_meta)
    lists: list[Any] = [[] for _ in keys]
    storage: dict[MetadataIndex, Any] = {}
    entries: dict[str, Any] = {}
    for key, value in global_meta.state_dict_metadata.items():
        if isinstance(value, TensorStorageMetadata):
            entries[key] = TensorStorageMetadata(value.properties, value.size, lists[keys.index(key)])
        else:
            entries[key] = BytesStorageMetadata()
    head = Metadata(
        state_dict_metadata=entries,
        planner_data=global_meta.planner_data,
        storage_data=storage,
        storage_meta=global_meta.storage_meta,
    )
    if hasattr(global_meta, "version"):
        head.version = global_meta.version
    buffer = io.BytesIO()
    pickler = pickle.Pickler(buffer, PROTOCOL)
    parts = []
    for obj in (_PRELUDE, [*lists, storage], head):
        start = buffer.tell()
        pickler.dump(obj)
        parts.append(buffer.getbuffer()[start : buffer.tell() - 1].tobytes())  # without STOP
    memo = {id(obj): index for index, obj in pickler.memo.copy().values()}
    expected = [_list_index(i) for i in range(len(keys) + 1)]
    if [memo.get(id(obj)) for obj in (*lists, storage)] != expected:
        raise RuntimeError("pickle memoised the metadata skeleton in another order than the pieces assume")
    # PROTO opens every dump; only the first is kept.
    return parts[0] + _POP + parts[1][2:] + _POP + parts[2][2:], keys


def assemble(head: bytes, pieces: Iterable[bytes]) -> bytes:
    """The whole `.metadata`: the skeleton, every rank's piece in rank order, STOP."""
    return b"".join([head, *pieces, _STOP])
