"""Decoding one request: the draft/verify loop, sampling and lossless acceptance, the
drafter interface with its plain and layer-skip drafters, prompt lookup, the
transformers reference, and the one statistics type every layer sums.

May import `pipeline.model` and `pipeline.errors`; no Ray.
"""
