"""QEMU's confinement (shim/vm/qemu/jail.py, `-sandbox`) on a real QEMU under TCG: what
/proc says of it, what its root holds, what an attacker inside it with its rights can
reach, and that each capability kept is needed by the 9p server (and mknod refused).
Over virtio-fs (the default) QEMU keeps no capability and sees none of the pod's files;
with shared_fs = "virtio-9p" it keeps jail.KEEP and the shared directory."""
from __future__ import annotations

import ctypes
import dataclasses
import errno
import os
import pathlib

import pytest
import pytest_asyncio

from guest.cpio import CpioWriter
from shim.vm.agent import Agent
from shim.vm.hypervisor import HypervisorError, VMSpec
from shim.vm.qemu import jail, pidfilter
from shim.vm.qemu.driver import QemuVM
from shim.libc import libc
from shim.host.mountns import in_namespace
from testbed.prereqs import require_root
from testbed.vmconfig import guest_image, vm_config
from tests.guestprobe import DIR, INTO_ROOT

IDS = 1_800_000_123
KEEP_MASK = sum(1 << jail.CAPABILITIES.index(name) for name in jail.KEEP)


def spec(tmp_path: pathlib.Path, name: str = "pod", **qemu: object) -> VMSpec:
    require_root()
    cfg = vm_config(**qemu)
    (tmp_path / name / "shared").mkdir(parents=True, exist_ok=True)
    return VMSpec(sandbox_id=name, workdir=str(tmp_path / name / "vm"),
                  shared_dir=str(tmp_path / name / "shared"), vcpus=1, max_vcpus=2,
                  memory_mib=256, max_memory_mib=1024, hypervisor=cfg.qemu)


def status_fields(pid: int) -> dict[str, str]:
    with open(f"/proc/{pid}/status") as f:
        return {k: v.strip() for k, v in (line.split(":", 1) for line in f if ":" in line)}


# One VM of each shared file system, in the module's loop, serves every test that only
# looks at a running QEMU (booting one a test cost the suite 40 s): those tests run in
# that loop too.
ON_THE_VM = pytest.mark.asyncio(loop_scope="module")


@pytest_asyncio.fixture(scope="module", loop_scope="module", params=["virtio-fs", "virtio-9p"])
async def vm(tmp_path_factory, request):
    base = tmp_path_factory.mktemp("jail")
    # Another pod's state beside this one's: the jail must not show it.
    (base / "other" / "vm").mkdir(parents=True)
    (base / "other" / "vm" / "secret").write_text("another pod's")
    qemu = QemuVM(spec(base, shared_fs=request.param))
    await qemu.launch()
    try:
        agent = Agent.of_vm(qemu)
        assert (await agent.ping(timeout=30)).online_cpus == 1
        await agent.close()
        yield qemu
    finally:
        await qemu.stop()


def other_pod(vm) -> pathlib.Path:
    """The state of another pod, beside the VM's."""
    return pathlib.Path(vm.spec.workdir).parents[1] / "other"


def kept(vm) -> tuple[str, ...]:
    return jail.KEEP if serves_files(vm) else ()


def serves_files(vm) -> bool:
    return vm.spec.hypervisor.shared_fs == "virtio-9p"


@ON_THE_VM
async def test_proc_shows_seccomp_no_new_privs_and_only_the_kept_capabilities(vm) -> None:
    fields = status_fields(vm.pid)
    assert fields["Seccomp"] == "2" and fields["NoNewPrivs"] == "1"
    assert fields["Seccomp_filters"] == "2"  # podvm's and QEMU's own
    mask = KEEP_MASK if serves_files(vm) else 0
    # a uid other than 0 holds what 9p needs through its ambient set (and inheritable)
    for key in ("CapEff", "CapPrm", "CapBnd", "CapInh", "CapAmb"):
        assert int(fields[key], 16) == mask, (key, fields[key])
    assert vm.jail_id >= vm.spec.hypervisor.jail_id_first
    assert jail.confinement(vm.pid) == {
        "uid": vm.jail_id, "gid": vm.jail_id, "seccomp": 2, "no_new_privs": 1,
        "capabilities": list(kept(vm)), "own_namespaces": ["mnt", "net", "ipc", "uts"]}
    assert fields["Uid"].split() == [str(vm.jail_id)] * 4
    assert fields["Groups"] == ""  # /dev/kvm's group only under KVM
    assert sorted(jail.KEEP) == ["chown", "dac_override", "fowner", "fsetid"]


