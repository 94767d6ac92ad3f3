"""The CPU decode kernel (C, built with the package or compiled on first use) equals the PyTorch
path, and a machine where it cannot be had runs the PyTorch path with a warning."""

import logging
import os
import shutil
import stat
import tempfile

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

import kv.attention.cpu_decode as cpu_decode
import kv.native_build as native_build
from kv.attention.cpu_decode import DecodeKernel, KernelBuildError, build, decode_kernel, reference_attend
from kv.native_stamp import LibraryRefused, check_stamp


@pytest.fixture
def fresh_kernel(monkeypatch, tmp_path):
    """decode_kernel() looked up again, with its builds in tmp_path; cleared again afterwards."""
    monkeypatch.setenv(native_build.CACHE_ENV, str(tmp_path))
    decode_kernel.cache_clear()
    yield tmp_path / "kernels"
    decode_kernel.cache_clear()


@pytest.fixture
def no_shipped_library(monkeypatch, tmp_path):
    """The package's library (setup.py's) missing, as in a package built without a compiler."""
    missing = tmp_path / "libpaged_decode.so"
    monkeypatch.setattr(cpu_decode, "LIBRARY", missing)
    return missing


def _records(caplog):
    return [(r.levelno, r.getMessage()) for r in caplog.records if r.name == cpu_decode.__name__]


def test_the_kernel_builds_and_runs_on_the_machines_the_suite_runs_on():
    kernel = decode_kernel()
    assert kernel is not None, "no C compiler, or the kernel failed its check: see the log"
    cache = torch.zeros(16, 2, 64)
    assert kernel.accepts(torch.zeros(1, 8, 64), cache, cache)
    assert kernel.accepts(torch.zeros(1, 8, 64, dtype=torch.bfloat16),
                          cache.bfloat16(), cache.bfloat16())
    assert not kernel.accepts(torch.zeros(1, 8, 64), cache.bfloat16(), cache.bfloat16())
    assert not kernel.accepts(torch.zeros(1, 8, 64, dtype=torch.float16),
                              cache.half(), cache.half())
    assert not kernel.accepts(torch.zeros(1, 8, 64), cache, torch.zeros(2, 16, 64).transpose(0, 1))


@settings(max_examples=40, deadline=None)
@given(num_seqs=st.integers(1, 5), num_kv_heads=st.sampled_from([1, 2, 4]),
       group=st.sampled_from([1, 2, 4, 8]), head_dim=st.sampled_from([64, 128, 40]),
       num_keys=st.integers(1, 1200), holes=st.booleans(), seed=st.integers(0, 2 ** 16))
def test_the_kernel_equals_gather_and_sdpa(num_seqs, num_kv_heads, group, head_dim, num_keys,
                                           holes, seed):
    """Shapes across the kernel's tiles (32 keys) and parts (512), GQA ratios 1-8 and MQA, head
    dims 64/128 and an odd one, padded rows (valid prefixes of random lengths) or keys masked
    anywhere (at least one seen per row)."""
    gen = torch.Generator().manual_seed(seed)
    num_slots = 2048
    k_cache = torch.randn(num_slots, num_kv_heads, head_dim, generator=gen)
    v_cache = torch.randn(num_slots, num_kv_heads, head_dim, generator=gen)
    q = torch.randn(num_seqs, num_kv_heads, group, head_dim, generator=gen)
    slots = torch.randint(0, num_slots, (num_seqs, num_keys), generator=gen)
    if holes:
        valid = torch.rand(num_seqs, num_keys, generator=gen) < 0.7
    else:
        lengths = torch.randint(1, num_keys + 1, (num_seqs,), generator=gen)
        valid = torch.arange(num_keys)[None, :] < lengths[:, None]
    valid[:, torch.randint(0, num_keys, (1,), generator=gen)] = True
    scale = head_dim ** -0.5
    got = decode_kernel().attend(q, k_cache, v_cache, slots, valid, scale)
    torch.testing.assert_close(got, reference_attend(q, k_cache, v_cache, slots, valid, scale),
                               rtol=1e-5, atol=1e-5)


@settings(max_examples=15, deadline=None)
@given(num_seqs=st.integers(1, 4), num_kv_heads=st.sampled_from([1, 3]),
       group=st.sampled_from([1, 3, 8]), head_dim=st.sampled_from([64, 40]),
       num_keys=st.integers(1, 1100), seed=st.integers(0, 2 ** 16))
