"""Frozen, validated configuration for the engine and the server."""

from __future__ import annotations

from dataclasses import dataclass, field

# vLLM's names (types.LogprobsMode says what each reports).
LOGPROBS_MODES = ("raw_logprobs", "raw_logits", "processed_logprobs", "processed_logits")
# The reasoning_effort values a request may name (OpenAI's).
REASONING_EFFORTS = ("none", "minimal", "low", "medium", "high", "xhigh")

# The prefill's defaults by device (CPU, GPU), for configs that name none (`EngineConfig.prefill`).
# On a GPU a prefill forward costs about as much host time as a decode step, so prompts
# are gathered; on the CPU the step itself is far longer than any useful delay.
# A GPU step of 2048 prompt tokens still takes milliseconds, and fewer, larger prefill
# steps cost less host time. On the CPU 1024 tokens take seconds, but fewer, fuller
# prefill steps keep a closed loop's wave together: +19% tokens/s at c=64 against 512.
PREFILL_CHUNK = (1024, 2048)
PREFILL_DELAY_MS = (0.0, 20.0)


@dataclass(frozen=True)
class EngineConfig:
    max_num_seqs: int = 64  # requests decoded together
    # Prompt tokens per prefill step, so decoding is never starved; None: the device's default
    # (PREFILL_CHUNK).
    prefill_chunk: int | None = None
    # While a batch decodes, a new prompt waits up to this long for others to prefill with;
    # None: the device's default (PREFILL_DELAY_MS).
    prefill_delay_ms: float | None = None
    # The server cap on top and prompt logprobs (vLLM's --max-logprobs): -1 is the whole
    # vocabulary, resolved against the model by the API (api/core/bounds.py). 256 by default:
    # a distillation teacher's lists; a request pays for its own list only (a step's rows
    # share the widest list asked in it, each reading its own first k).
    max_top_logprobs: int = 256
    max_model_len: int | None = None  # None: the model's own context length
    logprobs_mode: str = "raw_logprobs"  # the default of requests that name none
    # Chat logprobs of every generated token in `logprobs.content`, in order, reasoning and
    # tool-call tokens included (as vLLM writes them), for requests that name no
    # `flat_logprobs`; requests with `return_token_ids` get it anyway (docs/specs/rl.md).
    flat_logprobs: bool = False
    # vLLM's --enable-return-routed-experts: every request on a model whose routing is
    # recorded returns it, as if it asked (api/core/routed_experts.py).
    return_routed_experts: bool = False
    # MLX's cache of freed buffers; None: 4 GiB on a GPU, MLX's own default on the CPU.
    cache_limit_mib: int | None = None
    # Device memory for kept sequences' keys and values (runner/prefix_cache.py); 0 turns
    # prefix caching off; None: a share of the memory left after the weights.
    prefix_cache_mib: int | None = None
    # The prefix cache's disk tier (runner/disk_tier.py): a folder, and its size limit.
    kv_cache_dir: str | None = None
    kv_cache_disk_mib: int = 32768
    # The activations' dtype: auto (float32 on the CPU, the stored dtype on a GPU), float32,
    # bfloat16 or float16; the log-softmax is float32 whatever this is.
    dtype: str = "auto"
    # Under mlx.launch: how the model is split over the processes ("auto", "tensor" or
    # "pipeline"; distributed/distributed.py), and how long rank 0 waits for the others at most.
    parallel: str | None = None
    group_timeout_s: float = 60.0
    # Speculative decoding (runner/speculation.py, docs/specs/speculation.md): "off",
    # "prediction" (rows whose request sent a prediction), "lookup" (those, and every row
    # from n-grams of its own prompt and output) or "draft" (a prediction, else the draft
    # model's); drafts per step; the largest batch that speculates (beyond it a step is no
    # longer bound by the host).
    speculate: str = "prediction"
    # Batch-invariant mode (runner/invariance.py): a token's logprob depends on the tokens
    # before it alone, bit for bit, whatever else is in the batch; checked at start-up.
    batch_invariant: bool = False
    num_draft_tokens: int = 8
    speculate_max_batch: int = 4
    draft_model: str | None = None  # "draft": a local model directory sharing the tokenizer
    # --reasoning-budgets: a thinking budget for each reasoning_effort named (api/core/
    # thinking_budget.py), e.g. (("low", 1024), ("medium", 4096), ("high", 16384)).
    reasoning_budgets: tuple[tuple[str, int], ...] = ()

    def __post_init__(self) -> None:
        if self.max_num_seqs < 1:
            raise ValueError("max_num_seqs must be >= 1")
        if self.prefill_chunk is not None and self.prefill_chunk < 1:
            raise ValueError("prefill_chunk must be >= 1")
        if self.prefill_delay_ms is not None and not 0 <= self.prefill_delay_ms <= 10_000:
            raise ValueError("prefill_delay_ms must be in [0, 10000]")
        if self.max_top_logprobs < -1:
            raise ValueError("max_logprobs must be -1 (the vocabulary) or >= 0")
        if self.speculate not in ("off", "prediction", "lookup", "draft"):
            raise ValueError("speculate must be off, prediction, lookup or draft")
        if (self.speculate == "draft") != (self.draft_model is not None):
            raise ValueError("--speculate draft goes with --draft-model, and only it")
        for effort, budget in self.reasoning_budgets:
            if effort not in REASONING_EFFORTS or budget < 0:
                raise ValueError(
                    f"--reasoning-budgets: {effort}={budget}: an effort of"
                    f" {', '.join(REASONING_EFFORTS)} and a budget >= 0"
                )
        if not 1 <= self.num_draft_tokens <= 64:
            raise ValueError("num_draft_tokens must be in [1, 64]")
        if self.speculate_max_batch < 1:
            raise ValueError("speculate_max_batch must be >= 1")
        if self.logprobs_mode not in LOGPROBS_MODES:
            raise ValueError(f"logprobs_mode must be one of {', '.join(LOGPROBS_MODES)}")
        if self.max_model_len is not None and self.max_model_len < 1:
            raise ValueError("max_model_len must be >= 1")
        if not self.group_timeout_s > 0:
            raise ValueError("group_timeout_s must be > 0")
        if self.cache_limit_mib is not None and self.cache_limit_mib < 0:
            raise ValueError("cache_limit_mib must be >= 0")
        if self.prefix_cache_mib is not None and self.prefix_cache_mib < 0:
            raise ValueError("prefix_cache_mib must be >= 0")
        if self.kv_cache_disk_mib < 1:
            raise ValueError("kv_cache_disk_mib must be >= 1")
        if self.dtype not in ("auto", "float32", "bfloat16", "float16"):
            raise ValueError("dtype must be auto, float32, bfloat16 or float16")

    def prefill(self, cpu: bool) -> tuple[int, float]:
        """The prefill chunk (prompt tokens) and delay (ms) on this device (MLX's CPU backend
        or a GPU): those this config names, else the device's defaults."""
        device = 0 if cpu else 1  # the order of PREFILL_CHUNK and PREFILL_DELAY_MS: CPU, GPU
        chunk = PREFILL_CHUNK[device] if self.prefill_chunk is None else self.prefill_chunk
        delay = PREFILL_DELAY_MS[device] if self.prefill_delay_ms is None else self.prefill_delay_ms
        return chunk, delay


