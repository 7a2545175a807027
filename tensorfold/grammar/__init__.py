"""Structured output: grammars compiled by xgrammar, followed per request along its path.

spec.py: what a request asks for (GrammarSpec), compiler.py: the compile cache, constraint.py:
the per-request matcher behind the engine's constraint hooks (sampling/constraint.py), json_bounds.py:
the default bounds on a JSON grammar's numbers.
"""
