"""`python -m corolla.bench`."""

from corolla.bench.cli import main

if __name__ == "__main__":
    raise SystemExit(main())
