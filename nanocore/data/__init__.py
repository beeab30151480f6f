"""Core data plumbing: the interfaces dataset/tokenizer plugins implement, mixtures and stages."""
