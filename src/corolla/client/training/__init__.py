"""Autograd through the swarm: `remote_sequential` (a range of remote blocks used like a local module) and
Petals-compatible prompt tuning (`prompt_tuning`)."""
