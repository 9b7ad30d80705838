"""Engines: where a run's tasks are done.

chunks (the unit of processing: records -> masked, packed rows) -> tasks (the unit of work
and of output, planned from file sizes) -> engine (the interface; the local process pool,
or the Ray engine of preprocess/ray).
"""
