#!/usr/bin/env python3
"""CDK entry point: ``npx cdk synth -c env=<name>`` synthesizes environments/<name>.yaml (default dev)."""

import os

# jsii prints a large banner on every run under Node 20, which is still maintained for CDK's purposes.
os.environ.setdefault("JSII_SILENCE_WARNING_END_OF_LIFE_NODE_VERSION", "20")

from kvfleet.infra.app import main

main()
