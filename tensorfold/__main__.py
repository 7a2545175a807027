"""python -m tensorfold: serve a model at http://127.0.0.1:8080/v1 (the default model with no arguments)."""
import argparse
import json
import logging
import os
import signal
import sys

from tensorfold.api.images import ImageLimits
from tensorfold.backends import select_backend
from tensorfold.chat.cards import CardError
from tensorfold.engine.engine import EngineConfig
from tensorfold.models.checkpoint import CheckpointError


def parse_args(argv=None):
    p = argparse.ArgumentParser(prog="python -m tensorfold", description=__doc__)
    p.add_argument("--model", default=None, help="HF checkpoint directory or .gguf file (default: SmolLM2-135M-Instruct Q4_1)")
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--port", type=int, default=8080)
    p.add_argument("--backend", default="auto", choices=["auto", "cuda", "mlx", "cpu"],
                   help="where the model runs; auto: mlx on Apple silicon, else cuda if a GPU is found, else cpu "
                        "(mlx runs llama and qwen3 layers; on Linux it uses MLX's CPU device)")
    p.add_argument("--dtype", default="auto", choices=["auto", "float32", "bfloat16"],
                   help="auto: a GGUF's quantized matrices served in their blocks, float32 activations; "
                        "float32/bfloat16: every weight dequantized to it")
    p.add_argument("--kv-dtype", default="auto", choices=["auto", "float32", "bfloat16"],
                   help="the KV cache's dtype; auto: bfloat16 under --dtype auto, else the --dtype")
    p.add_argument("--quantize", default=None, choices=["q8_0", "q4_0"],
                   help="quantize a Hugging Face checkpoint's matrices at load (the exact quantized GEMM)")
    p.add_argument("--context", type=int, default=None, help="served window in tokens (default: the model's)")
    p.add_argument("--parallel", default="auto", help="'auto' or N: requests sharing a round")
    p.add_argument("--served-model-name", default=None)
    p.add_argument("--alias", action="append", default=[], help="another accepted model name (repeatable)")
    p.add_argument("--max-tokens", type=int, default=None, help="default reply limit (capped to the window)")
    p.add_argument("--prefill-chunk", type=int, default=512, help="prompt tokens per round")
    p.add_argument("--decode-share", type=float, default=0.25,
                   help="decode-only time after each prefill chunk, as a fraction of the chunk's time (0: prompts first)")
    p.add_argument("--kv-cache-gib", type=float, default=1.0, help="KV cache budget")
    p.add_argument("--block-size", type=int, default=32,
                   help="tokens per cache block (a multiple of 16): the prefix cache's unit, and for models "
                        "with recurrent layers the spacing of their kept states")
    p.add_argument("--prompt-cache-gib", type=float, default=None,
                   help="most memory the prefix cache keeps in idle blocks (default: all free blocks)")
    p.add_argument("--no-drafts", action="store_true", help="turn speculative decoding off server-wide")
    p.add_argument("--vision", action="store_true",
                   help="load a vision-language checkpoint's vision tower (Qwen3.5): chat image_url parts and "
                        "Responses input_image as data: URLs (http(s) URLs with --image-urls); without it such a "
                        "checkpoint serves text only")
    p.add_argument("--max-image-bytes", type=int, default=ImageLimits.max_bytes, help="--vision: bytes per image")
    p.add_argument("--max-image-pixels", type=int, default=ImageLimits.max_pixels,
                   help="--vision: width x height per image, as sent")
    p.add_argument("--max-images", type=int, default=ImageLimits.max_images, help="--vision: images per request")
    p.add_argument("--image-urls", action="store_true",
                   help="--vision: fetch http(s) image URLs (chat image_url, Responses input_image) from this "
                        "server, within --max-image-bytes and --image-url-timeout; off: only data: URLs")
    p.add_argument("--image-url-timeout", type=float, default=ImageLimits.url_timeout_s, metavar="SECONDS",
                   help="--image-urls: a request's fetches end within this (connect, redirects, the body)")
    p.add_argument("--drafter", default="auto", choices=["auto", "mtp", "ngram"],
                   help="where drafts come from: the checkpoint's multi-token-prediction layer (mtp; an error "
                        "without one), prompt lookup (ngram), or auto: mtp where the checkpoint has it, else ngram")
    p.add_argument("--num-draft-tokens", type=int, default=None,
                   help="drafts per round at most (default: 3 for mtp, 7 for ngram); the draft budget picks "
                        "fewer, down to none, where they do not pay")
    p.add_argument("--tp", type=int, default=1,
                   help="tensor-parallel ranks: every GEMM, attention head and the vocabulary split over N "
                        "processes (gloo on CPU), the same tokens as one rank")
    p.add_argument("--tp-timeout", type=float, default=10.0,
                   help="seconds a rank may stay silent (no heartbeat, a collective unanswered) before "
                        "the group counts as failed")
    p.add_argument("--restart-ranks", action="store_true",
                   help="restart the rank group after a rank fails (else requests get 503 until the server restarts)")
    p.add_argument("--threads", type=int, default=None, help="torch CPU threads (default: torch's)")
    p.add_argument("--model-card", default=None,
                   help="the model card to use (model_cards/NAME.json; default: chosen from the checkpoint)")
    p.add_argument("--reasoning-effort", default=None, choices=["none", "minimal", "low", "medium", "high", "xhigh"],
                   help="the effort of requests that set none (default: the template's own)")
    p.add_argument("--thinking-budget", type=int, default=0,
                   help="thinking tokens before the server closes a think block, for requests that set none")
    p.add_argument("--api-key", default=None,
                   help="require 'Authorization: Bearer KEY' on /v1 routes (default: $TENSORFOLD_API_KEY, else none)")
    p.add_argument("--response-store", default=None, metavar="PATH",
                   help="keep stored Responses in this SQLite file (default: in memory, lost on restart)")
    p.add_argument("--builtin-tools", default="refuse", choices=["refuse", "ignore"],
                   help="Responses built-in tools (web_search, file_search, ...), which this server does not run: "
                        "refuse them with a 400 (default) or drop them, logged and listed in the reply")
    p.add_argument("--reasoning-key-file", default=None, metavar="PATH",
                   help="the key that signs encrypted reasoning (made there if absent; default: kept in "
                        "--response-store, else a new key per process)")
    p.add_argument("--drain-seconds", type=float, default=30.0,
                   help="on SIGTERM/SIGINT, how long running requests may finish before the server exits")
    p.add_argument("--log-level", default="info", choices=["debug", "info", "warning", "error"])
    p.add_argument("--log-format", default="text", choices=["text", "json"], help="json: one JSON object per line")
    return p.parse_args(argv)


