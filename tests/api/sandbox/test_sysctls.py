"""Pod sysctls through the Sandbox API: one that would change the whole VM is refused
by CreateSandbox, naming it, before anything is made."""
from __future__ import annotations

import pytest

from podvm_core.ttrpc import Code, TtrpcError

from tests.api.sandbox.harness import cgroup_exists, sandbox_shim


async def test_a_vm_wide_sysctl_is_refused_at_create_and_nothing_is_taken(tmp_path) -> None:
    async with sandbox_shim(tmp_path) as pod:
        config = pod.config()
        config.linux.sysctls["kernel.shm_rmid_forced"] = "1"
        config.linux.sysctls["vm.overcommit_memory"] = "1"
        with pytest.raises(TtrpcError) as err:
            await pod.create(config)
        assert err.value.code == Code.INVALID_ARGUMENT
        assert "vm.overcommit_memory=1" in err.value.message, err.value.message
        assert "allowed_vm_wide_sysctls" in err.value.message, err.value.message
        assert not cgroup_exists(pod.sandbox_cgroup)
        del config.linux.sysctls["vm.overcommit_memory"]
        await pod.create(config)  # the namespaced one alone is taken
