"""Choosing the draft: the latency model (one device and pipeline stages), the knapsack DP
over items, the TPT plan, re-planning drafters — KnapSpec itself, its hybrid with prompt
lookup — and the baselines reproduced in the same engine.

Pure functions over tensors where it can be; may import `pipeline.model`,
`pipeline.decoding` and `pipeline.errors`; no Ray.
"""
