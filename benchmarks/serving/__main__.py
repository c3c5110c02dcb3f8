"""`python -m benchmarks.serving`: the single-card bench (`cli`)."""

from benchmarks.serving.cli import main

if __name__ == "__main__":
    raise SystemExit(main())
