"""`python -m benchmarks.users`: many users through one real server (`report` parses the flags and writes the table)."""

from benchmarks.users.report import main

if __name__ == "__main__":
    raise SystemExit(main())
