"""The disk tier's file format without a tier: bit-exact round trips per dtype, rejection of
every kind of bad file with the check that exists for it, file names, and the directory scan."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest
import torch
from disk_checks import DTYPES, NAMESPACE, make_block, make_layout, same_bits
from safetensors import SafetensorError
from safetensors.torch import load as load_safetensors
from safetensors.torch import save as save_safetensors

from kvpool.memory.kv_layout import KVLayout
from kvpool.memory.tiers import disk_block_format as block_format
from kvpool.memory.tiers.disk_block_format import RejectedBlock, decode_block, encode_block


def encoded(layout: KVLayout, key: int = 1, namespace: str = NAMESPACE) -> bytes:
    block_hash, tokens, kv, scales = make_block(layout, key)
    return encode_block(namespace, block_hash, tokens, kv, scales)


def decode(data: bytes, layout: KVLayout, key: int = 1):
    """Decode `data` as the query for block `key` of `layout`."""
    block_hash, tokens, *_ = make_block(layout, key)
    return decode_block(data, layout, NAMESPACE, block_hash, tokens)


def rewritten(data: bytes, **metadata: str) -> bytes:
    """The same tensors, saved again with some metadata fields replaced (checksum unchanged)."""
    header_len = int.from_bytes(data[:8], "little")
    old = json.loads(data[8 : 8 + header_len])["__metadata__"]
    return save_safetensors(load_safetensors(data), metadata={**old, **metadata})


# ---------------------------------------------------------------- round trips
@pytest.mark.parametrize("dtype", DTYPES)
def test_round_trip_is_bit_exact(dtype):
    layout = make_layout(dtype)
    _, _, kv, scales = make_block(layout, 1)
    block = decode(encoded(layout), layout)
    assert same_bits(block.kv, kv) and same_bits(block.scales, scales)
    assert block.kv.device.type == "cpu" and block.kv.is_contiguous()
    assert (block.scales is not None) == layout.is_quantized


def test_rows_of_a_batch_encode_as_the_row_alone():
    """A row (a view into a batch snapshot) is saved as its own bytes, not its storage's."""
    layout = make_layout("int8")
    blocks = [make_block(layout, key) for key in range(3)]
    kv = torch.stack([block[2] for block in blocks])  # [num_blocks, *layout.block_shape]
    scales = torch.stack([block[3] for block in blocks])
    block_hash, tokens, *_ = blocks[1]
    data = encode_block(NAMESPACE, block_hash, tokens, kv[1], scales[1])
    assert len(data) == len(encoded(layout))  # (safetensors orders metadata keys at random)
    block = decode(data, layout)
    assert same_bits(block.kv, blocks[1][2]) and same_bits(block.scales, blocks[1][3])


# ---------------------------------------------------------------- rejection
@pytest.mark.parametrize("num_bytes", [0, 7, 8, 40])
def test_a_file_cut_in_its_header_is_rejected_as_truncated(num_bytes):
    layout = make_layout()
    with pytest.raises(RejectedBlock, match="truncated"):
        decode(encoded(layout)[:num_bytes], layout)


@pytest.mark.parametrize("cut", [1, 100])
def test_a_file_cut_in_its_tensors_fails_the_safetensors_size_check(cut):
    layout = make_layout()
    with pytest.raises(SafetensorError):
        decode(encoded(layout)[:-cut], layout)


def test_junk_is_never_decoded():
    layout = make_layout()
    for junk in (b"\x00" * 64, b"\x02" + b"\x00" * 7 + b"{}", bytes(range(256))):
        with pytest.raises((ValueError, SafetensorError)):
            decode(junk, layout)


@pytest.mark.parametrize(("field", "value"), [
    ("format", "kvpool-kv-block/0"),
    ("namespace", "models/other|layout-a"),
    ("block_hash", "00" * 32),
])
def test_a_file_of_another_format_namespace_or_block_is_rejected(field, value):
    layout = make_layout()
    with pytest.raises(RejectedBlock, match=rf"^{field} is"):
        decode(rewritten(encoded(layout), **{field: value}), layout)


def test_a_valid_file_under_another_blocks_name_is_rejected():
    layout = make_layout()
    with pytest.raises(RejectedBlock, match=r"^block_hash is"):
        decode(encoded(layout, key=2), layout, key=1)


