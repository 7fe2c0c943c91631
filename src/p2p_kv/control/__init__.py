"""The control plane's transport: TCP connections carrying the sessions'
frames, bounded against whatever a party sends below the protocol.

It moves bytes and knows nothing of sessions: the runtime
(:mod:`p2p_kv.runtime`) hands its frames to the node and back.
"""
