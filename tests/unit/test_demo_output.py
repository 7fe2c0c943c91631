"""The demo's report, from made-up measurements: the spread of each row's
repeats, the flag on rows whose repeats disagree, the speedup bars, and
leftover state printed as ``none`` when there is none."""

from __future__ import annotations

from typing import Any

import pytest

from p2p_kv.demo import (
    BAR_WIDTH,
    Row,
    bar,
    disagreement,
    print_table,
    residue_text,
    speedup_lines,
    speedups,
    spread,
    summary_line,
    table_rows,
)


def _row(tokens: int, remote: list[float], recompute: list[float]) -> Row:
    return Row(
        tokens=tokens,
        remote_blocks=tokens // 32,
        bytes_fetched=tokens * 1024,
        ttft_remote_ms=sorted(remote)[len(remote) // 2],
        ttft_recompute_ms=sorted(recompute)[len(recompute) // 2],
        identical=True,
        ttft_remote_samples_ms=remote,
        ttft_recompute_samples_ms=recompute,
    )


def _result(rows: list[Row], repeats: int, **residue: dict[str, Any]) -> dict[str, Any]:
    return {
        "requests": 5 * repeats * len(rows),
        "repeats": repeats,
        "rows": [r.to_dict() for r in rows],
        "remote_hit_blocks": sum(r.remote_blocks for r in rows),
        "bytes_fetched": sum(r.bytes_fetched for r in rows),
        "outputs_identical": True,
        "residue": {"A": {}, "B": {}, **residue},
    }


def test_spread_is_min_max_then_p10_p90() -> None:
    assert spread([]) == (0.0, 0.0)
    assert spread([5.0]) == (5.0, 5.0)
    assert spread([3.0, 1.0, 2.0]) == (1.0, 3.0)
    # From ten repeats on, one outlier at either end does not set the range.
    values = [100.0] + [float(x) for x in range(10, 20)] + [-50.0]
    assert spread(values) == (10.0, 19.0)


def test_each_repeat_has_its_own_speedup() -> None:
    assert speedups([10.0, 20.0], [30.0, 20.0]) == [3.0, 1.0]


@pytest.mark.parametrize(
    ("remote", "recompute", "says"),
    [
        ([20.0, 21.0, 22.0], [40.0, 42.0, 44.0], ""),  # steady
        ([20.0], [10.0], ""),  # one repeat: nothing to disagree
        # The busy-machine case: 0.9x one run, 1.9x the next.
        ([40.0, 30.0, 21.0], [36.0, 40.0, 40.0], "both sides of 1.0x"),
        # Steady speedups, but the remote hit ranged 20-30 ms around 22.
        ([20.0, 22.0, 30.0], [40.0, 44.0, 60.0], "remote hit TTFT 20-30 ms"),
        ([20.0, 21.0, 22.0], [40.0, 44.0, 56.0], "recompute TTFT 40-56 ms"),
    ],
)
def test_rows_whose_repeats_disagree_are_flagged(
    remote: list[float], recompute: list[float], says: str
) -> None:
    why = disagreement(remote, recompute)
    assert (why == "") if not says else (says in why), why


def test_bar_scales_to_the_top_value_in_eighths() -> None:
    assert bar(4.0, 4.0) == "\u2588" * BAR_WIDTH
    assert bar(2.0, 4.0) == "\u2588" * (BAR_WIDTH // 2)
    assert bar(1.0, 64.0, width=8) == "\u258f"  # one eighth of a character
    assert bar(0.0, 4.0) == bar(1.0, 0.0) == ""
    assert bar(9.0, 4.0) == bar(4.0, 4.0)  # never past its width


def test_leftover_state_is_none_when_every_engine_is_empty() -> None:
    assert residue_text({"A": {}, "B": {}}) == "none"
    assert residue_text({}) == "none"
    assert residue_text({"A": {}, "B": {"loads": 2, "pins": 1}}) == (
        "B: loads=2, pins=1"
    )
    line = summary_line(_result([_row(64, [10.0], [12.0])], 1))
    assert line.endswith("leftover state: none")
    assert "{" not in line


def test_report_shows_spread_flag_and_a_bar_per_length(
    capsys: pytest.CaptureFixture[str],
) -> None:
    rows = [
        _row(256, [22.0, 23.0, 25.0], [40.0, 44.0, 47.0]),
        _row(1024, [40.0, 30.0, 21.0], [36.0, 40.0, 40.0]),  # disagrees
        _row(2048, [44.0, 45.0, 47.0], [420.0, 437.0, 440.0]),
    ]
    result = _result(rows, 3)
    assert result["rows"][1]["speedup_range"] == [0.9, 1.9]
    assert result["rows"][0]["ttft_remote_ms_range"] == [22.0, 25.0]
    assert [r["disagree"] != "" for r in result["rows"]] == [False, True, False]

    cells = table_rows(result)
    assert [c[5] for c in cells] == ["1.9x", "1.3x !", "9.7x"]

    lines = speedup_lines(result["rows"], 3)
    assert lines[0].endswith("median of 3 repeats (min-max in brackets)")
    per_length = lines[1:4]
    assert [line.split()[0] for line in per_length] == ["256", "1,024", "2,048"]
    assert "\u2588" * BAR_WIDTH in per_length[2]  # the largest fills the bar
    assert "1.9x (1.82-1.91)  hit 22-25 ms, recompute 40-47 ms" in per_length[0]
    assert per_length[1].endswith(" !") and not per_length[0].endswith("!")
    assert lines[4] == (
        "! 1,024 tokens: repeats disagree: speedup 0.90x-1.90x, both sides of 1.0x"
    )
    assert "--repeats" in lines[5]

    print_table(result)
    out = capsys.readouterr().out
    assert "leftover state: none" in out and "'A'" not in out
    for line in lines:
        assert line in out


def test_one_repeat_shows_no_spread() -> None:
    result = _result([_row(64, [10.0], [12.0])], 1)
    lines = speedup_lines(result["rows"], 1)
    assert lines[0] == "speedup = recompute TTFT / remote-hit TTFT"
    assert lines[1].rstrip().endswith("1.2x") and "(" not in lines[1]
    assert len(lines) == 2
