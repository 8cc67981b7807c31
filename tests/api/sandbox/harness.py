"""containerd 2.x's side of the Sandbox API ("shim" sandboxer), played over ttrpc against
the real shim binary: `start` with id = the sandbox id and a bundle without config.json,
an events endpoint on TTRPC_ADDRESS, and a pod cgroup that kubelet would have made."""
from __future__ import annotations

import contextlib
import os
import pathlib
import uuid

from podvm_core.pb.containerd.runtime.bootstrap.v1 import bootstrap_pb2
from podvm_core.pb.containerd.runtime.sandbox.v1 import sandbox_pb2 as sb
from podvm_core.pb.containerd.services.events.ttrpc.v1 import events_pb2
from podvm_core.pb.cri import api_pb2 as cri
from podvm_core.ttrpc import Client, Server, bind
import cgroups
from testbed.namespaces import run_namespace
from testbed.prereqs import require_root
from testbed.shimproc import daemon_pid, run_shim
from testbed.taskshim import EventSink, remove_cgroup_dirs
from testbed.vmconfig import vmm_config, vmm_env, write_test_config

SANDBOX = "containerd.runtime.sandbox.v1.Sandbox"
NS = run_namespace("podvm-sbapi-test")
MIB = 1 << 20
KATA_DEFAULT_MEMORY = "io.katacontainers.config.hypervisor.default_memory"


def start_address(stdout: bytes) -> str:
    """The address in `start`'s answer: bare, or in the BootstrapResult it answers to
    containerd 2.3's BootstrapParams (shim/contract/bootstrap.py)."""
    if stdout.startswith(b"unix://"):
        return stdout.decode()
    result = bootstrap_pb2.BootstrapResult.FromString(stdout)
    assert (result.version, result.protocol) == (2, "ttrpc"), result
    return result.address


class Pod:
    """One shim started for a sandbox, and the ttrpc client containerd would hold."""

    def __init__(self, tmp: pathlib.Path, sandbox_id: str, client: Client, address: str,
                 grpc: str, bundle: pathlib.Path, parent: str, env: dict,
                 events: list[tuple[str, str]]) -> None:
        self.tmp, self.id, self.client, self.address = tmp, sandbox_id, client, address
        self.grpc, self.bundle, self.parent, self.env = grpc, bundle, parent, env
        self.events = events
        self.daemon_pid = daemon_pid(NS, sandbox_id)

    @property
    def sandbox_cgroup(self) -> str:
        return f"{self.parent}/podvm_{self.id}"

    async def call(self, method: str, request, response_type):
        return await self.client.call(SANDBOX, method, request, response_type)

    def config(self, quota: int = 0, memory: int = 0, overhead_memory: int = 512 * MIB,
               annotations: dict[str, str] | None = None,
               overhead_quota: int = 100_000) -> cri.PodSandboxConfig:
        """A PodSandboxConfig as CRI sends it: the pod's totals, the RuntimeClass overhead
        (1000m CPU by default, as packaging/ declares), kubelet's pod cgroup as the
        parent."""
        config = cri.PodSandboxConfig()
        config.metadata.name, config.metadata.uid = "api-pod", f"uid-{self.id}"
        config.metadata.namespace = "default"
        config.hostname = "api-pod"
        config.linux.cgroup_parent = self.parent
        if quota:
            config.linux.resources.cpu_period = 100_000
            config.linux.resources.cpu_quota = quota
        config.linux.resources.memory_limit_in_bytes = memory
        config.linux.overhead.memory_limit_in_bytes = overhead_memory
        if overhead_quota:
            config.linux.overhead.cpu_period = 100_000
            config.linux.overhead.cpu_quota = overhead_quota
        config.annotations.update(annotations or {})
        return config

    async def create(self, config: cri.PodSandboxConfig | None = None,
                     sandbox_id: str | None = None, **annotations: str
                     ) -> sb.CreateSandboxResponse:
        req = sb.CreateSandboxRequest(sandbox_id=self.id if sandbox_id is None else sandbox_id,
                                      bundle_path=str(self.bundle))
        if config is not None:
            req.options.Pack(config)
        req.annotations.update(annotations)
        return await self.call("CreateSandbox", req, sb.CreateSandboxResponse)

    async def status(self, verbose: bool = True) -> sb.SandboxStatusResponse:
        return await self.call("SandboxStatus", sb.SandboxStatusRequest(
            sandbox_id=self.id, verbose=verbose), sb.SandboxStatusResponse)


