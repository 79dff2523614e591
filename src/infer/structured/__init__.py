"""Constrained decoding with llguidance: grammars from JSON schemas, regexes, choices, Lark and
GBNF; a token bitmask per constrained request, applied in the batched sampler.

- :func:`compile_grammar` turns a :class:`~infer.core.structured.StructuredOutputs` into an
  llguidance grammar and validates it (the server calls it before queueing a request, so a bad
  schema is a 400 naming the field).
- :class:`StructuredOutputManager` (engine side) compiles each request's matcher off the step
  loop (a thread pool; grammars cached per schema), fills the bitmask rows of the constrained
  requests in a step, and advances their matchers with the sampled tokens.

The grammar engine is llguidance (chosen over xgrammar: a 3 MB wheel with no dependencies,
where xgrammar pulls in triton; it compiles schemas lazily, so a new schema costs
milliseconds, and computes masks in Rust with the GIL released). See docs/structured-outputs.md.
"""

from infer.structured.grammar import GrammarError, compile_grammar

__all__ = ["GrammarError", "compile_grammar"]
