"""Serving containers: engine images and the serving agent."""
