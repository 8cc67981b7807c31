"""The layout docs/design.md describes, checked against the code: which room may import
which, how large a module and a function may grow, which imports wait for their first use
(and why), who makes ttrpc errors, that the benchmarks and the harness stand apart from the
tests, and that every path the code and docs cite exists.

Read from the source with `ast`: nothing of the project is imported or run here."""
from __future__ import annotations

import ast
import builtins
import pathlib
import re

import pytest

ROOT = pathlib.Path(__file__).resolve().parent.parent

FLOORS: tuple[tuple[str, ...], ...] = (
    # top: separate processes, with dependencies of their own
    ("podvm_node",),
    ("podvmctl",),
    ("podvm_webhook",),
    # the shim, from what containerd runs down to the pure model
    ("shim.contract",),
    ("shim.api",),
    ("shim.pod",),
    ("shim.vm",),  # the machine: a pod's VM and what the host holds for it
    ("shim.vm.template",),
    ("shim.vm.vmm", "shim.vm.agent", "shim.vm.stdio"),  # a VM made, its guest spoken to
    ("shim.vm.qemu",),
    # what QEMU and the rest share; the file server is no part of QEMU's driver
    ("shim.vm.virtiofsd", "shim.vm.scratchdisk", "shim.vm.stateload", "shim.vm.vmmlog"),
    ("shim.vm.hypervisor", "shim.vm.memcopy", "shim.vm.cappedlog", "shim.vm.workdir",
     "shim.vm.guestclock"),
    ("shim.host", "shim.network", "shim.cpus"),
    ("shim.resources",),
    ("shim.config", "shim"),
    # shared with the guest (podvm_core) and the host's cgroup library
    ("cgroups",),
    ("podvm_core",),
)
"""Rooms from the top down. A room imports only rooms on its own floor or below."""

GUEST_MAY_IMPORT = ("podvm_core", "guest")
"""The guest agent and image builder: a separate machine, sharing podvm_core only."""

PRODUCTION = ("shim", "podvm_core", "cgroups", "podvmctl", "podvm_webhook", "podvm_node",
              "guest", "images")
MODULE_MAX_LINES = 400
FUNCTION_MAX_LINES = 60

