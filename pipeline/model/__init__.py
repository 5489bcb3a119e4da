"""The network: model shapes, checkpoint reading, linears per compute mode, the KV cache,
the layer math, context limits with chunked prefill, the packing of several requests' rows,
and the sublayer runner that executes any subset of a decoder's items for one request or
for the packed rows of several.

Imports only `pipeline.errors`, `pipeline.locks`, torch, safetensors/gguf and transformers (configs,
tokenizers, the rotary tables): no Ray, and nothing from the other rooms.
"""
