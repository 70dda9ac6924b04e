"""GGUF checkpoints: metadata, tokenizer and weights read from one llama.cpp file."""
