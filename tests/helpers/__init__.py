"""Shared test helpers: tiny offline models (`tiny_models`) and swarm fixtures (`swarm`)."""
