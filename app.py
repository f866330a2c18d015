#!/usr/bin/env python3
"""CDK entry point: ``npx cdk synth -c env=<name>`` synthesizes environments/<name>.yaml (default dev)."""

from stacks.app import main

main()
