"""``p2p-kv doctor``: check a machine (and optionally a peer) before serving.

Every check is a function returning a :class:`CheckResult` (so tests and
other tools can call them); :func:`run_checks` runs the set the command line
asks for and :func:`main` prints one line per check, OK or FAIL with what is
wrong and how to fix it, and exits 0 when every check passed, 1 otherwise.

The checks, in order:

``nixl``
    NIXL imports, which plugins it finds, and that a throwaway agent can
    create the UCX backend the way the tier does (no progress thread,
    error-handling mode ``none``).
``loopback``
    Two NIXL agents in this process register a small buffer each and one
    WRITEs into the other over UCX; the bytes and the notification are
    verified. Reports ``UCX_TLS`` (and the other ``UCX_*`` settings).
``port``
    The control socket binds ``host:port`` (the tier's ``host``/``port``
    keys, their ``P2P_KV_*`` variables, or ``--host``/``--port``).
``hash-seed``
    ``PYTHONHASHSEED`` is set (unless ``--no-require-hash-seed`` or the
    config says ``require_hash_seed: false``).
``config``
    ``--config`` (the tier's ``secondary_tiers`` entry, or the whole
    ``--kv-transfer-config``, as JSON) validates exactly as the tier
    validates its entry at engine start; a whole config first gets the
    checks of the parts vLLM needs for the tier to load
    (:mod:`p2p_kv.doctor.kv_transfer`).
``peer``
    With ``--peer HOST:PORT``: a real handshake (TCP control, NIXL
    metadata) with that peer under an identity built from ``--layout``,
    ``--block-bytes``, ``--hash-seed``, ``--hash-algo``, ``--block-tokens``
    and ``--secret``, then one lookup round trip. Reports READY, or the
    refusal's reason and detail (hash seed, layout, auth, ...). An engine's
    layout string holds its block size in tokens and, on one worker, in
    bytes: those two options default to what it says, and one that
    contradicts it is an error.

``--from-log LINE`` runs no check: it reads the ``p2p_kv identity`` line an
engine logs (address, hash algorithm, seed digest, layout, block bytes,
whether a secret is set) and prints the ``p2p-kv doctor --peer`` command
that checks that engine, every field filled.

The peer identity mirrors what the tier states at first contact
(:func:`p2p_kv.adapter.tier._identity`): vLLM's canonical block hashes of
three fixed blocks, computed here without importing vLLM (its import takes
seconds) with the same recipe: ``NONE_HASH = hash_fn(seed)``, then
``hash_fn((parent, tokens, None))`` per block.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from collections.abc import Sequence

from p2p_kv.doctor.checks import (
    HASH_ALGOS,
    MAX_BLOCK_BYTES,
    PEER_KINDS,
    VLLM_DEFAULT_SEED,
    CheckResult,
    _guard,
    check_config,
    check_loopback,
    check_nixl,
    check_port,
    check_seed,
    parse_config,
)
from p2p_kv.doctor.peer import (
    _REFUSAL_FIXES,
    LoggedIdentity,
    PeerSpec,
    _read_log_arg,
    check_peer,
    engine_canonical_hashes,
    parse_identity_line,
    peer_command,
    sizes_from_layout,
)
from p2p_kv.peer.handshake import Layout, parse_layout
from p2p_kv.runtime.config import ConfigError, TierConfig

__all__ = [
    "HASH_ALGOS",
    "MAX_BLOCK_BYTES",
    "PEER_KINDS",
    "VLLM_DEFAULT_SEED",
    "_REFUSAL_FIXES",
    "CheckResult",
    "Layout",
    "LoggedIdentity",
    "PeerSpec",
    "add_arguments",
    "check_config",
    "check_loopback",
    "check_nixl",
    "check_peer",
    "check_port",
    "check_seed",
    "engine_canonical_hashes",
    "main",
    "parse_config",
    "parse_identity_line",
    "parse_layout",
    "peer_command",
    "render",
    "run",
    "run_checks",
    "sizes_from_layout",
]


# ---------------------------------------------------------------------------
# the command
# ---------------------------------------------------------------------------

DESCRIPTION = """\
Check this machine (and optionally a peer) before serving with p2p_kv.
Prints one line per check (OK, or FAIL with the fix); exits 0 when all pass.

