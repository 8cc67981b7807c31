"""A pod's one owner (pod.Pod), its planning inputs (planner.PodPlanner) and the slot the
Task and Sandbox APIs share it through (slot.PodSlot). Nothing is imported here: the
idle daemon loads only the slot."""
