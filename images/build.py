"""Build the project's images, podvm-webhook and podvm-node, with no Docker daemon: each as
an OCI image layout under build/images/<name>/ and as the archives `ctr images import`
and `skopeo copy` take (<name>.oci.tar: oci-archive; <name>.docker.tar: docker-archive).

podvm-webhook: Debian's Python 3.11 and the libraries it loads (images/rootfs.py), podvm's
Python dependencies, then podvm (images/python.py), one layer each so that a new podvm
leaves the first two in place; it runs as an unprivileged user and never writes to its
root. podvm-node: nsenter and the libraries it needs, then the self-contained podvm tree
`podvm-node install` copies to a host (podvm_node/bundle.py) at /opt/podvm; it runs as
root. Inputs are pinned (Debian versions, Python versions, podvm's sources, the bundle's
own key, this builder, SOURCE_DATE_EPOCH): the same inputs give the same bytes, and images
whose inputs did not change are not rebuilt.

usage: python -m images.build [--out DIR] [--bundle DIR] [--force]
"""
from __future__ import annotations

import argparse
import hashlib
import json
import os
import pathlib
import subprocess
import sys
import tempfile

import yaml

from guest.build import check_needed
from images import python, rootfs
from images.layer import Layer, make_layer
from images.oci import Image, docker_files, layout_files, write_layout, write_tar
from podvm_node import bundle

ROOT = pathlib.Path(__file__).resolve().parents[1]
DEFAULT_OUT = ROOT / "build" / "images"
DEFAULT_BUNDLE = ROOT / "build" / "node-bundle"
TAG = "0.1.0"
WEBHOOK_MANIFEST = ROOT / "packaging/kubernetes/webhook.yaml"
NAMES = ("podvm-webhook", "podvm-node")


def source_date_epoch() -> int:
    """Every time in the images: SOURCE_DATE_EPOCH when set, else the epoch itself."""
    value = os.environ.get("SOURCE_DATE_EPOCH", "0")
    if not value.isdigit():
        raise SystemExit(f"SOURCE_DATE_EPOCH={value!r}: not a whole number of seconds")
    return int(value)


def webhook_args() -> list[str]:
    """The arguments packaging/kubernetes/webhook.yaml gives the server: the image's
    default command, so the image alone runs as the Deployment runs it."""
    for doc in yaml.safe_load_all(WEBHOOK_MANIFEST.read_text()):
        if doc and doc.get("kind") == "Deployment":
            return doc["spec"]["template"]["spec"]["containers"][0]["args"]
    raise SystemExit(f"{WEBHOOK_MANIFEST}: no Deployment")


def image_configs() -> dict[str, dict]:
    uid, gid = rootfs.NONROOT
    return {
        "podvm-webhook": {
            "User": f"{uid}:{gid}", "WorkingDir": "/", "ExposedPorts": {"8443/tcp": {}},
            "Env": ["PATH=/usr/local/bin:/usr/bin:/bin", "LANG=C.UTF-8",
                    "PYTHONDONTWRITEBYTECODE=1"],
            "Entrypoint": ["/usr/local/bin/podvm-webhook"], "Cmd": webhook_args()},
        "podvm-node": {
            "User": "0:0", "WorkingDir": "/",
            "Env": [f"PATH={bundle.PREFIX}/bin:/usr/bin:/bin", "LANG=C.UTF-8"],
            "Entrypoint": [f"{bundle.PREFIX}/bin/podvm-node"]}}


def builder_digest() -> str:
    h = hashlib.sha256()
    for path in sorted([*(ROOT / "images").glob("*.py"), ROOT / "guest/debian.py",
                        ROOT / "guest/build.py", ROOT / "guest/elfneeded.py"]):
        h.update(str(path.relative_to(ROOT)).encode() + b"\0" + path.read_bytes())
    return h.hexdigest()


def node_bundle(path: pathlib.Path) -> str:
    """The bundle at `path`, built there unless up to date (podvm_node/bundle.py keeps
    its own cache key); returns that key."""
    try:
        bundle.build(path)
    except (bundle.BundleError, RuntimeError) as exc:
        raise SystemExit(f"the node bundle: {exc}") from None
    return (path / "inputs.sha256").read_text().strip()


def inputs(bundle_dir: pathlib.Path) -> dict:
    """Everything the images are made of or by (the cache key hashes it)."""
    return {"webhook_debian": rootfs.pinned_packages(rootfs.WEBHOOK_PACKAGES),
            "node_debian": rootfs.pinned_packages(rootfs.NODE_PACKAGES),
            "python": python.pins(), "podvm": python.sources_digest(),
            "bundle": node_bundle(bundle_dir), "builder": builder_digest(),
            "configs": image_configs(), "source_date_epoch": source_date_epoch(), "tag": TAG}


