"""The one seam between semantic and mlx-lm: every private attribute, subclass, fork and patch of
mlx-lm lives in this package, written against mlx-lm 0.32.2 (`seam_check.WRITTEN_FOR`: 0.32.x).

The rule: outside this package nothing in `semantic/` imports `mlx_lm`. The engine takes mlx-lm's
public, documented names from `api` and reaches past them only through the functions here; the few
public names other layers import directly are listed, with why, in
`tests/test_mlx_adapter_boundary.py`, which scans `semantic/` and fails on any other reach (a
private name imported or read, an mlx-lm module or class assigned to, an mlx-lm class subclassed).

At each model load `checks.check_seams` runs every piece's check; a new mlx-lm that breaks one stops
the load with a SeamError naming the assumption. The pieces (all against mlx-lm 0.32.2):

- `api`: mlx-lm's public names the engine uses (BatchGenerator, the KV cache classes,
  `make_prompt_cache`, `load`, `sharded_load`, `stream_generate`, `sample_utils`, `json_tools`).
  Why: one folder is the whole surface, public part included.
- `generator_seams`: reads BatchGenerator's `_currently_processing`, `_unprocessed_sequences`,
  `_generation_batch` (and its `_next_tokens`, `_next_logprobs`) and `_counters`. Why: the batch
  must know whether a prompt prefills, how many decode, tokens prefilled, and first tokens a step
  early; mlx-lm has no public way to ask.
- `kv_seams`: reads `BatchKVCache._idx`, `left_padding`, `RotatingKVCache._temporal_order` and
  BatchGenerator's `_find_uids`/`_prompt_batch`; builds a BatchKVCache over an agent's arrays;
  `HistoryKVCache` subclasses KVCache to take over `merge`. Why: a running sequence's cache read
  as views, and a returning agent's history copied once, not two or three times.
- `batch_joins`: `JoiningBatchKVCache` subclasses BatchKVCache, replacing `extend` and `filter`.
  Why: a sequence joining or leaving the decode batch copies each history once (mlx-lm: two or three times).
- `last_token_fold`: `FoldingBatchGenerator` forks `BatchGenerator._next` (pinned by the SHA-256 of
  `_next` and `GenerationBatch._step`; another mlx-lm gets its own generator, unfolded). Why: a
  prompt's last token rides its last chunk, not a forward pass of its own (on the CPU, a
  pass over every weight saved per turn).
- `mixing_generator`: `MixingBatchGenerator` subclasses the folding one, overriding `_next`. Why:
  decode rows and a prompt chunk in one forward pass on the CPU, which reads the weights once.
- `mixed_step`: the packed pass, handing mlx-lm's model layers a cache object of ours
  (`PackedLayerCache`). Why: what makes the mixing generator's one pass possible; probed at load.
- `guided_batch`: `GuidedGenerationBatch` subclasses `GenerationBatch`, overriding `_step` to hand
  mlx-lm's step a model whose logits its rows' grammars masked (checked: what `_step` calls and when
  it runs processors). Why: mlx-lm's per-row processor path slices, buffers and concatenates every
  row each step once any row has a grammar; here the masks are one op.
- `speculative_batch`: `SpeculativeGenerationBatch` subclasses the guided batch, overriding `next`
  (reads `_next_tokens`, `_next_logprobs`, `_num_tokens`, `_matchers`, `_token_context`) and moves
  rows inside BatchKVCache's arrays (`realign`). Why: drafts verified in the decode batch's pass.
- `model_hooks`: replaces the module globals `scaled_dot_product_attention`, `swiglu` and
  `create_causal_mask` in mlx-lm's model modules (attention checked by signature). Why: packed
  passes attend per group on every backend, and the CPU kernels (`cpu_attention`, `cpu_swiglu`).
- `tokenizers`: reads `tokenizer_utils._byte_decoder`. Why: a byte-level BPE token's raw bytes
  for log-probabilities when its text ends inside a UTF-8 character.
- `seam_check`: `require` and SeamError, how every check above names what broke.
- `checks`: the version warning, `check_seams`, and the families mlx-lm cannot batch.
"""
