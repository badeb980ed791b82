"""
The transformers config of an export (imports nothing from nanochat): GPTConfig's fields, window_sizes per layer.
"""

from transformers import PretrainedConfig


class NanochatConfig(PretrainedConfig):
    model_type = "nanochat"
    keys_to_ignore_at_inference = ["past_key_values", "cache"]  # the cache output, by either version's name
    attribute_map = {"hidden_size": "n_embd", "num_hidden_layers": "n_layer", "num_attention_heads": "n_head",
                     "num_key_value_heads": "n_kv_head", "max_position_embeddings": "sequence_len"}

    def __init__(self, vocab_size=32768, sequence_len=2048, n_layer=12, n_head=6, n_kv_head=6, n_embd=768,
                 window_sizes=None, rotary_base=100000.0, softcap=15.0,
                 l3_after_layers=(), l3_n_emb=0, l3_d_up=0, l3_k_max=512,
                 use_cache=True, bos_token_id=None, eos_token_id=None, pad_token_id=None, **kwargs):
        self.vocab_size, self.sequence_len = vocab_size, sequence_len
        self.n_layer, self.n_head, self.n_kv_head, self.n_embd = n_layer, n_head, n_kv_head, n_embd
        self.window_sizes = list(window_sizes) if window_sizes is not None else [sequence_len] * n_layer
        self.rotary_base, self.softcap, self.use_cache = rotary_base, softcap, use_cache
        # Large Lookup Layers: an L3 layer after each of these blocks (l3_n_emb table rows in all)
        self.l3_after_layers, self.l3_n_emb = list(l3_after_layers), l3_n_emb
        self.l3_d_up, self.l3_k_max = l3_d_up, l3_k_max
        kwargs["tie_word_embeddings"] = False  # the lm_head is its own matrix
        super().__init__(bos_token_id=bos_token_id, eos_token_id=eos_token_id, pad_token_id=pad_token_id, **kwargs)
