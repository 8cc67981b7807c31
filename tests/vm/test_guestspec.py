"""What the guest sees of a CRI container's spec."""
from __future__ import annotations

from shim.vm import guestspec
from shim.host import mounts

CRI_CONTAINER = {
    "ociVersion": "1.0.2",
    "process": {"args": ["sh"]},
    "root": {"path": "rootfs", "readonly": True},
    "hooks": {"prestart": [{"path": "/usr/bin/hook"}]},
    "mounts": [
        {"destination": "/proc", "type": "proc", "source": "proc"},
        {"destination": "/dev", "type": "tmpfs", "source": "tmpfs"},
        {"destination": "/etc/hosts", "type": "bind",
         "source": "/var/lib/containerd/io.containerd.grpc.v1.cri/sandboxes/sb/hosts",
         "options": ["rbind", "rprivate", "rw"]},
        {"destination": "/etc/resolv.conf", "type": "bind",
         "source": "/var/lib/containerd/io.containerd.grpc.v1.cri/sandboxes/sb/resolv.conf",
         "options": ["rbind", "ro"]},
        {"destination": "/dev/shm", "type": "bind",
         "source": "/run/containerd/io.containerd.grpc.v1.cri/sandboxes/sb/shm",
         "options": ["rbind", "rw"]},
        {"destination": "/dev/kmsg", "type": "bind", "source": "/dev/kmsg",
         "options": ["rbind"]},
    ],
    "linux": {
        "cgroupsPath": "/kubepods/burstable/podabc/c1",
        "resources": {"cpu": {"quota": 50000, "period": 100000, "cpus": "0-1", "mems": "0"},
                      "memory": {"limit": 134217728}},
        "namespaces": [{"type": "pid"}, {"type": "ipc", "path": "/proc/42/ns/ipc"},
                       {"type": "network", "path": "/var/run/netns/cni-1"},
                       {"type": "mount"}],
    },
}


def test_rootfs_and_host_files_come_through_the_shared_directory() -> None:
    g = guestspec.rewrite(CRI_CONTAINER, "c1")
    assert g.spec["root"] == {"path": "/run/podvm/shared/c1/rootfs", "readonly": True}
    by_dest = {m["destination"]: m for m in g.spec["mounts"]}
    assert by_dest["/proc"]["type"] == "proc"
    assert by_dest["/etc/hosts"]["source"] == "/run/podvm/shared/c1/mounts/2-hosts"
    assert by_dest["/etc/resolv.conf"]["source"] == "/run/podvm/shared/c1/mounts/3-resolv.conf"
    assert by_dest["/dev/shm"]["type"] == "tmpfs"
    assert "/dev/kmsg" not in by_dest
    assert [(b.source.rsplit("/", 1)[1], b.target, b.readonly) for b in g.binds] == [
        ("hosts", "c1/mounts/2-hosts", False), ("resolv.conf", "c1/mounts/3-resolv.conf", True)]


def test_a_writable_layer_in_the_guest_lays_the_root_over_the_share() -> None:
    g = guestspec.rewrite(CRI_CONTAINER, "c1", writable_in_guest=True)
    assert g.spec["root"] == {"path": "/run/podvm/rootfs/c1", "readonly": True}
    assert g.rootfs_lower == "/run/podvm/shared/c1/rootfs"
    assert guestspec.rewrite(CRI_CONTAINER, "c1").rootfs_lower == ""
    assert g.binds == guestspec.rewrite(CRI_CONTAINER, "c1").binds  # volumes as before


def test_host_only_parts_are_dropped_and_said() -> None:
    g = guestspec.rewrite(CRI_CONTAINER, "c1")
    linux = g.spec["linux"]
    assert "cgroupsPath" not in linux and "hooks" not in g.spec
    assert linux["resources"]["cpu"] == {"quota": 50000, "period": 100000}
    assert linux["resources"]["memory"] == {"limit": 134217728}
    assert linux["namespaces"] == [{"type": "pid"}, {"type": "ipc", "path": "podvm:sandbox"},
                                   {"type": "mount"}]
    text = " ".join(g.dropped)
    for word in ("/dev/shm", "/dev/kmsg", "hooks", "cpus", "mems"):
        assert word in text
    assert "cni-1" not in text  # not dropped: bridged, the VM has the pod's interfaces
    assert CRI_CONTAINER["linux"]["cgroupsPath"]  # the input is left alone


def test_update_resources_keep_the_host_cpuset_on_the_host() -> None:
    r = {"cpu": {"shares": 512, "cpus": "2"}, "memory": {"limit": 1}}
    assert guestspec.resources(r) == {"cpu": {"shares": 512}, "memory": {"limit": 1}}
    assert r["cpu"]["cpus"] == "2"