@dataclass(frozen=True)
class Limits:
    """What one request may ask for, and how many may wait; each breach is a 4xx naming it."""

    max_body_bytes: int = 8 << 20  # 413 above this
    max_queued: int = 256  # requests in flight beyond max_num_seqs before a 429
    retry_after_s: int = 1  # the 429's Retry-After
    # Output tokens of one request, sent or not (a larger max_tokens: 400); None: the context
    max_output_tokens: int | None = None
    max_n: int = 16
    max_stop: int = 16  # stop strings per request
    max_stop_chars: int = 512  # characters per stop string (each costs a scan per token)
    max_stop_token_ids: int = 128
    max_logprob_token_ids: int = 128
    max_bad_words: int = 128  # bad_words per request (each a scan of its row's output per step)
    max_image_pixels: int = 4096 * 4096  # width x height of one image, checked before decoding
    max_images: int = 8  # images in one request
    # Images from local files only under this folder (None: none), and from http(s) URLs only
    # when allowed (fetched within image_fetch_s, at most max_body_bytes).
    allowed_local_media_path: str | None = None
    allow_image_urls: bool = False
    image_fetch_s: float = 10.0

    def __post_init__(self) -> None:
        for name, value in vars(self).items():
            if not isinstance(value, int) or isinstance(value, bool):
                continue
            least = 0 if name in ("max_queued", "max_stop", "retry_after_s") else 1
            if value is not None and value < least:
                raise ValueError(f"{name} must be >= {least}")
        if not self.image_fetch_s > 0:
            raise ValueError("image_fetch_s must be > 0")