@ON_THE_VM
async def test_its_root_holds_only_the_pod_s_files(vm) -> None:
    root = pathlib.Path(f"/proc/{vm.pid}/root")
    q = vm.spec.hypervisor
    assert sorted(p.name for p in (root / "dev").iterdir()) == \
        ["null", "random", "urandom", "zero"]  # no /dev/kvm under TCG
    for present in (q.path, q.kernel, q.initrd, q.image, vm.qmp_socket):
        assert os.path.lexists(f"{root}{present}"), present
    assert os.path.lexists(f"{root}{vm.spec.shared_dir}") == serves_files(vm)
    for absent in ("/etc/shadow", "/etc/passwd", "/var/lib/containerd", "/proc/1", "/sys/fs",
                   "/root", "/run/containerd", str(other_pod(vm)), "/home"):
        assert not os.path.lexists(f"{root}{absent}"), absent
    assert sorted(os.listdir(root / "etc")) == ["ld.so.cache"]
    # /proc is QEMU's own /proc/PID alone (its 9p server needs /proc/self/fd, and the
    # guest's RAM is a /proc/self/fd path)
    assert os.listdir(root / "proc") == ["self"]
    assert os.stat(root / "proc" / "self").st_ino == os.stat(f"/proc/{vm.pid}").st_ino
    with pytest.raises(OSError) as err:  # even the host's root cannot write there
        (root / "usr" / "podvm-probe").write_text("x")
    assert err.value.errno == errno.EROFS
    with pytest.raises(OSError) as err:
        (root / "planted").write_text("x")
    assert err.value.errno == errno.EROFS


def _as_qemu_attacker(writable: list[str], ids: int, keep: tuple[str, ...]) -> dict:
    """In QEMU's mount namespace (setns done by in_namespace), with QEMU's rights (its
    uid and gid, capabilities, no_new_privs, podvm's filter): every directory that takes
    a new file, and each escape tried. The calls on other processes and the node's
    namespaces: tests/vm/test_jail_battery.py."""
    jail.drop_privileges(keep, ids)
    pidfilter.install()
    created = []
    for top, _, _ in os.walk("/"):
        probe = os.path.join(top, "attacker-was-here")
        try:
            os.close(os.open(probe, os.O_CREAT | os.O_WRONLY, 0o644))
        except OSError:
            continue
        created.append(top)
        os.unlink(probe)
    tried = {}

    def attempt(name, fn):
        try:
            fn()
            tried[name] = "done"
        except OSError as exc:
            tried[name] = errno.errorcode[exc.errno]

    c = libc()
    attempt("mount tmpfs", lambda: _check(c.mount(b"t", b"/dev", b"tmpfs", 0, None)))
    attempt("remount /usr rw", lambda: _check(c.mount(None, b"/usr", None,
                                                      jail.MS_REMOUNT | jail.MS_BIND, None)))
    attempt("umount /usr", lambda: _check(c.umount2(b"/usr", 0)))
    attempt("chroot", lambda: os.chroot("/usr"))
    attempt("mknod", lambda: os.mknod(os.path.join(writable[0], "disk"), 0o600 | 0o60000,
                                      os.makedev(8, 0)))
    attempt("open /etc/shadow", lambda: os.close(os.open("/etc/shadow", os.O_RDONLY)))
    attempt("sysrq", lambda: os.close(os.open("/proc/sysrq-trigger", os.O_WRONLY)))
    attempt("proc/sys", lambda: os.close(os.open("/proc/sys/kernel/core_pattern",
                                                 os.O_WRONLY)))
    return {"created": created, "tried": tried}


