"""The KnapSpec engine: sublayer model runner, KV cache, draft/verify decoding.

Everything here is plain PyTorch and imports without Ray.
"""
