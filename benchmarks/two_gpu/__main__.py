"""`python -m benchmarks.two_gpu`: a 70B-shaped model over two GPUs against `device_map="auto"` (`run`)."""

from benchmarks.two_gpu.run import main

if __name__ == "__main__":
    raise SystemExit(main())