def settings_from(args, backend: str = "cpu"):
    from tensorfold.server import ServeSettings

    if not 0 <= args.decode_share <= 1:
        raise SystemExit("--decode-share must lie in [0, 1]")
    if args.drain_seconds < 0:
        raise SystemExit("--drain-seconds must be 0 or more")
    if args.thinking_budget < 0:
        raise SystemExit("--thinking-budget must be 0 (none) or more")
    if args.block_size < 16 or args.block_size % 16:
        raise SystemExit("--block-size must be a positive multiple of 16")
    if args.tp < 1:
        raise SystemExit("--tp must be at least 1")
    if args.tp > 1 and backend == "mlx":
        raise SystemExit("--tp: the mlx backend runs on one device (use --backend cpu or cuda)")
    if args.tp_timeout <= 0:
        raise SystemExit("--tp-timeout must be positive")
    if args.tp > 1 and args.vision:
        raise SystemExit("--vision: the vision tower runs on one rank only (drop --tp or --vision)")
    if args.tp > 1 and args.drafter == "mtp":
        raise SystemExit("--drafter mtp: the MTP layer runs on one rank only (with --tp, drafts come from "
                         "n-grams: --drafter ngram or auto)")
    if args.num_draft_tokens is not None and args.num_draft_tokens < 1:
        raise SystemExit("--num-draft-tokens must be at least 1 (--no-drafts turns drafting off)")
    if not args.image_url_timeout > 0:
        raise SystemExit("--image-url-timeout must be positive")
    if args.parallel == "auto":
        parallel = 8
    else:
        try:
            parallel = int(args.parallel)
        except ValueError:
            raise SystemExit(f"--parallel: expected 'auto' or a positive integer, got {args.parallel!r}")
        if parallel < 1:
            raise SystemExit("--parallel must be at least 1")
    engine = EngineConfig(dtype=args.dtype, kv_dtype=args.kv_dtype, quantize=args.quantize, context=args.context,
                          max_num_seqs=parallel, max_tokens_per_step=args.prefill_chunk,
                          decode_share=args.decode_share,
                          kv_cache_gib=args.kv_cache_gib, prompt_cache_gib=args.prompt_cache_gib,
                          block_size=args.block_size, drafting=not args.no_drafts,
                          drafter=args.drafter, max_draft=args.num_draft_tokens, num_threads=args.threads, backend=backend,
                          tp=args.tp, tp_timeout_s=args.tp_timeout, restart_ranks=args.restart_ranks,
                          vision=args.vision)
    return ServeSettings(model=args.model, host=args.host, port=args.port,
                         served_model_name=args.served_model_name, aliases=tuple(args.alias),
                         max_tokens=args.max_tokens, model_card=args.model_card,
                         reasoning_effort=args.reasoning_effort, thinking_budget=args.thinking_budget,
                         api_key=args.api_key or os.environ.get("TENSORFOLD_API_KEY") or None,
                         response_store=args.response_store, builtin_tools=args.builtin_tools,
                         reasoning_key_file=args.reasoning_key_file, engine=engine,
                         image_limits=ImageLimits(args.max_image_bytes, args.max_image_pixels, args.max_images,
                                                    args.image_urls, args.image_url_timeout))


