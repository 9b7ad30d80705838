"""The document: one record made into the tokens and masks of its training type.

filters (valid records a config excludes) -> preference (TRL's implicit prompts) -> layout
(the keys and dtypes a config writes) -> truncation (cuts, counted) -> parts (a record's
sections made into parts) -> masking (RecordMasker: the parts joined into a document).
"""