@contextlib.asynccontextmanager
async def sandbox_shim(tmp_path: pathlib.Path, enable_annotations: tuple[str, ...] = (),
                       runtime_options: bytes | None = None, env_config: bool = True,
                       vmm: str = "qemu"):
    """The shim as containerd 2.x starts it for a sandbox; afterwards `delete` (as
    containerd runs it for a gone shim) and kubelet's pod cgroup removed.
    `runtime_options`: what containerd writes to `start`'s stdin (a marshalled Any);
    `env_config`: False starts it without $PODVM_CONFIG naming the test configuration;
    `vmm`: what makes its VMs (testbed/vmconfig.py VMMS: "fake", testbed/fakevm.py's)."""
    require_root()
    sandbox_id = f"sbapi-{uuid.uuid4().hex[:8]}"
    grpc = str(tmp_path / "containerd.sock")
    sink = EventSink()
    events = Server([bind(events_pb2.DESCRIPTOR.services_by_name["Events"], sink)])
    await events.start_path(grpc + ".ttrpc")
    bundle = tmp_path / sandbox_id
    bundle.mkdir()
    (bundle / "log").touch()  # the daemon logs here (containerd gives it a FIFO)
    config = write_test_config(tmp_path / "podvm.toml", default_maxvcpus=2, boot_timeout=90,
                               enable_annotations=enable_annotations, **vmm_config(vmm))
    env = vmm_env(dict(os.environ, PODVM_CONFIG=str(config), TTRPC_ADDRESS=grpc + ".ttrpc"),
                  vmm)
    if not env_config:
        del env["PODVM_CONFIG"]
    assert not (bundle / "config.json").exists()
    started = run_shim(bundle, sandbox_id, "start", grpc, namespace=NS, env=env,
                       stdin=runtime_options)
    assert started.returncode == 0, started.stderr
    address = start_address(started.stdout)
    parent = f"/podvm-sbapi-{uuid.uuid4().hex[:8]}"
    client = await Client.connect(address, metadata=[("containerd-namespace-ttrpc", NS)])
    try:
        yield Pod(tmp_path, sandbox_id, client, address, grpc, bundle, parent, env,
                  sink.events)
    finally:
        await client.close()
        await events.close()
        run_shim(bundle, sandbox_id, "delete", grpc, namespace=NS)
        remove_cgroup_dirs(parent)


def cgroup_file(path: str, name: str) -> str | None:
    """A cgroup file's content in whichever hierarchy has its controller (v1) or the
    unified one (v2); None when the cgroup does not exist."""
    state = cgroups.detect().to_state()
    controller = name.split(".", 1)[0]
    if controller == "cpu" and name.startswith("cpuacct"):
        controller = "cpuacct"
    mounts = [h["mountpoint"] for h in state.get("hierarchies", [])
              if controller in h["controllers"]] or [state.get("mountpoint", "")]
    for mount in mounts:
        file = pathlib.Path(mount) / path.strip("/") / name
        if file.exists():
            return file.read_text().strip()
    return None


def cgroup_exists(path: str) -> bool:
    state = cgroups.detect().to_state()
    mounts = [h["mountpoint"] for h in state.get("hierarchies", [])] or [state["mountpoint"]]
    return any((pathlib.Path(m) / path.strip("/")).exists() for m in mounts)


def cgroup_of(pid: int, controller: str) -> str:
    for line in pathlib.Path(f"/proc/{pid}/cgroup").read_text().splitlines():
        _, controllers, path = line.split(":", 2)
        if controller in controllers.split(",") or (not controllers and controller == ""):
            return path
    return ""


def v2() -> bool:
    return cgroups.detect().to_state().get("version") == 2
