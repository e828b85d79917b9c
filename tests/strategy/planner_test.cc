// Planner tests (placeholder until the planner lands).
