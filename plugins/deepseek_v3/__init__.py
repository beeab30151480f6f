"""DeepSeek-V3 (multi-head latent attention, group-limited sigmoid routing) from `nanocore.model_parts`."""
