"""Checkpoint formats: consolidated weights and Hugging Face Llama import / export."""
