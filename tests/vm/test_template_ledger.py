"""The bound on new template shapes (shim/vm/template/ledger.py, maker.make): a pod author
who mints a new shape with each memory remainder gets at most
template_new_per_namespace_per_hour templates an hour, all pods together
template_new_per_hour, and a pod over a bound evicts nothing; the operator's warm and an
existing template's restore are never bounded. The template's own make is stubbed: what
is bounded is whether it starts."""
from __future__ import annotations

import asyncio
import json
import logging
import os
import time

import pytest

from shim.config import ConfigError, load
from shim.vm.template import ledger, maker as templatemaker, store as templatestore
from shim.vm.template import template as templates
from testbed.vmconfig import vm_config

HOUR = ledger.WINDOW_S
BOUNDS = ledger.Bounds(per_node=3, per_namespace=2)


def makes_in(store) -> list[ledger.Make]:
    return ledger.read(str(store))


def test_a_namespace_makes_its_bound_of_new_shapes_an_hour_and_no_more(tmp_path) -> None:
    store = str(tmp_path)
    now = time.time()
    assert ledger.charge(store, ledger.Make(now, "team-a", "k1"), BOUNDS) == ""
    assert ledger.charge(store, ledger.Make(now + 1, "team-a", "k2"), BOUNDS) == ""
    said = ledger.charge(store, ledger.Make(now + 2, "team-a", "k3"), BOUNDS)
    assert said == ("namespace team-a started 2 new shapes in the last hour "
                    "(template_new_per_namespace_per_hour = 2)")
    assert [m.key for m in makes_in(store)] == ["k1", "k2"]  # the refused one not counted
    # another author still may, until the node's bound
    assert ledger.charge(store, ledger.Make(now + 3, "team-b", "k4"), BOUNDS) == ""
    assert ledger.charge(store, ledger.Make(now + 4, "", "k5"), BOUNDS) == \
        "the node started 3 new shapes in the last hour (template_new_per_hour = 3)"
    # an hour after its first two, team-a may again, and the old entries are dropped
    assert ledger.charge(store, ledger.Make(now + HOUR + 2, "team-a", "k6"), BOUNDS) == ""
    assert [m.key for m in makes_in(store)] == ["k4", "k6"]


def test_a_pod_without_a_namespace_is_bounded_as_one(tmp_path) -> None:
    bounds = ledger.Bounds(per_node=10, per_namespace=1)
    assert ledger.charge(str(tmp_path), ledger.Make(time.time(), "", "k1"), bounds) == ""
    assert ledger.charge(str(tmp_path), ledger.Make(time.time(), "", "k2"), bounds) == \
        ("namespace (none) started 1 new shapes in the last hour "
         "(template_new_per_namespace_per_hour = 1)")


def test_a_clock_set_back_by_more_than_an_hour_does_not_block_new_shapes(tmp_path) -> None:
    now = time.time()
    ledger.write(str(tmp_path), [ledger.Make(now + 2 * HOUR, "a", "k1")] * 2)
    assert ledger.charge(str(tmp_path), ledger.Make(now, "a", "k2"), BOUNDS) == ""
    assert [m.key for m in makes_in(tmp_path)] == ["k2"]


@pytest.mark.parametrize("damage", ["garbage", "format", "entry", "symlink", "fifo",
                                    "huge"])
