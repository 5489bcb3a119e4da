"""The decoding benchmark that jobs/benchmark.py drives: strategies and compute modes on the
same prompts (`comparison`), what verifying costs (`verify_costs`), the DP's candidates as fixed
drafts (`forced`), the summary, tables, plot and JSON of a run (`summary`, `tables`, `plots`,
`report`), and a pipelined replica's throughput (`pipeline_throughput`).

The job parses its options and reads the documents; it hands this package what they say
(`settings`) and prints what it returns: nothing here prints or reads the environment.
"""
