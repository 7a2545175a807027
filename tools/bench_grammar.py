"""What structured output costs, on the default model in one process (issue 12).

    python tools/bench_grammar.py                  # bf16, 2 threads
    python tools/bench_grammar.py --dtype float32 --repeats 5

Per grammar (a JSON schema, a regex, a choice):
- constrained decode tokens/s against unconstrained decode of the same prompt for the same
  number of tokens (ignore_eos), drafting off on both: the masking overhead per token;
- "mask ms/token": the time the engine spends building the rounds' bitmasks (the matcher
  following the path and filling the rows) per reply token, and that as a share of an
  unconstrained decode round (the sampler's masking inside the draw shows in the ratio);
- drafted / accepted under the grammar with drafting on, and whether the reply's token_sha
  equals the drafting-off one (it must).
Then compile times through the server's GrammarCompiler: cold (first compile) and cached.
Best of --repeats for the rates.
"""
import argparse
import json
import os
import sys
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if ROOT not in sys.path:
    sys.path.insert(0, ROOT)

from tensorfold.api.replies import token_sha  # noqa: E402
from tensorfold.engine.engine import Engine, EngineConfig  # noqa: E402
from tensorfold.grammar.compiler import GrammarCompiler  # noqa: E402
from tensorfold.grammar.constraint import GrammarConstraint  # noqa: E402
from tensorfold.grammar.spec import GrammarSpec  # noqa: E402
from tensorfold.sampling.params import SamplingParams  # noqa: E402
from tools.bench_core import chat_prompt_ids, fmt, machine_line, print_table  # noqa: E402

PERSON = {"type": "object", "properties": {
    "name": {"type": "string", "maxLength": 40}, "age": {"type": "integer", "minimum": 0, "maximum": 120},
    "email": {"type": "string", "maxLength": 40}, "city": {"type": "string", "maxLength": 30},
    "tags": {"type": "array", "maxItems": 4, "items": {"type": "string", "maxLength": 12}}},
    "required": ["name", "age", "email", "city", "tags"], "additionalProperties": False}
CASES = [
    ("json schema", GrammarSpec.json_schema(PERSON, "bench"), "Invent a person and describe them as JSON."),
    ("regex", GrammarSpec("regex", r"([A-Z][a-z]{2,9}, ){12,20}[A-Z][a-z]{2,9}\.", "bench"), "Name twenty cities."),
    ("choice", GrammarSpec.choice(["positive", "negative", "neutral"], "bench"), "Is 'great movie' positive?"),
]


class MaskClock:
    """Time spent in the engine's bitmask building (Engine._attach_masks) and in rounds."""

    def __init__(self, engine):
        self.mask_s = 0.0
        attach = engine._attach_masks

        def timed(plan):
            t = time.perf_counter()
            try:
                return attach(plan)
            finally:
                self.mask_s += time.perf_counter() - t
        engine._attach_masks = timed


def decode(engine, prompt, params, constraint=None):
    """(tokens/s over the decode rounds, request) for one request run alone."""
    rid = engine.add_request(prompt, params, constraint=constraint)
    req = engine.requests[rid]
    while engine.has_work():
        engine.step()
    decoded = len(req.output_ids) - 1
    return decoded / req.stats.decode_s if req.stats.decode_s else 0.0, req


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--dtype", default="bfloat16")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--max-tokens", type=int, default=128)
    args = ap.parse_args(argv)

    serial = Engine(None, EngineConfig(dtype=args.dtype, num_threads=args.threads, drafting=False, probe=False))
    drafted = Engine(None, EngineConfig(dtype=args.dtype, num_threads=args.threads, drafting=True, probe=False))
    compiler = GrammarCompiler(serial.tokenizer, serial.info.vocab_size)
    eos = serial.tokenizer.eos_token_ids
    clock = MaskClock(serial)
    print(machine_line())
    print(f"\n{args.dtype}, {args.threads} threads, greedy, best of {args.repeats}\n")
    rows = []
    for name, spec, text in CASES:
        compiled, _ = compiler.compile(spec)
        prompt = chat_prompt_ids(serial, text)
        params = SamplingParams(temperature=0.0, max_tokens=args.max_tokens)
        best_c = best_u = 0.0
        mask_ms = float("inf")
        for _ in range(args.repeats):
            clock.mask_s = 0.0
            rate, req = decode(serial, prompt, params, GrammarConstraint(compiled, eos))
            best_c = max(best_c, rate)
            mask_ms = min(mask_ms, 1e3 * clock.mask_s / len(req.output_ids))
            length = len(req.output_ids)
            free = SamplingParams(temperature=0.0, max_tokens=length, ignore_eos=True)
            best_u = max(best_u, decode(serial, prompt, free)[0])
        _, dreq = decode(drafted, prompt, params, GrammarConstraint(compiled, eos))
        same = token_sha(dreq.output_ids) == token_sha(req.output_ids)
        round_ms = 1e3 / best_u
        rows.append([name, length, fmt(best_u, 1), fmt(best_c, 1), f"{best_c / best_u:.2f}x",
                     f"{mask_ms:.3f}", f"{100 * mask_ms / round_ms:.1f}%",
                     f"{dreq.stats.accepted}/{dreq.stats.drafted}", same])
    print_table(["grammar", "reply tokens", "free tok/s", "constrained tok/s", "ratio", "mask ms/token",
                 "of a round", "accepted/drafted", "drafted == serial"], rows)

    print("\ncompile (GrammarCompiler, 2 threads)\n")
    fresh = GrammarCompiler(serial.tokenizer, serial.info.vocab_size)
    fresh.warm().result()
    crow = []
    for name, spec, _ in CASES + [("json object", GrammarSpec("json_object", "", "bench"), "")]:
        t = time.perf_counter()
        fresh.compile(spec)
        cold = time.perf_counter() - t
        t = time.perf_counter()
        fresh.compile(spec)
        cached = time.perf_counter() - t
        crow.append([name, f"{cold * 1e3:.1f}", f"{cached * 1e3:.3f}"])
    print_table(["grammar", "cold ms", "cached ms"], crow)
    print(json.dumps({"done": True}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
