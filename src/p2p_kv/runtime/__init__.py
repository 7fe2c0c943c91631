"""The runtime layer: everything that keeps time, owns a thread or touches a
socket on the tier's behalf.

:class:`~p2p_kv.runtime.tier_runtime.TierRuntime` drives the sans-IO node
(:mod:`p2p_kv.node`) with the clock and carries its events to the two
transports (:mod:`p2p_kv.control`, :mod:`p2p_kv.data`);
:mod:`~p2p_kv.runtime.stack` builds that stack once for the vLLM tier, the
standalone peer and the doctor.
"""
