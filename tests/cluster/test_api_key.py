"""The API key's sources and each replica's check of it (cluster.api.api_key), without Ray."""

from __future__ import annotations

import os
import socket

import pytest

from cluster.api.api_key import ApiKey, KeyCheck, read_key_file, resolve_api_key
from cluster.api.protocol import ProtocolError


class Clock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


def refused(check: KeyCheck, header) -> bool:
    try:
        check.authorize(header)
    except ProtocolError as exc:
        assert exc.status == 401 and exc.code == "invalid_api_key"
        return True
    return False


def test_a_value_is_one_fixed_key():
    key = resolve_api_key("  s3cret ", None)
    assert key == ApiKey(("s3cret",)) and "s3cret" not in repr(key)
    check = KeyCheck(key)
    assert not refused(check, "Bearer s3cret") and not refused(check, "bearer  s3cret ")
    assert refused(check, "Bearer other") and refused(check, None) and refused(check, "s3cret")
    assert refused(check, "Basic s3cret") and refused(check, "Bearer ")


def test_no_key_lets_everyone_in():
    assert resolve_api_key(None, None) is None
    assert not refused(KeyCheck(None), None)


def test_a_file_holds_one_key_per_line(tmp_path):
    path = tmp_path / "key"
    path.write_text("\nfirst\n  second  \n\n")
    key = resolve_api_key(None, str(path))
    assert key == ApiKey(("first", "second"), file=str(path))
    check = KeyCheck(key)
    assert not refused(check, "Bearer first") and not refused(check, "Bearer second")
    assert refused(check, "Bearer first second")


@pytest.mark.parametrize("content, words", [
    (None, "no such file on"),
    (b"\n  \n", "empty on"),
    (b"\xff\xfe", "not UTF-8"),
    (b"k" * (64 * 1024 + 1), "larger than 65536 bytes"),
])
def test_an_unusable_file_is_an_error_naming_it_and_the_host(tmp_path, content, words):
    path = tmp_path / "key"
    if content is not None:
        path.write_bytes(content)
    with pytest.raises(ValueError, match=words) as info:
        resolve_api_key(None, str(path))
    assert f"--api-key-file: {path}" in str(info.value)
    if content is None or content.strip() == b"":
        assert socket.gethostname() in str(info.value)


def test_a_value_and_a_file_together_are_refused(tmp_path):
    with pytest.raises(ValueError, match="--api-key and --api-key-file: give one"):
        resolve_api_key("k", str(tmp_path / "key"))
    with pytest.raises(ValueError, match="--api-key: empty"):
        resolve_api_key("  ", None)


def test_a_tilde_is_expanded_on_the_node_that_reads(tmp_path, monkeypatch):
    monkeypatch.setenv("HOME", str(tmp_path))
    (tmp_path / ".tpserve").mkdir()
    (tmp_path / ".tpserve" / "api_key").write_text("k1\n")
    assert read_key_file("~/.tpserve/api_key") == ("k1",)


def test_each_replica_rereads_its_file_when_it_changes(tmp_path):
    path = tmp_path / "key"
    path.write_text("old\n")
    clock = Clock()
    check = KeyCheck(resolve_api_key(None, str(path)), recheck_s=1.0, clock=clock)
    assert not refused(check, "Bearer old")
    path.write_text("old\nnew\n")
    os.utime(path, ns=(1, 10**18))  # a change the file's stamp shows, whatever the fs clock
    assert refused(check, "Bearer new")  # not looked at again within recheck_s
    clock.now += 1.0
    assert not refused(check, "Bearer new") and not refused(check, "Bearer old")
    path.write_text("new\n")
    os.utime(path, ns=(1, 2 * 10**18))
    clock.now += 1.0
    assert refused(check, "Bearer old") and not refused(check, "Bearer new")


def test_a_missing_or_broken_file_keeps_the_keys_the_replica_has(tmp_path, caplog):
    path = tmp_path / "key"
    path.write_text("k\n")
    clock = Clock()
    check = KeyCheck(ApiKey(("k",), file=str(path)), clock=clock)
    path.write_text("")
    clock.now += 5
    assert not refused(check, "Bearer k") and refused(check, None)
    path.unlink()
    clock.now += 5
    assert not refused(check, "Bearer k") and refused(check, "Bearer x")
    warnings = [r for r in caplog.records if "unusable here" in r.getMessage()]
    assert len(warnings) == 1  # said once, not per request
    assert "keeping the keys" in warnings[0].getMessage()


def test_a_replica_on_a_node_without_the_file_uses_the_keys_read_where_built(tmp_path):
    check = KeyCheck(ApiKey(("built",), file=str(tmp_path / "absent")), clock=Clock())
    assert not refused(check, "Bearer built") and refused(check, "Bearer other")