def test_guest_cpuset_names_the_vcpus_the_host_cpuset_maps_to() -> None:
    spec = {"linux": {"resources": {"cpu": {"cpus": "6-7", "shares": 512}}}}
    guest = guestspec.rewrite(spec, "c1", guest_cpus=[2, 1])
    assert guest.spec["linux"]["resources"]["cpu"] == {"cpus": "1,2", "shares": 512}
    assert guestspec.rewrite(spec, "c1", guest_cpus=[]).spec["linux"]["resources"]["cpu"] == {
        "shares": 512}
    assert guestspec.resources({"cpu": {"cpus": "6"}}, [0]) == {"cpu": {"cpus": "0"}}
    assert guestspec.resources({"memory": {"limit": 1}}, [3]) == {"memory": {"limit": 1},
                                                         "cpu": {"cpus": "3"}}


VOLUME = "/var/lib/kubelet/pods/p/volumes/data"


def volume_spec(*options: str) -> dict:
    return {"process": {"args": ["sh"]}, "root": {"path": "rootfs"},
            "mounts": [{"destination": "/data", "type": "bind", "source": VOLUME,
                        "options": ["rbind", "rprivate", *options]}]}


def host_table(path: str) -> list[mounts.Submount]:
    """A volume with a tmpfs below it and a read-only mount below that."""
    assert path == VOLUME
    return [mounts.Submount("cache", ("rw", "nosuid", "nodev")),
            mounts.Submount("cache/frozen", ("ro",))]


def test_a_read_only_bind_keeps_what_is_mounted_below_it_as_it_is() -> None:
    """runc's `ro` on an rbind remounts its top only: submounts stay writable."""
    g = guestspec.rewrite(volume_spec("ro"), "c1", submounts=host_table)
    shared = "/run/podvm/shared/c1/mounts/0-data"
    assert g.spec["mounts"] == [
        {"destination": "/data", "type": "bind", "source": shared,
         "options": ["rbind", "rprivate", "ro"]},
        {"destination": "/data/cache", "type": "bind", "source": f"{shared}/cache",
         "options": ["rbind", "rw", "nosuid", "nodev"]},
        {"destination": "/data/cache/frozen", "type": "bind",
         "source": f"{shared}/cache/frozen", "options": ["rbind", "ro"]}]
    assert [(b.source, b.readonly) for b in g.binds] == [(VOLUME, True)]


def test_a_recursive_read_only_bind_is_one_read_only_mount_in_the_guest() -> None:
    """The guest's 9p view of the tree has no submounts: `ro` there is recursive, and
    the guest's runc (1.1) does not know `rro`."""
    for options in (("rro",), ("ro", "rro")):
        g = guestspec.rewrite(volume_spec(*options), "c1", submounts=host_table)
        assert g.spec["mounts"] == [
            {"destination": "/data", "type": "bind",
             "source": "/run/podvm/shared/c1/mounts/0-data",
             "options": ["ro", "rbind", "rprivate"]}]
        assert [(b.source, b.readonly) for b in g.binds] == [(VOLUME, True)]


def test_a_writable_bind_does_not_look_below() -> None:
    def no_look(path: str) -> list[mounts.Submount]:
        raise AssertionError(f"looked below {path}")

    g = guestspec.rewrite(volume_spec("rw"), "c1", submounts=no_look)
    assert [m["destination"] for m in g.spec["mounts"]] == ["/data"]


def test_an_empty_dir_the_guest_keeps_is_bound_from_its_volumes_not_the_share() -> None:
    """With `local_dirs`, an emptyDir bind names the guest's directory (the last of those
    it needs) and is no host bind; `rro` becomes `ro`, other binds stay shares."""
    from shim.host.emptydir import LocalDir

    volume = "/var/lib/kubelet/pods/u1/volumes/kubernetes.io~empty-dir/cache"
    subpath = "/var/lib/kubelet/pods/u1/volume-subpaths/cache/app/2"
    kept = {volume: (LocalDir("cache", 0o2777, 0, 1234),),
            subpath: (LocalDir("cache", 0o2777, 0, 1234), LocalDir("cache/a", 0o755, 0, 0),
                      LocalDir("cache/a/b", 0o750, 0, 1234))}
    spec = dict(CRI_CONTAINER, mounts=[
        *CRI_CONTAINER["mounts"],
        {"destination": "/cache", "type": "bind", "source": volume,
         "options": ["rbind", "rprivate", "rw"]},
        {"destination": "/b", "type": "bind", "source": subpath, "options": ["rbind", "rro"]}])
    g = guestspec.rewrite(spec, "c1", writable_in_guest=True, local_dirs=kept.get)
    by_dest = {m["destination"]: m for m in g.spec["mounts"]}
    assert by_dest["/cache"] == {"destination": "/cache", "type": "bind",
                                 "source": "/run/podvm/scratch/volumes/cache",
                                 "options": ["rbind", "rprivate", "rw"]}
    assert by_dest["/b"]["source"] == "/run/podvm/scratch/volumes/cache/a/b"
    assert by_dest["/b"]["options"] == ["ro", "rbind"]
    assert g.local_dirs == kept[subpath]  # each directory once, the volume's first
    assert [b.target for b in g.binds] == ["c1/mounts/2-hosts", "c1/mounts/3-resolv.conf"]
    shared = guestspec.rewrite(spec, "c1", writable_in_guest=True)
    assert shared.local_dirs == () and len(shared.binds) == 4
