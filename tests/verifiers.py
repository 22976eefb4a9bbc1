"""Verifiers used by tests (importable by worker processes as ``tests.verifiers``)."""


def even_first_token(response, tokens, row):
    """Deterministic stand-in for a correctness check: 1 when the first response token is even."""
    return float(bool(tokens) and tokens[0] % 2 == 0)


async def picky(response, tokens, row):
    """Raises for the prompt with id q3 (verifier errors must be recorded, not fatal)."""
    if row.get("id") == "q3":
        raise ValueError("cannot grade q3")
    return 1.0
