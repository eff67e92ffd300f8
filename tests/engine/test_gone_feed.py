"""The decode side of the prefill-gone feed (cas_engine.kvfence.gone_feed): a real file, read
the way a kubelet-projected ConfigMap changes (the whole file replaced)."""

from __future__ import annotations

import json
import os
import threading
from pathlib import Path

import pytest
from prometheus_client import CollectorRegistry

from cas_engine.kvfence.gone_feed import (
    GoneFeed,
    GoneFeedError,
    GoneFeedMetrics,
    GonePrefill,
    parse_feed,
    split_host_port,
)


def feed_text(*entries: dict[str, str]) -> str:
    return json.dumps({"version": 1, "prefills": list(entries)})


def entry(bootstrap: str, at: str = "2026-12-03T14:00:00Z", uid: str = "u1") -> dict[str, str]:
    return {"bootstrap": bootstrap, "finishedAt": at, "pod": "ns/p", "uid": uid}


def replace(path: Path, text: str) -> None:
    """Atomic swap, as the kubelet's ..data symlink flip looks to a reader."""
    tmp = path.with_suffix(".tmp")
    tmp.write_text(text)
    os.replace(tmp, path)


def test_parse_normalises_addresses_and_times() -> None:
    got = parse_feed(
        feed_text(entry("10.0.0.5:8998"), entry("[fd00::0005]:8998", "2026-12-03T14:00:00+01:00"))
    )
    assert got[0].host == "10.0.0.5" and got[0].port == 8998
    assert got[0].finished_at == 1_796_306_400.0
    assert got[1].host == "fd00::5" and got[1].finished_at == got[0].finished_at - 3600
    assert split_host_port("[fd00::5]:1") == ("fd00::5", 1)
    assert parse_feed("") == []


@pytest.mark.parametrize(
    ("text", "message"),
    [
        ("{", "not JSON"),
        ('{"version": 2}', "version 1"),
        (feed_text(entry("10.0.0.5")), "host:port"),
        (feed_text(entry("fd00::5:8998")), "brackets"),
        (feed_text(entry("10.0.0.5:1", at="yesterday")), "finishedAt"),
        (feed_text(entry("10.0.0.5:1", at="2026-12-03T14:00:00")), "time zone"),
    ],
)
def test_malformed_feeds_are_refused_naming_the_problem(text: str, message: str) -> None:
    with pytest.raises(GoneFeedError, match=message):
        parse_feed(text)


def test_feed_delivers_each_entry_once_and_keeps_going_past_a_bad_file(tmp_path: Path) -> None:
    """Regression guard: an entry is delivered once however often the file is re-read; a
    malformed write is counted and skipped (earlier entries stay delivered), and the next good
    file's new entries still arrive."""
    path = tmp_path / "prefills.json"
    reg = CollectorRegistry()
    got: list[GonePrefill] = []
    feed = GoneFeed(path, got.append, metrics=GoneFeedMetrics(reg))
    assert feed.poll_once() == 0  # no file yet (optional ConfigMap not created)
    replace(path, feed_text(entry("10.0.0.5:8998")))
    assert feed.poll_once() == 1 and feed.poll_once() == 0
    replace(path, "{broken")
    assert feed.poll_once() == 0
    assert reg.get_sample_value("cas_kv_prefill_gone_feed_errors_total") == 1
    replace(path, feed_text(entry("10.0.0.5:8998"), entry("10.0.0.6:8998", uid="u2")))
    assert feed.poll_once() == 1
    assert [g.host for g in got] == ["10.0.0.5", "10.0.0.6"]
    assert reg.get_sample_value("cas_kv_prefill_gone_entries") == 2


def test_feed_thread_reads_the_file_it_is_given(tmp_path: Path) -> None:
    path = tmp_path / "prefills.json"
    arrived = threading.Event()
    feed = GoneFeed(path, lambda g: arrived.set(), interval_s=0.05)
    feed.start()
    try:
        replace(path, feed_text(entry("10.0.0.5:8998")))
        assert arrived.wait(5.0)
    finally:
        feed.stop()
