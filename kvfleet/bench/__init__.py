"""`kvfleet bench`: a load generator for a live endpoint with exact streaming timing (aiohttp; nothing else)."""