LAZY_IMPORTS: dict[tuple[str, str], str] = {
    ("podvmctl/cli.py", "asyncio"):
        "templates warm only: the other commands run no VM",
    ("podvmctl/cli.py", "shim.vm.template.maker"):
        "templates warm only: the other commands load no VM code",
    ("guest/agent/__main__.py",
     "google.protobuf.internal"):
        "picks protobuf's backend before its other modules load",
    ("guest/agent/containers.py",
     "tempfile"):
        "a terminal only: the agent boots without it",
    ("guest/agent/containers.py",
     "shutil"):
        "a terminal only: the agent boots without it",
    ("guest/agent/writable.py",
     "shutil"):
        "a container's layer removed, not the guest's boot",
    ("guest/agent/kill.py",
     "shutil"):
        "only when a container goes: the agent boots without it",
    ("guest/agent/resources.py",
     "glob"):
        "hot-plug only: the agent boots without glob and fnmatch",
    ("guest/agent/resources.py",
     "podvm_core.pb.containerd.cgroups.v2.metrics_pb2"):
        "the first Stats call, not the guest's boot",
    ("guest/agent/service.py",
     "guest.agent.portforward"):
        "a pod that forwards a port only",
    ("guest/agent/service.py",
     "shutil"):
        "a container's removal, not the guest's boot",
    ("guest/agent/service.py",
     "termios"):
        "a terminal only",
    ("podvm_core/ttrpc/__init__.py",
     "podvm_core.ttrpc.client"):
        "the client's first use: the agent serves without it",
    ("podvmctl/cli.py",
     "podvm_webhook.policy"):
        "`podvmctl plan` only: config and status load no planner",
    ("podvmctl/cli.py",
     "podvmctl.plan"):
        "`podvmctl plan` only",
    ("podvmctl/plan.py",
     "yaml"):
        "a YAML manifest only",
    ("shim/api/events.py",
     "podvm_core.pb.containerd.services.events.ttrpc.v1.events_pb2"):
        "the first event, off the daemon's start",
    ("shim/api/events.py",
     "podvm_core.ttrpc.client"):
        "the first event, off the daemon's start",
    ("shim/api/task/deferred.py",
     "shim.api.task.service"):
        "the first Task call past Connect: a quarter of the daemon's start",
    ("shim/api/task/service.py",
     "shim.pod.pod"):
        "the VM machinery, with a pod's first Create",
    ("shim/api/task/service.py",
     "shim.api.task.request"):
        "with the pod, at a pod's first Create",
    ("shim/config.py",
     "tomllib"):
        "a Create, not the idle daemon",
    ("shim/contract/cli.py",
     "shim.contract.info"):
        "`-info` only",
    ("shim/contract/cli.py",
     "shim.contract.manager"):
        "`start` only, imported with the collector off (`start`'s time)",
    ("shim/contract/cli.py",
     "shim.contract.delete"):
        "`delete` only, imported with the collector off",
    ("shim/contract/cli.py",
     "shim.host.mountns"):
        "`start` only",
    ("shim/contract/cli.py",
     "shim.contract.daemon"):
        "the daemon only: `start` and `delete` need none of it",
    ("shim/contract/cli.py",
     "importlib.util"):
        "the daemon only",
    ("shim/contract/cli.py",
     "shim.api.task.request"):
        "the fork server only (load_pod): a pod's first Create loads it otherwise",
    ("shim/contract/cli.py",
     "shim.host.cleanup"):
        "the fork server only (load_pod): a pod's first Create loads it otherwise",
    ("shim/contract/cli.py",
     "shim.network.portforward"):
        "the fork server only (load_pod): a pod's first Create loads it otherwise",
    ("shim/contract/cli.py",
     "shim.pod.pod"):
        "the fork server only (load_pod): a pod's first Create loads it otherwise",
    ("shim/contract/daemon.py",
     "podvm_core.treegc"):
        "after an uninstall only: shutil and the collection, off the daemon's start",
    ("shim/contract/daemon.py",
     "shim.host.cleanup"):
        "the daemon's exit: psutil and cgroups would grow every idle daemon",
    ("shim/contract/daemon.py",
     "shim.pod.hostns"):
        "a pod with a network only",
    ("shim/contract/daemon.py",
     "podvm_core.pb.containerd.runtime.sandbox.v1.sandbox_pb2"):
        "the first Sandbox API call: containerd 2.x's shim sandboxer only",
    ("shim/contract/daemon.py",
     "shim.api.sandbox.service"):
        "the first Sandbox API call",
    ("shim/contract/info.py",
     "podvm_core.pb.containerd.types.introspection_pb2"):
        "`-info` only",
    ("podvm_core/lightjson.py", "json"):
        "a Python without the _json accelerator only",
    ("podvm_core/atomic.py", "json"):
        "json.dumps's options only: lightjson writes the default text without re and enum",
    ("shim/contract/forkserver.py", "podvm_core.treegc"):
        "after an uninstall only",
    ("shim/contract/manager.py", "socket"):
        "the daemon `start` forks itself only: `start` binds with _socket",
    ("shim/contract/forkserver.py", "shim.contract.cli"):
        "`python -m shim.contract.forkserver` only: the daemon's entry it forks into",
    ("shim/contract/manager.py",
     "shim.host.mountns"):
        "a `start` that forks a daemon only (ctypes)",
    ("shim/contract/delete.py",
     "shim.host.cleanup"):
        "a pod that left something only: psutil, cgroups, the network's client",
    ("shim/contract/delete.py",
     "podvm_core.treegc"):
        "after an uninstall only",
    ("shim/host/processes.py",
     "asyncio"):
        "the daemon's children only: `delete` kills with this module and has no loop",
    ("shim/host/cleanup.py",
     "shim.network.remote"):
        "a pod with a network only: asyncio, which `delete` has no other use for",
    ("shim/host/cgroup.py",
     "podvm_core.pb.containerd.cgroups.v2.metrics_pb2"):
        "the first metrics call on a v2 host",
    ("shim/host/cgroup.py",
     "podvm_core.pb.containerd.cgroups.v1.metrics_pb2"):
        "the first metrics call on a v1 host",
    ("shim/libc.py",
     "ctypes"):
        "the first call, not every module that names libc()",
    ("shim/host/emptydir.py",
     "shim.host.mountns"):
        "a container with an emptyDir only: the idle daemon has no use for it",
    ("shim/host/mounts.py",
     "shim.host.mountns"):
        "a bind from the pod's namespace only: the idle daemon has no use for it",
    ("shim/network/ahead.py",
     "shim.network.remote"):
        "a pod with a network only: the idle daemon holds a WorkerAhead",
    ("shim/vm/vmnetwork.py",
     "shim.network.portforward"):
        "a pod with a network only",
    ("shim/vm/memcopy.py",
     "ctypes"):
        "a template's making only: a restore's copier starts without it",
    ("shim/vm/stdio.py",
     "podvm_core.pb.agent.agent_pb2"):
        "a pod's first Create, not the idle daemon",
    ("shim/vm/stdio.py",
     "threading"):
        "stdin only: the one thread a shim starts",
    ("shim/vm/vmm.py",
     "testbed.fakevm"):
        "the tests' FakeVM, where PODVM_TEST_VMM selects it: no node has testbed/",
}
"""Every import made inside a function, (file, module) -> why it waits: each one is
start-up time or memory an idle daemon, `start` or `delete` would otherwise pay. The code
says why too, in a comment on the import or the line above it."""