class JsonLogFormatter(logging.Formatter):
    """One JSON object per line: time, level, logger, message, and an access line's fields."""

    def format(self, record: logging.LogRecord) -> str:
        entry = {"time": self.formatTime(record), "level": record.levelname, "logger": record.name,
                 "message": record.getMessage()}
        if getattr(record, "access", None):
            entry.update(record.access)
        if record.exc_info:
            entry["exception"] = self.formatException(record.exc_info)
        return json.dumps(entry, ensure_ascii=False)


def setup_logging(level: str, fmt: str) -> None:
    handler = logging.StreamHandler()
    handler.setFormatter(JsonLogFormatter() if fmt == "json" else
                         logging.Formatter("%(asctime)s %(levelname)s %(name)s: %(message)s"))
    logging.basicConfig(level=level.upper(), handlers=[handler])


def main(argv=None) -> int:
    args = parse_args(argv)
    setup_logging(args.log_level, args.log_format)
    log = logging.getLogger("tensorfold")
    try:
        backend = select_backend(args.backend)
    except RuntimeError as e:
        log.error("%s", e)
        return 2
    from tensorfold.parallel.launch import torchrun_rank
    from tensorfold.server import build_server

    torchrun = torchrun_rank()
    if torchrun is not None:  # torchrun started every rank with this command line
        rank, world, host, port, _ = torchrun
        if args.tp not in (1, world):
            log.error("--tp %d, but torchrun started %d ranks", args.tp, world)
            return 2
        args.tp = world
        if rank != 0:  # not the server: this rank's shard, until rank 0 says stop
            from tensorfold.parallel.backend import serve_rank
            serve_rank(rank, world, host, port, args.model, settings_from(args, backend).engine)
            return 0
    try:
        server = build_server(settings_from(args, backend))
    except CheckpointError as e:
        log.error("cannot load the model: %s", e)
        return 2
    except CardError as e:
        log.error("%s", e)
        return 2
    if server.service.grammar.compiler.available():
        server.service.grammar.compiler.warm()  # xgrammar and its tokenizer table, loaded off the serving thread
    host, port = server.address
    names = server.service.model_names
    log.info("backend %s; serving %s at http://%s:%d/v1 (window %d tokens)", backend, ", ".join(names),
             host, port, server.service.info.context_length)
    signals = []

    def on_signal(signum, frame):
        signals.append(signum)
        if len(signals) > 1:  # a second signal: leave now
            log.warning("second %s: exiting at once", signal.Signals(signum).name)
            os._exit(1)
        log.info("%s: finishing running requests (up to %.0fs), then exiting", signal.Signals(signum).name,
                 args.drain_seconds)
        server.drain(args.drain_seconds)

    for signum in (signal.SIGTERM, signal.SIGINT):
        signal.signal(signum, on_signal)
    try:
        server.serve_forever()
    finally:
        server.shutdown()
        server.service.engine.close()  # a rank group's other processes end with it
    return 0


if __name__ == "__main__":
    sys.exit(main())
