"""Model loading: GGUF conversion, tiny seeded models, mlx-lm directories -> (model, tokenizer, ModelSpec)."""
