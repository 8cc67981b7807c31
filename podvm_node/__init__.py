"""podvm-node: what the node DaemonSet runs (packaging/kubernetes/): `install` and
`uninstall` put podvm on the host it mounts and take it off again, `monitor` serves
every sandbox of the node as Prometheus metrics."""
