"""Where a one-stream decode round goes, measured inside the process: each layer's call, the
head, the rest of the model's forward, the engine's time outside it, and next to each the same
GEMMs called alone.

    python tools/bench_round.py ~/.cache/tensorfold-bench/real/llama-1b-q4_0.gguf
    python tools/bench_round.py ~/.cache/tensorfold-bench/dense-24 --quantize q4_0
    PYTHONPATH=/tmp/other_checkout python tools/bench_round.py PATH    # another build, to alternate

A round here is one engine step of one greedy request (drafting off) after a 16-token prompt;
the table is the best of --repeats requests of --tokens tokens (the repeat with the shortest
steps), ms per round. "GEMMs alone": the model's own packed weights, each called with one random
row, in the forward's order, --gemm-passes times over the whole model (so each reads its weight
from memory, as a round does when the model is beyond the caches); the median per weight. A
layer's "rest" is its time in the round beyond its GEMMs alone: its other ops, its Python, the
code that runs cold after the weights have streamed through the caches, and the first GEMM's
slower start after the memory idled (docs/benchmarks.md, "A decode round besides its GEMMs").
"""
import argparse
import os
import sys
import time

if "PYTHONPATH" not in os.environ:  # else the checkout it names (its build and its tools)
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from tools.bench_families import Clocks, layer_kind  # noqa: E402
from tools.bench_native import prompt_ids  # noqa: E402


class RoundClocks(Clocks):
    """Seconds per label over the steps since reset(): each layer's call, the head, the forward
    and the step."""

    def __init__(self, engine):
        super().__init__()
        model = engine.backend.model
        for i in range(len(model.layers)):
            model._run[i] = self._timed(model._run[i], f"layer {i}")
        model.lm_head = _TimedWeight(model.lm_head, self, "head")
        model.forward = self._timed(model.forward, "forward")
        engine.step = self._timed(engine.step, "step")


class _TimedWeight:
    """A LinearWeight whose calls are timed (the head: the forward calls it, not a _run entry)."""

    def __init__(self, weight, clocks: RoundClocks, label: str):
        self._weight, self._clocks, self._label = weight, clocks, label

    def __call__(self, x):
        started = time.perf_counter()
        try:
            return self._weight(x)
        finally:
            self._clocks.add(self._label, time.perf_counter() - started)

    def __getattr__(self, name):
        return getattr(self._weight, name)


def round_times(engine, clocks: RoundClocks, tokens: int, repeats: int) -> dict:
    """ms per round of each label, from the repeat with the shortest steps."""
    from tensorfold.sampling.params import SamplingParams

    greedy = SamplingParams(max_tokens=tokens, temperature=0, ignore_eos=True, draft=False)
    best = None
    for _ in range(repeats):
        rid = engine.add_request(prompt_ids(16), greedy)
        req = engine.requests[rid]
        while req.num_computed_tokens < 16:
            engine.step()  # the prompt and the first token
        clocks.reset()
        steps = 0
        while engine.has_work():
            engine.step()
            steps += 1
        per_round = {label: 1e3 * s / steps for label, s in clocks.seconds.items()}
        if best is None or per_round["step"] < best["step"]:
            best = per_round
    return best


def gemms_alone(model, passes: int) -> dict:
    """ms per call of each of the model's GEMM weights, one random row, median over the passes."""
    import torch

    weights = [(f"layer {i}", w) for i, layer in enumerate(model.layers) for w in layer.gemms().values()]
    weights.append(("head", model.lm_head))
    rows = {}
    times = [[] for _ in weights]
    for p in range(passes + 1):
        for j, (_, w) in enumerate(weights):
            x = rows.setdefault(w.in_features, torch.randn(1, w.in_features).to(model.dtype))
            started = time.perf_counter()
            w(x)
            if p:  # the first pass warms up
                times[j].append(time.perf_counter() - started)
    out = {}
    for (label, _), t in zip(weights, times):
        t.sort()
        out[label] = out.get(label, 0.0) + 1e3 * t[len(t) // 2]
    return out


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("path", help="a GGUF file or an HF checkpoint directory")
    p.add_argument("--quantize", default=None, help="quantize at load (q4_0, q8_0, ...), as --quantize serves")
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--tokens", type=int, default=64)
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--gemm-passes", type=int, default=7)
    args = p.parse_args(argv)

    import torch

    from tensorfold.engine.engine import Engine, EngineConfig
    from tensorfold.sampling.params import SamplingParams

    torch.set_num_threads(args.threads)
    engine = Engine(os.path.expanduser(args.path), EngineConfig(
        quantize=args.quantize, num_threads=args.threads, prompt_cache_gib=0, context=1024, max_tokens_per_step=512))
    model = engine.backend.model
    engine.generate(prompt_ids(8), SamplingParams(max_tokens=2, temperature=0, ignore_eos=True, draft=False))
    clocks = RoundClocks(engine)
    rounds = round_times(engine, clocks, args.tokens, args.repeats)
    alone = gemms_alone(model, args.gemm_passes)

    print(f"{os.path.basename(os.path.normpath(args.path))}, {args.threads} threads, ops {engine.info.ops}: "
          f"ms per decode round (best of {args.repeats} x {args.tokens} tokens)\n")
    print("| part | kind | in the round | its GEMMs alone | the rest |")
    print("|---|---|---|---|---|")
    labels = [f"layer {i}" for i in range(len(model.layers))] + ["head"]
    kinds = [layer_kind(layer) for layer in model.layers] + ["lm_head"]
    for label, kind in zip(labels, kinds):
        got, gemm = rounds.get(label, 0.0), alone.get(label, 0.0)
        print(f"| {label} | {kind} | {got:.3f} | {gemm:.3f} | {got - gemm:.3f} |")
    in_parts = sum(rounds.get(label, 0.0) for label in labels)
    gemm_total = sum(alone.values())
    rest_of_forward = rounds["forward"] - in_parts
    outside = rounds["step"] - rounds["forward"]
    print(f"| the forward's other steps | embedding, norms | {rest_of_forward:.3f} | | {rest_of_forward:.3f} |")
    print(f"| outside the forward | batch, draw, engine | {outside:.3f} | | {outside:.3f} |")
    print(f"| **the round** | | **{rounds['step']:.3f}** | **{gemm_total:.3f}** | "
          f"**{rounds['step'] - gemm_total:.3f}** ({(rounds['step'] - gemm_total) / rounds['step']:.0%}) |")


if __name__ == "__main__":
    main()
