"""Prompts of the benchmarks: short simulated-engine prompts, and a chat mix of short, medium and long requests."""

from __future__ import annotations

import random
from typing import Any


def prompt_rows(n: int) -> list[str]:
    """``n`` distinct short prompts (the simulated engine uses a byte tokenizer)."""
    return [f"Task {i}: write a function that passes hidden tests #{i * 7919 % 10007}." for i in range(n)]


SHORT = [
    "What is the capital of France?",
    "Name three primary colors.",
    "What is 12 times 12?",
    "What is the boiling point of water in Celsius?",
    "Give a synonym for 'happy'.",
    "Who wrote 'Romeo and Juliet'?",
    "What is the largest planet in our solar system?",
    "Translate 'good morning' into Spanish.",
    "What does DNA stand for?",
    "What is the square root of 81?",
    "Suggest a name for a pet cat.",
    "How many days are in a leap year?",
    "What is the chemical symbol for gold?",
    "Which ocean is the largest?",
    "What is 7 plus 15?",
    "Name a mammal that can fly.",
]
MEDIUM = [
    "Explain what a CPU does.",
    "What is photosynthesis?",
    "Describe how a bicycle works.",
    "Why is the sky blue?",
    "Explain the difference between weather and climate.",
    "What is a black hole?",
    "How do vaccines work?",
    "What causes the seasons on Earth?",
    "Explain what an API is.",
    "What is machine learning?",
    "How does a refrigerator keep food cold?",
    "What is inflation in economics?",
    "Explain how rainbows form.",
    "What is the water cycle?",
    "Describe the role of the heart.",
    "What is a prime number?",
]
LONG = [
    "Write a short story about a robot who learns to paint.",
    "Write a Python function that sorts a list with merge sort, and explain it.",
    "List ten tips for studying effectively, with a sentence on each.",
    "Write a letter to a friend describing your summer holiday.",
    "Explain step by step how to bake bread.",
    "Write a poem about the sea with several stanzas.",
    "Describe the history of the internet in detail.",
    "Write a recipe for a vegetable soup with ingredients and steps.",
    "Compare cats and dogs as pets in several paragraphs.",
    "Write a Python class for a bank account with deposit and withdraw methods.",
    "Explain the causes of the First World War.",
    "Write a dialogue between a teacher and a student about climate change.",
    "Describe a day in the life of a medieval farmer.",
    "Give a detailed plan for a week-long trip to Japan.",
    "Write a fairy tale about a dragon and a princess.",
    "Explain how a computer network works, layer by layer.",
]


def builtin_prompts(n: int, seed: int = 0) -> list[dict[str, Any]]:
    """``n`` chat rows drawn from short, medium and long requests in equal parts, in a seeded order."""
    pool = [q for trio in zip(SHORT, MEDIUM, LONG, strict=True) for q in trio]
    rows = [{"id": f"q{i}", "messages": [{"role": "user", "content": pool[i % len(pool)]}]} for i in range(n)]
    random.Random(seed).shuffle(rows)
    return rows
