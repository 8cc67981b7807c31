"""Where templates are kept (shim/vm/template/store.py): whoever can replace a template
controls the guest of every later pod of its shape, so the store must be root's alone and
local, or templates are off (pods boot) with one line that says why; nothing is written
through a name someone else made; and the store is bounded (count, bytes, the disk),
least recently used out first, never one being made, listed and pruned by `podvmctl
templates`."""
from __future__ import annotations

import json
import logging
import os
import time

import pytest

from podvmctl import cli
from shim.host import mounts
from shim.vm.template import store as templatestore
from shim.vm.template import template as templates
from testbed.prereqs import require_root


def test_a_missing_store_is_made_root_s_and_0700(tmp_path) -> None:
    require_root()
    store = tmp_path / "var" / "templates"
    assert templatestore.untrusted_store(str(store)) == ""
    assert store.is_dir() and (os.stat(store).st_mode & 0o777) == 0o700


@pytest.mark.parametrize("attack", ["symlink", "file", "mode", "owner"])
def test_a_store_others_could_write_turns_templates_off(tmp_path, attack, caplog) -> None:
    require_root()
    store = tmp_path / "templates"
    if attack == "symlink":
        (tmp_path / "elsewhere").mkdir(mode=0o700)
        store.symlink_to(tmp_path / "elsewhere")
    elif attack == "file":
        store.write_text("")
    else:
        store.mkdir(mode=0o700)
        if attack == "mode":
            store.chmod(0o770)
        else:
            os.chown(store, 1000, 0)
    said = {"symlink": "is a symlink", "file": "is not a directory",
            "mode": "has mode 0770, not 0700", "owner": "is owned by uid 1000, not root"}
    assert said[attack] in templatestore.untrusted_store(str(store))
    with caplog.at_level(logging.WARNING, logger="podvm.template"):
        assert said[attack] in templatestore.refusal(str(store))
    assert f"templates off: {store} {said[attack]} (pods boot instead)" in caplog.text


def test_a_store_on_a_remote_file_system_turns_templates_off(tmp_path, monkeypatch) -> None:
    require_root()
    store = tmp_path / "templates"
    monkeypatch.setattr(mounts, "fstype_of", lambda path: "nfs4")
    assert templatestore.untrusted_store(str(store)) == \
        f"{store} is on a nfs4 file system, not a local one"
    monkeypatch.setattr(mounts, "fstype_of", lambda path: "fuse.sshfs")
    assert "fuse.sshfs" in templatestore.untrusted_store(str(store))


def test_the_file_system_of_a_path_is_its_deepest_mount_s() -> None:
    assert mounts.fstype_of("/proc/self/status") == "proc"
    assert mounts.fstype_of("/") not in ("", "proc")


def test_temporary_files_are_never_an_existing_name(tmp_path) -> None:
    """A name made before (a stale file, a planted symlink) fails the write: the
    template is not saved, nothing is written through it."""
    planted = tmp_path / "x.json.tmp"
    planted.symlink_to(tmp_path / "target")
    with pytest.raises(OSError):
        templates._new_file(str(planted))
    assert not (tmp_path / "target").exists()
    with templates._new_file(str(tmp_path / "fresh.tmp")) as f:
        f.write("ok")
    assert (os.stat(tmp_path / "fresh.tmp").st_mode & 0o777) == 0o600


def fake_template(store, key: str, mib: int, hits: int, last_use: float) -> None:
    """A template's files as the store sees them: `mib` MiB of memory data, `hits`."""
    (store / f"{key}.json").write_text(json.dumps({
        "format": templatestore.FORMAT, "made": last_use - 100, "made_by": f"pod-{key}",
        "command": ["qemu", "-smp", "1,maxcpus=2", "-m", "256M,slots=8"]}))
    (store / f"{key}.vmstate").write_bytes(b"s" * 4096)
    (store / f"{key}.vmstate.ram").write_bytes(b"m" * (mib << 20))
    (store / f"{key}.uses").write_bytes(b"." * hits)
    os.utime(store / f"{key}.uses", (last_use, last_use))


def test_the_least_recently_used_go_first_and_never_one_being_made(tmp_path) -> None:
    store = tmp_path / "templates"
    store.mkdir(mode=0o700)
    now = time.time()
    for i, key in enumerate(("old", "mid", "new")):
        fake_template(store, key, 2, hits=i + 1, last_use=now - 300 + 100 * i)
    listed = templatestore.listing(str(store))
    assert [t["key"] for t in listed] == ["old", "mid", "new"]
    assert listed[0]["hits"] == 1 and listed[0]["shape"] == {"-smp": "1,maxcpus=2",
                                                             "-m": "256M,slots=8"}
    assert listed[0]["bytes"] >= 2 << 20
    # "old" is being made again by a pod: it stays, the next one goes.
    making = templates.Template(str(store), "old", {}).lock()
    assert making is not None
    try:
        assert templatestore.make_room(str(store), 1 << 20, max_count=3, max_bytes=1 << 40)
        assert sorted(templatestore._keys(str(store))) == ["new", "old"]
    finally:
        making.release()
    # Bytes: two of 2 MiB do not fit under 3 MiB with a third to come; the older goes.
    assert templatestore.make_room(str(store), 1 << 20, max_count=8, max_bytes=3 << 20)
    assert templatestore._keys(str(store)) == ["new"]
    assert not any(p.name.startswith(("old.", "mid.")) for p in store.iterdir())
    # No room at all: nothing more is removed, the pod boots.
    assert not templatestore.make_room(str(store), 1 << 20, max_count=0, max_bytes=1 << 40)
    assert not templatestore.make_room(str(store), 1 << 60, max_count=8, max_bytes=1 << 40)
    assert templatestore._keys(str(store)) == ["new"]


