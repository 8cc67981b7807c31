"""The node-wide ids of jailed QEMUs (shim/host/jailids.py): one per VM, never two VMs
on one, kept through a shim's restart (they are files), taken back only from a VM that
is gone, and a full range said in words."""
from __future__ import annotations

import multiprocessing
import os
import subprocess
import time

import pytest

from shim.host import jailids

FIRST = 1_900_000_000


def test_each_vm_gets_its_own_id_and_gives_it_back(tmp_path) -> None:
    claims = str(tmp_path / "claims")
    owners = [str(tmp_path / f"pod{i}" / "vm") for i in range(5)]
    for owner in owners:
        os.makedirs(owner)
    ids = [jailids.claim(owner, FIRST, 8, claims) for owner in owners]
    assert len(set(ids)) == 5 and all(FIRST <= i < FIRST + 8 for i in ids)
    assert [jailids.owner_of(i, claims) for i in ids] == owners
    jailids.release(ids[0], owners[0], claims)
    assert jailids.owner_of(ids[0], claims) is None
    jailids.release(ids[1], "/another/owner", claims)  # not its claim: kept
    assert jailids.owner_of(ids[1], claims) == owners[1]


def _claim_many(args: tuple[str, str, int]) -> list[int]:
    claims, base, n = args
    return [jailids.claim(f"{base}/{os.getpid()}-{i}", FIRST, 256, claims) for i in range(n)]


def test_shims_claiming_at_once_never_share_an_id(tmp_path) -> None:
    claims = str(tmp_path / "claims")
    base = str(tmp_path)  # owners that do not exist: no claim is stale while the range lasts
    with multiprocessing.get_context("fork").Pool(4) as pool:
        results = pool.map(_claim_many, [(claims, base, 40)] * 4)
    every = [i for r in results for i in r]
    assert len(every) == 160 and len(set(every)) == 160


def test_a_full_range_takes_back_only_claims_of_vms_that_are_gone(tmp_path) -> None:
    claims = str(tmp_path / "claims")
    live, gone = tmp_path / "live" / "vm", tmp_path / "gone" / "vm"
    live.mkdir(parents=True)
    gone.mkdir(parents=True)
    first = jailids.claim(str(live), FIRST, 2, claims)
    second = jailids.claim(str(gone), FIRST, 2, claims)
    new = tmp_path / "new" / "vm"
    new.mkdir(parents=True)
    with pytest.raises(jailids.JailIdsExhausted, match="all 2 ids of QEMU's jail .*"
                                                      "jail_id_count"):
        jailids.claim(str(new), FIRST, 2, claims)
    gone.rmdir()  # its pod was deleted, its shim died before it gave the id back
    assert jailids.claim(str(new), FIRST, 2, claims) == second
    assert jailids.owner_of(first, claims) == str(live)


def test_a_claim_whose_id_still_runs_a_process_is_not_taken_back(tmp_path) -> None:
    claims = str(tmp_path / "claims")
    gone = tmp_path / "gone" / "vm"
    gone.mkdir(parents=True)
    number = jailids.claim(str(gone), FIRST, 1, claims)
    gone.rmdir()
    # a QEMU that outlived its work directory still runs as the id
    proc = subprocess.Popen(["setpriv", f"--reuid={number}", f"--regid={number}",
                             "--clear-groups", "sleep", "60"])
    try:
        while f"\t{number}\t" not in _status(proc.pid):  # setpriv has set it
            time.sleep(0.01)
        with pytest.raises(jailids.JailIdsExhausted):
            jailids.claim(str(tmp_path / "new"), FIRST, 1, claims)
    finally:
        proc.kill()
        proc.wait()
    assert jailids.claim(str(tmp_path / "new"), FIRST, 1, claims) == number


def _status(pid: int) -> str:
    with open(f"/proc/{pid}/status") as f:
        return f.read()


def test_delete_after_a_crash_drops_every_claim_of_the_pod(tmp_path) -> None:
    claims = str(tmp_path / "claims")
    state = tmp_path / "k8s.io" / "sandbox"
    vm = jailids.claim(str(state / "vm"), FIRST, 16, claims)
    template = jailids.claim(str(state / "vm-template"), FIRST, 16, claims)
    other = jailids.claim(str(tmp_path / "k8s.io" / "sandbox2" / "vm"), FIRST, 16, claims)
    assert jailids.release_under(str(state), claims) == sorted([vm, template])
    assert jailids.owner_of(other, claims) is not None


def test_a_planted_link_in_the_claims_is_never_followed(tmp_path) -> None:
    claims = tmp_path / "claims"
    claims.mkdir()
    target = tmp_path / "target"
    target.write_text("untouched")
    os.symlink(target, claims / str(FIRST))
    number = jailids.claim(str(tmp_path / "vm"), FIRST, 2, str(claims))
    assert number == FIRST + 1 and target.read_text() == "untouched"
