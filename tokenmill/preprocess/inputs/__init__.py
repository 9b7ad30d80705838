"""Inputs: what a run reads, as records that remember where they came from.

files (paths, URLs, folders, compression) | hf (Hugging Face datasets and their folders) ->
records (a Record per line or row; RecordError names file, line and field) -> fields (dotted
lookups, message checks) -> columns (other names and shapes mapped to ours).
"""
