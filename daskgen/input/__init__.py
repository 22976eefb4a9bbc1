"""Prompts in: reading and validating rows, tokenizing with the chat template, reusing a scan."""