@dataclass(frozen=True)
class TinkerConfig:
    """Tinker's training API (docs/specs/tinker.md): where save_weights writes checkpoints
    (None: a new temporary folder, gone with the process), and how long a session goes unheard
    of (no heartbeat, no call) before it ends as a finished one does (the SDK heartbeats every
    10 s and warns after 120 s without an answer)."""

    dir: str | None = None
    session_timeout_s: float = 120.0

    def __post_init__(self) -> None:
        if not self.session_timeout_s > 0:
            raise ValueError("tinker_session_timeout must be > 0")


@dataclass(frozen=True)
class BatchConfig:
    """OpenAI's Batch API (api/batches/): where its files and batches are kept (None: a new
    temporary folder, gone with the process), how many batch lines run at once (of all batches
    together), and the largest file an upload may be."""

    dir: str | None = None
    concurrency: int = 16
    max_file_bytes: int = 200 << 20  # OpenAI's limit for a batch's input file

    def __post_init__(self) -> None:
        if self.concurrency < 1:
            raise ValueError("batch_concurrency must be >= 1")
        if self.max_file_bytes < 1:
            raise ValueError("max_file_bytes must be >= 1")


@dataclass(frozen=True)
class Access:
    """Who may call: an optional bearer key (all routes but /health) and CORS origins."""

    api_key: str | None = None
    allowed_origins: tuple[str, ...] = ()  # empty: no CORS headers at all

    def __post_init__(self) -> None:
        if self.api_key is not None and not self.api_key.strip():
            raise ValueError("api_key must not be empty")


@dataclass(frozen=True)
class PoolConfig:
    """Several models in one server (api/core/pool.py): how many may be loaded at once, the memory
    their weights may take together (estimated from the weight files), and how long a request
    waits for a busy model to go idle so that another can be loaded in its place."""

    max_loaded: int | None = None  # None: no limit on the count
    memory_mib: int | None = None  # None: no memory budget
    load_timeout_s: float = 60.0  # then a 503 with Retry-After

    def __post_init__(self) -> None:
        if self.max_loaded is not None and self.max_loaded < 1:
            raise ValueError("max_loaded_models must be >= 1")
        if self.memory_mib is not None and self.memory_mib < 1:
            raise ValueError("max_model_memory_mib must be >= 1")
        if not self.load_timeout_s > 0:
            raise ValueError("model_load_timeout_s must be > 0")


@dataclass(frozen=True)
class ServerConfig:
    # An mlx-lm directory, a GGUF file or a Hugging Face name; None: the embedded default.
    model: str | None = None
    served_model_name: str | None = None
    offline: bool = False  # a Hugging Face name must be in the local cache: no download
    # Models served beside the first (the default of routes that name none): (source, name).
    other_models: tuple[tuple[str | None, str | None], ...] = ()
    # Each model's --task (models/embedding.py), in order; one: every model's; none: auto.
    tasks: tuple[str, ...] = ()
    # LoRA adapters (name, path) served on the first model from the start (--lora).
    lora: tuple[tuple[str, str], ...] = ()
    pool: PoolConfig = PoolConfig()
    host: str = "127.0.0.1"  # loopback unless told otherwise
    port: int = 8000
    engine: EngineConfig = EngineConfig()
    limits: Limits = field(default_factory=Limits)
    access: Access = field(default_factory=Access)
    batches: BatchConfig = field(default_factory=BatchConfig)
    tinker: TinkerConfig = field(default_factory=lambda: TinkerConfig())
    shutdown_grace_s: float = 10.0  # on SIGINT/SIGTERM, in-flight requests get this long
    # The engine in a process of its own (its own GIL), or in a thread of the server's.
    engine_process: bool = True
    metrics: bool = True  # GET /metrics, and the requests observed for it
    # Answers whose sampled ids each model remembers for conversations sent back (0: none).
    faithful_answers: int = 4096

    @property
    def models(self) -> tuple[tuple[str | None, str | None], ...]:
        """Every served model as (source, name), the default first."""
        return ((self.model, self.served_model_name), *self.other_models)

    def task(self, i: int) -> str:
        """The i-th model's --task."""
        if not self.tasks:
            return "auto"
        return self.tasks[0] if len(self.tasks) == 1 else self.tasks[i]

    def __post_init__(self) -> None:
        if len(self.tasks) > 1 and len(self.tasks) != len(self.models):
            raise ValueError("--task is given once, or once per --model")
        if not 0 <= self.port <= 65535:
            raise ValueError("port must be in [0, 65535]")
        if not self.shutdown_grace_s >= 0:
            raise ValueError("shutdown_grace_s must be >= 0")
        if self.faithful_answers < 0:
            raise ValueError("faithful_answers must be >= 0")
