"""The run: one preprocessing run, resumable after a crash, its output local or in a bucket.

pipeline (Pipeline: inputs -> tasks on an engine -> manifest) -> task_output (a task's
shards and its record, the unit of resume) -> runlog (Summary, the run folder) -> upload
(an output at a URL: the bucket's side of a run, manifest last).
"""
