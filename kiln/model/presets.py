"""Named model configs, embedded so that a preset needs no network: the config.json of common real models.

Each is the published config.json's architecture fields (its hub name in the comment); where it was saved from and
what dtype it was saved in are left out. Served with dummy weights, or with a checkpoint's safetensors via
``--weights``. kiln.model.features honours or refuses each like any other config (tests/test_presets.py).
"""

TINY = dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
            vocab_size=512, max_position_embeddings=512, bos_token_id=1, eos_token_id=2, tie_word_embeddings=False)

PRESETS: dict[str, dict] = {
    # Small enough for CPU CI: two layers, so two attention calls and three compiled pieces.
    "tiny-llama": dict(model_type="llama", **TINY),
    "llama-3-8b": dict(  # meta-llama/Meta-Llama-3-8B
        model_type="llama", hidden_size=4096, intermediate_size=14336, num_hidden_layers=32, num_attention_heads=32,
        num_key_value_heads=8, vocab_size=128256, max_position_embeddings=8192, rope_theta=500000.0,
        rms_norm_eps=1e-5, bos_token_id=128000, eos_token_id=128001, tie_word_embeddings=False,
    ),
    "llama-3.1-8b": dict(  # meta-llama/Llama-3.1-8B
        model_type="llama", hidden_size=4096, intermediate_size=14336, num_hidden_layers=32, num_attention_heads=32,
        num_key_value_heads=8, vocab_size=128256, max_position_embeddings=131072, rope_theta=500000.0,
        rms_norm_eps=1e-5, bos_token_id=128000, eos_token_id=128001, tie_word_embeddings=False,
        rope_scaling=dict(factor=8.0, low_freq_factor=1.0, high_freq_factor=4.0, original_max_position_embeddings=8192,
                          rope_type="llama3"),
    ),
    "llama-3.1-70b": dict(  # meta-llama/Llama-3.1-70B: 141 GB in bfloat16, so on one H200 in FP8 (docs/fp8.md)
        model_type="llama", hidden_size=8192, intermediate_size=28672, num_hidden_layers=80, num_attention_heads=64,
        num_key_value_heads=8, vocab_size=128256, max_position_embeddings=131072, rope_theta=500000.0,
        rms_norm_eps=1e-5, bos_token_id=128000, eos_token_id=128001, tie_word_embeddings=False,
        rope_scaling=dict(factor=8.0, low_freq_factor=1.0, high_freq_factor=4.0, original_max_position_embeddings=8192,
                          rope_type="llama3"),
    ),
    "llama-3.2-1b": dict(  # meta-llama/Llama-3.2-1B
        model_type="llama", hidden_size=2048, intermediate_size=8192, num_hidden_layers=16, num_attention_heads=32,
        num_key_value_heads=8, head_dim=64, vocab_size=128256, max_position_embeddings=131072, rope_theta=500000.0,
        rms_norm_eps=1e-5, bos_token_id=128000, eos_token_id=128001, tie_word_embeddings=True,
        rope_scaling=dict(factor=32.0, high_freq_factor=4.0, low_freq_factor=1.0,
                          original_max_position_embeddings=8192, rope_type="llama3"),
    ),
    "mistral-7b-v0.1": dict(  # mistralai/Mistral-7B-v0.1: a 4096-token sliding window on every layer
        model_type="mistral", hidden_size=4096, intermediate_size=14336, num_hidden_layers=32, num_attention_heads=32,
        num_key_value_heads=8, vocab_size=32000, max_position_embeddings=32768, rope_theta=10000.0, rms_norm_eps=1e-5,
        sliding_window=4096, bos_token_id=1, eos_token_id=2, tie_word_embeddings=False,
    ),
    "mistral-7b-v0.3": dict(  # mistralai/Mistral-7B-v0.3: no window, a larger vocabulary and rope base
        model_type="mistral", hidden_size=4096, intermediate_size=14336, num_hidden_layers=32, num_attention_heads=32,
        num_key_value_heads=8, vocab_size=32768, max_position_embeddings=32768, rope_theta=1000000.0,
        rms_norm_eps=1e-5, sliding_window=None, bos_token_id=1, eos_token_id=2, tie_word_embeddings=False,
    ),
    "qwen2.5-0.5b": dict(  # Qwen/Qwen2.5-0.5B
        model_type="qwen2", hidden_size=896, intermediate_size=4864, num_hidden_layers=24, num_attention_heads=14,
        num_key_value_heads=2, vocab_size=151936, max_position_embeddings=32768, rope_theta=1000000.0,
        rms_norm_eps=1e-6, bos_token_id=151643, eos_token_id=151643, tie_word_embeddings=True,
        use_sliding_window=False,
    ),
    "qwen2.5-7b": dict(  # Qwen/Qwen2.5-7B (the window is configured but off: use_sliding_window false)
        model_type="qwen2", hidden_size=3584, intermediate_size=18944, num_hidden_layers=28, num_attention_heads=28,
        num_key_value_heads=4, vocab_size=152064, max_position_embeddings=131072, rope_theta=1000000.0,
        rms_norm_eps=1e-6, use_sliding_window=False, sliding_window=131072, max_window_layers=28,
        bos_token_id=151643, eos_token_id=151643, tie_word_embeddings=False,
    ),
    "qwen3-8b": dict(  # Qwen/Qwen3-8B
        model_type="qwen3", hidden_size=4096, intermediate_size=12288, num_hidden_layers=36, num_attention_heads=32,
        num_key_value_heads=8, head_dim=128, vocab_size=151936, max_position_embeddings=40960, rope_theta=1000000.0,
        rms_norm_eps=1e-6, use_sliding_window=False, sliding_window=None, max_window_layers=36,
        bos_token_id=151643, eos_token_id=151645, tie_word_embeddings=False,
    ),
    "gemma-2-9b": dict(  # google/gemma-2-9b: local (4096) and global layers alternate, both logit caps, head_dim 256
        model_type="gemma2", hidden_size=3584, intermediate_size=14336, num_hidden_layers=42, num_attention_heads=16,
        num_key_value_heads=8, head_dim=256, vocab_size=256000, max_position_embeddings=8192, rope_theta=10000.0,
        rms_norm_eps=1e-6, hidden_activation="gelu_pytorch_tanh", query_pre_attn_scalar=256, sliding_window=4096,
        attn_logit_softcapping=50.0, final_logit_softcapping=30.0, bos_token_id=2, eos_token_id=1, pad_token_id=0,
        tie_word_embeddings=True,
    ),
    "phi-3-mini": dict(  # microsoft/Phi-3-mini-4k-instruct: head_dim 96, a 2047-token window
        model_type="phi3", hidden_size=3072, intermediate_size=8192, num_hidden_layers=32, num_attention_heads=32,
        num_key_value_heads=32, vocab_size=32064, max_position_embeddings=4096, original_max_position_embeddings=4096,
        rope_theta=10000.0, rms_norm_eps=1e-5, sliding_window=2047, bos_token_id=1, eos_token_id=32000,
        pad_token_id=32000, tie_word_embeddings=False,
    ),
}
