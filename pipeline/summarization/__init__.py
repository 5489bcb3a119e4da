"""The summarization job's data side: reading inputs (and one document of a file, for a run in
one process) and checking rows, chunking and map-reduce, prompts, the document summarizer, the
output schema with resume, and the Ray Data glue (the datasource, the `map_batches` stage, its
dispatcher and the sink).

May import every other room of `pipeline`. Ray is imported only by its Ray Data
modules; the rest runs without it.
"""
