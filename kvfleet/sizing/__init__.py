"""Sizing: how many tokens of KV cache fit beside the weights, and what serving the load costs.

Pure Python (no aws_cdk, no boto3): every other part of kvfleet derives from these numbers.
Bytes internally; units in names.
"""
