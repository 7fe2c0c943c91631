"""A p2p_kv peer without vLLM: a memory region, a key->slot table and the
real runtime (TCP control plane + NIXL).

It plays the part of an engine for the transport tests, the transfer
benchmark and ``p2p-kv doctor``: everything below the adapter is the code
that runs inside vLLM, driven the way vLLM's scheduler drives it (lookup,
flush, poll, submit, poll).
"""

from __future__ import annotations

import hashlib
import itertools
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

import numpy as np

from p2p_kv.data.shm_copy import shared_region
from p2p_kv.data.staged import DEFAULT_READ_STAGING_BYTES
from p2p_kv.node.manager import Answer, JobResult, LoadManager
from p2p_kv.node.membership import parse_peers
from p2p_kv.node.roles import Roles
from p2p_kv.peer import PinResult, Timeouts
from p2p_kv.runtime.resolver import Resolve, resolve_host
from p2p_kv.runtime.stack import build_runtime, stated_identity


def canonical_hashes(seed: str, block_tokens: int = 16) -> tuple[bytes, ...]:
    """Stand-in for the engine's hashes of a canonical token sequence."""
    prev = hashlib.sha256(seed.encode()).digest()
    out = []
    for i in range(3):
        tokens = bytes(range(i * block_tokens, (i + 1) * block_tokens))
        prev = hashlib.sha256(prev + tokens).digest()
        out.append(prev[:16])
    return tuple(out)


@dataclass
class TablePinner:
    """The engine's primary tier as a dict: key -> slot, pins counted."""

    table: dict[bytes, int] = field(default_factory=dict)
    pinned: dict[int, list[int]] = field(default_factory=dict)
    _jobs: itertools.count[int] = field(
        default_factory=lambda: itertools.count(1 << 40)
    )

    def pin(self, label: str, keys: Sequence[bytes]) -> PinResult:
        hits = [k in self.table for k in keys]
        hit_keys = [k for k in keys if k in self.table]
        if not hit_keys:
            return PinResult(hits, [])
        job = next(self._jobs)
        slots = [self.table[k] for k in hit_keys]
        self.pinned[job] = slots
        return PinResult(hits, [(job, hit_keys, slots)])

    def release(self, results: Sequence[JobResult]) -> None:
        for r in results:
            self.pinned.pop(r.job_id, None)


