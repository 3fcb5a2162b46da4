"""`checksum`: the one snapshot checksum (CRC32C)."""

from __future__ import annotations

import zlib

import numpy as np
import pytest

from mnemojax._src.checksum import NAME, checksum


def test_is_crc32c():
    assert NAME == "CRC32C"
    assert checksum(b"123456789") == 0xE3069283  # the standard check value of CRC-32C
    assert checksum(b"") == 0
    assert checksum(b"123456789") != zlib.crc32(b"123456789")


def test_chains_over_parts_and_reads_any_contiguous_buffer():
    data = np.arange(1000, dtype=np.float32)
    raw = data.tobytes()
    whole = checksum(raw)
    assert checksum(data) == checksum(memoryview(raw)) == checksum(bytearray(raw)) == whole
    assert checksum(raw[600:], checksum(raw[:600])) == whole
    with pytest.raises(ValueError):
        checksum(data[::2])  # a strided view has no single byte range


def test_every_single_bit_flip_changes_it():
    raw = bytearray(np.random.default_rng(0).integers(0, 256, 64, dtype=np.uint8).tobytes())
    good = checksum(raw)
    for byte in range(len(raw)):
        for bit in range(8):
            raw[byte] ^= 1 << bit
            assert checksum(raw) != good, (byte, bit)
            raw[byte] ^= 1 << bit
    assert checksum(raw) == good
