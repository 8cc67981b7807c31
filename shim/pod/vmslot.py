"""Where a pod's parts find its VM: the Machine while it runs (shim/vm/machine.py), and how
it ended when it died under the pod. The Pod (shim/pod/pod.py) fills it as the VM boots,
dies and stops; its containers (shim/pod/containers.py) and its resizer
(shim/pod/resize.py) read it as each of their calls is made."""
from __future__ import annotations

from typing import TYPE_CHECKING

from .errors import NotRunning, VMGone

if TYPE_CHECKING:
    from ..vm.agent import Agent
    from ..vm.hypervisor import HypervisorError
    from ..vm.machine import Machine


class VMSlot:
    def __init__(self) -> None:
        self.machine: Machine | None = None
        """The running VM's Machine; None before the boot and once stopped."""
        self.gone: HypervisorError | None = None
        """How the VM ended, when it died under the pod."""

    def agent(self) -> Agent:
        """The guest agent; the pod's typed error when there is none."""
        if self.gone is not None:
            raise VMGone(self.gone)
        if self.machine is None or self.machine.agent is None:
            raise NotRunning()
        return self.machine.agent

    def guest_seconds(self) -> float:
        """How long the host has waited for this VM's guest so far (shim/vm/guestclock.py);
        0 before the agent is connected."""
        if self.machine is None or self.machine.agent is None:
            return 0.0
        return self.machine.agent.clock.seconds()
