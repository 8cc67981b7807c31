"""The one table from podvm's errors to ttrpc codes: every row names a real class, no row
hides a later one, and each kind of failure answers the code containerd acts on."""
from __future__ import annotations

import importlib

import pytest

from podvm_core.cpulist import CpuListError
from podvm_core.ttrpc import Code, TtrpcError
import cgroups
from shim.api import errors
from shim.config import ConfigError
from shim.cpus.allocator import NoFreeCPUs
from shim.vm.hypervisor import BootTimeout, CannotGrow, HypervisorError, MissingFile, VMExited
from shim.pod.errors import (NotRunning, PodFilesError, Refused, StaticRefusal, StepFailed,
                             VMGone)
from shim.resources.model import NoFit, PlanError
from shim.resources.update import StaticSizeExceeded


def test_every_row_names_an_exception_class() -> None:
    for module, name, _ in errors.TABLE:
        cls = getattr(importlib.import_module(module), name)
        assert isinstance(cls, type) and issubclass(cls, BaseException), (module, name)


def test_no_row_is_shadowed_by_an_earlier_one() -> None:
    classes = [getattr(importlib.import_module(m), n) for m, n, _ in errors.TABLE]
    for i, later in enumerate(classes):
        for earlier in classes[:i]:
            assert not issubclass(later, earlier), f"{later} is hidden by {earlier}"


@pytest.mark.parametrize("exc, code", [
    (MissingFile("kernel /x does not exist"), Code.FAILED_PRECONDITION),
    (CannotGrow("no free vCPU slot"), Code.FAILED_PRECONDITION),
    (VMExited("QEMU exited with status 1"), Code.UNAVAILABLE),
    (BootTimeout("did not come up"), Code.UNAVAILABLE),
    (HypervisorError("QMP failed"), Code.UNAVAILABLE),
    (StaticRefusal("cannot grow a static VM"), Code.FAILED_PRECONDITION),
    (NoFit("does not fit"), Code.RESOURCE_EXHAUSTED),
    (StaticSizeExceeded("too big", None), Code.FAILED_PRECONDITION),
    (PlanError("bad value"), Code.INVALID_ARGUMENT),
    (NoFreeCPUs("none left"), Code.RESOURCE_EXHAUSTED),
    (cgroups.InvalidLimits("memory below use"), Code.INVALID_ARGUMENT),
    (cgroups.CgroupError("cannot write"), Code.FAILED_PRECONDITION),
    (CpuListError("cpuset '1-x'"), Code.INVALID_ARGUMENT),
    (ConfigError("bad key"), Code.INVALID_ARGUMENT),
    (TtrpcError(Code.NOT_FOUND, "gone"), Code.NOT_FOUND),
    (RuntimeError("a bug"), Code.UNKNOWN),
])
def test_each_error_answers_one_code(exc: BaseException, code: Code) -> None:
    assert errors.code_of(exc) is code
    answer = errors.to_ttrpc(exc, "booting")
    assert answer.code is code
    if not isinstance(exc, TtrpcError):
        assert answer.message == f"podvm: booting: {exc}"


@pytest.mark.parametrize("exc, code", [
    (Refused("podvm runs the pod in a VM"), Code.INVALID_ARGUMENT),
    (NotRunning(), Code.FAILED_PRECONDITION),
    (PodFilesError("cannot write the pod's /etc files"), Code.FAILED_PRECONDITION),
])
def test_the_pods_refusals_answer_as_worded(exc: BaseException, code: Code) -> None:
    answer = errors.to_ttrpc(exc)
    assert (answer.code, answer.message) == (code, str(exc))


def test_a_failed_step_answers_its_causes_code_naming_the_step() -> None:
    cause = cgroups.InvalidLimits("memory below use")
    answer = errors.to_ttrpc(StepFailed("resizing sandbox sb", cause))
    assert answer.code is Code.INVALID_ARGUMENT
    assert answer.message == errors.to_ttrpc(cause, "resizing sandbox sb").message
    gone = VMExited("QEMU exited with status 1")
    answer = errors.to_ttrpc(VMGone(gone))
    assert (answer.code, answer.message) == (Code.UNAVAILABLE, f"podvm: {gone}")
