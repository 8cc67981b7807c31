"""Host CPUs for pods (docs/design.md, CPUs): CPU sets and the pod's cpuset
(`cpuset`), the pure rules for pinning vCPU threads and confining containers to vCPUs
inside the guest (`pinning`), and the node-wide allocator of exclusive CPUs
(`allocator`)."""
