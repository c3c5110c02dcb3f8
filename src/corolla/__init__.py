"""corolla: run large language models collaboratively over a Petals-compatible swarm.

Subpackages (see docs/design.md): `protocol` (wire records), `swarm` (DHT and block placement), `models` (block
families), `engine` (running spans fast), `server`, `client`, `api` (OpenAI-compatible gateway), `health` (swarm
monitor), `cli` (entry points only), `demo` and `utils`.
"""

__version__ = "0.1.0"
# The version we announce to Petals peers: they compare it only for display, but some tools parse it.
PETALS_COMPAT_VERSION = "2.3.0.dev2"
