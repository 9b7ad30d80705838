"""The document: one record made into the tokens and masks of its training type.

cleaning (the config's map and filter hooks, the validation split) -> filters (valid
records a config excludes) -> preference (TRL's implicit prompts) -> layout
(the keys and dtypes a config writes, and its rows' schema) -> truncation (cuts, counted) ->
parts (a record's sections made into parts; what a chunk premade) -> masking
(RecordMasker, holding a layout and a part maker: the parts joined into a document).
"""
