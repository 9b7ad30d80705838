"""Tools for people, on top of both halves: the `tokenmill` command, inspect, show, demo."""
