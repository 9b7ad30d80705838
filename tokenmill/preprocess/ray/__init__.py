"""The Ray engine: the local engine's tasks, each done by a Ray task that writes its own shards.

engine (RayEngine: connect, size the task pool, run the tasks, hand their records back in
task order).
"""
