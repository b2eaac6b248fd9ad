"""End-to-end benchmarks on the example workload: `bench rollback` and `bench goodput`."""