def test_over_bf16_caches_it_equals_fp32_sdpa_of_the_same_values_rounded_once(
        num_seqs, num_kv_heads, group, head_dim, num_keys, seed):
    """bf16 K/V read as bf16, summed in fp32: the fp32 attention of the same bf16 values, within
    the output's one rounding to bf16."""
    gen = torch.Generator().manual_seed(seed)
    num_slots = 2048
    k_cache, v_cache = torch.randn(2, num_slots, num_kv_heads, head_dim,
                                   generator=gen).bfloat16()
    q = torch.randn(num_seqs, num_kv_heads, group, head_dim, generator=gen).bfloat16()
    slots = torch.randint(0, num_slots, (num_seqs, num_keys), generator=gen)
    valid = torch.rand(num_seqs, num_keys, generator=gen) < 0.7
    valid[:, 0] = True
    got = decode_kernel().attend(q, k_cache, v_cache, slots, valid, head_dim ** -0.5)
    want = reference_attend(q.float(), k_cache.float(), v_cache.float(), slots, valid,
                            head_dim ** -0.5)
    assert got.dtype == torch.bfloat16
    torch.testing.assert_close(got, want.bfloat16(), rtol=8e-3, atol=1e-3)


def test_no_mask_means_every_key():
    gen = torch.Generator().manual_seed(1)
    k_cache, v_cache = torch.randn(2, 64, 2, 64, generator=gen)
    q = torch.randn(3, 2, 4, 64, generator=gen)
    slots = torch.randint(0, 64, (3, 700), generator=gen)
    got = decode_kernel().attend(q, k_cache, v_cache, slots, None, 0.125)
    torch.testing.assert_close(got, reference_attend(q, k_cache, v_cache, slots, None, 0.125))


def test_shapes_it_cannot_run_are_refused_by_name():
    with pytest.raises(ValueError, match="at least one key"):
        decode_kernel().attend(torch.zeros(1, 1, 1, 64), torch.zeros(4, 1, 64),
                               torch.zeros(4, 1, 64), torch.zeros(1, 0, dtype=torch.int64), None,
                               1.0)


@pytest.mark.parametrize("bad_slot", [64, -1])
def test_a_slot_outside_the_cache_is_an_error_not_a_read(bad_slot):
    cache = torch.zeros(64, 1, 64)
    slots = torch.tensor([[0, 5, 9], [3, bad_slot, 4]])
    with pytest.raises(IndexError, match="outside the cache's 64 slots"):
        decode_kernel().attend(torch.zeros(2, 1, 2, 64), cache, cache, slots, None, 1.0)
    masked = torch.tensor([[True, True, True], [True, False, True]])  # never read: no error
    decode_kernel().attend(torch.zeros(2, 1, 2, 64), cache, cache, slots, masked, 1.0)


@pytest.mark.parametrize("position", [0, 31, 32, 70])  # first tile, its end, later tiles
def test_a_slot_outside_the_cache_in_any_tile_is_an_error_not_a_read(position):
    cache = torch.zeros(64, 1, 64)
    slots = torch.arange(80).remainder(64)[None].repeat(2, 1)
    slots[1, position] = 64
    with pytest.raises(IndexError, match="outside the cache's 64 slots"):
        decode_kernel().attend(torch.zeros(2, 1, 2, 64), cache, cache, slots, None, 1.0)


@pytest.mark.parametrize("built_by", ["setup.py", "first use"])
def test_loading_it_leaves_denormals_alone(tmp_path, built_by):
    """Linked with -ffast-math, GCC 12 adds code that sets flush-to-zero for the whole process
    when the library loads: every torch op after it would change."""
    if built_by == "setup.py" and not cpu_decode.LIBRARY.exists():
        pytest.skip("not built with the package here (`pip install -e .` builds it)")
    DecodeKernel(cpu_decode.LIBRARY if built_by == "setup.py" else build(tmp_path))
    tiny = torch.tensor([1e-39])
    assert (tiny * 2).item() != 0.0


def _counting_compiler(tmp_path, real="cc"):
    """A compiler that logs each call to calls.log, then runs the real one."""
    script = tmp_path / "counting-cc"
    script.write_text(f'#!/bin/sh\necho "$@" >> {tmp_path}/calls.log\nexec {real} "$@"\n')
    script.chmod(script.stat().st_mode | stat.S_IEXEC)
    return script


def test_a_build_is_made_once_and_then_found(monkeypatch, tmp_path):
    monkeypatch.setenv("CC", str(_counting_compiler(tmp_path)))
    first = build(tmp_path / "kernels")
    calls = (tmp_path / "calls.log").read_text().splitlines()
    assert len(calls) == 2 and " -c " in f" {calls[0]} "  # compiled, then linked
    assert "-ffast-math" not in calls[1]  # see test_loading_it_leaves_denormals_alone
    assert build(tmp_path / "kernels") == first
    assert len((tmp_path / "calls.log").read_text().splitlines()) == 2
    assert os.listdir(tmp_path / "kernels") == [first.name]  # no scratch left behind


