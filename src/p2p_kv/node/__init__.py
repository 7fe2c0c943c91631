"""The node layer, sans-IO: one engine's view of its peers and requests.

:class:`~p2p_kv.node.manager.LoadManager` is the facade vLLM's calls and the
runtime reach; its parts keep the requests and jobs, the sessions by peer,
the parked stores, the fleet's membership and the directory of what each
member holds. Nothing here reads a clock, owns a thread or touches a socket:
time and bytes are passed in by the runtime (:mod:`p2p_kv.runtime`).
"""