def test_a_ledger_that_is_not_one_is_logged_and_started_afresh(tmp_path, damage,
                                                               caplog) -> None:
    """Nothing else lost: the make is counted in a fresh ledger, written as a file of its
    own (a symlink's target untouched, a FIFO never opened for a blocking read)."""
    path = tmp_path / ledger.NAME
    target = tmp_path / "elsewhere"
    target.write_text("keep")
    if damage == "garbage":
        path.write_bytes(b"\x00{not json")
    elif damage == "format":
        path.write_text(json.dumps({"format": 99, "makes": []}))
    elif damage == "entry":
        path.write_text(json.dumps({"format": ledger.FORMAT, "makes": [[1, 2, 3]]}))
    elif damage == "symlink":
        path.symlink_to(target)
    elif damage == "fifo":
        os.mkfifo(path)
    else:
        path.write_bytes(b" " * (ledger.MAX_BYTES + 1))
    with caplog.at_level(logging.WARNING, logger="podvm.template"):
        assert ledger.charge(str(tmp_path), ledger.Make(time.time(), "a", "k1"), BOUNDS) == ""
    assert f"ledger of new template shapes {path} unreadable" in caplog.text
    assert "started afresh" in caplog.text
    assert not path.is_symlink() and path.is_file()
    assert [m.key for m in makes_in(tmp_path)] == ["k1"]
    assert target.read_text() == "keep"
    assert sorted(os.listdir(tmp_path)) == sorted([ledger.NAME, "elsewhere"])


def test_a_ledger_that_cannot_be_written_refuses_the_make(tmp_path) -> None:
    """The bound holds however the disk fares: an unrecorded make is not made, and the
    half-written ledger goes."""
    (tmp_path / ledger.NAME).mkdir()
    said = ledger.charge(str(tmp_path), ledger.Make(time.time(), "a", "k1"), BOUNDS)
    assert said.startswith(f"the ledger of new shapes cannot be written in {tmp_path}: ")
    assert sorted(os.listdir(tmp_path)) == [ledger.NAME]


# --- at maker.make's level: what a pod's shim does after its VM booted -------------------

@pytest.fixture
def made(monkeypatch):
    """The template's make stubbed: its files written, as a make that succeeded leaves
    them; the keys it was called for."""
    calls: list[str] = []

    async def make_in_cgroup(template, shape, record) -> None:
        calls.append(template.key)
        for path in (template.state, template.memory):
            with open(path, "wb") as f:
                f.write(b"\0" * 4096)
        with open(template.meta, "w") as f:
            json.dump({"made": time.time()}, f)

    monkeypatch.setattr(templatemaker, "_make_in_cgroup", make_in_cgroup)
    return calls


def shapes(q, tmp_path, count: int):
    """`count` shapes a pod author mints by the memory's remainder modulo 128 MiB."""
    return [templatemaker.spec_of(q, templatemaker.Shape(1, 257 + i), str(tmp_path / "w"))
            for i in range(count)]


def test_a_namespace_over_its_bound_makes_no_template_and_evicts_none(tmp_path,
                                                                      made) -> None:
    q = vm_config(template_path=str(tmp_path / "store"), template_max_count=2,
                  template_new_per_hour=3, template_new_per_namespace_per_hour=2).qemu
    first, second, third, fourth = shapes(q, tmp_path, 4)
    for spec in (first, second):
        assert asyncio.run(templatemaker.make(spec, namespace="team-a")).result is \
            templatemaker.Result.MADE
    kept = {templates.of(s).key for s in (first, second)}
    outcome = asyncio.run(templatemaker.make(third, namespace="team-a"))
    assert outcome == templatemaker.Outcome(
        templatemaker.Result.BOUNDED, "namespace team-a started 2 new shapes in the last "
        "hour (template_new_per_namespace_per_hour = 2)")
    assert not outcome.ready and len(made) == 2
    assert {t["key"] for t in templatestore.listing(q.template_path)} == kept
    # another author's pod may, and its template takes the least recently used's place
    assert asyncio.run(templatemaker.make(fourth, namespace="team-b")).ready
    # the node's bound: a third author's pod makes none either
    outcome = asyncio.run(templatemaker.make(third, namespace="team-c"))
    assert outcome.line == ("the node started 3 new shapes in the last hour "
                            "(template_new_per_hour = 3)")
    assert len(made) == 3


