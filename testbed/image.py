"""A busybox image built from Debian's busybox-static, as an OCI archive `ctr` imports,
and a pause image (the same layer, an entrypoint that sleeps forever) for CRI sandboxes.

No registry is reachable here, so the pod images are made locally and reproducibly.
"""
from __future__ import annotations

import hashlib
import io
import json
import pathlib
import subprocess
import tarfile

BUSYBOX = "/bin/busybox"
IMAGE_NAME = "docker.io/library/busybox:podvm"
# containerd's CRI `sandbox_image` in the test harness. A local name, so no one mistakes it
# for (or containerd tries to pull) the registry's pause image.
PAUSE_IMAGE_NAME = "localhost/podvm/pause:local"
# What the pause container runs: it only has to hold the pod's namespaces, and CRI stops it
# with SIGKILL (PID 1 ignores SIGTERM without a handler).
PAUSE_ENTRYPOINT = ["/bin/sleep", "2147483647"]


def _blob(layout: dict[str, bytes], data: bytes) -> str:
    digest = "sha256:" + hashlib.sha256(data).hexdigest()
    layout["blobs/sha256/" + digest.split(":")[1]] = data
    return digest


def _layer() -> bytes:
    applets = subprocess.run([BUSYBOX, "--list"], check=True, capture_output=True,
                             text=True).stdout.split()
    buf = io.BytesIO()
    with tarfile.open(fileobj=buf, mode="w", format=tarfile.PAX_FORMAT) as tar:
        for d in ("bin", "etc", "proc", "sys", "dev", "tmp", "root"):
            info = tarfile.TarInfo(d)
            info.type, info.mode = tarfile.DIRTYPE, 0o1777 if d == "tmp" else 0o755
            tar.addfile(info)
        with open(BUSYBOX, "rb") as f:
            data = f.read()
        info = tarfile.TarInfo("bin/busybox")
        info.size, info.mode = len(data), 0o755
        tar.addfile(info, io.BytesIO(data))
        for applet in sorted(set(applets) - {"busybox"}):
            info = tarfile.TarInfo(f"bin/{applet}")
            info.type, info.linkname = tarfile.SYMTYPE, "busybox"
            tar.addfile(info)
        passwd = b"root:x:0:0:root:/root:/bin/sh\n"
        info = tarfile.TarInfo("etc/passwd")
        info.size = len(passwd)
        tar.addfile(info, io.BytesIO(passwd))
    return buf.getvalue()


def build_archive(path: pathlib.Path, name: str = IMAGE_NAME,
                  entrypoint: list[str] | None = None) -> pathlib.Path:
    """Write an OCI image archive of busybox to `path` (reused when it exists).

    Without `entrypoint` the image runs `sh` (busybox's usual default); with one, that is
    the image's Entrypoint and it has no Cmd (the pause image)."""
    if path.exists():
        return path
    blobs: dict[str, bytes] = {}
    layer = _layer()
    layer_digest = _blob(blobs, layer)
    image_config: dict = {"Env": ["PATH=/bin"], "WorkingDir": "/"}
    if entrypoint is None:
        image_config["Cmd"] = ["sh"]
    else:
        image_config["Entrypoint"] = entrypoint
    config = json.dumps({
        "architecture": "amd64", "os": "linux",
        "config": image_config,
        "rootfs": {"type": "layers", "diff_ids": [layer_digest]},
    }, sort_keys=True).encode()
    config_digest = _blob(blobs, config)
    manifest = json.dumps({
        "schemaVersion": 2, "mediaType": "application/vnd.oci.image.manifest.v1+json",
        "config": {"mediaType": "application/vnd.oci.image.config.v1+json",
                   "digest": config_digest, "size": len(config)},
        "layers": [{"mediaType": "application/vnd.oci.image.layer.v1.tar",
                    "digest": layer_digest, "size": len(layer)}],
    }, sort_keys=True).encode()
    manifest_digest = _blob(blobs, manifest)
    index = json.dumps({
        "schemaVersion": 2, "mediaType": "application/vnd.oci.image.index.v1+json",
        "manifests": [{"mediaType": "application/vnd.oci.image.manifest.v1+json",
                       "digest": manifest_digest, "size": len(manifest),
                       "platform": {"architecture": "amd64", "os": "linux"},
                       "annotations": {"io.containerd.image.name": name,
                                       "org.opencontainers.image.ref.name": name}}],
    }, sort_keys=True).encode()
    files = {"oci-layout": b'{"imageLayoutVersion":"1.0.0"}', "index.json": index, **blobs}
    tmp = path.with_suffix(".tmp")
    with tarfile.open(tmp, "w") as tar:
        for member, data in files.items():
            info = tarfile.TarInfo(member)
            info.size = len(data)
            tar.addfile(info, io.BytesIO(data))
    tmp.replace(path)
    return path


def build_pause_archive(path: pathlib.Path) -> pathlib.Path:
    """Write the pause image's OCI archive to `path` (reused when it exists)."""
    return build_archive(path, PAUSE_IMAGE_NAME, entrypoint=PAUSE_ENTRYPOINT)