def _check(result: int) -> None:
    if result != 0:
        raise OSError(ctypes.get_errno(), "")


@ON_THE_VM
async def test_an_attacker_with_qemu_s_rights_in_its_namespace_writes_only_pod_files(
        vm) -> None:
    writable = [vm.spec.workdir, *([vm.spec.shared_dir] if serves_files(vm) else [])]
    found = in_namespace(f"/proc/{vm.pid}/ns/mnt", _as_qemu_attacker, writable, vm.jail_id,
                         kept(vm))
    assert set(writable) <= set(found["created"])  # a test that can fail
    outside = [d for d in found["created"]
               if not any((d + "/").startswith(w + "/") for w in writable)]
    assert outside == [], outside
    assert found["tried"] == {
        "mount tmpfs": "EPERM", "remount /usr rw": "EPERM", "umount /usr": "EPERM",
        "chroot": "EPERM", "mknod": "EPERM", "open /etc/shadow": "ENOENT",
        "sysrq": "ENOENT", "proc/sys": "ENOENT"}


# Each operation the guest's root does on the share through 9p, by the capability it
# needs of QEMU; mknod never succeeds.
NINE_P = f"""exec 3>&1 > /tmp/res 2>&1
modprobe -a 9pnet_virtio 9p
mkdir /tmp/s && mount -t 9p -o trans=virtio,version=9p2000.L podvm /tmp/s || echo NOMOUNT
cd /tmp/s
t() {{ n=$1; shift; if "$@"; then echo "$n ok"; else echo "$n failed"; fi; }}
touch f g && mkdir d
t chown chown 1000:1000 f
t fowner chmod 600 f
chown 1000:1000 d g; chmod 755 d
t dac_override touch d/x
chmod 2755 g
t fsetid test "$(stat -c %a g)" = 2755
t mknod mknod n c 1 3
cd /; umount /tmp/s
mount -t 9p -o trans=virtio,version=9p2000.L podvm /tmp/s && cp /tmp/res /tmp/s/result
umount /tmp/s
cat /tmp/res >&3
"""


def probe_initrd(tmp_path: pathlib.Path) -> str:
    """The guest's initramfs with its /init replaced: into the root image, NINE_P, off."""
    _, initrd = guest_image()
    overlay = tmp_path / "probe-initrd.img"
    with open(overlay, "wb") as f:
        f.write(pathlib.Path(initrd).read_bytes())
        cpio = CpioWriter(f)
        cpio.file(f"{DIR}/script", NINE_P.encode(), 0o755)
        cpio.file("init", ("#!/bin/busybox sh\nexport PATH=/bin\n" + INTO_ROOT).encode(),
                  0o755)
        cpio.close()
    return str(overlay)


@pytest.mark.parametrize("without", ["", *jail.KEEP])
async def test_the_9p_server_needs_each_kept_capability(tmp_path, monkeypatch,
                                                        without) -> None:
    monkeypatch.setattr(jail, "KEEP", tuple(c for c in jail.KEEP if c != without))
    s = spec(tmp_path, boot_timeout=120, shared_fs="virtio-9p")
    vm = QemuVM(dataclasses.replace(s, hypervisor=dataclasses.replace(
        s.hypervisor, initrd=probe_initrd(tmp_path))))
    with pytest.raises(HypervisorError, match="exited with status 0"):
        await vm.launch()  # the probe powers the guest off: no agent ever answers
    # read from the guest's console: copying it into the share needs the capabilities
    # under test (QEMU's uid owns nothing there)
    result = pathlib.Path(vm.console_log).read_text(errors="replace").replace("\r", "").split("\n")
    outcomes = dict(line.split(" ", 1) for line in result if line.endswith((" ok", " failed")))
    expected = {name: "ok" for name in jail.KEEP} | {"mknod": "failed"}
    if without:
        expected[without] = "failed"
        assert outcomes[without] == "failed", result
    else:
        assert outcomes == expected, result


