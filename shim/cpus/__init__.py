"""Host CPUs for pods (resources.md sections 4 and 5): CPU sets and the pod's cpuset
(`cpuset`), the pure rules for pinning vCPU threads and confining containers to vCPUs
inside the guest (`pinning`), and the node-wide allocator of exclusive CPUs
(`allocator`)."""
