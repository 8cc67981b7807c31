"""Both cgroups path syntaxes kubelet and containerd use, and the sandbox layout built on
them: what parses, where it lands, and that anything else is refused with a clear error."""
from __future__ import annotations

import pytest
from hypothesis import given
from hypothesis import strategies as st

from cgroups import (CgroupPathError, SandboxLayout, child_for_role, parse_cgroupfs_path,
                     parse_cgroups_path, parse_systemd_path)
from cgroups.paths import expand_slice

HEX = "0123456789abcdef"
uids = st.uuids().map(str)
container_ids = st.text(HEX, min_size=64, max_size=64)
qos_classes = st.sampled_from(["", "burstable", "besteffort"])
words = st.text("abcdefghijklmnopqrstuvwxyz0123456789_", min_size=1, max_size=12)
components = st.text(st.characters(blacklist_categories=("Cc", "Cs"), blacklist_characters="/"),
                     min_size=1, max_size=20).filter(lambda c: c not in (".", ".."))


def kubelet_pod_slice(qos: str, uid: str) -> str:
    """How kubelet names a pod's slice: dashes of the uid escaped as underscores."""
    pod = "pod" + uid.replace("-", "_")
    return "-".join(["kubepods"] + ([qos] if qos else []) + [pod]) + ".slice"


@given(qos=qos_classes, uid=uids, cid=container_ids)
def test_kubelet_systemd_path_maps_to_the_directories_systemd_makes(qos, uid, cid):
    pod = "pod" + uid.replace("-", "_")
    expected_dirs = ["kubepods.slice"]
    if qos:
        expected_dirs.append(f"kubepods-{qos}.slice")
    expected_dirs.append("-".join(["kubepods"] + ([qos] if qos else []) + [pod]) + ".slice")
    parsed = parse_cgroups_path(f"{kubelet_pod_slice(qos, uid)}:cri-containerd:{cid}")
    assert parsed.syntax == "systemd"
    assert parsed.path == "/" + "/".join(expected_dirs) + f"/cri-containerd-{cid}.scope"
    assert parsed.parent == "/" + "/".join(expected_dirs)
    layout = SandboxLayout.from_cgroups_path(f"{kubelet_pod_slice(qos, uid)}:cri-containerd:{cid}",
                                             cid)
    assert layout.sandbox == parsed.parent + f"/podvm_{cid}"
    assert layout.vcpus == layout.sandbox + "/vcpus"
    assert layout.vmm == layout.sandbox + "/vmm"


@given(qos=qos_classes, uid=uids, cid=container_ids)
def test_kubelet_cgroupfs_path_parent_is_the_pod_cgroup(qos, uid, cid):
    pod_cgroup = "/kubepods" + (f"/{qos}" if qos else "") + f"/pod{uid}"
    parsed = parse_cgroups_path(f"{pod_cgroup}/{cid}")
    assert parsed.syntax == "cgroupfs"
    assert (parsed.parent, parsed.name) == (pod_cgroup, cid)
    assert SandboxLayout.from_cgroups_path(parsed.path, cid).sandbox == \
        f"{pod_cgroup}/podvm_{cid}"


@given(st.lists(words, min_size=1, max_size=6))
def test_a_slice_nests_once_per_dash(levels):
    slice_name = "-".join(levels) + ".slice"
    dirs = expand_slice(slice_name).split("/")[1:]
    assert len(dirs) == len(levels)
    assert dirs[-1] == slice_name
    for outer, inner in zip(dirs, dirs[1:]):
        assert inner.startswith(outer[: -len(".slice")] + "-")


@given(st.lists(components, min_size=1, max_size=6))
def test_any_canonical_cgroupfs_path_round_trips(parts):
    path = "/" + "/".join(parts)
    parsed = parse_cgroupfs_path(path)
    assert parsed.path == path
    assert parsed.name == parts[-1]
    assert parsed.parent == ("/" + "/".join(parts[:-1]) if parts[:-1] else "/")


@given(st.lists(components, min_size=1, max_size=4), st.integers(0, 4),
       st.sampled_from(["", ".", ".."]))
def test_empty_and_dot_components_are_refused(parts, at, bad):
    parts.insert(min(at, len(parts)), bad)
    with pytest.raises(CgroupPathError):
        parse_cgroupfs_path("/" + "/".join(parts))


@given(st.text(max_size=80))
def test_any_text_either_parses_to_a_canonical_absolute_path_or_is_refused(text):
    try:
        parsed = parse_cgroups_path(text)
    except CgroupPathError as err:
        assert str(err)
        return
    assert parsed.path.startswith("/")
    for part in parsed.path[1:].split("/"):
        assert part not in ("", ".", "..")
        assert all(ord(c) >= 0x20 for c in part)


@pytest.mark.parametrize("bad", [
    "kubepods",                                      # relative, no colons
    "kubepods/burstable/pod1/c1",                    # relative
    "/",                                             # the root is no container
    "/kubepods/../etc",
    "/kubepods//pod1/c1",
    "/kubepods/pod1/c1/",
    "/kubepods/pod1\n/c1",
    "kubepods-burstable.slice:cri-containerd",       # two fields
    "kubepods-burstable.slice:a:b:c",                # four fields
    "kubepods-burstable:cri-containerd:c1",          # not a slice
    "kubepods--burstable.slice:cri-containerd:c1",   # empty level
    "-kubepods.slice:cri-containerd:c1",
    "kubepods-.slice:cri-containerd:c1",
    ".slice:cri-containerd:c1",
    "kubepods.slice::c1",                            # empty prefix
    "kubepods.slice:cri-containerd:",                # empty name
    "kube/pods.slice:cri-containerd:c1",
    "kubepods.slice:cri containerd:c1",
])
def test_malformed_paths_are_refused_with_the_path_in_the_message(bad):
    with pytest.raises(CgroupPathError) as err:
        parse_cgroups_path(bad)
    assert repr(bad) in str(err.value)


def test_systemd_corner_cases_follow_systemd_and_runc():
    assert parse_systemd_path("-.slice:cri-containerd:c1").path == "/cri-containerd-c1.scope"
    assert parse_systemd_path(":cri-containerd:c1").path == "/system.slice/cri-containerd-c1.scope"
    assert parse_systemd_path("a-b.slice:x:c-d.slice").path == "/a.slice/a-b.slice/c-d.slice"


@pytest.mark.parametrize("sandbox_id", ["", "a/b", "..", "a..b", "-a", "x" * 77, "a b"])
def test_sandbox_ids_that_would_escape_or_break_a_directory_name_are_refused(sandbox_id):
    with pytest.raises(CgroupPathError):
        SandboxLayout("/kubepods/pod1", sandbox_id)


def test_pod_cgroup_must_be_canonical():
    with pytest.raises(CgroupPathError):
        SandboxLayout("kubepods/pod1", "abc")
    assert SandboxLayout("/", "abc").sandbox == "/podvm_abc"
    assert SandboxLayout("/a/b", "abc").ancestors() == ["/a/b", "/a", "/"]


@pytest.mark.parametrize("role,child", [("vcpu", "vcpus"), ("main", "vmm"),
                                        ("iothread", "vmm"), ("worker", "vmm"),
                                        ("other", "vmm")])
def test_roles_map_to_children(role, child):
    assert child_for_role(role) == child


def test_the_hypervisors_role_enum_is_accepted():
    from shim.vm.hypervisor import ThreadRole
    assert child_for_role(ThreadRole.VCPU) == "vcpus"
    assert child_for_role(ThreadRole.IOTHREAD) == "vmm"
