"""A safe evaluator for Countdown answers: integers, + - * / and parentheses.

A small recursive-descent parser (no `eval`) over the grammar

    expr   := term (("+" | "-") term)*
    term   := factor (("*" | "/") factor)*
    factor := INTEGER | "(" expr ")"

evaluated exactly with `fractions.Fraction`. Spaces between tokens are allowed.
There are no unary operators: "-3" and "+3" are rejected (the given numbers are
positive; a negative value is reached by subtraction). Division by zero is an
error. Input longer than MAX_LEN characters is rejected before parsing and
parentheses nested deeper than MAX_DEPTH while parsing, so hostile input costs
a bounded amount of work and stack.
"""

from __future__ import annotations

from fractions import Fraction

MAX_LEN = 64
MAX_DEPTH = 16
DIGITS = "0123456789"  # not str.isdigit: that accepts "²" and other Unicode digits


class ExpressionError(ValueError):
    """The text is not a well-formed expression (or divides by zero)."""


def tokenize(text: str) -> list[int | str]:
    if len(text) > MAX_LEN:
        raise ExpressionError(f"longer than {MAX_LEN} characters")
    tokens: list[int | str] = []
    i = 0
    while i < len(text):
        c = text[i]
        if c in DIGITS:
            j = i
            while j < len(text) and text[j] in DIGITS:
                j += 1
            tokens.append(int(text[i:j]))
            i = j
            continue
        if c in "+-*/()":
            tokens.append(c)
        elif c != " ":
            raise ExpressionError(f"unexpected character {c!r}")
        i += 1
    return tokens


class _Parser:
    def __init__(self, tokens: list[int | str]) -> None:
        self.tokens, self.pos, self.depth = tokens, 0, 0
        self.numbers: list[int] = []  # every integer literal, in order

    def peek(self) -> int | str | None:
        return self.tokens[self.pos] if self.pos < len(self.tokens) else None

    def take(self) -> int | str | None:
        token = self.peek()
        self.pos += 1
        return token

    def expr(self) -> Fraction:
        value = self.term()
        while self.peek() in ("+", "-"):
            op, rhs = self.take(), self.term()
            value = value + rhs if op == "+" else value - rhs
        return value

    def term(self) -> Fraction:
        value = self.factor()
        while self.peek() in ("*", "/"):
            op, rhs = self.take(), self.factor()
            if op == "/" and rhs == 0:
                raise ExpressionError("division by zero")
            value = value * rhs if op == "*" else value / rhs
        return value

    def factor(self) -> Fraction:
        token = self.take()
        if isinstance(token, int):
            self.numbers.append(token)
            return Fraction(token)
        if token == "(":
            self.depth += 1
            if self.depth > MAX_DEPTH:
                raise ExpressionError(f"parentheses nested deeper than {MAX_DEPTH}")
            value = self.expr()
            if self.take() != ")":
                raise ExpressionError("missing ')'")
            self.depth -= 1
            return value
        raise ExpressionError(f"expected a number or '(', got {token!r}")


def evaluate(text: str) -> tuple[Fraction, list[int]]:
    """(exact value, integer literals used) of `text`; ExpressionError if malformed."""
    parser = _Parser(tokenize(text))
    value = parser.expr()
    if parser.pos != len(parser.tokens):
        raise ExpressionError(f"unexpected {parser.peek()!r}")
    return value, parser.numbers
