"""The fleet simulator: replicas under continuous batching on a step-time model, a router and the target's
autoscaler. Pure Python."""
