"""Chat: a conversation rendered with its real template, and the tokens of each message.

tokenizer (the local tokenizer folder) -> token_offsets (where tokens sit in the text) ->
training_templates (the shipped templates that keep what training needs) -> template (the
Jinja rendering) -> content_spans | probe_spans (where each message lies) -> mask_proof (each
record's spans proven on its own rendering) -> spans (a conversation's tokens and mask).
"""
