"""Host CPUs for pods: the node-wide allocator of exclusive CPUs, and the pure rules for
pinning vCPU threads and confining containers to vCPUs inside the guest (resources.md
sections 4 and 5)."""
