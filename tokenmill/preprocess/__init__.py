"""The preprocessing half: raw records -> exact tokens and masks -> shards. Never imports torch.

config (what a run makes; presets per training type) -> inputs/ (files -> records, their
fields) -> chat/ (tokenizer, chat template, the spans of each message and their proof) ->
document/ (a record's parts joined, truncated, masked; filters; cleaning hooks and the split)
-> dedup (exact duplicates found before the tasks run) -> packing (rows) -> engines/
(chunks: the unit of work; the local engine) | ray/ (the same chunks on a Ray cluster) -> run/
(pipeline: one run, resumable; runlog; upload to a bucket). ledger counts every token on the
way.
"""
