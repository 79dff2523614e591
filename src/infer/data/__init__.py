"""Offline text and tokenizers: everything here uses only what Python itself ships."""
