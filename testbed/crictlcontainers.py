"""crictl's container commands: create, start, stop, rm, inspect, ps, stats and update."""
from __future__ import annotations

import argparse
import json
import re
import time

import grpc

from podvm_core.pb.cri import api_pb2 as cri

from .criclient import CriClient, CriError
from .crictlformat import (Fatal, ago, for_each_id, human_size, load_message,
                           status_info, table, to_dict, truncate_id, write)


def cmd_create(c: CriClient, a: argparse.Namespace) -> None:
    container = load_message(a.container_config, cri.ContainerConfig())
    pod = load_message(a.pod_config, cri.PodSandboxConfig())
    try:
        r = c.runtime("CreateContainer", cri.CreateContainerRequest(
            pod_sandbox_id=a.pod_id, config=container, sandbox_config=pod))
    except CriError as exc:
        raise Fatal(f"creating container: {exc}") from None
    write(r.container_id + "\n")


def cmd_start(c: CriClient, a: argparse.Namespace) -> None:
    def start(ident: str) -> None:
        c.runtime("StartContainer", cri.StartContainerRequest(container_id=ident))
        write(ident + "\n")
    for_each_id(a.ids, "starting the container", start)


def cmd_stop(c: CriClient, a: argparse.Namespace) -> None:
    def stop(ident: str) -> None:
        # The call lasts up to the grace period: give it that on top of the usual deadline.
        c.runtime("StopContainer", cri.StopContainerRequest(container_id=ident,
                                                            timeout=a.timeout),
                  timeout=(c.timeout or 0) + a.timeout)
        write(ident + "\n")
    for_each_id(a.ids, "stopping the container", stop)


def cmd_rm(c: CriClient, a: argparse.Namespace) -> None:
    ids = list(a.ids)
    if a.all:
        ids = [x.id for x in c.runtime("ListContainers", cri.ListContainersRequest()).containers]
    if not ids:
        raise Fatal("ID cannot be empty")

    def rm(ident: str) -> None:
        status = c.runtime("ContainerStatus", cri.ContainerStatusRequest(container_id=ident))
        if status.status.state == cri.CONTAINER_RUNNING:
            if not a.force:
                raise CriError(grpc.StatusCode.FAILED_PRECONDITION,
                               "container is running, please stop it first or use -f")
            c.runtime("StopContainer", cri.StopContainerRequest(container_id=ident))
        c.runtime("RemoveContainer", cri.RemoveContainerRequest(container_id=ident))
        write(ident + "\n")
    for_each_id(ids, "removing the container", rm)


def cmd_inspect(c: CriClient, a: argparse.Namespace) -> None:
    for ident in a.ids:
        try:
            r = c.runtime("ContainerStatus", cri.ContainerStatusRequest(container_id=ident,
                                                                       verbose=True))
        except CriError as exc:
            raise Fatal(f"getting the status of the container {ident!r}: {exc}") from None
        write(status_info(r.status, dict(r.info)) + "\n")


def _container_state(state: int) -> str:
    return {cri.CONTAINER_CREATED: "Created", cri.CONTAINER_RUNNING: "Running",
            cri.CONTAINER_EXITED: "Exited"}.get(state, "Unknown")


_STATES = {"created": cri.CONTAINER_CREATED, "running": cri.CONTAINER_RUNNING,
           "exited": cri.CONTAINER_EXITED, "unknown": cri.CONTAINER_UNKNOWN}


