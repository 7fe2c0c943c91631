"""The layer rules docs/architecture.md draws, held by reading the source.

Each folder under ``src/p2p_kv/`` is a layer; a module may import its own
layer and the layers below it, never one above. Every ``import`` statement
counts, wherever it stands: inside a function, under ``TYPE_CHECKING`` or at
the top, because a type-only import still ties one file's meaning to
another's and a function-level one still runs.
"""

from __future__ import annotations

import ast
from collections.abc import Iterator
from functools import cache
from pathlib import Path

import pytest

SRC = Path(__file__).resolve().parents[2] / "src"
PACKAGE = SRC / "p2p_kv"

#: Each layer and what it may import besides itself, top to bottom.
#: ``tools`` are the commands (``p2p-kv``, the demo, the doctor, the model
#: builder); ``ratelog`` bounds the lines peers cause, shared by the
#: runtime and the data plane; ``ground`` is the wire protocol and the
#: lifecycle table, which import nothing of ours.
ALLOWED: dict[str, frozenset[str]] = {
    "tools": frozenset(
        {"adapter", "runtime", "node", "peer", "control", "data", "ratelog", "ground"}
    ),
    "adapter": frozenset(
        {"runtime", "node", "peer", "control", "data", "ratelog", "ground"}
    ),
    "runtime": frozenset({"node", "peer", "control", "data", "ratelog", "ground"}),
    "node": frozenset({"peer", "ground"}),
    "peer": frozenset({"ground"}),
    "control": frozenset({"ground"}),
    "data": frozenset({"ratelog"}),
    "ratelog": frozenset(),
    "ground": frozenset(),
}
#: Modules at the package's root, by layer.
ROOT_LAYERS = {
    "protocol": "ground",
    "lifecycle": "ground",
    "ratelog": "ratelog",
    "cli": "tools",
    "demo": "tools",
    "tiny_model": "tools",
}
#: The sans-IO layers: nothing here keeps time, owns a thread or touches a
#: socket; the runtime passes the clock and the bytes in.
SANS_IO = frozenset({"node", "peer", "ground"})
IO_MODULES = frozenset(
    {"time", "socket", "threading", "select", "selectors", "asyncio"}
)


