"""One model over several processes: the stage layout (layout.py), a stage's share of the model and
the coordinator-side pipelined model with the single-process model's interface, the links
that reach stages (links.py), and tensor-parallel slices with their all-reduce.

May import `pipeline.model`, `pipeline.decoding`, `pipeline.knapspec` and torch.distributed;
not Ray: a stage is reached through a link that `actors/` provides.
"""
