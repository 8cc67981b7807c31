"""Test-wide rules: in CI every prerequisite must be there (a missing one fails the test);
on a developer's machine a missing one skips it, saying what to install."""
from __future__ import annotations

import compileall
import os
import pathlib
import shutil

import pytest

from shim.host.paths import STATE_ROOT

IN_CI = os.environ.get("CI", "").lower() in ("1", "true", "yes")
REPO_ROOT = pathlib.Path(__file__).resolve().parent.parent
# What a shim daemon imports, all of it this tree's (its other imports were compiled by pip).
SHIM_PACKAGES = ("shim", "cgroups", "podvm_core")


def compile_shim() -> None:
    """Bytecode for the shim's packages, as a node has it: pip and podvm-node's bundle
    compile what they install, but this tree is installed in place, and where Python may
    not write bytecode (PYTHONDONTWRITEBYTECODE) every shim process would compile its
    ~120 modules afresh (0.1 s of a pod's start, in every `start` and `delete` too).
    Quick when it is current: only a source newer than its bytecode is compiled."""
    for package in SHIM_PACKAGES:
        if not compileall.compile_dir(str(REPO_ROOT / package), quiet=1):
            raise RuntimeError(f"{package}: some of its modules do not compile")


def require(condition: bool, what: str) -> None:
    if condition:
        return
    if IN_CI:
        pytest.fail(f"prerequisite missing in CI: {what}")
    pytest.skip(f"needs {what} (`make test` installs it)")


def require_tool(name: str, package: str) -> str:
    path = shutil.which(name)
    require(path is not None, f"{name} (Debian package {package})")
    assert path is not None
    return path


def require_root() -> None:
    require(os.geteuid() == 0, "root (containerd, mounts and cgroups need it)")


_run_namespaces: set[str] = set()


def run_namespace(prefix: str) -> str:
    """A containerd namespace for this run alone (another run on the machine has its
    own /run/podvm/<namespace>); its directory there is removed when the run ends."""
    namespace = f"{prefix}-{os.getpid()}"
    _run_namespaces.add(namespace)
    return namespace


def _remove_run_namespaces() -> None:
    for namespace in _run_namespaces:
        try:
            os.rmdir(os.path.join(STATE_ROOT, namespace))  # empty, or a test left state
        except (FileNotFoundError, OSError):
            pass


_skipped: list[str] = []


def pytest_sessionstart(session: pytest.Session) -> None:
    compile_shim()


def pytest_runtest_logreport(report: pytest.TestReport) -> None:
    if report.skipped:
        _skipped.append(report.nodeid)


def pytest_sessionfinish(session: pytest.Session, exitstatus: int) -> None:
    """Under CI a skipped test is a failed run, whatever route it took (pytest.skip,
    a skip mark, an expected failure): every test must run there."""
    _remove_run_namespaces()
    from tests.vmconfig import remove_templates

    remove_templates()  # the run's (the pods of its shapes made them)
    if IN_CI and _skipped:
        reporter = session.config.pluginmanager.get_plugin("terminalreporter")
        if reporter is not None:
            reporter.write_line(f"CI=true: {len(_skipped)} test(s) did not run, which CI "
                                f"does not allow: {', '.join(_skipped)}", red=True)
        session.exitstatus = pytest.ExitCode.TESTS_FAILED


def _entries(directory: pathlib.Path) -> set[str]:
    return set(os.listdir(directory)) if directory.is_dir() else set()


def _cmdline(pid: int | str) -> str:
    try:
        with open(f"/proc/{pid}/cmdline", "rb") as f:
            return f.read().replace(b"\0", b" ").decode(errors="replace")
    except OSError:
        return ""


def _ours() -> set[tuple[int, str]]:
    """Shim daemons and pod QEMUs running now: (pid, command line, and for a QEMU its
    parent's command line, or "orphan")."""
    found = set()
    for pid in os.listdir("/proc"):
        if not pid.isdigit():
            continue
        cmdline = _cmdline(pid)
        if "containerd-shim-podvm-v2" in cmdline:
            found.add((int(pid), cmdline))
        elif "qemu-system" in cmdline and "-name podvm-" in cmdline:
            try:
                with open(f"/proc/{pid}/stat") as f:
                    ppid = int(f.read().rsplit(")", 1)[1].split()[1])
            except (OSError, ValueError, IndexError):
                continue
            found.add((int(pid), f"{cmdline} [parent: "
                                 f"{_cmdline(ppid) if ppid > 1 else 'orphan'}]"))
    return found


@pytest.fixture(scope="session", autouse=True)
def nothing_left_running(tmp_path_factory):
    """A test run that leaves a shim daemon or a pod QEMU behind fails, whichever test did
    it. This run's: a daemon whose bundle, or a QEMU whose files or parent shim's bundle,
    are under this run's temporary directory, and any orphaned pod QEMU (not the VMs that
    other work on the machine runs)."""
    from shim.config import HypervisorConfig

    system_templates = pathlib.Path(HypervisorConfig().template_path)
    system_scratch = pathlib.Path(HypervisorConfig().scratch_path)
    templates_before = _entries(system_templates)
    scratch_before = _entries(system_scratch)
    before = _ours()
    yield
    import time

    made = sorted(_entries(system_templates) - templates_before)
    assert not made, (f"templates left in {system_templates} (a pod of the run used the "
                      f"default template_path): {made}")
    made = sorted(_entries(system_scratch) - scratch_before)
    assert not made, (f"files left in {system_scratch} (a pod of the run used the default "
                      f"scratch_path): {made}")

    base = str(tmp_path_factory.getbasetemp())

    def left() -> list:
        return sorted(p for p in _ours() - before
                      if base in p[1] or p[1].endswith("[parent: orphan]"))

    deadline = time.monotonic() + 10
    while (found := left()) and time.monotonic() < deadline:
        time.sleep(0.2)
    assert not found, f"left running after the tests: {found}"
