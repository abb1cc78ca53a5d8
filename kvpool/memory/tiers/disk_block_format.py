"""The stored block format: one full KV block as one safetensors blob, validated on read. It is
both the disk tier's file (`kvpool.memory.tiers.disk_tier`) and the shared tier's Redis value
(`kvpool.memory.tiers.redis_tier`): one format, one set of checks.

Where a block lives on disk, under the disk tier's directory (`namespace_dir_name`,
`block_file_parts`); the shared tier puts `namespace_dir_name` in its Redis keys the same way:

    <sha256(namespace)[:16]>/<hash hex[:2]>/<hash hex>.safetensors

The hash is the block's salted chained hash (`kvpool.memory.prefix_cache`; the tenant salt is
inside the chain, so tenants never share a block). The namespace names the model and KV layout,
so two models never meet. A write in progress is `<hash hex>.<pid>.tmp` next to its final name
(`temp_path`); a name this format would not write (`hash_from_name` is None) is not a block.

What a blob holds (`encode_block`): `kv` (`layout.block_shape`, the layout's dtype), `scales`
for int8 / fp8 layouts (`layout.scale_block_shape`, float32), and metadata: `format`
(FORMAT_TAG, the format version), `namespace`, `block_hash` (hex), `token_ids` (JSON) and
`checksum`.

`decode_block` returns a `StoredBlock` only if all of the blob is what was asked for, and
raises (`RejectedBlock`, or whatever the parsers raise on junk) otherwise. Each check has its
reason:
- the header length fits the blob: a blob cut short in its header (torn write, power cut;
  writes are not fsynced; a truncated value) is caught before the JSON parser reads past its
  end; one cut in its tensors fails safetensors' own size check;
- `format` is FORMAT_TAG: a blob of another format version is never misread;
- `namespace` is the query's: a file copied from another model's directory (or a value set
  under another model's key) is not served;
- `block_hash` is the name's (the key's): a valid blob under another block's name is not served;
- the tensors' names, shapes and dtypes are the layout's: a blob of another KV layout (dtype,
  head dim, ...) never reaches the KV cache;
- `checksum` (BLAKE2b over the four fields above and the tensors' raw bytes) matches:
  safetensors checks no payload, so a flipped bit anywhere would otherwise be served;
- `token_ids` are the query's: a hash collision (or a reused name) never serves other tokens.
"""

from __future__ import annotations

import hashlib
import json
import os
import re
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

import torch
from safetensors.torch import load as load_safetensors
from safetensors.torch import save as save_safetensors

from kvpool.memory.kv_layout import KVLayout
from kvpool.memory.prefix_cache import BlockHash

FORMAT_TAG = "kvpool-kv-block/1"
SUFFIX = ".safetensors"
TEMP_SUFFIX = ".tmp"
_BLOCK_FILE_NAME = re.compile(r"([0-9a-f]{64})\.safetensors")
_CHECKED_FIELDS = ("format", "namespace", "block_hash", "token_ids")  # in checksum order


@dataclass(frozen=True, slots=True)
class StoredBlock:
    """A block read back from disk or Redis, validated; the caller owns both tensors."""

    kv: torch.Tensor  # layout.block_shape, layout.torch_dtype, CPU, contiguous
    scales: torch.Tensor | None  # layout.scale_block_shape float32 for int8/fp8 layouts, else None


class RejectedBlock(ValueError):
    """The blob is not the block asked for (module docstring)."""


# ---------------------------------------------------------------- names
def namespace_dir_name(namespace: str) -> str:
    """A namespace's short name: the disk tier's directory for it, below the tier's root, and
    the middle of the shared tier's keys."""
    return hashlib.sha256(namespace.encode()).hexdigest()[:16]


def block_file_parts(block_hash: BlockHash) -> tuple[str, str]:
    """(shard directory, file name) of a block's file, below the namespace directory."""
    name = block_hash.hex()
    return name[:2], f"{name}{SUFFIX}"


def temp_path(path: Path) -> Path:
    """Where this process writes a block's file before moving it to `path`."""
    return path.with_name(f"{path.stem}.{os.getpid()}{TEMP_SUFFIX}")


def hash_from_name(shard: str, name: str) -> BlockHash | None:
    """The hash a block file's name spells, or None if this tier would not write that name."""
    match = _BLOCK_FILE_NAME.fullmatch(name)
    return bytes.fromhex(match[1]) if match and match[1][:2] == shard else None


@dataclass(frozen=True, slots=True)
class DirectoryScan:
    """What `scan_namespace_dir` found in a namespace directory's shard directories."""

    block_files: list[tuple[int, BlockHash, int]]  # (mtime_ns, hash, size), oldest first
    temp_paths: list[str]  # writes a crashed process left half-done
    misnamed_paths: list[str]  # `*.safetensors` files under a name this format never writes


