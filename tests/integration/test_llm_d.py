"""What llm-d's deployment assumes of the tier, and the recipe that says so.

llm-d's routing sidecar (llm-d/llm-d-router,
``pkg/sidecar/proxy/connector_p2p.go``, ``p2pPortFor``) addresses
data-parallel rank *r* of a pod at ``--p2p-connector-port`` + *r*: a tier
bound anywhere else is never reached. And ``docs/recipes.md``'s llm-d
section is checked as written: every tier entry in it validates as the
tier validates it at engine start, the swap changes only the entry's
type, and every request parameter in it parses into the legs it names.
"""

from __future__ import annotations

import json
import re
import socket
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest
import yaml

from p2p_kv.doctor import check_config
from p2p_kv.node.roles import Roles

RECIPES = Path(__file__).resolve().parents[2] / "docs" / "recipes.md"
POD_IP = "10.0.6.107"
#: what a pod of the recipe has in its environment
POD_ENV = {"P2P_KV_SECRET": "fleet secret", "PYTHONHASHSEED": "0"}


def _free_run(n: int) -> int:
    """A base port with ``n`` ports free after it (racy, as any free port)."""
    for _ in range(50):
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            base = int(s.getsockname()[1]) - n
        taken = False
        for port in range(base, base + n + 1):
            with socket.socket() as s:
                try:
                    s.bind(("127.0.0.1", port))
                except OSError:
                    taken = True
                    break
        if not taken and base > 1024:
            return base
    raise AssertionError("no run of free ports")


@pytest.mark.parametrize("rank", [0, 3])
def test_a_data_parallel_rank_listens_at_port_plus_rank(
    rank: int, monkeypatch: pytest.MonkeyPatch
) -> None:
    from p2p_kv.adapter.tier import P2PKVTier

    monkeypatch.setenv("PYTHONHASHSEED", "0")
    base = _free_run(3)
    parallel = SimpleNamespace(data_parallel_index=rank)
    spec: Any = SimpleNamespace(config=SimpleNamespace(parallel=parallel))
    view = memoryview(bytearray(4 * 4096)).cast("B", (4, 4096))
    tier = P2PKVTier(spec, view, host="127.0.0.1", port=base)
    try:
        assert tier.address == f"127.0.0.1:{base + rank}"
        # Where the sidecar dials rank r: something listens there.
        with socket.create_connection(("127.0.0.1", base + rank), timeout=5):
            pass
    finally:
        tier.shutdown()


def _section() -> str:
    text = RECIPES.read_text()
    start = text.index("## llm-d")
    end = text.find("\n## ", start + 1)
    return text[start : end if end >= 0 else len(text)]


def _blocks(kind: str) -> list[str]:
    return re.findall(rf"```{kind}\n(.*?)```", _section(), re.DOTALL)


def _json_blocks() -> list[Any]:
    # Kubernetes fills $(POD_IP) from the pod's environment.
    return [json.loads(b.replace("$(POD_IP)", POD_IP)) for b in _blocks("json")]


def _tier_entries(obj: Any) -> list[dict[str, Any]]:
    """Every secondary_tiers entry in ``obj``, at any depth."""
    if isinstance(obj, dict):
        if "type" in obj and "port" in obj:
            return [obj]
        return [e for v in obj.values() for e in _tier_entries(v)]
    if isinstance(obj, list):
        return [e for v in obj for e in _tier_entries(v)]
    return []


def test_the_recipes_tier_entries_validate_and_swap_only_the_type() -> None:
    entries = [e for b in _json_blocks() for e in _tier_entries(b)]
    theirs = [e for e in entries if e["type"] == "p2p"]
    ours = [e for e in entries if e["type"] == "P2PKVTier"]
    assert len(theirs) == 1 and len(ours) == 3, entries
    for entry in ours:
        assert entry["module_path"] == "p2p_kv.adapter.tier"
        result, cfg = check_config(entry, env=POD_ENV)
        assert result.ok, result.summary
        assert cfg is not None and (cfg.host, cfg.port) == (POD_IP, 7777)
    swapped = {**theirs[0], "type": "P2PKVTier", "module_path": "p2p_kv.adapter.tier"}
    assert ours[0] == swapped
    # The full --kv-transfer-config is the guide's with the entry swapped.
    (config,) = [b for b in _json_blocks() if "kv_connector" in b]
    assert config["kv_connector"] == "OffloadingConnector"
    assert config["kv_connector_extra_config"]["secondary_tiers"] == [swapped]
    # The fleet entry lists a name, resolved while the engine runs.
    (fleet,) = [e for e in ours if "peers" in e]
    _, cfg = check_config(fleet, env=POD_ENV)
    assert cfg is not None and cfg.peers is not None and cfg.peers[0].is_name


def test_without_the_secret_the_recipes_entry_is_refused() -> None:
    """The recipe says why the secret is there: off loopback, without it
    (or allow_unauthenticated), the engine does not start."""
    entry = _tier_entries(_json_blocks()[1])[0]
    result, _ = check_config(entry, env={})
    assert not result.ok and "no secret is set" in result.summary


def test_the_recipes_env_gives_the_secret_from_a_kubernetes_secret() -> None:
    (block,) = _blocks("yaml")
    (var,) = yaml.safe_load(block)["env"]
    assert var["name"] == "P2P_KV_SECRET"
    assert set(var["valueFrom"]["secretKeyRef"]) == {"name", "key"}


def test_the_recipes_request_parameters_name_the_legs_they_say() -> None:
    params = [b for b in _json_blocks() if "type" not in json.dumps(b)]
    assert len(params) == 3, params
    pull, prefill, decode = (Roles.parse(p) for p in params)
    assert pull.source is not None and pull.source.probe
    assert pull.source.peer == f"{POD_IP}:7777" and pull.dest_kv_id is None
    assert prefill.source is not None and prefill.source.probe
    assert prefill.dest_kv_id == params[1]["remote_decoder"]["kv_request_id"]
    assert decode.source is not None and not decode.source.probe
    assert decode.source.kv_id == prefill.dest_kv_id
    for p in params:  # the sidecar's port is a JSON number
        for leg in p.values():
            assert "remote_port" not in leg or type(leg["remote_port"]) is int
