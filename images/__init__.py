"""The project's container images (podvm-webhook, podvm-node), built from Debian's packages
and pinned Python wheels into OCI image layouts and archives with no Docker daemon:
`make images` (images/build.py)."""