class StandalonePeer:
    """One engine's worth of p2p_kv around a numpy region."""

    def __init__(
        self,
        num_blocks: int,
        block_bytes: int,
        *,
        engine_id: str,
        host: str = "127.0.0.1",
        port: int = 0,
        hash_seed: str = "0",
        secret: bytes | None = None,
        layout: str = "standalone",
        timeouts: Timeouts | None = None,
        idle_wait_s: float = 0.01,
        region: object | None = None,
        reads: bool = True,
        same_host: bool = True,
        read_staging_bytes: int = DEFAULT_READ_STAGING_BYTES,
        peers: Sequence[str] | None = None,
        peers_refresh_s: float = 10.0,
        resolve: Resolve = resolve_host,
    ) -> None:
        self.region = (
            shared_region(num_blocks * block_bytes) if region is None else region
        )
        self.block_bytes = block_bytes
        self.runtime = build_runtime(
            self.region,  # type: ignore[arg-type]
            block_bytes,
            lambda data, _address: stated_identity(
                data,
                engine_id=engine_id,
                hash_algo="sha256",
                hash_seed=hash_seed,
                canonical_hashes=canonical_hashes(hash_seed),
                layout=layout,
                secret=secret,
            ),
            name=engine_id,
            host=host,
            port=port,
            timeouts=timeouts,
            same_host=same_host,
            read_staging_bytes=read_staging_bytes,
            reads=reads,
            idle_wait_s=idle_wait_s,
            peers=None if peers is None else parse_peers(peers),
            peers_refresh_s=peers_refresh_s,
            resolve=resolve,
        )
        #: closing the peer is closing its runtime: sockets, agent, region
        self.close: Callable[[], None] = self.runtime.close
        self.pinner = TablePinner()
        self.results: dict[int, JobResult] = {}
        #: when the last step's finished_jobs returned (perf_counter)
        self.results_at = 0.0
        self._jobs = itertools.count(1)
        #: where peers dial it (the control socket is bound by now)
        self.address: str = self.runtime.control.address
        #: the runtime's manager, which tests and benchmarks drive as the
        #: engine's scheduler would
        self.manager: LoadManager = self.runtime.manager

    def fill(self, keys: Sequence[bytes], slots: Sequence[int]) -> None:
        """Make blocks ``slots`` hold data derived from ``keys``."""
        for k, s in zip(keys, slots, strict=True):
            self.pinner.table[k] = s
            self.block(s)[:] = block_pattern(k, self.block_bytes)

    def block(self, slot: int) -> np.ndarray:
        return self.region[slot * self.block_bytes : (slot + 1) * self.block_bytes]  # type: ignore[index,no-any-return]

    def step(self, wait: bool | None = None) -> list[JobResult]:
        """What one engine step does to the tier."""
        rt = self.runtime
        results = rt.finished_jobs() if wait is None else self._poll(wait)
        self.results_at = time.perf_counter()
        rt.serve(self.pinner)
        rt.flush()
        for r in results:
            # Loads only (the caller pops them): results of our pin jobs
            # would pile up for the life of a producer.
            if r.job_id not in self.pinner.pinned:
                self.results[r.job_id] = r
        self.pinner.release(results)
        return results

    def _poll(self, wait: bool) -> list[JobResult]:
        self.runtime.poll(wait)
        return self.runtime.manager.get_finished_jobs(self.runtime.clock())

    def serve_until(self, stop: object, max_s: float = 600.0) -> None:
        """Producer loop: step (waiting idle) until ``stop.is_set()``."""
        end = time.monotonic() + max_s
        while not stop.is_set() and time.monotonic() < end:  # type: ignore[attr-defined]
            self.step()

    # -- consumer side, driven like vLLM's scheduler drives a request --------

    def open(self, req_id: str, peer: str, kv_id: str, *, probe: bool = True) -> None:
        """Start consumer request ``req_id`` whose KV lives at ``peer``
        (``host:port``) as ``kv_id``: what vLLM does for a request with
        ``remote_kv_source`` (``probe``) or ``remote_prefiller``."""
        host, _, port = peer.rpartition(":")
        leg = "remote_kv_source" if probe else "remote_prefiller"
        roles = Roles.parse(
            {
                leg: {
                    "kv_request_id": kv_id,
                    "remote_host": host.strip("[]"),
                    "remote_port": int(port),
                }
            }
        )
        self.runtime.start_request(req_id, roles)

    def ask(self, req_id: str, keys: Sequence[bytes], end: float) -> list[Answer]:
        """Look ``keys`` of open request ``req_id`` up until none is
        RETRY or ``end`` (``time.monotonic()``) passes, as vLLM's
        scheduler asks each step and sends the lookups at the step's end."""
        while True:
            answers = [self.manager.lookup(req_id, k) for k in keys]
            if Answer.RETRY not in answers or time.monotonic() > end:
                return answers
            self.runtime.flush()
            self.step()

    def fetch(
        self,
        peer: str,
        kv_id: str,
        keys: Sequence[bytes],
        slots: Sequence[int],
        *,
        req_id: str | None = None,
        probe: bool = True,
        timeout_s: float = 10.0,
        finish: bool = True,
    ) -> FetchOutcome:
        """Look ``keys`` up at ``peer`` and load the hits into ``slots``."""
        rt = self.runtime
        req_id = req_id or f"req-{next(self._jobs)}"
        t0 = time.perf_counter()
        self.open(req_id, peer, kv_id, probe=probe)
        end = time.monotonic() + timeout_s
        try:
            answers = self.ask(req_id, keys, end)
            t_lookup = time.perf_counter()
            hit_idx = [i for i, a in enumerate(answers) if a is Answer.HIT]
            outcome = FetchOutcome(hits=len(hit_idx), lookup_s=t_lookup - t0)
            if not hit_idx:
                return outcome
            job = next(self._jobs)
            rt.submit_load(
                job, req_id, [keys[i] for i in hit_idx], [slots[i] for i in hit_idx]
            )
            while job not in self.results and time.monotonic() < end:
                self.step()
            result = self.results.pop(job, None)
            outcome.job_done = result is not None
            outcome.ok = bool(result and result.success)
            if outcome.job_done:
                # The engine has the result when finished_jobs returns it;
                # the rest of that step (serving, the Release) is not the
                # load's.
                outcome.total_s = self.results_at - t0
            return outcome
        finally:
            if finish:
                rt.end_request(req_id)
                rt.pump()


@dataclass
class FetchOutcome:
    hits: int
    lookup_s: float
    ok: bool = False
    job_done: bool = False
    total_s: float = 0.0


def block_pattern(key: bytes, nbytes: int) -> np.ndarray:
    """Deterministic bytes for a key, cheap for any block size."""
    seed = int.from_bytes(hashlib.sha256(key).digest()[:8], "little")
    rng = np.random.default_rng(seed)
    return rng.integers(0, 256, nbytes, dtype=np.uint8)


def make_key(n: int) -> bytes:
    return hashlib.sha256(f"block-{n}".encode()).digest()[:16] + b"\0\0\0\0"
