"""What a prune deletes and keeps (tannery.calls.retention), decided from one List and the aliases."""

from __future__ import annotations

from datetime import datetime, timedelta, timezone

from tannery.records import Alias, ArchiveInfo
from tannery.calls.retention import is_save_part, plan_prune

T0 = datetime(2026, 12, 3, tzinfo=timezone.utc)


def info(name: str, minute: int) -> ArchiveInfo:
    return ArchiveInfo(name=name, entries=1, nbytes=4, payload_bytes=40, created=T0 + timedelta(minutes=minute))


def test_the_parts_of_a_save_are_not_counted_and_go_once_older_than_every_archive_kept():
    part = "runs/7/step-3.rank-1.0123456789abcdef"
    assert is_save_part(part) and is_save_part("runs/7/step-3.metadata.0123456789abcdef")
    assert not is_save_part("runs/7/step-3") and not is_save_part("runs/7/step-3.rank-1")
    archives = [info("runs/7/step-1", 1), info("runs/7/step-2", 2), info(part, 3), info("runs/7/step-4", 4)]
    plan = plan_prune(archives, [], keep_last=2)
    assert [i.name for i in plan.keep] == ["runs/7/step-4", "runs/7/step-2"]  # the part pushed none out
    assert [i.name for i in plan.delete] == ["runs/7/step-1"]  # the part is newer than step-2: its save may run
    later = plan_prune([*archives, info("runs/7/step-5", 5)], [], keep_last=2)
    assert [i.name for i in later.keep] == ["runs/7/step-5", "runs/7/step-4"]
    assert sorted(i.name for i in later.delete) == sorted(["runs/7/step-1", "runs/7/step-2", part])


def test_an_aliased_archive_is_kept_whatever_its_age_and_holds_parts_newer_than_it():
    archives = [info("a/1", 1), info("a/2.rank-0.00000000000000ff", 2), info("a/3", 3), info("a/4", 4)]
    plan = plan_prune(archives, [Alias(alias="prod", archive="a/1", moved=T0)], keep_last=1)
    assert [i.name for i in plan.keep] == ["a/4", "a/1"] and plan.aliased == {"a/1": ("prod",)}
    assert [i.name for i in plan.delete] == ["a/3"]  # the part is newer than a/1, the oldest kept
