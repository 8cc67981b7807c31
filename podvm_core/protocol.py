"""Names host and guest must agree on. Changing one changes the wire."""
from __future__ import annotations

# The virtio-serial port the agent listens on (QEMU's chardev name on the host side).
AGENT_PORT = "podvm.agent"
# The agent's ttrpc service, as in protos/podvm_core/pb/agent/agent.proto.
AGENT_SERVICE = "podvm.agent.v1.Agent"
# The mount source that tells the agent "join the pod's namespaces, made by its holder"
# where a spec would name the sandbox container's network namespace path.
SANDBOX_NS = "podvm:sandbox"
# Where the guest keeps the pod's own volumes (its emptyDirs, on the scratch disk): the
# shim's binds name directories here, which the agent makes.
GUEST_VOLUMES = "/run/podvm/scratch/volumes"
# The CFS period the kernel, runc and kubelet use when none is given (microseconds).
DEFAULT_CFS_PERIOD_US = 100_000
