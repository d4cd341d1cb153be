"""Prompts the end-to-end tests share: short and long, prose, code, a repeated pattern."""

PROMPTS = [
    "The quick brown fox jumps over the lazy dog because it wanted to see the other side",
    "Hello",
    "In 1969, astronauts landed on the Moon. The mission was called",
    "def fibonacci(n):\n    if n < 2:\n        return n\n    return",
    "A B C D E F G H I J K L M N O P Q R S T U V W X Y Z " * 3,
    "Paris is the capital of",
    "1, 2, 3, 4, 5,",
    "Once upon a time",
]