def test_a_failed_make_still_counts(tmp_path, monkeypatch) -> None:
    async def broken(template, shape, record) -> None:
        raise templates.NotSaved("the disk is full")

    monkeypatch.setattr(templatemaker, "_make_in_cgroup", broken)
    q = vm_config(template_path=str(tmp_path / "store"),
                  template_new_per_namespace_per_hour=1).qemu
    first, second = shapes(q, tmp_path, 2)
    with pytest.raises(templates.NotSaved):
        asyncio.run(templatemaker.make(first, namespace="a"))
    assert asyncio.run(templatemaker.make(second, namespace="a")).result is \
        templatemaker.Result.BOUNDED


def test_warm_and_an_existing_template_are_never_bounded(tmp_path, made) -> None:
    """Bounds of 0: no pod makes a template, yet the operator's warm does, uncounted, and
    a pod of a shape that has one finds it (a restore never reaches the bound)."""
    q = vm_config(template_path=str(tmp_path / "store"), template_new_per_hour=0,
                  template_new_per_namespace_per_hour=0).qemu
    spec, other = shapes(q, tmp_path, 2)
    assert asyncio.run(templatemaker.make(other, namespace="a")).result is \
        templatemaker.Result.BOUNDED
    assert asyncio.run(templatemaker.make(spec)).result is templatemaker.Result.MADE
    assert asyncio.run(templatemaker.make(spec, namespace="a")).result is \
        templatemaker.Result.EXISTS
    assert makes_in(q.template_path) == [] and len(made) == 1


def test_the_pod_s_shim_logs_the_bound_and_the_key_to_raise(tmp_path, made,
                                                            caplog) -> None:
    q = vm_config(template_path=str(tmp_path / "store"),
                  template_new_per_namespace_per_hour=0).qemu
    spec, = shapes(q, tmp_path, 1)
    with caplog.at_level(logging.INFO, logger="podvm.templatemaker"):
        asyncio.run(templatemaker.make_in_background(spec, "sb1", lambda cg: None, "team-a"))
    assert [r.getMessage() for r in caplog.records] == [
        "sandbox sb1: template of its shape not made: namespace team-a started 0 new "
        "shapes in the last hour (template_new_per_namespace_per_hour = 0)"]
    assert made == []


@pytest.mark.parametrize("key", ["template_new_per_hour",
                                 "template_new_per_namespace_per_hour"])
def test_a_negative_bound_is_refused_in_words(tmp_path, key) -> None:
    conf = tmp_path / "podvm.toml"
    conf.write_text(f"[hypervisor.qemu]\n{key} = -1\n")
    with pytest.raises(ConfigError, match=f"{key} must be 0 .pods make no templates. or "
                                          f"more, got -1"):
        load(str(conf))
    conf.write_text(f"[hypervisor.qemu]\n{key} = 5\n")
    assert getattr(load(str(conf)).qemu, key) == 5


def test_a_pod_s_template_is_made_for_its_namespace(tmp_path, monkeypatch) -> None:
    """The Restorer (shim/vm/template/restore.py) hands the maker the pod's namespace,
    which the Machine has from the sandbox's io.kubernetes.cri.sandbox-namespace."""
    from shim.vm.template.restore import Restorer

    seen = []

    async def make_in_background(shape, sandbox_id, record, namespace) -> None:
        seen.append((shape, sandbox_id, namespace))

    monkeypatch.setattr(templatemaker, "make_in_background", make_in_background)
    q = vm_config(template_path=str(tmp_path / "store")).qemu
    spec, = shapes(q, tmp_path, 1)
    restorer = Restorer("sb1", None, False, lambda **changes: None)
    restorer._untemplated = spec  # what launch() leaves after a boot without a template

    async def boot_then_make() -> None:
        restorer.make_template("team-a")
        await asyncio.sleep(0)  # the maker's task runs
        await restorer.cancel_background()

    asyncio.run(boot_then_make())
    assert seen == [(spec, "sb1", "team-a")]