def module_name(path: Path) -> str:
    parts = list(path.relative_to(SRC).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


@cache
def modules() -> dict[str, Path]:
    return {module_name(p): p for p in sorted(PACKAGE.rglob("*.py"))}


def layer_of(module: str) -> str:
    parts = module.split(".")
    if len(parts) == 1:
        return "tools"  # the package's own __init__
    if len(parts) == 2 and parts[1] in ROOT_LAYERS:
        return ROOT_LAYERS[parts[1]]
    if parts[1] == "doctor":
        return "tools"
    if parts[1] in ALLOWED and len(parts) >= 2 and (PACKAGE / parts[1]).is_dir():
        return parts[1]
    raise AssertionError(
        f"{module} is in no layer: put it in a layer's folder, or name its "
        "layer in ROOT_LAYERS with why"
    )


def imported(path: Path) -> Iterator[tuple[int, str]]:
    """Every module an import statement in ``path`` names, with its line."""
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            for alias in node.names:
                yield node.lineno, alias.name
        elif isinstance(node, ast.ImportFrom) and node.module:
            yield node.lineno, node.module
            for alias in node.names:  # ``from p2p_kv.data import plan``
                yield node.lineno, f"{node.module}.{alias.name}"


@cache
def graph() -> dict[str, frozenset[str]]:
    """Our modules and the modules of ours each one imports."""
    mods = modules()
    return {
        m: frozenset(i for _, i in imported(p) if i in mods and i != m)
        for m, p in mods.items()
    }


def test_every_module_is_in_a_layer() -> None:
    for m in modules():
        layer_of(m)


def test_a_module_imports_only_its_layer_and_those_below() -> None:
    wrong = []
    for m, p in modules().items():
        mine = layer_of(m)
        for line, name in imported(p):
            if name not in modules() or name == "p2p_kv":
                continue
            theirs = layer_of(name)
            if theirs != mine and theirs not in ALLOWED[mine]:
                wrong.append(
                    f"{p.relative_to(SRC)}:{line}: {mine} imports {theirs} ({name})"
                )
    assert not wrong, "\n".join(wrong)


def test_only_the_adapter_imports_vllm() -> None:
    wrong = [
        f"{p.relative_to(SRC)}:{line}: imports {name}"
        for m, p in modules().items()
        if not m.startswith("p2p_kv.adapter")
        for line, name in imported(p)
        if name == "vllm" or name.startswith("vllm.")
    ]
    assert not wrong, "\n".join(wrong)


def test_nothing_at_or_below_the_node_keeps_time_threads_or_sockets() -> None:
    wrong = [
        f"{p.relative_to(SRC)}:{line}: imports {name}"
        for m, p in modules().items()
        if layer_of(m) in SANS_IO
        for line, name in imported(p)
        if name.split(".")[0] in IO_MODULES
    ]
    assert not wrong, "\n".join(wrong)


@pytest.mark.parametrize("side", ["consumer", "producer", "lookups"])
def test_a_peer_side_imports_neither_another_side_nor_the_session(side: str) -> None:
    """The sides share exactly the link's interface; what they do together
    is the session's to route."""
    others = {"consumer", "producer", "lookups", "session"} - {side}
    if side == "consumer":
        others.discard("lookups")  # the consumer's lookups are its own part
    names = graph()[f"p2p_kv.peer.{side}"]
    assert not {f"p2p_kv.peer.{o}" for o in others} & names


def test_the_node_never_imports_the_runtime() -> None:
    for m, deps in graph().items():
        if layer_of(m) in SANS_IO:
            assert not [d for d in deps if layer_of(d) == "runtime"], m


def cycles(nodes: set[str]) -> list[list[str]]:
    """Strongly connected components of more than one module (Tarjan)."""
    g = graph()
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    out: list[list[str]] = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        for w in g[v] & nodes:
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            comp = []
            while True:
                w = stack.pop()
                comp.append(w)
                if w == v:
                    break
            if len(comp) > 1:
                out.append(sorted(comp))

    for v in sorted(nodes):
        if v not in index:
            visit(v)
    return out


def test_no_import_cycle_type_only_ones_included() -> None:
    assert cycles(set(modules())) == []


def test_the_cycle_finder_finds_a_planted_cycle(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """So the test above can fail: a planted edge back from the peer's
    records to the session makes a cycle it reports."""
    g = dict(graph())
    g["p2p_kv.peer.records"] = g["p2p_kv.peer.records"] | {"p2p_kv.peer.session"}
    monkeypatch.setitem(globals(), "graph", lambda: g)
    found = cycles(set(modules()))
    assert any({"p2p_kv.peer.records", "p2p_kv.peer.session"} <= set(c) for c in found)


def forwarders(source: str, filename: str = "<src>") -> Iterator[str]:
    """Methods whose body (past a docstring) only passes their own
    arguments on, unchanged and in order, to a callee of the same name
    (``def f(self, a): return self.x.f(a)``), and properties that only
    read an attribute of the same name below them
    (``@property def f(self): return self.x.f``): a layer that adds
    nothing a reader must still walk through. A decorated method adds what
    its decorator does (the tier's lock) and is not one."""
    tree = ast.parse(source, filename)
    for cls in (n for n in ast.walk(tree) if isinstance(n, ast.ClassDef)):
        for fn in cls.body:
            if not isinstance(fn, ast.FunctionDef | ast.AsyncFunctionDef):
                continue
            wraps = [
                d for d in fn.decorator_list if getattr(d, "id", None) != "property"
            ]
            if wraps:
                continue  # a decorator adds something: a lock, a cache
            body = fn.body
            first = body[0] if body else None
            if isinstance(first, ast.Expr) and isinstance(first.value, ast.Constant):
                body = body[1:]  # the docstring
            if len(body) != 1 or not isinstance(body[0], ast.Return | ast.Expr):
                continue
            value = body[0].value
            params = [a.arg for a in fn.args.args[1:]]
            if isinstance(value, ast.Call):
                callee = value.func
                name = getattr(callee, "attr", getattr(callee, "id", None))
                passed = [a.id if isinstance(a, ast.Name) else None for a in value.args]
                passed += [
                    k.arg
                    if isinstance(k.value, ast.Name) and k.value.id == k.arg
                    else None
                    for k in value.keywords
                ]
                if name == fn.name and passed == params:
                    yield f"{cls.name}.{fn.name}"
            elif (
                isinstance(value, ast.Attribute)
                and value.attr == fn.name
                and not params
                and any(getattr(d, "id", None) == "property" for d in fn.decorator_list)
            ):
                yield f"{cls.name}.{fn.name}"


def test_no_method_only_passes_its_arguments_on_under_the_same_name() -> None:
    found = [
        f"{path.relative_to(PACKAGE)}: {name}"
        for path in modules().values()
        for name in forwarders(path.read_text(), str(path))
    ]
    assert found == [], (
        "these add a layer that does nothing: call the callee where it "
        f"lives, or bind it as an attribute: {found}"
    )


def test_the_forwarder_finder_finds_planted_forwarders() -> None:
    """So the test above can fail: each planted shape is reported, and a
    method that adds an argument, a lock or a name of its own is not."""
    planted = '''
class A:
    def load(self, job, keys):
        """Docs."""
        return self.manager.load(job, keys)

    def close(self):
        self.runtime.close()

    @property
    def peer(self):
        return self.link.peer

    def serve(self, pinner):
        self.manager.serve(pinner, self.clock())

    def report(self):
        with self.lock:
            return self.inner.report()

    def send(self, msg):
        return self.link.queue(msg)

    @locked
    def state(self):
        return self.runtime.state()
'''
    assert list(forwarders(planted)) == ["A.load", "A.close", "A.peer"]