def test_a_failing_compiler_is_named_with_its_error(monkeypatch, tmp_path):
    script = tmp_path / "broken-cc"
    script.write_text("#!/bin/sh\necho 'fatal: no such target' >&2\nexit 3\n")
    script.chmod(script.stat().st_mode | stat.S_IEXEC)
    monkeypatch.setenv("CC", str(script))
    with pytest.raises(KernelBuildError, match=r"broken-cc .*exited 3: fatal: no such target"):
        build(tmp_path / "kernels")
    assert os.listdir(tmp_path / "kernels") == []


def _shipped_library_or_skip():
    if not cpu_decode.LIBRARY.exists():
        pytest.skip("not built with the package here (`pip install -e .` builds it)")
    try:
        check_stamp(cpu_decode.LIBRARY, (cpu_decode.SOURCE, cpu_decode.HEADER))
    except LibraryRefused as exc:
        if "CPU lacks" not in str(exc):
            raise
        pytest.skip(str(exc))


def test_the_package_library_is_used_where_it_is_built(fresh_kernel, caplog):
    _shipped_library_or_skip()
    with caplog.at_level(logging.INFO, logger=cpu_decode.__name__):
        kernel = decode_kernel()
    assert kernel is not None and kernel.path == cpu_decode.LIBRARY
    assert [level for level, _ in _records(caplog)] == [logging.INFO]
    assert not fresh_kernel.exists()  # nothing compiled


def test_a_library_built_from_other_sources_is_compiled_anew(monkeypatch, fresh_kernel, tmp_path,
                                                             caplog):
    """An editable install's library after the C changed: the C as it is now runs."""
    _shipped_library_or_skip()
    edited = tmp_path / "paged_decode.c"
    edited.write_text(cpu_decode.SOURCE.read_text() + "/* edited */\n")
    shutil.copy(cpu_decode.HEADER, tmp_path)  # the header it includes, beside it
    monkeypatch.setattr(cpu_decode, "SOURCE", edited)
    with caplog.at_level(logging.INFO, logger=cpu_decode.__name__):
        kernel = decode_kernel()
    assert kernel is not None and kernel.path.parent == fresh_kernel
    [(level, message)] = _records(caplog)
    assert level == logging.WARNING
    assert f"{cpu_decode.LIBRARY} was built from other sources than paged_decode.c" in message


def test_without_the_library_it_is_compiled_at_first_use_with_one_warning(
        fresh_kernel, no_shipped_library, caplog):
    with caplog.at_level(logging.INFO, logger=cpu_decode.__name__):
        kernel = decode_kernel()
    assert kernel is not None and kernel.path.parent == fresh_kernel
    assert _records(caplog) == [(logging.WARNING, (
        f"CPU decode attention: {no_shipped_library} is missing (the package was built without "
        "a C compiler, or this checkout without `pip install -e .`); the C kernel was compiled "
        f"for this machine at first use instead: {kernel.path}"))]


def test_without_the_library_or_a_compiler_decodes_take_the_pytorch_path(
        monkeypatch, fresh_kernel, no_shipped_library, caplog):
    monkeypatch.setenv("CC", "/nonexistent/cc")
    with caplog.at_level(logging.INFO, logger=cpu_decode.__name__):
        assert decode_kernel() is None
    [(level, message)] = _records(caplog)
    assert level == logging.WARNING and "PyTorch path" in message
    assert f"{no_shipped_library} is missing" in message and "'/nonexistent/cc'" in message


def test_the_switch_turns_it_off(monkeypatch, fresh_kernel):
    monkeypatch.setenv(cpu_decode.SWITCH_ENV, "0")
    assert decode_kernel() is None
    assert not fresh_kernel.exists()  # nothing was built


def test_an_unwritable_cache_builds_in_the_temporary_directory(monkeypatch, tmp_path):
    monkeypatch.setenv(native_build.CACHE_ENV, "/proc/no-such-dir")
    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path))
    built = build()
    assert built.parent.parent == tmp_path and built.exists()


def test_an_engine_on_cpu_has_it_before_its_first_step(fresh_kernel, no_shipped_library,
                                                        tiny_llama):
    """Without the package's library, compiled (about a second) while the rank starts, not in the
    first request's decode."""
    from workers.config import EngineConfig
    from workers.llm import LLM

    with LLM(EngineConfig(model=str(tiny_llama), num_kv_blocks=16)):
        assert decode_kernel.cache_info().misses == 1 and decode_kernel() is not None
        assert list(fresh_kernel.glob("paged_decode-*.so"))
