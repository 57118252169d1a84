"""Find the final answer a model wrote inside ``\\boxed{...}`` (or ``\\fbox{...}``)."""

import re

# The last box wins: models often box intermediate results before the final one.
_BOX_COMMAND = re.compile(r"\\(?:boxed|fbox)")


def extract_boxed(text: str) -> str | None:
    """Return the contents of the last ``\\boxed{...}`` / ``\\fbox{...}`` in ``text``.

    Braces nest (``\\boxed{\\frac{1}{2}}`` gives ``\\frac{1}{2}``). The brace-less form
    ``\\boxed 5`` gives the token after the space, up to whitespace or ``$``. Returns None
    when there is no box or the last box is never closed (an unbalanced box is no answer).
    """
    starts = [m.end() for m in _BOX_COMMAND.finditer(text)]
    if not starts:
        return None
    pos = starts[-1]
    rest = text[pos:]
    stripped = rest.lstrip(" ")
    if stripped.startswith("{"):
        return _braced_group(stripped)
    if stripped is rest or not stripped:
        # "\boxedx" is another command name, and "\boxed" at the very end boxes nothing.
        return None
    token = re.match(r"[^\s$]+", stripped)
    return token.group(0) if token else None


def _braced_group(text: str) -> str | None:
    """Contents of the brace group that opens ``text[0]``; None if it never closes."""
    depth = 0
    for i, char in enumerate(text):
        if char == "{":
            depth += 1
        elif char == "}":
            depth -= 1
            if depth == 0:
                return text[1:i]
    return None
