"""Latency microbenchmarks, the latency-model fit and the calibration store."""