--peer HOST:PORT runs a real handshake with that peer under the identity
your engine would state. Pass your engine's own values: --layout must be the
engine's layout string, exactly (model name, dtype, KV groups, bytes per
block, blocks per chunk, TP, PP, joined by '|', as the tier states it in
its handshake), --hash-seed its PYTHONHASHSEED, --hash-algo its
prefix_caching_hash_algo, --secret the tier's 'secret' key. The layout
string gives the block size in tokens and, with one worker (TP and PP 1),
in bytes; --block-tokens and --block-bytes are needed only where it does
not. A refusal names the field that differs.

The engine logs a "p2p_kv identity" line (logger vllm.p2p_kv, at its first
handshake with any peer): --from-log takes that line ('-' reads it from
standard input, '@FILE' finds the last one in a log) and prints the
--peer command for it with every field filled.
"""


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """The doctor's options, on its own parser or a ``p2p-kv`` subparser."""
    parser.description = DESCRIPTION
    parser.formatter_class = argparse.RawDescriptionHelpFormatter
    parser.add_argument(
        "--config",
        metavar="JSON",
        help="the tier's secondary_tiers entry, or the whole "
        "--kv-transfer-config given to vllm serve, as JSON (or @file)",
    )
    parser.add_argument(
        "--host", help="control host to test (default: config, P2P_KV_HOST)"
    )
    parser.add_argument(
        "--port",
        type=int,
        help="control port to test (default: config, P2P_KV_PORT, 5800)",
    )
    parser.add_argument(
        "--no-require-hash-seed",
        dest="require_hash_seed",
        action="store_false",
        help="accept an unset PYTHONHASHSEED (as require_hash_seed: false)",
    )
    peer = parser.add_argument_group("peer handshake (with --peer)")
    peer.add_argument("--peer", metavar="HOST:PORT", help="a peer tier to handshake")
    peer.add_argument(
        "--layout",
        help="the engine's layout string, exactly (default: 'standalone' for "
        "--peer-kind standalone; unset otherwise, so a layout refusal shows "
        "the peer's string)",
    )
    peer.add_argument(
        "--block-bytes",
        type=int,
        help="the tier's block size in bytes (default: from --layout with "
        "one worker, else 4096)",
    )
    peer.add_argument(
        "--hash-seed",
        help="the engine's PYTHONHASHSEED (default: this shell's, else vLLM's "
        f"fixed {VLLM_DEFAULT_SEED!r})",
    )
    peer.add_argument(
        "--hash-algo",
        choices=HASH_ALGOS,
        default="sha256",
        help="the engine's prefix_caching_hash_algo (default sha256)",
    )
    peer.add_argument(
        "--block-tokens",
        type=int,
        help="tokens per KV block of the engine's first KV group (default: "
        "from --layout, else 16)",
    )
    peer.add_argument(
        "--seed-digest",
        metavar="HEX",
        help="the engine's seed digest (its identity line's): check the hash "
        "seed here against it before dialing",
    )
    peer.add_argument(
        "--secret",
        help="the tier's 'secret' (default: config, P2P_KV_SECRET); prefer the "
        "variable: an argument is visible to every user in ps",
    )
    peer.add_argument(
        "--peer-kind",
        choices=PEER_KINDS,
        default="engine",
        help="'standalone' when the peer is a p2p_kv StandalonePeer (its "
        "canonical hashes differ from vLLM's)",
    )
    peer.add_argument(
        "--timeout",
        type=float,
        default=5.0,
        help="seconds to wait for the handshake (default 5)",
    )
    parser.add_argument(
        "--from-log",
        metavar="LINE",
        help="print the --peer command for the engine whose 'p2p_kv identity' "
        "log line this is ('-': read it from stdin; '@FILE': the last one in "
        "a log), and run no check",
    )
    parser.add_argument("--json", action="store_true", help="print JSON instead")