APART_FROM_TESTS = ("bench", "testbed")
"""The benchmarks and the harness they share with the tests (testbed/): they import
testbed, never a module of tests/ (nor name one to run)."""

TTRPC_ERROR_MAKERS = (
    "shim/api/",  # the adapters: the only code that answers containerd
    "shim/vm/agent.py",  # a ttrpc client: the guest's answers are ttrpc errors already
    "podvm_core/",  # ttrpc itself
    "guest/",  # the agent's own ttrpc service
)
"""Where `TtrpcError(...)` may be made. Everywhere else raises a typed error, which
shim/api/errors.py turns into a code."""


def _sources(*tops: str) -> list[pathlib.Path]:
    files = []
    for top in tops:
        base = ROOT / top
        files += [p for p in base.rglob("*.py") if "pb" not in p.relative_to(ROOT).parts
                  and "__pycache__" not in p.parts]
    return sorted(files)


def _module(path: pathlib.Path) -> str:
    parts = list(path.relative_to(ROOT).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def _imports(path: pathlib.Path) -> list[tuple[int, str, bool]]:
    """(line, module imported, inside a function) for each of the file's imports,
    relative ones resolved; `from X import name` counts X.name when that is a module."""
    tree = ast.parse(path.read_text(), str(path))
    module = _module(path)
    package = module if path.name == "__init__.py" else module.rpartition(".")[0]
    found = []

    def visit(node: ast.AST, in_function: bool) -> None:
        for child in ast.iter_child_nodes(node):
            inner = in_function or isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef))
            if isinstance(child, ast.Import):
                found.extend((child.lineno, a.name, in_function) for a in child.names)
            elif isinstance(child, ast.ImportFrom):
                if child.level:
                    base = package.split(".")
                    base = base[:len(base) - child.level + 1]
                    target = ".".join(base + ([child.module] if child.module else []))
                else:
                    target = child.module or ""
                for alias in child.names:
                    sub = f"{target}.{alias.name}"
                    is_module = (ROOT / (sub.replace(".", "/") + ".py")).exists() or \
                        (ROOT / sub.replace(".", "/") / "__init__.py").exists()
                    found.append((child.lineno, sub if is_module else target, in_function))
            visit(child, inner)

    visit(tree, False)
    return found


