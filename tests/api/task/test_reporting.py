"""What containerd hears when a container's init exits: an OOM kill the guest reports
with the exit is published first (CRI's status then reads OOMKilled), one without is not.
The guest agent is a stand-in here; tests/e2e/test_pod_resources.py has the real one."""
from __future__ import annotations

import asyncio
from types import SimpleNamespace

import pytest

from podvm_core.pb.agent import agent_pb2 as pb
from podvm_core.procstate import RUNNING
from shim.api.task.process import Container, Process
from shim.api.task.reporting import Reporter


class Published(list):
    def publish(self, topic: str, event) -> None:
        self.append((topic, event))


class ExitingAgent:
    def __init__(self, answer: pb.WaitProcessResponse) -> None:
        self.answer = answer

    async def wait(self, container_id: str, exec_id: str) -> pb.WaitProcessResponse:
        return self.answer


@pytest.mark.parametrize("oom_killed, topics", [
    (True, ["/tasks/oom", "/tasks/exit"]),
    (False, ["/tasks/exit"]),
])
async def test_an_oom_kill_reported_with_the_exit_is_published_before_it(oom_killed,
                                                                         topics) -> None:
    published = Published()
    proc = Process("c1", pid=10, state=RUNNING)
    reporter = Reporter(published,  # type: ignore[arg-type]
                        {"c1": Container("c1", "/b", proc)})
    agent = ExitingAgent(pb.WaitProcessResponse(exit_status=137, oom_killed=oom_killed))
    reporter.watch(proc, lambda: SimpleNamespace(containers=agent))  # the pod's
    status, _ = await asyncio.wait_for(proc.wait(), 5)
    assert status == 137
    assert [topic for topic, _ in published] == topics
    assert all(event.container_id == "c1" for _, event in published)