def run_checks(args: argparse.Namespace) -> list[CheckResult]:
    """Every check the parsed options ask for, in order."""
    env = os.environ
    results = [
        _guard("nixl", check_nixl),
        _guard("loopback", check_loopback),
    ]
    try:
        raw = parse_config(args.config)
    except (OSError, ValueError) as exc:
        config_result = CheckResult(
            "config",
            False,
            f"--config is not a JSON object: {exc}",
            "pass the secondary_tiers entry as JSON, e.g. "
            '\'{"host": "10.0.0.5", "port": 5800}\'',
        )
        cfg = None
    else:
        config_result, cfg = check_config(raw, env)
    if cfg is None:  # fall back to env and defaults for the other checks
        try:
            base = TierConfig.from_dict({}, env)
        except ConfigError:
            base = TierConfig()
    else:
        base = cfg
    host = args.host if args.host is not None else base.host
    port = args.port if args.port is not None else base.port
    results.append(_guard("port", lambda: check_port(host, port)))
    require = args.require_hash_seed and base.require_hash_seed
    results.append(_guard("hash-seed", lambda: check_seed(require, env)))
    results.append(config_result)
    if args.peer:
        seed = args.hash_seed
        if seed is None:
            seed = env.get("PYTHONHASHSEED", VLLM_DEFAULT_SEED)
        layout = args.layout
        if layout is None:
            layout = "standalone" if args.peer_kind == "standalone" else "(unset)"
        try:
            block_bytes, block_tokens, derived = sizes_from_layout(
                args.layout, args.block_bytes, args.block_tokens
            )
        except ValueError as exc:
            results.append(
                CheckResult(
                    "peer",
                    False,
                    str(exc),
                    "leave the option out (the layout string says it), or "
                    "pass the engine's own layout string",
                    {"peer": args.peer, "state": "error"},
                )
            )
            return results
        spec = PeerSpec(
            layout=layout,
            block_bytes=block_bytes,
            hash_seed=seed,
            secret=args.secret if args.secret is not None else base.secret,
            hash_algo=args.hash_algo,
            block_tokens=block_tokens,
            peer_kind=args.peer_kind,
            seed_digest=args.seed_digest,
        )

        def peer_check() -> CheckResult:
            result = check_peer(args.peer, spec, args.timeout)
            if derived:
                result.details["from_layout"] = derived
            return result

        results.append(_guard("peer", peer_check))
    return results


def render(results: Sequence[CheckResult], as_json: bool = False) -> None:
    """Print the results: one line each (rich when available), or JSON."""
    ok = all(r.ok for r in results)
    if as_json:
        doc = {"ok": ok, "checks": [r.to_dict() for r in results]}
        print(json.dumps(doc, indent=2, default=str))
        return
    try:
        from rich.console import Console
        from rich.text import Text
    except ImportError:
        for r in results:
            print(f"{'OK  ' if r.ok else 'FAIL'} {r.name:<10} {r.summary}")
            if not r.ok and r.fix:
                print(f"     {'':<10} fix: {r.fix}")
        print("all checks passed" if ok else "some checks failed")
        return
    console = Console(highlight=False, soft_wrap=True)
    for r in results:
        console.print(
            Text.assemble(
                ("OK  " if r.ok else "FAIL", "bold green" if r.ok else "bold red"),
                f" {r.name:<10} ",
                r.summary,
            )
        )
        if not r.ok and r.fix:
            console.print(Text.assemble(f"     {'':<10} ", ("fix: ", "yellow"), r.fix))
    console.print(
        Text("all checks passed", "green")
        if ok
        else Text(f"{sum(not r.ok for r in results)} check(s) failed", "red")
    )


def from_log(text: str) -> int:
    """``--from-log``: print the command (stdout) and its notes (stderr)."""
    try:
        ident = parse_identity_line(_read_log_arg(text))
    except (OSError, ValueError) as exc:
        print(f"p2p-kv doctor --from-log: {exc}", file=sys.stderr)
        return 2
    line, notes = peer_command(ident)
    print(line)
    for note in notes:
        print(f"# {note}", file=sys.stderr)
    return 0


def run(args: argparse.Namespace) -> int:
    if args.from_log is not None:
        return from_log(args.from_log)
    results = run_checks(args)
    render(results, args.json)
    return 0 if all(r.ok for r in results) else 1


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="p2p-kv doctor")
    add_arguments(parser)
    return run(parser.parse_args(argv))
