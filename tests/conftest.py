"""Test-wide rules: in CI every prerequisite must be there (a missing one fails the test:
testbed/prereqs.py); on a developer's machine a missing one skips it, saying what to
install."""
from __future__ import annotations

import os
import pathlib

import pytest

from testbed.bytecode import compile_shim
from testbed.namespaces import remove_run_namespaces
from testbed.prereqs import IN_CI


_skipped: list[str] = []


def pytest_sessionstart(session: pytest.Session) -> None:
    compile_shim()


def pytest_runtest_logreport(report: pytest.TestReport) -> None:
    if report.skipped:
        _skipped.append(report.nodeid)


def pytest_sessionfinish(session: pytest.Session, exitstatus: int) -> None:
    """Under CI a skipped test is a failed run, whatever route it took (pytest.skip,
    a skip mark, an expected failure): every test must run there."""
    remove_run_namespaces()
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
    system_cgroup = HypervisorConfig().template_cgroup.strip("/")
    templates_before = _entries(system_templates)
    scratch_before = _entries(system_scratch)
    cgroup_before = set(pathlib.Path("/sys/fs/cgroup").glob(f"*/{system_cgroup}"))
    before = _ours()
    yield
    import time

    made = sorted(_entries(system_templates) - templates_before)
    assert not made, (f"templates left in {system_templates} (a pod of the run used the "
                      f"default template_path): {made}")
    made = sorted(set(pathlib.Path("/sys/fs/cgroup").glob(f"*/{system_cgroup}")) -
                  cgroup_before)
    assert not made, (f"cgroups left (a pod or bench of the run used the default "
                      f"template_cgroup, where the templates' page cache cgroup stays): {made}")
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
    from testbed import forkservers

    left_servers = forkservers.stop_own()  # started by the run's shims, ours to stop
    assert not left_servers, f"fork servers that did not stop: {left_servers}"
