"""Our blob files are standard safetensors: the reference library reads ours and we read its files."""

from __future__ import annotations

import torch
import xxhash
from safetensors.torch import load_file, save_file

from supervisor.checkpoint.blobs import BlobReader, write_blob

TENSORS = {
    "a.weight": torch.randn(3, 5),
    "b": torch.arange(7, dtype=torch.int64),
    "c": torch.tensor(2.5, dtype=torch.bfloat16),
    "d": torch.zeros(0, 2),
    "e": torch.tensor([True, False]),
    "f": torch.arange(5, dtype=torch.uint8),
}


def test_reference_library_reads_our_files(tmp_path):
    path = tmp_path / "x.safetensors"
    size, digest = write_blob(str(path), TENSORS, {"checkpoint": "x"})
    assert size == path.stat().st_size and digest == xxhash.xxh3_64_hexdigest(path.read_bytes())
    loaded = load_file(path)
    assert loaded.keys() == TENSORS.keys()
    assert all(torch.equal(loaded[k], v) and loaded[k].dtype == v.dtype for k, v in TENSORS.items())


def test_we_read_reference_files_into_existing_memory(tmp_path):
    path = tmp_path / "y.safetensors"
    save_file(TENSORS, path)
    reader = BlobReader(str(path))
    try:
        for name, tensor in TENSORS.items():
            dst = torch.empty_like(tensor)
            reader.read_into(reader.entries[name], dst)
            assert torch.equal(dst, tensor)
    finally:
        reader.close()
