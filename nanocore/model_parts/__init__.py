"""Shared model parts: what LLaMA-family decoders are made of, written once for every model type,
built-in or third-party (docs/plugins.md, "A model from the shared parts").

- `rotary`: RoPE tables (default, linear, llama3 scaling) and `apply_rotary`;
- `layers`: `RMSNorm`, `GatedMLP`, the activations;
- `attention`: the causal kernel call, `AttentionCore` (selective recompute's unit), `SequenceSlot`
  (context parallelism, document masking), `GroupedQueryAttention` (MHA/GQA, optional qk-norm);
- `moe`: `SparseMoeBlock` (top-k softmax or sigmoid routing, shared experts, auxiliary losses; a
  `nanocore.moe_api.MoELayer`) and `MoEDecoderLM`;
- `config`: `DecoderConfig`, the config fields they share (transformers' names) and their checks;
- `decoder`: `DecoderLayer`, `DecoderModel`, `DecoderLM` (a `nanocore.model_api.CausalLM` with
  transformers' module names; a model type subclasses it and changes what differs).

These are parts, not models: the core registers no model type; model plugins compose these.
"""
