"""Grammars compiled by xgrammar for the served tokenizer, cached by (kind, text).

One GrammarCompiler serves one tokenizer (the engine's), so the cache key (tokenizer, kind, text)
reduces to (kind, text). Compiling a JSON schema for a 49k-token vocabulary takes milliseconds to
a few hundred; the service runs compiles on a worker thread (compile_async) so a slow one never
holds up the other streams, and a cached grammar is ready at once. xgrammar and its tokenizer
table are loaded on first use (or by warm()), also off the serving thread. JSON grammars carry the
default number bounds of json_bounds.py.
"""
import re
import threading
import time
from collections import OrderedDict
from concurrent.futures import Future, ThreadPoolExecutor

from tensorfold.grammar.json_bounds import json_grammar
from tensorfold.grammar.spec import MAX_WHITESPACE, GrammarSpec
from tensorfold.grammar.tool_call import tool_call_grammar

CACHE_SIZE = 256
_LOCATION = re.compile(r"^\[[^\]]*\] \S+:\d+: ")  # "[17:30:40] /project/cpp/x.cc:820: " before xgrammar's reason


class GrammarCompileError(ValueError):
    """xgrammar could not compile a grammar; str() is xgrammar's reason."""


class GrammarCompiler:
    def __init__(self, tokenizer, vocab_size: int, *, threads: int = 2):
        self.tokenizer = tokenizer
        self.vocab_size = vocab_size
        self.threads = threads
        self._compiler = None
        self._lock = threading.Lock()           # the cache and the lazy load
        self._cache: OrderedDict = OrderedDict()
        self._pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="grammar")

    @staticmethod
    def available() -> bool:
        try:
            import xgrammar  # noqa: F401
        except ImportError:
            return False
        return True

    def warm(self) -> Future:
        """Load xgrammar and the tokenizer table on the worker thread."""
        return self._pool.submit(self._xgr_compiler)

    def cached(self, spec: GrammarSpec):
        """The compiled grammar if it is in the cache, else None."""
        with self._lock:
            compiled = self._cache.get(spec.key)
            if compiled is not None:
                self._cache.move_to_end(spec.key)
            return compiled

    def compile_async(self, spec: GrammarSpec) -> Future:
        """A future of (compiled grammar, seconds spent compiling); GrammarCompileError on failure."""
        return self._pool.submit(self.compile, spec)

    def compile(self, spec: GrammarSpec):
        """(compiled grammar, seconds spent compiling: 0.0 for a cached one)."""
        compiled = self.cached(spec)
        if compiled is not None:
            return compiled, 0.0
        compiler = self._xgr_compiler()
        started = time.perf_counter()
        try:
            compiled = self._compile(compiler, spec)
        except RuntimeError as e:  # xgrammar reports every grammar error as RuntimeError
            raise GrammarCompileError(_LOCATION.sub("", str(e)).strip()) from None
        seconds = time.perf_counter() - started
        with self._lock:
            self._cache[spec.key] = compiled
            while len(self._cache) > CACHE_SIZE:
                self._cache.popitem(last=False)
        return compiled, seconds

    def _compile(self, compiler, spec: GrammarSpec):
        if spec.kind == "json_schema":
            return compiler.compile_grammar(json_grammar(spec.text, any_whitespace=True,
                                                         max_whitespace_cnt=MAX_WHITESPACE, strict_mode=True))
        if spec.kind == "json_object":
            return compiler.compile_grammar(json_grammar('{"type": "object"}', any_whitespace=True,
                                                         max_whitespace_cnt=MAX_WHITESPACE, strict_mode=False))
        if spec.kind == "regex":
            return compiler.compile_regex(spec.text)
        if spec.kind == "choice":
            return compiler.compile_grammar(spec.choice_ebnf())
        if spec.kind == "tool_call":
            return compiler.compile_grammar(tool_call_grammar(spec))
        return compiler.compile_grammar(spec.text)

    def _xgr_compiler(self):
        with self._lock:
            if self._compiler is None:
                import xgrammar as xgr
                from transformers import PreTrainedTokenizerFast

                fast = PreTrainedTokenizerFast(tokenizer_object=self.tokenizer.hf_tokenizer)
                info = xgr.TokenizerInfo.from_huggingface(fast, vocab_size=self.vocab_size,
                                                          stop_token_ids=list(self.tokenizer.eos_token_ids))
                self._compiler = xgr.GrammarCompiler(info, max_threads=self.threads, cache_enabled=False)
            return self._compiler
