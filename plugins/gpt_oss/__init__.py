"""The `gpt_oss` model type (gpt-oss: attention sinks, alternating windowed layers, biased MoE)."""
