"""The commands of ``python -m asyncbus``, one module each."""
