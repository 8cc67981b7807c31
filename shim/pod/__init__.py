"""A pod's one owner (pod.Pod, holding its parts: vmslot.VMSlot, containers.Containers
and resize.Resizer), the request either API creates it from (request.PodRequest), its typed
errors (errors) and the slot the Task and Sandbox APIs share it through (podslot.PodSlot).
Its planning inputs are shim/resources/planner.py's. Nothing is imported here: the idle
daemon loads only the slot (with the network worker it holds, shim/network/ahead.py)."""
