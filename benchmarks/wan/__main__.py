"""`python -m benchmarks.wan`: generation through a chain of servers behind emulated WAN links (`run`)."""

from benchmarks.wan.run import main

if __name__ == "__main__":
    raise SystemExit(main())
