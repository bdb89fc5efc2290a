"""Pre-staging: the planner, the node side of its orders, placement by features."""
