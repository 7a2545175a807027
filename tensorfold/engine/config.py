"""EngineConfig: what an engine is built with (parsed once by the CLI, or made by tests)."""
from dataclasses import dataclass

DRAFTERS = ("auto", "mtp", "ngram")
DEFAULT_DRAFTS = {"ngram": 7, "mtp": 3}


@dataclass(frozen=True)
class EngineConfig:
    dtype: str = "auto"              # auto: GGUF blocks kept as stored, float32 activations;
                                     # float32 / bfloat16: every weight dequantized to it
    kv_dtype: str = "auto"           # the KV cache's: auto (bfloat16 under dtype auto, else the
                                     # activations' dtype), float32 or bfloat16
    quantize: str | None = None      # q8_0 / q4_0: a Hugging Face checkpoint's GEMM weights
                                     # quantized at load
    context: int | None = None       # served window; None = the model's max_position_embeddings
    max_num_seqs: int = 8
    max_tokens_per_step: int = 512   # the prefill chunk
    decode_share: float = 0.25       # decode-only time after each prefill chunk, as its fraction
    kv_cache_gib: float = 1.0
    prompt_cache_gib: float | None = None  # cap on cached free blocks; None = all free blocks
    block_size: int = 32             # also the attention split: blocks align to absolute positions
    drafting: bool = True
    drafter: str = "auto"            # where drafts come from: "ngram" (prompt lookup), "mtp" (the
                                     # checkpoint's multi-token-prediction layer; an error without
                                     # one), "auto" (mtp where the checkpoint has it, else ngram)
    max_draft: int | None = None     # drafts per round at most (--num-draft-tokens); None: 7 for
                                     # ngram, 3 for mtp (each MTP draft costs a forward of its layer)
    draft_budget: bool = True        # each round's draft depth from measured row cost and
                                     # acceptance (engine/draft_budget.py); False: every proposal
                                     # runs at full depth (max_draft)

    def drafts_for(self, drafter: str) -> int:
        """max_draft as set, else the drafter's default."""
        return self.max_draft if self.max_draft is not None else DEFAULT_DRAFTS[drafter]
    default_max_tokens: int = 4096
    num_threads: int | None = None
    probe: bool = True               # check batch invariance on the model's shapes at startup
    backend: str = "cpu"             # the backend select_backend chose: "cpu" (the C++ kernels, else
                                     # the torch references) or "cuda" (Triton kernels)
    device: str | None = None        # torch device; None = the backend's. Tests set "cpu" to run
                                     # the cuda op set on CPU tensors under TRITON_INTERPRET=1
    tp: int = 1                      # tensor-parallel ranks (parallel/): rank 0 serves, the others run
                                     # their shard of every round
    tp_timeout_s: float = 10.0       # a rank silent this long (no heartbeat, a collective unanswered)
                                     # has failed
    vision: bool = False             # load a vision-language checkpoint's tower: image input (--vision)
    image_cache_mib: int = 256       # encoded images kept by content hash (the runner's image cache)
    restart_ranks: bool = False      # after a rank fails, restart the group (else 503 until restarted)
