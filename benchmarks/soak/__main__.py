"""`python -m benchmarks.soak`: the churn soak (`churn`), what `make soak` runs."""

from benchmarks.soak.churn import main

if __name__ == "__main__":
    raise SystemExit(main())
