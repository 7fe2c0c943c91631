"""vLLM's OffloadingConnector, answering a prefill with where its KV waits.

A disaggregated prefill runs on one engine (the prefiller) and its decode on
another. The layer above (a router or proxy) sends the prefill with
``kv_transfer_params: {"remote_decoder": {"kv_request_id": ID}}``: the
prefiller parks the request's blocks for a decoder that names ``ID``. With
this connector the prefiller's response carries the decoder's leg, ready to
pass on as the decode request's ``kv_transfer_params``::

    {"remote_prefiller": {"kv_request_id": ID,
                          "remote_host": HOST, "remote_port": PORT}}

as vLLM's NixlConnector returns its own parameters for the proxy. The
router then needs no table of prefillers' p2p_kv addresses.

Routers that speak NixlConnector's contract (vllm-router
``--vllm-pd-disaggregation``, vLLM's toy proxy) send the prefill with
``kv_transfer_params: {"do_remote_decode": true, ...}`` and copy the
response's ``kv_transfer_params``, whole, into the decode request. Such a
prefill parks under an id p2p_kv derives from the request's id
(:func:`p2p_kv.node.roles.nixl_kv_id`), and its response carries, in
NixlConnector's keys::

    {"do_remote_prefill": true, "do_remote_decode": false,
     "remote_request_id": ID, "remote_host": HOST, "remote_port": PORT}

``remote_host``/``remote_port`` being this engine's p2p_kv tier: a decoder
whose tier reads them (:meth:`p2p_kv.node.roles.Roles.parse`) pulls the blocks.
Everything else
is ``OffloadingConnector``'s; select it with ``"kv_connector":
"P2PKVConnector", "kv_connector_module_path": "p2p_kv.adapter.connector"``.
"""

from __future__ import annotations

from typing import Any

from vllm.distributed.kv_transfer.kv_connector.v1.offloading_connector import (
    OffloadingConnector,
)

from p2p_kv.adapter.tier import local_address
from p2p_kv.control.transport import parse_peer
from p2p_kv.node.roles import Roles


def decoder_leg(params: Any, req_id: str = "") -> dict[str, Any] | None:
    """The decode request's ``kv_transfer_params`` for prefill request
    ``req_id`` that carried ``params``: None unless it parks for a decoder
    (a ``remote_decoder`` leg, or NixlConnector's ``do_remote_decode``)
    and this process's tier is live. A malformed leg answers nothing here
    (the tier refuses it and logs why)."""
    address = local_address()
    if address is None or not isinstance(params, dict):
        return None
    try:
        roles = Roles.parse(params, req_id)
    except ValueError:
        return None
    if not roles.dest_kv_id:
        return None
    host, port = parse_peer(address)
    if "remote_decoder" not in params:
        return {
            "do_remote_prefill": True,
            "do_remote_decode": False,
            "remote_request_id": roles.dest_kv_id,
            "remote_host": host,
            "remote_port": port,
        }
    return {
        "remote_prefiller": {
            "kv_request_id": roles.dest_kv_id,
            "remote_host": host,
            "remote_port": port,
        }
    }


class P2PKVConnector(OffloadingConnector):
    """``OffloadingConnector`` whose finished prefills say where their KV
    waits (see the module docstring)."""

    def request_finished(
        self, request: Any, block_ids: list[int]
    ) -> tuple[bool, dict[str, Any] | None]:
        delay, params = super().request_finished(request, block_ids)
        return delay, params or decoder_leg(
            request.kv_transfer_params, request.request_id
        )

    def request_finished_all_groups(
        self, request: Any, block_ids: tuple[list[int], ...]
    ) -> tuple[bool, dict[str, Any] | None]:
        delay, params = super().request_finished_all_groups(request, block_ids)
        return delay, params or decoder_leg(
            request.kv_transfer_params, request.request_id
        )
