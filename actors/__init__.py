"""Thin Ray shells over the pure core: each actor owns one core object and turns
messages into method calls. Classes are plain; ``actors.factory`` makes them remote."""
