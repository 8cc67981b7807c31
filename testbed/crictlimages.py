"""crictl's image commands: images, pull and inspecti."""
from __future__ import annotations

import argparse
import json

from podvm_core.pb.cri import api_pb2 as cri

from .criclient import CriClient, CriError
from .crictlformat import Fatal, human_size, status_info, table, to_dict, truncate_id, write


def cmd_images(c: CriClient, a: argparse.Namespace) -> None:
    flt = cri.ImageFilter(image=cri.ImageSpec(image=a.image or ""))
    images = list(c.image("ListImages", cri.ListImagesRequest(filter=flt)).images)
    if a.output == "json":
        write(json.dumps({"images": [to_dict(i) for i in images]}, indent=2) + "\n")
        return
    if a.quiet:
        write("".join(i.id + "\n" for i in images))
        return
    rows = []
    for i in images:
        for tag in i.repo_tags or ["<none>:<none>"]:
            repo, _, version = tag.rpartition(":")
            rows.append([repo, version, truncate_id(i.id, "sha256:"), human_size(i.size)])
    write(table(["IMAGE", "TAG", "IMAGE ID", "SIZE"], rows))


def cmd_pull(c: CriClient, a: argparse.Namespace) -> None:
    try:
        r = c.image("PullImage", cri.PullImageRequest(image=cri.ImageSpec(image=a.image)),
                    timeout=None)
    except CriError as exc:
        raise Fatal(f"pulling image: {exc}") from None
    write(f"Image is up to date for {r.image_ref}\n")


def cmd_inspecti(c: CriClient, a: argparse.Namespace) -> None:
    for ref in a.images:
        r = c.image("ImageStatus", cri.ImageStatusRequest(image=cri.ImageSpec(image=ref),
                                                         verbose=True))
        if not r.HasField("image"):
            raise Fatal(f"no such image {ref!r} present")
        write(status_info(r.image, dict(r.info)) + "\n")
