"""lookupdec._fs.atomic_write: the one way lookupdec writes a file."""

import os
import stat

import pytest

from lookupdec import _fs


def _mode(path) -> int:
    return stat.S_IMODE(os.stat(path).st_mode)


def test_writes_text_and_bytes(tmp_path):
    with _fs.atomic_write(tmp_path / "a.txt") as f:
        f.write("héllo\r\nworld\n")
    assert (tmp_path / "a.txt").read_bytes() == "héllo\r\nworld\n".encode()  # UTF-8, newlines untranslated
    with _fs.atomic_write(tmp_path / "b.bin", binary=True) as f:
        f.write(b"\x00\x01")
    assert (tmp_path / "b.bin").read_bytes() == b"\x00\x01"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["a.txt", "b.bin"]  # no temporary file left


def test_keeps_the_mode_of_the_file_it_replaces_and_gives_a_new_file_the_umask_mode(tmp_path):
    old = tmp_path / "old"
    old.write_text("x")
    old.chmod(0o640)
    with _fs.atomic_write(old) as f:
        f.write("y")
    assert _mode(old) == 0o640 and old.read_text() == "y"
    mask = os.umask(0o027)
    try:
        with _fs.atomic_write(tmp_path / "new") as f:
            f.write("z")
    finally:
        os.umask(mask)
    assert _mode(tmp_path / "new") == 0o640  # 0o666 & ~0o027, not mkstemp's private 0o600


def test_a_failure_leaves_the_old_file_and_no_temporary_file(tmp_path):
    target = tmp_path / "config.yaml"
    target.write_text("old\n")
    with pytest.raises(RuntimeError):
        with _fs.atomic_write(target) as f:
            f.write("half of the new")
            raise RuntimeError("interrupted")
    assert target.read_text() == "old\n"
    assert [p.name for p in tmp_path.iterdir()] == ["config.yaml"]


def test_a_failed_rename_leaves_the_old_file(tmp_path, monkeypatch):
    target = tmp_path / "config.yaml"
    target.write_text("old\n")

    def refuse(src, dst):
        raise OSError("disk full")

    monkeypatch.setattr(_fs.os, "replace", refuse)
    with pytest.raises(OSError, match="disk full"):
        with _fs.atomic_write(target) as f:
            f.write("new\n")
    assert target.read_text() == "old\n"
    assert [p.name for p in tmp_path.iterdir()] == ["config.yaml"]


def test_backup_keeps_the_previous_version(tmp_path):
    target = tmp_path / "config.yaml"
    target.write_text("v1\n")
    with _fs.atomic_write(target, backup=True) as f:
        f.write("v2\n")
    assert target.read_text() == "v2\n" and (tmp_path / "config.yaml.bak").read_text() == "v1\n"
    with _fs.atomic_write(tmp_path / "fresh", backup=True) as f:  # nothing to back up: no .bak
        f.write("new\n")
    assert not (tmp_path / "fresh.bak").exists()
