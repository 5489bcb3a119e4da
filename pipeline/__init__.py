"""The KnapSpec engine, in rooms by concern (each subpackage's docstring says what it may import):

- `model/`: shapes, checkpoints, linears, KV cache, the sublayer runner;
- `decoding/`: the draft/verify loop, sampling and acceptance, drafters, statistics;
- `knapspec/`: latency model, knapsack DP, TPT plan, the KnapSpec drafters and baselines;
- `parallel/`: pipeline stages and tensor-parallel slices of one model;
- `summarization/`: the summarization job's data stages;
- `engine.py`: the front door — load a model once, generate a batch with any strategy;
- `strategies.py`: the decoding strategies and how each builds a request's drafter;
- `errors.py`, `logs.py`, `locks.py`: shared by all: the error hierarchy, logging set-up, and
  lock files that name their holder.

Nothing here imports `actors`, `jobs` or `profiling` (tests/test_layout.py checks the rules).
"""
