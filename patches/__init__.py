"""Hugging Face transformers integration (attention and mask registration) will live here."""