def scan_namespace_dir(directory: Path) -> DirectoryScan:
    """Sort every file in the shard directories below `directory` by what its name says (other
    names are ignored); contents are not read. OSError if a directory cannot be scanned."""
    scan = DirectoryScan([], [], [])
    with os.scandir(directory) as shards:
        for shard in shards:
            if not shard.is_dir(follow_symlinks=False):
                continue
            with os.scandir(shard.path) as entries:
                for entry in entries:
                    _sort_entry(scan, shard.name, entry)
    scan.block_files.sort()  # ties in hash order
    return scan


def _sort_entry(scan: DirectoryScan, shard: str, entry: os.DirEntry[str]) -> None:
    if entry.name.endswith(TEMP_SUFFIX):
        scan.temp_paths.append(entry.path)
    elif entry.name.endswith(SUFFIX):
        block_hash = hash_from_name(shard, entry.name)
        if block_hash is None:
            scan.misnamed_paths.append(entry.path)
        else:
            stat = entry.stat()
            scan.block_files.append((stat.st_mtime_ns, block_hash, stat.st_size))


# ---------------------------------------------------------------- contents
def _checksum(fields: Sequence[str], tensors: Sequence[torch.Tensor]) -> str:
    digest = hashlib.blake2b(digest_size=32)
    for field in fields:  # length-prefixed, so no two field lists hash the same bytes
        digest.update(len(field.encode()).to_bytes(8, "little") + field.encode())
    for tensor in tensors:  # raw bytes, no copy (their lengths are fixed by the layout)
        digest.update(memoryview(tensor.detach().reshape(-1).view(torch.uint8).numpy()))
    return digest.hexdigest()


def encode_block(namespace: str, block_hash: BlockHash, token_ids: list[int],
                 kv: torch.Tensor, scales: torch.Tensor | None) -> bytes:
    """The bytes of one stored block (the tensors are copied to the CPU if they are not)."""
    tensors = {"kv": kv.detach().cpu().contiguous()}
    if scales is not None:
        tensors["scales"] = scales.detach().cpu().contiguous()
    values = (FORMAT_TAG, namespace, block_hash.hex(), json.dumps(token_ids))
    fields = dict(zip(_CHECKED_FIELDS, values, strict=True))
    metadata = {**fields, "checksum": _checksum(list(fields.values()), list(tensors.values()))}
    return save_safetensors(tensors, metadata=metadata)


def _read_metadata(data: bytes) -> dict[str, str]:
    """A safetensors blob's `__metadata__`: after an 8-byte little-endian length, JSON."""
    header_len = int.from_bytes(data[:8], "little")
    if len(data) < 8 or header_len > len(data) - 8:
        raise RejectedBlock(f"truncated: {len(data)} bytes, header of {header_len}")
    header = json.loads(data[8 : 8 + header_len])
    metadata = header.get("__metadata__") if isinstance(header, dict) else None
    if not isinstance(metadata, dict):
        raise RejectedBlock("no metadata")
    return metadata


def _check_tensors(tensors: dict[str, torch.Tensor], layout: KVLayout) -> list[str]:
    """The tensor names the layout asks for, in checksum order, if `tensors` has exactly those
    with the layout's shapes and dtypes; else RejectedBlock."""
    specs = {"kv": (layout.block_shape, layout.torch_dtype)}
    if layout.is_quantized:
        specs["scales"] = (layout.scale_block_shape, torch.float32)
    found = {name: (tuple(tensor.shape), tensor.dtype) for name, tensor in tensors.items()}
    if found != specs:
        raise RejectedBlock(f"tensors {found} do not fit the layout's {specs}")
    return list(specs)


def decode_block(data: bytes, layout: KVLayout, namespace: str, block_hash: BlockHash,
                 token_ids: list[int]) -> StoredBlock:
    """The block in `data` if it is exactly what was asked for; else RejectedBlock (or
    whatever a parser raises). The checks, and why each exists, are in the module docstring."""
    metadata = _read_metadata(data)
    expected = {"format": FORMAT_TAG, "namespace": namespace, "block_hash": block_hash.hex()}
    for key, value in expected.items():
        if metadata.get(key) != value:
            raise RejectedBlock(f"{key} is {metadata.get(key)!r}, not {value!r}")
    tensors = load_safetensors(data)
    names = _check_tensors(tensors, layout)
    fields = [metadata.get(key) for key in _CHECKED_FIELDS]
    if not all(isinstance(field, str) for field in fields) or (
            metadata.get("checksum") != _checksum(fields, [tensors[name] for name in names])):
        raise RejectedBlock("checksum mismatch")
    if json.loads(metadata["token_ids"]) != token_ids:
        raise RejectedBlock("other token ids")
    return StoredBlock(tensors["kv"], tensors.get("scales"))
