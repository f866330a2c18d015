"""Workloads from measurements: request traces (traces.py) and their profile (profile.py). Pure Python."""
