"""The preprocessing half: raw records -> exact tokens and masks -> shards. Never imports torch.

inputs -> records -> fields -> config -> tokenizer + chat_template -> spans -> masking ->
packing -> chunks -> engine (local | ray_engine + ray_results, with plans) -> pipeline (+ runlog; upload
for an output at a URL).
"""
