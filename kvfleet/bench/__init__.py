"""`kvfleet bench`: a load generator for a live endpoint with exact streaming timing (aiohttp; nothing else)."""

from kvfleet.extras import require_extra

# `kvfleet bench` and `kvfleet check` import this package before aiohttp or boto3: without the bench extra they
# stop here with one line.
require_extra("bench", "kvfleet.bench")
