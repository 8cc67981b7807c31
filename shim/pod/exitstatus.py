"""The exit statuses a pod reports for processes whose VM ended under them: what both
APIs and the pod itself report, so that no part imports another for two numbers."""
from __future__ import annotations

VM_GONE_STATUS = 255
"""Exit status of a process whose VM died under it."""
KILLED_STATUS = 137
"""Exit status of a process whose VM was stopped under it (128 + SIGKILL)."""
