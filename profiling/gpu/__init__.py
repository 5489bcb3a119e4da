"""The GPU check's measurements (jobs/gpu_check.py): step costs eager and captured side by
side, drafts against the bytes they skip, prompt reading against the matmul peak
(`steps`), and greedy equality and speculative sampling's law on the device (`checks`)."""