def _floor(module: str) -> int | None:
    best, floor = "", None
    for index, rooms in enumerate(FLOORS):
        for room in rooms:
            if (module == room or module.startswith(room + ".")) and len(room) > len(best):
                best, floor = room, index
    return floor


def test_no_room_imports_one_above_it():
    wrong = []
    for path in _sources("shim", "podvm_core", "cgroups", "podvmctl", "podvm_webhook",
                         "podvm_node"):
        own = _floor(_module(path))
        assert own is not None, f"{path.relative_to(ROOT)} is in no room of FLOORS"
        for line, target, _ in _imports(path):
            floor = _floor(target)
            if floor is not None and floor < own:
                wrong.append(f"{path.relative_to(ROOT)}:{line} imports {target} "
                             f"({' '.join(FLOORS[floor])} is above {' '.join(FLOORS[own])})")
    assert not wrong, "imports against the floors:\n" + "\n".join(wrong)


def test_the_guest_shares_only_podvm_core():
    wrong = []
    for path in _sources("guest"):
        for line, target, _ in _imports(path):
            top = target.split(".")[0]
            if _floor(target) is not None and top not in GUEST_MAY_IMPORT:
                wrong.append(f"{path.relative_to(ROOT)}:{line} imports {target}")
    assert not wrong, "\n".join(wrong)


def test_the_floors_name_real_rooms():
    for rooms in FLOORS:
        for room in rooms:
            path = ROOT / room.replace(".", "/")
            assert path.is_dir() or path.with_suffix(".py").is_file(), room


def test_module_sizes():
    big = [f"{p.relative_to(ROOT)}: {n} lines" for p in _sources(*PRODUCTION)
           if (n := len(p.read_text().splitlines())) > MODULE_MAX_LINES]
    assert not big, f"modules over {MODULE_MAX_LINES} lines:\n" + "\n".join(big)


def test_function_sizes():
    long = []
    for path in _sources(*PRODUCTION):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                size = node.end_lineno - node.lineno + 1
                if size > FUNCTION_MAX_LINES:
                    long.append(f"{path.relative_to(ROOT)}:{node.lineno} {node.name}: "
                                f"{size} lines")
    assert not long, f"functions over {FUNCTION_MAX_LINES} lines:\n" + "\n".join(long)


def test_function_local_imports_are_the_listed_ones_with_their_reason():
    found = {}
    for path in _sources(*PRODUCTION):
        lines = path.read_text().splitlines()
        for line, target, in_function in _imports(path):
            if not in_function:
                continue
            key = (str(path.relative_to(ROOT)), target)
            found[key] = line
            said = lines[line - 1] + (lines[line - 2] if line > 1 else "")
            assert "#" in said, f"{key[0]}:{line}: the import of {target} says not why it " \
                                f"waits (a comment on it or the line above)"
    unlisted = sorted(set(found) - set(LAZY_IMPORTS))
    gone = sorted(set(LAZY_IMPORTS) - set(found))
    assert not unlisted, "function-local imports not in LAZY_IMPORTS:\n" + \
        "\n".join(f"{f}:{found[(f, m)]} {m}" for f, m in unlisted)
    assert not gone, f"LAZY_IMPORTS lists imports the code no longer makes: {gone}"
    assert all(reason.strip() for reason in LAZY_IMPORTS.values())


def _names_tests(target: str) -> bool:
    return target == "tests" or target.startswith("tests.")


def test_bench_and_testbed_import_nothing_from_tests():
    wrong = []
    for path in _sources(*APART_FROM_TESTS):
        rel = path.relative_to(ROOT)
        wrong += [f"{rel}:{line} imports {target}" for line, target, _ in _imports(path)
                  if _names_tests(target)]
        # a module run by name (`python -m tests.x`, importlib) is an import too
        wrong += [f"{rel}:{node.lineno} names {node.value}"
                  for node in ast.walk(ast.parse(path.read_text()))
                  if isinstance(node, ast.Constant) and isinstance(node.value, str)
                  and re.fullmatch(r"tests(\.\w+)+", node.value)]
    assert not wrong, "bench/ and testbed/ stand apart from tests/ (move what they need " \
        "into testbed/):\n" + "\n".join(wrong)


