"""Latency microbenchmarks, the latency-model fit and the calibration store; and the decoding
benchmark that jobs/benchmark.py drives (`benchmark/`)."""
