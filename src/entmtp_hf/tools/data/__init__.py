"""Prompts and training text: datasets, task baskets and self-distillation."""
