"""Helpers that know nothing of blocks or swarms: logging, environment, asyncio glue (polling)."""