@pytest.mark.parametrize(("written", "read"), [
    (make_layout("bfloat16"), make_layout("float32")),  # other dtype
    (make_layout("float32"), make_layout("int8")),  # no scales, other dtype
    (make_layout("int8"), make_layout("float8_e4m3fn")),  # both quantized, other codes
    (make_layout("int8"), make_layout("float32")),  # scales the layout has no place for
    (make_layout(head_dim=4), make_layout(head_dim=8)),  # other shape
])
def test_a_file_of_another_layout_is_rejected(written, read):
    with pytest.raises(RejectedBlock, match="do not fit the layout"):
        decode(encoded(written), read)


@pytest.mark.parametrize("dtype", ["float32", "int8"])
@pytest.mark.parametrize("where", [0.0, 0.5, 1.0])
def test_a_flipped_payload_byte_fails_the_checksum(dtype, where):
    """safetensors checks no payload: only the checksum catches this."""
    layout = make_layout(dtype)
    data = bytearray(encoded(layout))
    payload = layout.bytes_per_block  # the tensors' bytes end the file
    data[-1 - int(where * (payload - 1))] ^= 0x10
    with pytest.raises(RejectedBlock, match="checksum mismatch"):
        decode(bytes(data), layout)


@pytest.mark.parametrize("metadata", [
    {"token_ids": json.dumps([1, 2, 3, 4])}, {"checksum": "0" * 64}, {"checksum": ""},
])
def test_edited_metadata_fails_the_checksum(metadata):
    layout = make_layout()
    with pytest.raises(RejectedBlock, match="checksum mismatch"):
        decode(rewritten(encoded(layout), **metadata), layout)


def test_other_token_ids_are_rejected():
    """The same hash for other tokens (a collision) is not served."""
    layout = make_layout()
    block_hash, tokens, *_ = make_block(layout, 1)
    with pytest.raises(RejectedBlock, match="other token ids"):
        decode_block(encoded(layout), layout, NAMESPACE, block_hash, [*tokens[:-1], 7])


# ---------------------------------------------------------------- names
def test_block_file_names_round_trip_and_foreign_names_do_not():
    block_hash = make_block(make_layout(), 1)[0]
    shard, name = block_format.block_file_parts(block_hash)
    assert name == f"{block_hash.hex()}.safetensors" and shard == name[:2]
    assert block_format.hash_from_name(shard, name) == block_hash
    other_shard = "00" if shard != "00" else "01"
    foreign = [(other_shard, name), (shard, name.upper()), (shard, f"{name}.tmp"),
               (shard, f"{block_hash.hex()[:-1]}.safetensors"), (shard, "x.safetensors")]
    for foreign_shard, foreign_name in foreign:
        assert block_format.hash_from_name(foreign_shard, foreign_name) is None, foreign_name


def test_namespaces_and_temp_files_are_named_apart():
    first = block_format.namespace_dir_name(NAMESPACE)
    assert len(first) == 16 and first != block_format.namespace_dir_name("models/other|layout-a")
    temp = block_format.temp_path(Path("/d/ab/abc.safetensors"))
    assert temp == Path(f"/d/ab/abc.{os.getpid()}.tmp")


def test_the_scan_sorts_files_by_name_and_block_files_by_age(tmp_path):
    layout = make_layout()
    hashes = [make_block(layout, key)[0] for key in range(3)]
    for age, block_hash in zip([30, 10, 20], hashes, strict=True):
        shard, name = block_format.block_file_parts(block_hash)
        (tmp_path / shard).mkdir(exist_ok=True)
        (tmp_path / shard / name).write_bytes(b"x" * age)
        os.utime(tmp_path / shard / name, ns=(age, age))
    shard = block_format.block_file_parts(hashes[0])[0]
    (tmp_path / shard / "abc.123.tmp").write_bytes(b"")
    (tmp_path / shard / "junk.safetensors").write_bytes(b"")
    (tmp_path / shard / "notes.txt").write_bytes(b"")  # neither: ignored
    (tmp_path / "top-level.safetensors").write_bytes(b"")  # not in a shard: ignored
    scan = block_format.scan_namespace_dir(tmp_path)
    assert scan.block_files == [(10, hashes[1], 10), (20, hashes[2], 20), (30, hashes[0], 30)]
    assert scan.temp_paths == [str(tmp_path / shard / "abc.123.tmp")]
    assert scan.misnamed_paths == [str(tmp_path / shard / "junk.safetensors")]
