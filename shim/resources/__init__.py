"""The pure resource model: VM size, sandbox cgroup limits and overhead from one set of
inputs. No I/O here: actuators (cgroups, hypervisor, agent) apply what it computes."""
from .model import (ContainerResources, Host, NoFit, PlanError, SandboxPlan, SandboxRequest,
                    plan_sandbox)
from .update import PlanDelta, StaticSizeExceeded, plan_update, pod_totals

__all__ = ["ContainerResources", "Host", "NoFit", "PlanDelta", "PlanError", "SandboxPlan",
           "SandboxRequest", "StaticSizeExceeded", "plan_sandbox", "plan_update", "pod_totals"]