def test_only_the_api_makes_ttrpc_errors():
    wrong = []
    for path in _sources("shim", "podvmctl", "podvm_webhook"):
        rel = str(path.relative_to(ROOT))
        if rel.startswith(TTRPC_ERROR_MAKERS):
            continue
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Call) and getattr(node.func, "id", None) == "TtrpcError":
                wrong.append(f"{rel}:{node.lineno}")
    assert not wrong, "TtrpcError made outside shim/api (raise a typed error):\n" + \
        "\n".join(wrong)


SHARED_BASES: dict[tuple[str, str], str] = {
    ("shim/vm/hypervisor.py", "VM"):
        "the hypervisor interface: one implementation per VMM",
    ("podvm_core/procstate.py", "Lifecycle"):
        "the process state machine's record, which the shim's and the agent's processes are",
    ("cgroups/manager.py", "CgroupManager"):
        "the cgroup interface: one implementation per cgroup version",
    ("podvm_core/fdio.py", "FdStream"):
        "the non-blocking fd both sides copy stdio through; a FIFO is one",
}
"""The classes, besides exceptions, that classes in other files may inherit from, each
with why: real interfaces and shared building blocks. (A class's own file may build on
it freely: the process states of podvm_core/procstate.py on ProcessState.) Anything else
is a part of one object spread over files, calling the other parts through `self` where
no import shows it: that part is an object of its own, held and passed."""


def _classes_and_names() -> tuple[dict[str, tuple[str, list[ast.expr]]], dict[str, dict]]:
    """{qualified class name: (its file, its bases)} and {module: {name bound at its top
    level by an import: what it names, qualified}}."""
    classes, names = {}, {}
    for path in _sources(*PRODUCTION):
        module, rel = _module(path), str(path.relative_to(ROOT))
        package = module if path.name == "__init__.py" else module.rpartition(".")[0]
        bound = names[module] = {}
        tree = ast.parse(path.read_text(), str(path))
        for node in ast.walk(tree):
            if isinstance(node, ast.ClassDef):
                classes.setdefault(f"{module}.{node.name}", (rel, node.bases))
            elif isinstance(node, ast.Import):
                for alias in node.names:
                    bound[alias.asname or alias.name.split(".")[0]] = \
                        alias.name if alias.asname else alias.name.split(".")[0]
            elif isinstance(node, ast.ImportFrom):
                base = package.split(".")[:len(package.split(".")) - node.level + 1] \
                    if node.level else []
                target = ".".join(base + ([node.module] if node.module else []))
                for alias in node.names:
                    bound[alias.asname or alias.name] = f"{target}.{alias.name}"
    return classes, names


def _qualified(name: str, classes: dict, names: dict) -> str:
    """`name` (module.Name) where it is defined, following what modules re-export."""
    for _ in range(10):
        module, _, attr = name.rpartition(".")
        if name in classes or attr not in names.get(module, {}):
            break
        name = names[module][attr]
    return name


def _base_names(module: str, bases: list[ast.expr], classes: dict, names: dict) -> list[str]:
    """The qualified names of a class's `bases`, written in `module`: builtins.X for
    Python's own, module.Name for the project's, as written for what is neither."""
    found = []
    for base in bases:
        dotted = ast.unparse(base)
        head, _, rest = dotted.partition(".")
        if f"{module}.{head}" in classes and not rest:
            found.append(f"{module}.{head}")
        elif head in names[module]:
            found.append(_qualified(".".join(filter(None, (names[module][head], rest))),
                                    classes, names))
        else:
            found.append(f"builtins.{dotted}" if dotted in dir(builtins) else dotted)
    return found


