"""The one place that knows model internals.

loading.py          the policy and tokenizer: the built-in tiny char-level Qwen2, or a Hugging Face causal LM
transformers_api.py the adapter over transformers: its moving internals (cache argument, cache classes), the
                    Llama family and its layout check, the peft unwrap, FastPathUnavailable
llama.py            the one Llama/Mistral/Qwen2/Qwen3 decoder layer (fused q/k/v and gate/up weights), run by both:
decode.py             the fast engine's forward over a KV cache (prefill and decode steps)
packed.py             the update's packed shared-prompt forward (layout and block attention: packed_layout.py)
kernels.py          RMSNorm, rotary, SwiGLU and packing as plain ops and as autograd functions
attention.py        grouped-query attention as matmuls (CPU) or SDPA, and the one-query decode form
logprobs.py         chunked log-probs and entropy from logits or from hidden states and the output layer
static_cache.py     the fast engine's static KV cache and finished-row compaction
"""