async def test_a_jail_that_cannot_be_made_is_said_and_nothing_runs(tmp_path,
                                                                    monkeypatch) -> None:
    """A failure between fork and exec reaches the parent only as "the child failed":
    what failed is written to QEMU's log and quoted."""
    s = spec(tmp_path)
    real = jail.plan

    def broken(vm_spec: VMSpec, ids: int) -> jail.Jail:
        made = real(vm_spec, ids)
        return dataclasses.replace(made, binds=(*made.binds, jail.Bind("/nonexistent/x")))

    monkeypatch.setattr(jail, "plan", broken)
    vm = QemuVM(s)
    with pytest.raises(HypervisorError, match="cannot start QEMU of sandbox pod: podvm: "
                                              "QEMU's jail: mount /nonexistent/x .*No such"):
        await vm.launch()
    assert vm._proc is None


def test_the_plan_binds_the_paths_qemu_is_given_and_nothing_twice(tmp_path) -> None:
    (tmp_path / "real").mkdir()
    (tmp_path / "real" / "vmlinux").write_bytes(b"k")
    (tmp_path / "linked").mkdir()
    os.symlink(tmp_path / "real" / "vmlinux", tmp_path / "linked" / "vmlinux")
    cfg = vm_config(kernel=str(tmp_path / "linked" / "vmlinux"),
                    initrd="/usr/share/qemu/qboot.rom", accel="kvm")
    s = VMSpec(sandbox_id="p", workdir=str(tmp_path / "vm"), shared_dir=str(tmp_path / "sh"),
               vcpus=1, max_vcpus=1, memory_mib=256, max_memory_mib=256,
               hypervisor=cfg.qemu)
    binds = {b.source: b for b in jail.plan(s, IDS).binds}
    assert str(tmp_path / "linked" / "vmlinux") in binds  # the path on QEMU's command line
    assert str(tmp_path / "real" / "vmlinux") in binds  # and where it leads
    assert "/usr/share/qemu/qboot.rom" not in binds and not binds["/usr"].writable
    assert binds[s.workdir].writable and s.shared_dir not in binds  # virtiofsd serves it
    nine_p = dataclasses.replace(s, hypervisor=dataclasses.replace(s.hypervisor,
                                                                   shared_fs="virtio-9p"))
    assert jail.plan(nine_p, IDS).keep == jail.KEEP and jail.plan(s, IDS).keep == ()
    assert {b.source: b for b in jail.plan(nine_p, IDS).binds}[s.shared_dir].recursive
    assert ("/dev/kvm" in binds) == os.path.exists("/dev/kvm")
    # under KVM its one supplementary group is /dev/kvm's, which opens the device
    assert jail.plan(s, IDS).groups == (os.stat("/dev/kvm").st_gid,)
    assert jail.plan(s, IDS).ids == IDS
    tcg = dataclasses.replace(s, hypervisor=dataclasses.replace(s.hypervisor, accel="tcg"))
    assert "/dev/kvm" not in {b.source for b in jail.plan(tcg, IDS).binds}


async def test_without_proc_self_the_guest_cannot_create_a_file(tmp_path, monkeypatch) -> None:
    """Why the jail has /proc/self: QEMU's 9p server sets a new file's mode through
    /proc/self/fd, and without it every create fails (the guest sees ENOENT). No scratch
    disk: QEMU opens it by a /proc/self/fd path too, and would not start."""
    monkeypatch.setattr(jail.Jail, "_proc_self", lambda self: None)
    s = spec(tmp_path, boot_timeout=120, shared_fs="virtio-9p", scratch_disk_mib=0)
    vm = QemuVM(dataclasses.replace(s, hypervisor=dataclasses.replace(
        s.hypervisor, initrd=probe_initrd(tmp_path))))
    with pytest.raises(HypervisorError, match="exited with status 0"):
        await vm.launch()
    assert not os.path.exists(os.path.join(s.shared_dir, "f"))  # touch f failed
    assert os.listdir(s.shared_dir) == []  # and so did the result's copy
