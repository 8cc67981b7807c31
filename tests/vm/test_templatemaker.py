"""Templates made off the pods' path (shim/vm/template/maker.py), what needs no VM: the
shapes `podvmctl templates warm` takes, and one maker at a time on a node. A template is
made for real, and restored by the node's first pod, in tests/e2e/test_templates.py."""
from __future__ import annotations

import asyncio
import dataclasses
import os
import time

import pytest

from podvmctl import cli
from shim.vm.template import maker as templatemaker, store as templatestore
from shim.vm.template import template as templates
from testbed.vmconfig import vm_config


@pytest.mark.parametrize("text, shape", [
    ("1:256", templatemaker.Shape(1, 256, 1, 1500)),
    ("2:640:0", templatemaker.Shape(2, 640, 0, 1500)),
    (" 1:256:2:9000 ", templatemaker.Shape(1, 256, 2, 9000)),
])
def test_shapes(text, shape) -> None:
    assert templatemaker.Shape.parse(text) == shape


@pytest.mark.parametrize("text", ["", "1", "1:256:1:1500:3", "a:256", "0:256", "1:32",
                                  "1:256:9", "1:256:1:100", "-1:256"])
def test_a_shape_that_is_not_one_is_refused_in_words(text) -> None:
    with pytest.raises(ValueError, match="VCPUS:MIB|at least 1 vCPU"):
        templatemaker.Shape.parse(text)


def test_the_warmed_shape_is_the_one_a_default_pod_restores(tmp_path) -> None:
    """Same key as a pod asking for nothing would look up (machine.py: class_of), and a
    larger pod's class is the same template."""
    q = vm_config(template_path=str(tmp_path / "store")).qemu
    warm = templatemaker.spec_of(q, templatemaker.default_shape(q), str(tmp_path / "w"))
    pod = dataclasses.replace(warm, sandbox_id="pod", workdir=str(tmp_path / "pod"),
                              vcpus=2, memory_mib=q.default_memory + 3 * 128)
    assert templates.of(templatemaker.class_of(pod)).key == templates.of(warm).key
    no_nic = templatemaker.spec_of(q, templatemaker.Shape(1, 256, 0), str(tmp_path / "w"))
    assert templates.of(no_nic).key != templates.of(warm).key


def test_one_maker_at_a_time_on_a_node(tmp_path) -> None:
    """While another process makes a template (the store's `making` lock), a maker
    boots nothing and says so: a flood of new shapes costs one template boot at once."""
    q = vm_config(template_path=str(tmp_path / "store")).qemu
    spec = templatemaker.spec_of(q, templatemaker.default_shape(q), str(tmp_path / "w"))
    os.makedirs(q.template_path, mode=0o700)
    held = templatestore.lock(q.template_path, templatemaker.MAKING)
    assert held >= 0
    try:
        said = asyncio.run(templatemaker.make(spec))
    finally:
        os.close(held)
    assert said == templatemaker.Outcome(templatemaker.Result.BUSY,
                                         "another template is being made on this node")
    assert not templates.of(spec).exists() and not os.path.exists(str(tmp_path / "w"))


def test_warm_waits_for_the_maker_at_work_and_then_says_it_did_not_warm(tmp_path) -> None:
    """`podvmctl templates warm` while a pod's shim holds the node's maker: it waits (it
    does not skip the shape as made), but not for ever, and says so."""
    q = vm_config(template_path=str(tmp_path / "store")).qemu
    os.makedirs(q.template_path, mode=0o700)
    held = templatestore.lock(q.template_path, templatemaker.MAKING)
    try:
        started = time.monotonic()
        outcome, = asyncio.run(templatemaker.warm(q, [templatemaker.default_shape(q)],
                                                  wait_s=2.0))
        waited = time.monotonic() - started
    finally:
        os.close(held)
    assert outcome.result is templatemaker.Result.BUSY and not outcome.ready
    assert outcome.line == ("1:256:1:1500: another template is being made on this node: "
                            "not warmed after 2 s")
    assert 2 <= waited < 10, waited
    assert os.listdir(q.template_path) == [f"{templatemaker.MAKING}.lock"]  # nothing made


def test_warm_refuses_a_configuration_that_keeps_no_templates(tmp_path) -> None:
    q = vm_config(template_path=str(tmp_path / "store"), enable_template=False).qemu
    with pytest.raises(templatemaker.TemplatesOff, match="enable_template = false"):
        asyncio.run(templatemaker.warm(q, [templatemaker.default_shape(q)]))
    assert not (tmp_path / "store").exists()


def test_a_template_being_made_of_the_shape_is_not_made_twice(tmp_path) -> None:
    q = vm_config(template_path=str(tmp_path / "store")).qemu
    spec = templatemaker.spec_of(q, templatemaker.default_shape(q), str(tmp_path / "w"))
    lock = templates.of(spec).lock()
    assert lock is not None
    try:
        said = asyncio.run(templatemaker.make(spec))
    finally:
        lock.release()
    assert said == templatemaker.Outcome(templatemaker.Result.BUSY,
                                         f"template {templates.of(spec).key} is being made")


def test_podvmctl_warm_refuses_what_it_cannot_do_in_words(tmp_path, capsys) -> None:
    """A shape that is not one, --shape without warm, templates off or untrusted: a clear
    line, an exit status, and nothing made."""
    store = tmp_path / "templates"
    conf = tmp_path / "podvm.toml"
    conf.write_text(f'[hypervisor.qemu]\ntemplate_path = "{store}"\n')
    assert cli.main(["templates", "warm", "--config", str(conf), "--shape", "1:x"]) == 2
    assert "a shape is VCPUS:MIB[:NICS[:MTU]]" in capsys.readouterr().err
    assert cli.main(["templates", "--config", str(conf), "--shape", "1:256"]) == 2
    assert "--shape is for `podvmctl templates warm`" in capsys.readouterr().err
    store.mkdir(mode=0o755)  # others may read it: not a store templates may be kept in
    assert cli.main(["templates", "warm", "--config", str(conf)]) == 1
    assert "podvmctl: templates are off:" in capsys.readouterr().err
    conf.write_text(f'[hypervisor.qemu]\ntemplate_path = "{store}"\nenable_template = false\n')
    assert cli.main(["templates", "warm", "--config", str(conf)]) == 1
    assert "templates are off: enable_template = false" in capsys.readouterr().err
    assert list(store.iterdir()) == []


def test_warm_gives_the_template_vm_an_empty_share_to_export(tmp_path, monkeypatch) -> None:
    """Over 9p QEMU exports the shared directory from the template VM's start (its jail
    binds it): warm makes it, empty, where a pod's share would be (it was missing, and
    warm failed with shared_fs = "virtio-9p")."""
    q = vm_config(template_path=str(tmp_path / "store"), shared_fs="virtio-9p").qemu
    seen = []

    async def make(spec, record=None):
        seen.append((os.path.isdir(spec.shared_dir), os.listdir(spec.shared_dir)))
        return templatemaker.Outcome(templatemaker.Result.MADE, "made")

    monkeypatch.setattr(templatemaker, "make", make)
    shapes = [templatemaker.Shape.parse(s) for s in ("1:256:1", "1:256:0")]  # one size
    outcomes = asyncio.run(templatemaker.warm(q, shapes))
    assert [o.result for o in outcomes] == [templatemaker.Result.MADE] * 2
    assert seen == [(True, [])] * 2
