"""Entry points only: parse config, build objects, run, shut down."""
