"""mix64, the device checksum's numpy reference: bit-identical to a plain-Python spelling of its
definition, deterministic, and catching flipped bits, swapped words and swapped rows."""

import numpy as np
import pytest
from hypothesis import assume, given, settings
from hypothesis import strategies as st

from kv.integrity.checksum import block_checksum, mix64_checksum

MASK = (1 << 64) - 1
# No per-example deadline: a shared 2-core machine stalls a 1 ms example now and then.
NO_DEADLINE = settings(deadline=None)


def mix64_by_definition(data: bytes) -> int:
    """The module docstring's formula, one word at a time in Python integers."""
    total = 0
    for i in range(len(data) // 8):
        x = (int.from_bytes(data[8 * i:8 * i + 8], "little") + (i + 1) * 0x9E3779B97F4A7C15) & MASK
        x ^= x >> 30
        x = (x * 0xBF58476D1CE4E5B9) & MASK
        x ^= x >> 27
        x = (x * 0x94D049BB133111EB) & MASK
        x ^= x >> 31
        total = (total + x) & MASK
    return total


def word_blocks(min_words: int = 1, max_words: int = 64):
    return st.integers(min_words, max_words).flatmap(
        lambda n: st.binary(min_size=8 * n, max_size=8 * n))


@NO_DEADLINE
@given(word_blocks())
def test_numpy_reference_equals_the_definition(data):
    assert mix64_checksum(data) == mix64_by_definition(data)
    assert mix64_checksum(np.frombuffer(data, dtype=np.uint8)) == mix64_checksum(data)


def test_known_values_and_chunks_longer_than_one_numpy_pass():
    assert mix64_checksum(bytes(16)) == 0x509946A41CD733A3  # pins the constants
    rng = np.random.default_rng(1)
    long = rng.integers(0, 256, 8 * ((1 << 15) + 7), dtype=np.uint8)  # two chunks
    assert mix64_checksum(long) == mix64_by_definition(long.tobytes())


@NO_DEADLINE
@given(word_blocks(), st.data())
def test_a_flipped_bit_anywhere_changes_it(data, draw):
    position = draw.draw(st.integers(0, len(data) - 1), label="byte")
    bit = draw.draw(st.integers(0, 7), label="bit")
    flipped = bytearray(data)
    flipped[position] ^= 1 << bit
    assert mix64_checksum(bytes(flipped)) != mix64_checksum(data)


def test_a_flipped_last_bit_changes_it():
    data = bytearray(range(64))
    before = mix64_checksum(bytes(data))
    data[-1] ^= 0x80
    assert mix64_checksum(bytes(data)) != before


@NO_DEADLINE
@given(word_blocks(min_words=2), st.data())
def test_swapped_words_change_it(data, draw):
    n = len(data) // 8
    i = draw.draw(st.integers(0, n - 1), label="i")
    j = draw.draw(st.integers(0, n - 1), label="j")
    words = [data[8 * k:8 * k + 8] for k in range(n)]
    assume(words[i] != words[j])
    words[i], words[j] = words[j], words[i]
    assert mix64_checksum(b"".join(words)) != mix64_checksum(data)


@settings(max_examples=50, deadline=None)
@given(st.integers(2, 6), st.integers(1, 6), st.integers(0, 2**32 - 1))
def test_rows_hash_as_laid_back_to_back_and_swapped_rows_change_it(num_rows, row_words, seed):
    rng = np.random.default_rng(seed)
    pool = rng.integers(0, 256, (num_rows, 3 * 8 * row_words), dtype=np.uint8)
    rows = pool[:, 8 * row_words:16 * row_words]  # strided: the middle block of each row
    assert mix64_checksum(rows) == mix64_checksum(np.ascontiguousarray(rows).tobytes())
    swapped = rows[[1, 0] + list(range(2, num_rows))]
    assume(not np.array_equal(rows[0], rows[1]))
    assert mix64_checksum(swapped) != mix64_checksum(rows)


@NO_DEADLINE
@given(word_blocks(), word_blocks())
def test_different_blocks_differ(a, b):
    assume(a != b)
    assert mix64_checksum(a) != mix64_checksum(b)


def test_all_zero_blocks_of_different_lengths_differ_and_are_not_zero():
    sums = {mix64_checksum(bytes(8 * n)) for n in range(1, 50)}
    assert len(sums) == 49 and 0 not in sums


def test_sizes_not_a_multiple_of_eight_are_refused():
    with pytest.raises(ValueError, match="multiple of 8"):
        mix64_checksum(bytes(12))
    with pytest.raises(ValueError, match="multiple of 8"):
        mix64_checksum(np.zeros((2, 4), dtype=np.uint8))
    with pytest.raises(ValueError, match="uint8"):
        mix64_checksum(np.zeros(4, dtype=np.float32))
    assert block_checksum(bytes(12)) == block_checksum(bytearray(12))  # xxh3 takes any size
