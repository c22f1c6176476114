"""kvserve's GGUF reader (weights/gguf_reader.py) against the gguf package's own: the same
metadata values and the same tensor bytes, shapes and types, on a file with every metadata type
and on the bundled model; cut or damaged files raise CorruptModelFileError, nothing else."""

from __future__ import annotations

import numpy as np
import pytest

from kvserve.errors import CorruptModelFileError
from kvserve.weights.gguf_file import open_gguf, read_metadata
from kvserve.weights.gguf_reader import GGUFFile

gguf = pytest.importorskip("gguf")


def _assert_same_as_gguf_package(path) -> None:
    ours, theirs = GGUFFile(path), gguf.GGUFReader(str(path))
    expected = {key: field.contents() for key, field in theirs.fields.items()
                if not key.startswith("GGUF.")}
    assert ours.metadata == expected
    assert [t.name for t in ours.tensors] == [t.name for t in theirs.tensors]
    for mine, reference in zip(ours.tensors, theirs.tensors):
        assert mine.tensor_type == reference.tensor_type, mine.name
        assert mine.shape == tuple(int(d) for d in reference.shape), mine.name
        assert mine.data.shape == reference.data.shape, mine.name
        assert mine.data.dtype == reference.data.dtype, mine.name
        assert np.array_equal(mine.data, reference.data), mine.name


@pytest.fixture
def every_type_file(tmp_path):
    path = tmp_path / "types.gguf"
    writer = gguf.GGUFWriter(str(path), "llama")
    writer.add_uint8("t.u8", 200)
    writer.add_int8("t.i8", -100)
    writer.add_uint16("t.u16", 60000)
    writer.add_int16("t.i16", -30000)
    writer.add_uint32("t.u32", 4_000_000_000)
    writer.add_int32("t.i32", -2_000_000_000)
    writer.add_float32("t.f32", 1.5)
    writer.add_uint64("t.u64", 2**63 + 5)
    writer.add_int64("t.i64", -(2**62))
    writer.add_float64("t.f64", 0.1)
    writer.add_bool("t.bool", True)
    writer.add_string("t.str", "héllo ✓")
    writer.add_array("t.ints", [1, -2, 3])
    writer.add_array("t.floats", [0.5, -1.25])
    writer.add_array("t.bools", [True, False, True])
    writer.add_array("t.strs", ["a", "", "日本", "  "])
    writer.add_array("t.empty", [])
    rng = np.random.default_rng(0)
    writer.add_tensor("f32", rng.standard_normal((3, 64)).astype(np.float32))
    writer.add_tensor("f16", rng.standard_normal((2, 32)).astype(np.float16))
    for kind in ("Q8_0", "Q4_1"):
        qtype = getattr(gguf.GGMLQuantizationType, kind)
        array = rng.standard_normal((4, 256)).astype(np.float32)
        writer.add_tensor(kind.lower(), gguf.quants.quantize(array, qtype), raw_dtype=qtype)
    for kind in ("Q4_K", "Q6_K"):  # gguf cannot quantize these: any bytes will do here
        qtype = getattr(gguf.GGMLQuantizationType, kind)
        block_bytes = gguf.GGML_QUANT_SIZES[qtype][1]
        raw = rng.integers(0, 256, (4, 2 * block_bytes), dtype=np.uint8)
        writer.add_tensor(kind.lower(), raw, raw_dtype=qtype)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path


def test_every_metadata_type_and_tensor_kind(every_type_file):
    _assert_same_as_gguf_package(every_type_file)
    meta = read_metadata(open_gguf(every_type_file))
    assert meta["t.u64"] == 2**63 + 5 and meta["t.strs"] == ["a", "", "日本", "  "]


def test_bundled_model_reads_as_the_gguf_package_reads_it(smollm_source):
    _assert_same_as_gguf_package(smollm_source.path)


def test_cut_or_damaged_files_are_corrupt_model_errors(every_type_file, tmp_path):
    data = every_type_file.read_bytes()
    damaged = tmp_path / "damaged.gguf"
    for cut in range(0, len(data), max(1, len(data) // 97)):
        damaged.write_bytes(data[:cut])
        with pytest.raises(CorruptModelFileError):
            open_gguf(damaged)
    for bad in (b"GGUX" + data[4:], data[:4] + (7).to_bytes(4, "little") + data[8:]):
        damaged.write_bytes(bad)
        with pytest.raises(CorruptModelFileError):
            open_gguf(damaged)
