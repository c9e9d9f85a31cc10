"""Atomic writes (`phase1a/core/atomic.py`): the target is the old content or the new, never a part, and no scratch
is left behind."""
from __future__ import annotations

import pytest

from phase1a.core.atomic import atomic_path, write_atomically


def leftovers(directory) -> list[str]:
    return sorted(p.name for p in directory.iterdir() if ".partial-" in p.name)


def test_a_file_is_replaced_whole(tmp_path):
    target = tmp_path / "sub" / "report.json"
    write_atomically(target, "old")
    write_atomically(target, b"new")
    assert target.read_text() == "new" and leftovers(target.parent) == []


def test_a_failing_writer_leaves_the_old_content_and_no_scratch(tmp_path):
    target = tmp_path / "plan.json"
    target.write_text("old")
    with pytest.raises(RuntimeError, match="disk full"), atomic_path(target) as scratch:
        scratch.write_text("half")
        raise RuntimeError("disk full")
    assert target.read_text() == "old" and leftovers(tmp_path) == []


def test_a_directory_replaces_one_that_exists(tmp_path):
    target = tmp_path / "final"
    (target / "stale").mkdir(parents=True)
    with atomic_path(target) as scratch:
        scratch.mkdir()
        (scratch / "COMPLETE").write_text("ok\n")
    assert sorted(p.name for p in target.iterdir()) == ["COMPLETE"] and leftovers(tmp_path) == []


def test_keep_drops_ours_when_another_writer_finished_first(tmp_path):
    target = tmp_path / "converted"
    with atomic_path(target, existing="keep") as scratch:
        scratch.mkdir()
        (scratch / "mine").write_text("")
        target.mkdir()  # the other process's identical copy lands meanwhile
        (target / "theirs").write_text("")
    assert [p.name for p in target.iterdir()] == ["theirs"] and leftovers(tmp_path) == []


def test_fail_never_overwrites(tmp_path):
    target = tmp_path / "versions" / "v1"
    target.mkdir(parents=True)
    with pytest.raises(FileExistsError, match="v1 already exists"), atomic_path(target, existing="fail") as scratch:
        scratch.mkdir()
    assert list(target.iterdir()) == [] and leftovers(target.parent) == []


def test_a_link_takes_its_name_in_one_rename(tmp_path):
    (tmp_path / "snapshot").mkdir()
    target = tmp_path / "staged"
    for _ in range(2):  # the second replaces the first
        with atomic_path(target) as link:
            link.symlink_to(tmp_path / "snapshot", target_is_directory=True)
    assert target.is_symlink() and target.resolve() == (tmp_path / "snapshot").resolve()