def cmd_ps(c: CriClient, a: argparse.Namespace) -> None:
    flt = cri.ContainerFilter(id=a.id or "", pod_sandbox_id=a.pod or "")
    if a.state:
        if a.state.lower() not in _STATES:
            raise Fatal(f"state should be one of {', '.join(_STATES)}")
        flt.state.state = _STATES[a.state.lower()]
    elif not a.all and not a.id:
        flt.state.state = cri.CONTAINER_RUNNING
    for sel in a.label or []:
        key, _, value = sel.partition("=")
        flt.label_selector[key] = value
    containers = list(c.runtime("ListContainers", cri.ListContainersRequest(filter=flt))
                      .containers)
    if a.name:
        containers = [x for x in containers if re.search(a.name, x.metadata.name)]
    containers.sort(key=lambda x: x.created_at, reverse=True)
    if a.latest:
        containers = containers[:1]
    if a.output == "json":
        write(json.dumps({"containers": [to_dict(x) for x in containers]}, indent=2) + "\n")
        return
    if a.quiet:
        write("".join(x.id + "\n" for x in containers))
        return
    pods = {p.id: p for p in c.runtime("ListPodSandbox", cri.ListPodSandboxRequest()).items}
    rows = []
    for x in containers:
        pod = pods.get(x.pod_sandbox_id)
        pod_name = x.labels.get("io.kubernetes.pod.name") or (pod.metadata.name if pod
                                                              else "unknown")
        image = x.image.image
        if image.startswith("sha256:"):
            image = truncate_id(image, "sha256:")
        rows.append([truncate_id(x.id), image, ago(x.created_at), _container_state(x.state),
                     x.metadata.name, str(x.metadata.attempt), truncate_id(x.pod_sandbox_id),
                     pod_name])
    write(table(["CONTAINER", "IMAGE", "CREATED", "STATE", "NAME", "ATTEMPT", "POD ID",
                 "POD"], rows))


def _stats(c: CriClient, a: argparse.Namespace) -> list[cri.ContainerStats]:
    flt = cri.ContainerStatsFilter(id=a.id or "", pod_sandbox_id=a.pod or "")
    stats = list(c.runtime("ListContainerStats",
                           cri.ListContainerStatsRequest(filter=flt)).stats)
    if not a.all:
        running = {x.id for x in c.runtime("ListContainers", cri.ListContainersRequest(
            filter=cri.ContainerFilter(state=cri.ContainerStateValue(
                state=cri.CONTAINER_RUNNING)))).containers}
        stats = [s for s in stats if s.attributes.id in running]
    return stats


def cmd_stats(c: CriClient, a: argparse.Namespace) -> None:
    a.id = a.id or a.container
    first = _stats(c, a)
    if a.output == "json":
        write(json.dumps({"stats": [to_dict(s) for s in first]}, indent=2) + "\n")
        return
    before = {s.attributes.id: s for s in first}
    time.sleep(a.seconds)
    rows = []
    for s in sorted(_stats(c, a), key=lambda s: s.attributes.metadata.name):
        old = before.get(s.attributes.id)
        cpu = 0.0
        if old is not None and s.cpu.timestamp > old.cpu.timestamp:
            used = s.cpu.usage_core_nano_seconds.value - old.cpu.usage_core_nano_seconds.value
            cpu = used / (s.cpu.timestamp - old.cpu.timestamp) * 100
        rows.append([truncate_id(s.attributes.id), s.attributes.metadata.name, f"{cpu:.2f}",
                     human_size(s.memory.working_set_bytes.value),
                     human_size(s.writable_layer.used_bytes.value),
                     str(s.writable_layer.inodes_used.value)])
    write(table(["CONTAINER", "NAME", "CPU %", "MEM", "DISK", "INODES"], rows))


def cmd_update(c: CriClient, a: argparse.Namespace) -> None:
    res = cri.LinuxContainerResources(
        cpu_period=a.cpu_period, cpu_quota=a.cpu_quota, cpu_shares=a.cpu_share,
        memory_limit_in_bytes=a.memory, cpuset_cpus=a.cpuset_cpus, cpuset_mems=a.cpuset_mems)

    def update(ident: str) -> None:
        c.runtime("UpdateContainerResources", cri.UpdateContainerResourcesRequest(
            container_id=ident, linux=res))
        write(ident + "\n")
    for_each_id(a.ids, "updating container resources for", update)
