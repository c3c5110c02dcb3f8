"""Generation through chains of servers behind emulated WAN links (`python -m benchmarks.wan`): the chains
(`chain`), per-token timing (`measure`), the table (`report`), and the stock Petals side run by the Petals venv
(`petals_side`, `petals_server`: both import nothing of corolla and are run by path)."""