def webhook_layers(manifest: dict, cache: pathlib.Path, work: pathlib.Path
                   ) -> list[tuple[str, Layer]]:
    """Debian's Python, the dependencies, podvm: each checked to load with the rest."""
    epoch = source_date_epoch()
    debian, deps, podvm, whole = (work / n for n in ("debian", "deps", "podvm", "whole"))
    pinned = manifest["webhook_debian"]
    rootfs.stage_debian(rootfs.fetch_debs(pinned, cache / "debs"), debian,
                        rootfs.WEBHOOK_MOUNT_POINTS)
    python.fetch_wheels(manifest["python"], cache / "wheels")
    python.install([f"{n}=={v}" for n, v in manifest["python"].items()], [cache / "wheels"],
                   deps)
    wheel = python.podvm_wheel(work)
    python.install([f"podvm=={wheel.name.split('-')[1]}"], [wheel.parent], podvm)
    python.write_scripts(podvm)
    for tree, compiled in ((debian, "usr/lib/python3.11"), (deps, python.SITE),
                           (podvm, python.SITE)):
        rootfs.prune(tree)
        rootfs.compile_python(tree, [compiled])
    for tree in (debian, deps, podvm):
        subprocess.run(["cp", "-a", "--link", f"{tree}/.", str(whole)], check=True)
    check_needed(whole)
    debs = " ".join(f"{p}={v}" for p, v in sorted(pinned.items()))
    pins = " ".join(f"{p}=={v}" for p, v in sorted(manifest["python"].items()))
    return [(f"debian: {debs}", make_layer(debian, epoch)),
            (f"pip: {pins}", make_layer(deps, epoch)),
            (f"pip: {wheel.name}", make_layer(podvm, epoch))]


def node_layers(manifest: dict, cache: pathlib.Path, work: pathlib.Path,
                bundle_dir: pathlib.Path) -> list[tuple[str, Layer]]:
    epoch = source_date_epoch()
    base = work / "node"
    pinned = manifest["node_debian"]
    rootfs.stage_debian(rootfs.fetch_debs(pinned, cache / "debs"), base)
    rootfs.prune(base)
    check_needed(base)
    debs = " ".join(f"{p}={v}" for p, v in sorted(pinned.items()))
    return [(f"debian: {debs}", make_layer(base, epoch)),
            (f"podvm_node.bundle: {manifest['bundle']}",
             make_layer(bundle_dir, epoch, prefix=bundle.PREFIX.strip("/")))]


def write_image(image: Image, out: pathlib.Path) -> dict:
    files = layout_files(image)
    write_layout(files, out / image.name)
    write_tar(files, out / f"{image.name}.oci.tar", image.created)
    write_tar(docker_files(image), out / f"{image.name}.docker.tar", image.created)
    index = json.loads(files["index.json"])
    return {"reference": image.reference, "manifest": index["manifests"][0]["digest"],
            "compressed_bytes": sum(len(layer.gzipped) for _, layer in image.layers),
            "unpacked_bytes": sum(len(layer.tar) for _, layer in image.layers)}


def build(out: pathlib.Path, force: bool = False, cache: pathlib.Path | None = None,
          bundle_dir: pathlib.Path = DEFAULT_BUNDLE) -> dict:
    """Both images under `out`, unless those there were made from the same inputs;
    fetched .debs and wheels are kept in `cache` (default: out/cache). Returns each
    image's reference, manifest digest and sizes."""
    manifest = inputs(bundle_dir)
    digest = hashlib.sha256(json.dumps(manifest, sort_keys=True).encode()).hexdigest()
    stamp, summary = out / "inputs.sha256", out / "images.json"
    if not force and stamp.exists() and stamp.read_text().strip() == digest and \
            summary.exists() and all((out / n / "index.json").exists() for n in NAMES):
        print(f"images in {out} are up to date ({digest[:12]})")
        return json.loads(summary.read_text())["images"]
    out.mkdir(parents=True, exist_ok=True)
    stamp.unlink(missing_ok=True)
    made = assemble(manifest, out, cache or out / "cache", bundle_dir)
    summary.write_text(json.dumps({"inputs": manifest, "images": made}, indent=2,
                                  sort_keys=True) + "\n")
    stamp.write_text(digest + "\n")
    return made


def assemble(manifest: dict, out: pathlib.Path, cache: pathlib.Path,
             bundle_dir: pathlib.Path, names: tuple[str, ...] = NAMES) -> dict:
    """The images `names` of `manifest` (inputs()' answer) written under `out`."""
    with tempfile.TemporaryDirectory(prefix="podvm-images-") as tmp:
        work = pathlib.Path(tmp)
        makers = {"podvm-webhook": lambda: webhook_layers(manifest, cache, work),
                  "podvm-node": lambda: node_layers(manifest, cache, work, bundle_dir)}
        layers = {name: makers[name]() for name in names}
    return {name: write_image(Image(
        name, TAG, layers[name], manifest["configs"][name], manifest["source_date_epoch"],
        {"org.opencontainers.image.title": name, "org.opencontainers.image.version": TAG}),
        out) for name in names}


def report(made: dict) -> None:
    mib = 1 << 20
    for name, facts in made.items():
        print(f"{facts['reference']}: {facts['compressed_bytes'] / mib:.1f} MiB compressed, "
              f"{facts['unpacked_bytes'] / mib:.1f} MiB unpacked ({facts['manifest'][:19]})")


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", type=pathlib.Path, default=DEFAULT_OUT,
                        help=f"output directory (default {DEFAULT_OUT})")
    parser.add_argument("--bundle", type=pathlib.Path, default=DEFAULT_BUNDLE,
                        help=f"where the node bundle is built (default {DEFAULT_BUNDLE})")
    parser.add_argument("--force", action="store_true", help="rebuild even if up to date")
    args = parser.parse_args()
    report(build(args.out.resolve(), args.force, bundle_dir=args.bundle.resolve()))
    return 0


if __name__ == "__main__":
    sys.exit(main())
