"""An image as the OCI image spec lays it out (oci-layout, index.json, blobs/sha256/...:
the manifest, the config, the gzip'd layers), and the two archives tools take it as: the
layout in a tar (`oci-archive`) and what `docker save` writes (`docker-archive`:
manifest.json, the config, each layer's uncompressed tar). Every file and archive member
has the same fixed time, so equal images give equal bytes."""
from __future__ import annotations

import hashlib
import io
import json
import pathlib
import shutil
import tarfile
import time
from dataclasses import dataclass, field

from images.layer import Layer

MANIFEST = "application/vnd.oci.image.manifest.v1+json"
CONFIG = "application/vnd.oci.image.config.v1+json"
INDEX = "application/vnd.oci.image.index.v1+json"
LAYER = "application/vnd.oci.image.layer.v1.tar+gzip"
NAME_ANNOTATION = "io.containerd.image.name"  # the name `ctr images import` gives it
REF_ANNOTATION = "org.opencontainers.image.ref.name"  # the tag within the layout


@dataclass
class Image:
    name: str  # "podvm-webhook"
    tag: str  # "0.1.0"
    layers: list[tuple[str, Layer]]  # (what the layer holds, the layer)
    config: dict  # the image config's "config": User, Env, Entrypoint ...
    created: int  # SOURCE_DATE_EPOCH
    labels: dict[str, str] = field(default_factory=dict)

    @property
    def reference(self) -> str:
        """The fully qualified name Kubernetes turns `podvm-webhook:0.1.0` into."""
        return f"docker.io/library/{self.name}:{self.tag}"


def _json(value: object) -> bytes:
    return json.dumps(value, sort_keys=True, separators=(",", ":")).encode()


def _digest(data: bytes) -> str:
    return "sha256:" + hashlib.sha256(data).hexdigest()


def _timestamp(epoch: int) -> str:
    return time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime(epoch))


def config_blob(image: Image) -> bytes:
    created = _timestamp(image.created)
    return _json({
        "architecture": "amd64", "os": "linux", "created": created,
        "config": dict(image.config, Labels=image.labels) if image.labels else image.config,
        "rootfs": {"type": "layers", "diff_ids": [layer.diff_id for _, layer in image.layers]},
        "history": [{"created": created, "created_by": what, "comment": "images/build.py"}
                    for what, _ in image.layers]})


def manifest_blob(image: Image, config: bytes) -> bytes:
    return _json({
        "schemaVersion": 2, "mediaType": MANIFEST,
        "config": {"mediaType": CONFIG, "digest": _digest(config), "size": len(config)},
        "layers": [{"mediaType": LAYER, "digest": layer.digest, "size": len(layer.gzipped)}
                   for _, layer in image.layers]})


def layout_files(image: Image) -> dict[str, bytes]:
    """The OCI image layout's files, by path within it."""
    config = config_blob(image)
    manifest = manifest_blob(image, config)
    files = {"oci-layout": _json({"imageLayoutVersion": "1.0.0"})}
    index = {"schemaVersion": 2, "mediaType": INDEX, "manifests": [{
        "mediaType": MANIFEST, "digest": _digest(manifest), "size": len(manifest),
        "platform": {"architecture": "amd64", "os": "linux"},
        "annotations": {NAME_ANNOTATION: image.reference,
                        REF_ANNOTATION: image.tag}}]}
    files["index.json"] = _json(index)
    for blob in (manifest, config, *(layer.gzipped for _, layer in image.layers)):
        files["blobs/sha256/" + _digest(blob).split(":")[1]] = blob
    return files


def docker_files(image: Image) -> dict[str, bytes]:
    """What `docker save` writes for the image (its classic format)."""
    config = config_blob(image)
    config_name = _digest(config).split(":")[1] + ".json"
    files = {config_name: config}
    layer_names = []
    for _, layer in image.layers:
        name = layer.diff_id.split(":")[1] + "/layer.tar"
        files[name] = layer.tar
        layer_names.append(name)
    files["manifest.json"] = _json([{"Config": config_name,
                                     "RepoTags": [f"{image.name}:{image.tag}"],
                                     "Layers": layer_names}])
    return files


def write_tar(files: dict[str, bytes], path: pathlib.Path, mtime: int) -> None:
    """`files` as a tar at `path`, replaced in one step; directories made explicit."""
    tmp = path.with_name(path.name + ".tmp")
    dirs = sorted({str(p) for name in files for p in pathlib.PurePosixPath(name).parents
                   if str(p) != "."})
    with tarfile.open(tmp, "w", format=tarfile.PAX_FORMAT) as tar:
        for name in sorted([*dirs, *files]):
            info = tarfile.TarInfo(name)
            info.mtime = mtime
            if name in files:
                info.size, info.mode = len(files[name]), 0o644
                tar.addfile(info, io.BytesIO(files[name]))
            else:
                info.type, info.mode = tarfile.DIRTYPE, 0o755
                tar.addfile(info)
    tmp.replace(path)


def write_layout(files: dict[str, bytes], directory: pathlib.Path) -> None:
    """The layout as a directory, replacing what was there in one rename."""
    tmp = directory.with_name(directory.name + ".tmp")
    shutil.rmtree(tmp, ignore_errors=True)
    for name, data in files.items():
        (tmp / name).parent.mkdir(parents=True, exist_ok=True)
        (tmp / name).write_bytes(data)
    shutil.rmtree(directory, ignore_errors=True)
    tmp.rename(directory)
