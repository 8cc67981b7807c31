"""The agent's Resume (guest/agent/resume.py) refuses what it cannot apply whole before
it changes anything: too little entropy, no clock, a template MAC none of the guest's
devices has. What it does is seen in a restored guest (tests/e2e/test_templates.py,
tests/vm/test_template.py)."""
from __future__ import annotations

import os
import pathlib
import time

import pytest

from guest.agent import resume
from podvm_core.pb.agent import agent_pb2 as pb
from podvm_core.ttrpc import Code, TtrpcError
from testbed.prereqs import require_root

LINKS = {"eth0": "02:70:6f:64:00:00", "eth1": "02:70:6f:64:00:01"}


def change(template_mac: str, mac: str) -> pb.MacChange:
    return pb.MacChange(template_mac=template_mac, mac=mac)


def test_each_template_mac_is_found_whatever_its_case() -> None:
    assert resume._mac_renames([change("02:70:6F:64:00:01", "0A:58:0A:09:00:05"),
                                change("02:70:6f:64:00:00", "0a:58:0a:09:00:04")],
                               LINKS) == [("eth1", "0a:58:0a:09:00:05"),
                                          ("eth0", "0a:58:0a:09:00:04")]


def test_a_template_mac_the_guest_lacks_names_what_it_has() -> None:
    with pytest.raises(TtrpcError) as err:
        resume._mac_renames([change("02:70:6f:64:00:07", "0a:58:0a:09:00:05")], LINKS)
    assert err.value.code == Code.INVALID_ARGUMENT
    assert "02:70:6f:64:00:07" in err.value.message and "eth0 02:70:6f:64:00:00" in err.value.message


@pytest.mark.parametrize("req, says", [
    (pb.ResumeRequest(realtime_unix_nanos=time.time_ns(), entropy=b"x" * 31), "entropy"),
    (pb.ResumeRequest(entropy=b"x" * 64), "realtime_unix_nanos"),
])
async def test_a_request_it_cannot_apply_changes_nothing(req, says, monkeypatch) -> None:
    def changed(*args):
        raise AssertionError(f"changed something: {args}")

    monkeypatch.setattr(resume.time, "clock_settime_ns", changed)
    monkeypatch.setattr(resume, "_reseed", changed)
    with pytest.raises(TtrpcError) as err:
        await resume.resume(req)
    assert err.value.code == Code.INVALID_ARGUMENT and says in err.value.message


async def test_the_crng_is_reseeded_right_after_the_clock_before_anything_else(
        monkeypatch) -> None:
    """Resume is the first request a restored guest gets (shim/vm/machine.py, _connect),
    and no process of the pod exists yet: the reseed comes before the NICs get the pod's
    MACs and before the pod's share is mounted, with the host's entropy as sent."""
    done: list[tuple] = []
    monkeypatch.setattr(resume.time, "clock_settime_ns", lambda c, ns: done.append(("clock",)))
    monkeypatch.setattr(resume, "_reseed", lambda entropy: done.append(("reseed", entropy)))
    monkeypatch.setattr(resume.network, "links", lambda: dict(LINKS))

    class Netlink:
        def __enter__(self):
            return self

        def __exit__(self, *exc):
            return False

        def apply(self, change):
            done.append(("mac", change.device, change.address))

    def mount_share() -> float:
        done.append(("share",))
        return time.monotonic()

    monkeypatch.setattr(resume, "Netlink", Netlink)
    monkeypatch.setattr(resume, "_mount_share", mount_share)
    entropy = bytes(range(64))
    await resume.resume(pb.ResumeRequest(realtime_unix_nanos=time.time_ns(), entropy=entropy,
                                         macs=[change(LINKS["eth0"], "0a:58:0a:09:00:04")]))
    assert done == [("clock",), ("reseed", entropy), ("mac", "eth0", "0a:58:0a:09:00:04"),
                    ("share",)]


def test_the_reseed_is_one_a_real_kernel_takes() -> None:
    """The write and RNDRESEEDCRNG on this machine's own kernel (root: the ioctl needs
    CAP_SYS_ADMIN): a wrong request number or a kernel without it fails here."""
    require_root()
    resume._reseed(os.urandom(64))


def test_the_share_is_mounted_as_the_guest_s_fstab_says() -> None:
    """mount(2)'s arguments from the fstab the guest image carries, for either share."""
    fstab = pathlib.Path(__file__).resolve().parents[2] / "guest" / "fstab"
    with pytest.MonkeyPatch.context() as m:
        m.setattr(resume, "FSTAB", str(fstab))
        assert resume.share_entry("virtiofs") == ("podvm", "")
        assert resume.share_entry("9p") == (
            "podvm", "trans=virtio,version=9p2000.L,msize=262144,cache=mmap")
        with pytest.raises(TtrpcError) as err:
            resume.share_entry("nfs")
    assert err.value.code == Code.FAILED_PRECONDITION and "no nfs line" in err.value.message


def test_a_share_that_does_not_mount_is_said_with_the_kernel_s_reason(tmp_path,
                                                                      monkeypatch) -> None:
    """mount(2) for real, on this machine's kernel, where no virtio transport has the
    share's tag: the resume fails in words, and nothing is mounted."""
    require_root()
    fstab = tmp_path / "fstab"
    share = tmp_path / "shared"
    share.mkdir()
    fstab.write_text(f"podvm {share} 9p trans=virtio,version=9p2000.L 0 0\n")
    monkeypatch.setattr(resume, "FSTAB", str(fstab))
    monkeypatch.setattr(resume, "SHARE", str(share))
    monkeypatch.setattr(resume, "share_type", lambda: "9p")
    with pytest.raises(TtrpcError) as err:
        resume._mount_share()
    assert err.value.code == Code.FAILED_PRECONDITION, err.value.message
    assert err.value.message.startswith(f"mount of the pod's share (9p podvm) at {share} "
                                        f"failed: "), err.value.message
    assert not os.path.ismount(share)
