"""Engines: where a run's chunks are processed.

chunks (the unit of work: records -> masked, packed rows) -> plans (where each chunk's
records lie, for a worker elsewhere) -> engine (the interface; the local process pool, or
the Ray engine of preprocess/ray).
"""