def _is_exception(name: str, classes: dict, names: dict, seen: frozenset = frozenset()
                  ) -> bool:
    """Whether the class `name` is an exception: its bases lead to one of Python's."""
    if name.startswith("builtins."):
        found = getattr(builtins, name.partition(".")[2], None)
        return isinstance(found, type) and issubclass(found, BaseException)
    if name not in classes or name in seen:
        return False
    module = name.rpartition(".")[0]
    return any(_is_exception(base, classes, names, seen | {name})
               for base in _base_names(module, classes[name][1], classes, names))


def _inherited_across_files() -> list[tuple[str, str, str, str]]:
    """(file, class, file of its base, base) for every production class whose base is a
    production class of another file, exceptions left out."""
    classes, names = _classes_and_names()
    found = []
    for name, (rel, bases) in sorted(classes.items()):
        module, _, short = name.rpartition(".")
        for base in _base_names(module, bases, classes, names):
            if base in classes and classes[base][0] != rel and \
                    not _is_exception(base, classes, names):
                found.append((rel, short, classes[base][0], base.rpartition(".")[2]))
    return found


def test_no_class_inherits_a_part_of_another_file():
    found = _inherited_across_files()
    wrong = [f"{rel}: {cls} inherits {base} ({base_file})"
             for rel, cls, base_file, base in found if (base_file, base) not in SHARED_BASES]
    assert not wrong, "classes built from parts in other files (hold the part as an " \
        "object instead, or list a real interface in SHARED_BASES):\n" + "\n".join(wrong)
    unused = set(SHARED_BASES) - {(base_file, base) for _, _, base_file, base in found}
    assert not unused, f"SHARED_BASES lists bases nothing inherits across files: {unused}"
    assert all(reason.strip() for reason in SHARED_BASES.values())


CITED = re.compile(r"(?<![\w./~$-])((?:shim|podvm_core|cgroups|podvmctl|podvm_webhook|podvm_node|"
                   r"guest|tests|testbed|bench|docs|packaging|protos|images|\.ci)/[\w./-]*[\w/]|"
                   r"[\w-]+\.md)\b")


def _cited(text: str) -> set[str]:
    return {m.group(1).rstrip("/.") for m in CITED.finditer(text)}


def _texts() -> list[tuple[str, str]]:
    """(where, text) of every docstring and comment of the code, and of the docs."""
    out = []
    for path in _sources(*PRODUCTION, "tests", "testbed", "bench"):
        source = path.read_text()
        rel = str(path.relative_to(ROOT))
        for node in ast.walk(ast.parse(source)):
            if isinstance(node, ast.Expr) and isinstance(node.value, ast.Constant) and \
                    isinstance(node.value.value, str):
                out.append((f"{rel}:{node.lineno}", node.value.value))
        for number, line in enumerate(source.splitlines(), 1):
            if "#" in line:
                out.append((f"{rel}:{number}", line[line.index("#"):]))
    for doc in [ROOT / "README.md", *sorted((ROOT / "docs").rglob("*.md"))]:
        out.append((str(doc.relative_to(ROOT)), doc.read_text()))
    return out


def test_every_cited_path_exists():
    missing = []
    for where, text in _texts():
        for path in _cited(text):
            if "*" in path or "<" in path:
                continue
            if not (ROOT / path).exists():
                missing.append(f"{where}: {path}")
    assert not missing, "cited paths that do not exist (a .md from the repository root):\n" \
        + "\n".join(sorted(set(missing)))


@pytest.mark.parametrize("text, cited", [
    ("see design.md section 3", {"design.md"}),
    ("(shim/vm/qemu/driver.py)", {"shim/vm/qemu/driver.py"}),
    ("under shim/pod/, and docs/design.md.", {"shim/pod", "docs/design.md"}),
    ("/run/podvm/shim.json, k8s.io/foo", set()),
])
def test_the_citation_reader_sees_paths(text, cited):
    assert _cited(text) == cited
