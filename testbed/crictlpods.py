"""crictl's pod sandbox commands: runp, stopp, rmp, inspectp and pods."""
from __future__ import annotations

import argparse
import json
import re

import grpc

from podvm_core.pb.cri import api_pb2 as cri

from .criclient import CriClient, CriError
from .crictlformat import (Fatal, ago, for_each_id, load_message, status_info, table,
                           to_dict, truncate_id, write)


def cmd_runp(c: CriClient, a: argparse.Namespace) -> None:
    config = load_message(a.config_file, cri.PodSandboxConfig())
    try:
        r = c.runtime("RunPodSandbox", cri.RunPodSandboxRequest(
            config=config, runtime_handler=a.runtime or ""))
    except CriError as exc:
        raise Fatal(f"run pod sandbox: {exc}") from None
    write(r.pod_sandbox_id + "\n")


def cmd_stopp(c: CriClient, a: argparse.Namespace) -> None:
    ids = list(a.ids)
    if a.all:
        ids = [p.id for p in c.runtime("ListPodSandbox", cri.ListPodSandboxRequest()).items]

    def stopp(ident: str) -> None:
        c.runtime("StopPodSandbox", cri.StopPodSandboxRequest(pod_sandbox_id=ident))
        write(f"Stopped sandbox {ident}\n")
    for_each_id(ids, "stopping the pod sandbox", stopp)


def cmd_rmp(c: CriClient, a: argparse.Namespace) -> None:
    ids = list(a.ids)
    if a.all:
        ids = [p.id for p in c.runtime("ListPodSandbox", cri.ListPodSandboxRequest()).items]

    def rmp(ident: str) -> None:
        status = c.runtime("PodSandboxStatus", cri.PodSandboxStatusRequest(pod_sandbox_id=ident))
        if status.status.state == cri.SANDBOX_READY:
            if not a.force:
                raise CriError(grpc.StatusCode.FAILED_PRECONDITION,
                               f"pod sandbox {ident} is running, please stop it first or "
                               "use -f")
            c.runtime("StopPodSandbox", cri.StopPodSandboxRequest(pod_sandbox_id=ident))
        c.runtime("RemovePodSandbox", cri.RemovePodSandboxRequest(pod_sandbox_id=ident))
        write(f"Removed sandbox {ident}\n")
    for_each_id(ids, "removing the pod sandbox", rmp)


def cmd_inspectp(c: CriClient, a: argparse.Namespace) -> None:
    for ident in a.ids:
        try:
            r = c.runtime("PodSandboxStatus", cri.PodSandboxStatusRequest(
                pod_sandbox_id=ident, verbose=True))
        except CriError as exc:
            raise Fatal(f"getting the pod sandbox status for {ident!r}: {exc}") from None
        write(status_info(r.status, dict(r.info)) + "\n")


def cmd_pods(c: CriClient, a: argparse.Namespace) -> None:
    flt = cri.PodSandboxFilter(id=a.id or "")
    if a.state:
        states = {"ready": cri.SANDBOX_READY, "notready": cri.SANDBOX_NOTREADY}
        if a.state.lower() not in states:
            raise Fatal("state should be ready or notready")
        flt.state.state = states[a.state.lower()]
    for sel in a.label or []:
        key, _, value = sel.partition("=")
        flt.label_selector[key] = value
    pods = list(c.runtime("ListPodSandbox", cri.ListPodSandboxRequest(filter=flt)).items)
    if a.name:
        pods = [p for p in pods if re.search(a.name, p.metadata.name)]
    if a.namespace:
        pods = [p for p in pods if re.search(a.namespace, p.metadata.namespace)]
    pods.sort(key=lambda p: p.created_at, reverse=True)
    if a.latest:
        pods = pods[:1]
    if a.output == "json":
        write(json.dumps({"items": [to_dict(p) for p in pods]}, indent=2) + "\n")
        return
    if a.quiet:
        write("".join(p.id + "\n" for p in pods))
        return
    rows = [[truncate_id(p.id), ago(p.created_at),
             "Ready" if p.state == cri.SANDBOX_READY else "NotReady", p.metadata.name,
             p.metadata.namespace, str(p.metadata.attempt), p.runtime_handler or "(default)"]
            for p in pods]
    write(table(["POD ID", "CREATED", "STATE", "NAME", "NAMESPACE", "ATTEMPT", "RUNTIME"],
                rows))
