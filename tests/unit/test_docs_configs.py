"""docs/configuration.md's whole ``--kv-transfer-config`` examples are the
ones the run pages use: the CPU one is the quickstart's engine A (run by
tests/e2e/test_quickstart.py), the GPU one the two-host page's GPU variant
(not run: no GPU here). Each tier entry in them validates as the tier
validates it at start, and none puts ``block_size`` in the tier's entry
(the tier refuses it there; it belongs beside ``cpu_bytes_to_use``)."""

from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Any

from p2p_kv.doctor import check_config
from tests.support.docs import marked_blocks

DOCS = Path(__file__).resolve().parents[2] / "docs"
ENV = {"P2P_KV_SECRET": "fleet secret", "PYTHONHASHSEED": "0"}


def served_configs(page: str, mark: str) -> list[dict[str, Any]]:
    """Every ``--kv-transfer-config '...'`` of the page's blocks so marked."""
    found = []
    for got, body in marked_blocks(page):
        if got == mark:
            for raw in re.findall(r"--kv-transfer-config '([^']*)'", body):
                found.append(json.loads(raw))
    return found


def configuration_examples() -> list[dict[str, Any]]:
    text = (DOCS / "configuration.md").read_text()
    section = text[text.index("## The whole") : text.index("## The tier's entry")]
    return [json.loads(b) for b in re.findall(r"```json\n(.*?)```", section, re.S)]


def test_the_whole_configs_are_those_the_pages_run() -> None:
    cpu, gpu = configuration_examples()
    assert cpu == served_configs("quickstart.md", "run")[0]
    assert gpu == served_configs("two_hosts.md", "not run: GPU")[0]
    assert cpu["kv_connector_extra_config"]["spec_name"] == "HostCopyTieringSpec"
    assert gpu["kv_connector_extra_config"]["spec_name"] == "TieringOffloadingSpec"
    assert "spec_module_path" not in gpu["kv_connector_extra_config"]


def test_every_tier_entry_validates_and_block_size_is_the_specs() -> None:
    configs = [
        *configuration_examples(),
        *served_configs("quickstart.md", "run"),
        *served_configs("two_hosts.md", "run: host-a"),
        *served_configs("two_hosts.md", "run: host-b"),
        *served_configs("two_hosts.md", "not run: GPU"),
    ]
    assert len(configs) == 7
    for config in configs:
        extra = config["kv_connector_extra_config"]
        (entry,) = extra["secondary_tiers"]
        assert entry.pop("type") == "P2PKVTier"
        assert entry.pop("module_path") == "p2p_kv.adapter.tier"
        result, cfg = check_config(entry, ENV)
        assert result.ok and cfg is not None, result
        assert "block_size" not in entry
        assert extra["cpu_bytes_to_use"] > 0