def test_a_new_template_over_the_cap_alone_is_not_kept(tmp_path) -> None:
    store = tmp_path / "templates"
    store.mkdir(mode=0o700)
    fake_template(store, "big", 3, hits=0, last_use=time.time())
    fake_template(store, "small", 1, hits=5, last_use=time.time() - 50)
    assert not templatestore.trim(str(store), 8, 2 << 20, keep="big")
    assert templatestore._keys(str(store)) == ["big"]  # the others went first


def test_each_restore_is_a_hit(tmp_path) -> None:
    store = tmp_path / "templates"
    store.mkdir(mode=0o700)
    fake_template(store, "k", 1, hits=0, last_use=time.time() - 1000)
    t = templates.Template(str(store), "k", {})
    t.record_use()
    t.record_use()
    (entry,) = templatestore.listing(str(store))
    assert entry["hits"] == 2 and time.time() - entry["last_use"] < 60


def test_podvmctl_lists_and_removes_templates(tmp_path, capsys) -> None:
    store = tmp_path / "templates"
    store.mkdir(mode=0o700)
    fake_template(store, "aaa", 1, hits=3, last_use=time.time() - 7200)
    conf = tmp_path / "podvm.toml"
    conf.write_text(f'[hypervisor.qemu]\ntemplate_path = "{store}"\n')
    assert cli.main(["templates", "--config", str(conf)]) == 0
    out = capsys.readouterr().out
    assert f"1 templates in {store}" in out
    assert "aaa" in out and "3 hits" in out and "2h ago" in out and "made by pod-aaa" in out
    assert "-smp 1,maxcpus=2 -m 256M,slots=8" in out
    assert cli.main(["templates", "--config", str(conf), "--remove", "aaa"]) == 0
    assert "removed template aaa" in capsys.readouterr().out
    assert list(store.iterdir()) == []
    making = templates.Template(str(store), "bbb", {}).lock()
    try:
        assert cli.main(["templates", "--config", str(conf), "--remove", "bbb"]) == 1
        assert "template bbb is being made: not removed" in capsys.readouterr().err
    finally:
        making.release()


def test_what_a_killed_maker_left_goes_at_the_next_prune_unless_it_is_being_made(
        tmp_path) -> None:
    """A shim SIGKILLed while it made a template leaves its half-written files (no
    `finally` ran, and `shim delete` does not know the store): the next prune removes
    them, but never those of a template someone is making now (its lock is held)."""
    store = str(tmp_path)
    left = ["a1b2c3.vmstate.4242.tmp", "a1b2c3.vmstate.4242.tmp.ram"]
    making = ["d4e5f6.vmstate.77.tmp", "d4e5f6.vmstate.77.tmp.ram"]
    others = ["notes.tmp", "a1b2c3.vmstate.x.tmp"]  # not a maker's: never touched
    for name in left + others:
        (tmp_path / name).write_bytes(b"x")
    held = templatestore.lock(store, "d4e5f6")  # a maker takes the lock, then writes
    assert held >= 0
    for name in making:
        (tmp_path / name).write_bytes(b"x")
    try:
        templatestore.prune(store)
    finally:
        os.close(held)
    names = set(os.listdir(store))
    assert not names & set(left), names
    assert set(making + others) <= names


def test_the_next_maker_of_a_template_finds_nothing_a_killed_one_left(tmp_path) -> None:
    """A node's power lost (or a shim SIGKILLed) while a template was made: the next make
    of that template is the next to take its lock, and the prune after a make runs with
    that lock still held, so it never removed them (tests/e2e/test_reboot.py found the
    memory file, as large as the VM's, still there). Taking the lock removes them, the
    metadata's temporary file too, which would make every later make of the template
    fail (it is made with O_EXCL)."""
    store = str(tmp_path)
    left = ["a1b2c3.vmstate.4242.tmp", "a1b2c3.vmstate.4242.tmp.ram", "a1b2c3.json.tmp"]
    others = ["d4e5f6.vmstate.77.tmp.ram", "d4e5f6.json.tmp", "a1b2c3.uses"]
    for name in left + others:
        (tmp_path / name).write_bytes(b"x")
    held = templatestore.lock(store, "a1b2c3")
    assert held >= 0
    try:
        assert sorted(os.listdir(store)) == sorted(others + ["a1b2c3.lock"])
        assert templatestore.lock(store, "a1b2c3") == -1  # one maker at a time
    finally:
        os.close(held)
    templatestore.prune(store)  # another template's leftovers: removed by a prune
    assert sorted(os.listdir(store)) == ["a1b2c3.lock", "a1b2c3.uses", "d4e5f6.lock"]
