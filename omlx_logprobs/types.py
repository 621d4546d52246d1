"""Typed records that cross module boundaries: what the API submits to the engine
(`EngineRequest`), what the engine hands back (`RequestOutput`, whose logprob entries are one
columnar `Entries` block), and the request facts both sides read. No mlx here: the scheduler and
the API import these. The control plane's records (weights, adapters, pauses) are control.py's."""

from __future__ import annotations

import hashlib
import math
from dataclasses import dataclass, field, replace
from enum import Enum
from typing import Any

import numpy as np

from omlx_logprobs.control import INITIAL_WEIGHTS, AdapterVersion, WeightVersion

THINK_OPEN = "<think>"
THINK_CLOSE = "</think>"
THINK_TAGS = (THINK_OPEN, THINK_CLOSE)
# gpt-oss's harmony messages: `<|start|>ROLE<|channel|>CHANNEL ...<|message|>TEXT<|end|>`. A
# call ends with `<|call|>`, the answer with `<|return|>`: those end the generation and stay
# control tokens (no bytes, as other end-of-turn tokens).
HARMONY_TAGS = ("<|start|>", "<|channel|>", "<|message|>", "<|constrain|>", "<|end|>")
HARMONY_REASONING = ("<|channel|>analysis<|message|>", "<|end|>")  # its reasoning's tags
# Tool-call and harmony markers that tokenizers mark special: output text all the same (the
# parsers read them), so their tokens keep their bytes.
TOOL_TAGS = ("[TOOL_CALLS]", "[ARGS]", "[CALL_ID]", "<|python_tag|>", *HARMONY_TAGS)


class LogprobsMode(str, Enum):
    """What generated tokens' entries hold (vLLM's four names and meanings). Raw: the model's
    own logits, before every mask, logit bias, penalty and temperature. Processed: what was
    sampled from (masks, bias, penalties, temperature, min-p, top-k and top-p applied). The
    `_logits` modes report the values themselves, the `_logprobs` ones their log-softmax."""

    RAW = "raw_logprobs"
    RAW_LOGITS = "raw_logits"
    PROCESSED = "processed_logprobs"
    PROCESSED_LOGITS = "processed_logits"

    @property
    def processed(self) -> bool:
        return self in (LogprobsMode.PROCESSED, LogprobsMode.PROCESSED_LOGITS)

    @property
    def logits(self) -> bool:
        """Entries are the values themselves, not normalised."""
        return self in (LogprobsMode.RAW_LOGITS, LogprobsMode.PROCESSED_LOGITS)


class FinishReason(str, Enum):
    STOP = "stop"
    LENGTH = "length"
    ABORT = "abort"
    ERROR = "error"


class ThinkStart(Enum):
    """Where a request's output starts (parsing/thinking.py splits it)."""

    OFF = "off"  # no parsing: every byte is content
    DETECT = "detect"  # reasoning only if the output opens with <think>
    INSIDE = "inside"  # the prompt opened <think>: the output starts inside reasoning


class ConstraintKind(str, Enum):
    """What a constrained request's output must match (parsing/grammar.py compiles each)."""

    JSON_SCHEMA = "json"  # a JSON Schema (response_format json_schema, structured_outputs json)
    JSON_OBJECT = "json_object"  # any JSON object (response_format json_object)
    REGEX = "regex"
    CHOICE = "choice"  # one of a list of strings, exactly
    GRAMMAR = "grammar"  # a Lark grammar (GBNF is converted)
    # Tool calls in the model's own format, or content beside them (api/core/tools.py builds it in
    # llguidance's form). Open-ended: once the calls are complete the model samples freely, and
    # a token that does not continue them ends the output (it adds no text).
    TOOL_CALLS = "tool_calls"


@dataclass(frozen=True)
class Constraint:
    """A request's output grammar as the API accepted it: `source` is the schema (JSON text),
    the regex, the choices (a JSON list) or the grammar; `strict` false lets a schema's keywords
    that cannot be enforced pass (ignored) instead of failing; `whitespace` is the JSON
    whitespace pattern ("" for none, None for any run of JSON whitespace)."""

    kind: ConstraintKind
    source: str
    strict: bool = True
    whitespace: str | None = None


@dataclass(frozen=True)
class SamplingParams:
    """What one request asks of the sampler and of the logprob extractor. The server's limits
    (how many ids, how large a top list) are checked by the API before it builds one."""

    max_tokens: int = 16
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0  # 0 or -1: off
    min_p: float = 0.0
    seed: int | None = None
    stop: tuple[str, ...] = ()
    stop_token_ids: tuple[int, ...] = ()
    ignore_eos: bool = False
    logit_bias: tuple[tuple[int, float], ...] = ()
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    logprobs: bool = False
    top_logprobs: int = 0
    prompt_logprobs: int | None = None  # None: off; k: each prompt token's entry and a top k
    logprob_token_ids: tuple[int, ...] = ()  # reported in place of the natural top list
    # Each position's tail mass too: the log of the probability outside its k alternatives
    # (logprobs/tail.py), for generated and prompt positions alike.
    tail_logprob: bool = False
    logprobs_mode: LogprobsMode = LogprobsMode.RAW
    # vLLM's generation controls. Token masks, applied before logit bias and penalties:
    min_tokens: int = 0  # until this many tokens, EOS and stop_token_ids cannot be sampled
    allowed_token_ids: tuple[int, ...] = ()  # empty: every token may be sampled
    bad_words_ids: tuple[tuple[int, ...], ...] = ()  # a word's last token, after its others
    # Text: the matched stop string stays in the output; special tokens' text is output text.
    include_stop_str_in_output: bool = False
    skip_special_tokens: bool = True
    # Constrained decoding: every sampled token keeps the output a prefix of the grammar's
    # language; EOS only once it is complete (a token mask with the others).
    constraint: Constraint | None = None
    # OpenAI's Predicted Outputs: the ids of the text the client expects, drafts that the model
    # verifies (runner/speculation.py); they never change what is sampled.
    prediction: tuple[int, ...] = ()
    # vLLM's and SGLang's routed experts: each computed position's top-k expert ids per MoE
    # layer (runner/routing.py), with the choice's last output (RequestOutput.routed_experts).
    return_routed_experts: bool = False
    # vLLM's thinking budget: after this many reasoning tokens (those after the opening tag)
    # without the closing tag, the next tokens are forced to `thinking_end_ids`, the model's
    # own closing tag, and the answer follows (batch/budget.py). None: no budget.
    thinking_token_budget: int | None = None
    thinking_end_ids: tuple[int, ...] = ()

    def __post_init__(self) -> None:
        if self.max_tokens < 0:
            raise ValueError("max_tokens must be >= 0")
        if not (self.temperature >= 0 and math.isfinite(self.temperature)):
            raise ValueError("temperature must be a finite number >= 0")
        if not 0 < self.top_p <= 1:
            raise ValueError("top_p must be in (0, 1]")
        if not 0 <= self.min_p <= 1:
            raise ValueError("min_p must be in [0, 1]")
        if not self.repetition_penalty > 0:
            raise ValueError("repetition_penalty must be > 0")
        if self.top_logprobs < 0 or (self.top_logprobs and not self.logprobs):
            raise ValueError("top_logprobs needs logprobs and must be >= 0")
        if self.prompt_logprobs is not None and self.prompt_logprobs < 0:
            raise ValueError("prompt_logprobs must be >= 0")
        if len(set(self.logprob_token_ids)) != len(self.logprob_token_ids):
            raise ValueError("logprob_token_ids must be distinct")
        if not 0 <= self.min_tokens <= max(self.max_tokens, 0):
            raise ValueError("min_tokens must be in [0, max_tokens]")
        if any(not w for w in self.bad_words_ids):
            raise ValueError("a bad word has at least one token")
        if self.thinking_token_budget is not None and (
            self.thinking_token_budget < 0 or not self.thinking_end_ids
        ):
            raise ValueError("thinking_token_budget must be >= 0, with the closing tag's ids")

    @property
    def greedy(self) -> bool:
        return self.temperature == 0

    @property
    def truncates(self) -> bool:
        """Whether top-k, top-p or min-p cut the distribution (needs a sort of the vocabulary)."""
        return not self.greedy and (self.top_k > 0 or self.top_p < 1 or self.min_p > 0)

    @property
    def processed(self) -> bool:
        return self.logprobs_mode.processed

    @property
    def masks(self) -> bool:
        """Whether some tokens may be forbidden at a step (a row of the sampler's token mask)."""
        return bool(
            self.min_tokens
            or self.allowed_token_ids
            or self.bad_words_ids
            or self.constraint
            or self.thinking_token_budget is not None
        )

    @property
    def num_top(self) -> int:
        """Entries per generated position besides the sampled one: the fixed ids or the top K."""
        return len(self.logprob_token_ids) or self.top_logprobs

    @property
    def num_prompt_top(self) -> int:
        return len(self.logprob_token_ids) or (self.prompt_logprobs or 0)

    @property
    def penalizes(self) -> bool:
        """Whether a penalty reads the tokens before this step (the prompt's, the output's)."""
        return bool(self.presence_penalty or self.frequency_penalty or self.repetition_penalty != 1)

    @property
    def processes(self) -> bool:
        """Whether a logit processor changes this row's logits: logit bias or a penalty (a bias
        is a fixed row: it needs no history, so it leaves the step overlap on)."""
        return bool(self.logit_bias) or self.penalizes


@dataclass(frozen=True)
class ToolCall:
    """A parsed tool call: the function's name and its arguments as JSON text."""

    name: str
    arguments: str


@dataclass(frozen=True)
class ToolParsing:
    """How a request's content is searched for tool calls (parsing/tools/): the format, the
    request's `tools` (their parameter schemas type the arguments of XML formats) and whether
    generation ends after the first call (`parallel_tool_calls: false`). Harmony models parse
    every request, tools or not: their answer too is a message with a header."""

    parser: str  # a parsing.tools.ToolCallFormat value
    tools: tuple[dict[str, Any], ...] = ()
    parallel: bool = True
    # False: messages are parsed (harmony's headers) but a call stays text (tool_choice none)
    calls: bool = True
    # tool_choice required or named: the output is calls by grammar, so every token is a
    # tool-call token and text left over at the end (a call cut by max_tokens) is not content
    forced: bool = False


@dataclass(frozen=True)
class ImageInput:
    """One image of a prompt: its content's hash (what the encoder's cache and the prefix
    cache key it by), its pixel values as the model's processor computed them ([1, C, H, W]
    float32; Idefics3's [1, tiles, C, H, W]; Qwen's patches [1, t, h, w, values], shaped by
    their grid), and the runs of placeholder tokens its
    embeddings take in the prompt: one run (LLaVA's), or several with the processor's own
    tokens between them (Idefics3's tiles, each after its row and column marker). The encoder
    gives one row per placeholder, in prompt order."""

    digest: str  # hex SHA-256 of the image file's bytes
    pixels: np.ndarray
    runs: tuple[tuple[int, int], ...]  # (prompt position of its first placeholder, count)

    @property
    def start(self) -> int:
        """The prompt position of its first placeholder token."""
        return self.runs[0][0]

    @property
    def end(self) -> int:
        """One past its last placeholder token."""
        return self.runs[-1][0] + self.runs[-1][1]

    @property
    def length(self) -> int:
        """Its placeholder tokens: the rows the encoder gives."""
        return sum(n for _, n in self.runs)

    def placed(self) -> list[tuple[int, int, int]]:
        """(prompt position, count, the encoder's row) of each run."""
        out, row = [], 0
        for start, n in self.runs:
            out.append((start, n, row))
            row += n
        return out

    def positions(self) -> list[int]:
        """Every placeholder position, in order."""
        return [p for start, n in self.runs for p in range(start, start + n)]


@dataclass(frozen=True)
class EngineRequest:
    """One prompt as the API submits it: the engine makes `n` choices of it, prefilled once."""

    request_id: str  # unique among the requests in flight; aborts name it
    prompt_ids: list[int]
    params: SamplingParams
    n: int = 1
    think: ThinkStart = ThinkStart.OFF
    # Streamed: an output whenever tokens are released. Not streamed: one output per choice, at
    # its end (nothing crosses to the API before it is needed).
    stream: bool = False
    tools: ToolParsing | None = None  # None: content is not searched for tool calls
    reasoning_tags: tuple[str, str] = THINK_TAGS  # what opens and closes reasoning
    adapter: str | None = None  # the LoRA adapter's name (None: the base model)
    # The prefix cache's namespace (`cache_namespace` of vLLM's `cache_salt`; 0: the default):
    # kept prefixes serve only requests of the same namespace.
    cache_namespace: int = 0
    # vLLM's priority scheduling: lower is scheduled first, ties by arrival (docs/specs/rl.md).
    priority: int = 0
    # A routing to replay (runner/routing.py): the top-k expert ids per MoE layer of the
    # prompt's first positions, [n, moe_layers, top_k] int16, used in place of the router's.
    routed_experts: np.ndarray | None = None
    # An embedding: the prompt is prefilled and nothing is sampled (max_tokens 0); its output
    # carries the final hidden state of the prompt's last position (RequestOutput.embedding).
    embed: bool = False
    # A vision model's images, in prompt order (models/vision.py, runner/vision.py).
    images: tuple[ImageInput, ...] = ()


# vLLM's `priority` is a Python int; here it is bounded to what a 32-bit int holds.
PRIORITY_RANGE = (-(2**31), 2**31 - 1)
MAX_CACHE_SALT = 256  # characters of a `cache_salt`


def cache_namespace(salt: str | None) -> int:
    """The prefix cache's namespace of a `cache_salt`: 63 bits of its SHA-256, never 0 (no salt,
    the default namespace). A stable hash: the disk tier's files keep it across restarts."""
    if salt is None:
        return 0
    digest = hashlib.sha256(salt.encode("utf-8", "surrogatepass")).digest()
    return int.from_bytes(digest[:8], "big") >> 1 or 1


def image_namespace(namespace: int, images: tuple[ImageInput, ...]) -> int:
    """The prefix cache's namespace of a prompt with images: its own (its salt's) with its
    images' hashes and places. Their placeholder tokens are the same ids whatever the image,
    so kept keys and values serve only prompts with the same images in the same places (a
    conversation's next turn about them). Stable, as `cache_namespace`; the 0xff byte, which
    no UTF-8 text holds, keeps it apart from every salt's."""
    if not images:
        return namespace
    data = repr([namespace, *((i.digest, i.start) for i in images)]).encode()
    digest = hashlib.sha256(b"\xff" + data).digest()
    return int.from_bytes(digest[:8], "big") >> 1 or 1


@dataclass(frozen=True)
class Entries:
    """Logprob entries of consecutive positions, as columns: each position's own token, its
    logprob and rank (count of logprobs >= its own: 1 for the argmax), and k alternatives (the
    top k best first, or the logprobs of `logprob_token_ids` in the order asked). The same
    record holds an extraction's lazy device arrays (`to_host` reads them) and host numpy
    arrays (int32 ids and ranks, float32 logprobs). `tail`, when the request asked for it: each
    position's log of the probability outside its k alternatives (logprobs/tail.py). `forced`
    (host blocks only): which positions' tokens the server forced instead of sampling (the
    closing tag at a thinking budget, batch/budget.py), None when none of them was."""

    token_ids: Any  # [n]
    logprobs: Any  # [n]
    ranks: Any  # [n]
    top_ids: Any  # [n, k]
    top_logprobs: Any  # [n, k]
    tail: Any = None  # [n] float32, or None when not asked
    forced: Any = None  # [n] bool, or None when no position was forced

    def __len__(self) -> int:
        return int(self.logprobs.shape[0])

    @property
    def k(self) -> int:
        return int(self.top_ids.shape[1])

    def arrays(self) -> list[Any]:
        """What to evaluate (device arrays), the tail last when there is one."""
        cols = [self.token_ids, self.logprobs, self.ranks, self.top_ids, self.top_logprobs]
        return cols if self.tail is None else [*cols, self.tail]

    def to_host(self) -> Entries:
        """Numpy copies of the columns with their wire dtypes (no copy when they match)."""
        cols = [np.array(a, copy=False).astype(t, copy=False) for a, t in zip(self.arrays(), _WIRE)]
        return _of(cols, self.forced)

    def rows(self, a: int, b: int) -> Entries:
        forced = self.forced[a:b] if self.forced is not None else None
        return _of([c[a:b] for c in self.arrays()], forced)

    def __reduce__(self) -> tuple[Any, tuple[int, int, bool, bytes, bytes | None]]:
        """Host entries cross between processes as one buffer (five numpy pickles cost ~3x)."""
        cols = zip(self.arrays(), _WIRE)
        data = b"".join(np.ascontiguousarray(a, t).tobytes() for a, t in cols)
        forced = None if self.forced is None else np.asarray(self.forced, bool).tobytes()
        return _entries_from, (len(self), self.k, self.tail is not None, data, forced)

    @staticmethod
    def empty(k: int, tail: bool = False) -> Entries:
        f, i = np.zeros(0, np.float32), np.zeros(0, np.int32)
        top = np.zeros((0, k), np.int32), np.zeros((0, k), np.float32)
        return Entries(i, f, i, *top, f if tail else None)

    @staticmethod
    def concat(parts: list[Entries]) -> Entries:
        if len(parts) == 1:
            return parts[0]
        forced = None
        if any(p.forced is not None for p in parts):
            forced = np.concatenate(
                [p.forced if p.forced is not None else np.zeros(len(p), bool) for p in parts]
            )
        return _of([np.concatenate(c) for c in zip(*(p.arrays() for p in parts))], forced)


# The columns' host dtypes, the tail's last.
_WIRE = (np.int32, np.float32, np.int32, np.int32, np.float32, np.float32)


def _of(cols: list[Any], forced: Any) -> Entries:
    """Entries of `arrays()`' columns (the tail last, when there is one) and forced marks."""
    ids, lps, ranks, top_ids, top_lps = cols[:5]
    return Entries(ids, lps, ranks, top_ids, top_lps, cols[5] if len(cols) > 5 else None, forced)


def _entries_from(n: int, k: int, tail: bool, data: bytes, forced: bytes | None) -> Entries:
    sizes = (n, n, n, n * k, n * k, n)[: 6 if tail else 5]
    cols, at = [], 0
    for size, dtype in zip(sizes, _WIRE):
        cols.append(np.frombuffer(data, dtype, size, at))
        at += 4 * size
    ids, lps, ranks, top_ids, top_lps = cols[:5]
    last = cols[5] if tail else None
    marks = None if forced is None else np.frombuffer(forced, bool)
    return Entries(ids, lps, ranks, top_ids.reshape(n, k), top_lps.reshape(n, k), last, marks)


_NO_IDS = np.zeros(0, np.int32)


@dataclass(slots=True)  # not frozen: made for every streamed row every step
class RequestOutput:
    """What one choice of a request gained since its last output: the only record the engine
    hands out. Its tokens' entries and text travel together (a token leaves with the text it
    carries); reasoning precedes content and content precedes tool calls, so the first
    `num_reasoning` tokens are reasoning and the last `num_tool` are tool-call tokens. The
    counts are the request's totals so far."""

    request_id: str
    index: int = 0  # the choice
    token_ids: np.ndarray = field(default_factory=lambda: _NO_IDS)  # int32, new tokens
    text: str = ""  # content
    reasoning_text: str = ""
    num_reasoning: int = 0
    tool_calls: tuple[ToolCall, ...] = ()  # calls completed with these tokens
    num_tool: int = 0
    logprobs: Entries | None = None  # the new tokens' entries, when asked for
    prompt_logprobs: Entries | None = None  # prompt positions 1.., in a choice's first output
    finished: bool = False
    finish_reason: FinishReason | None = None
    error: str | None = None
    prompt_tokens: int = 0
    completion_tokens: int = 0
    cached_tokens: int = 0  # prompt tokens whose keys and values came from the prefix cache
    reasoning_tokens: int = 0
    tool_tokens: int = 0
    # Prediction tokens the model accepted as drafts, and those it rejected (OpenAI's usage).
    accepted_prediction_tokens: int = 0
    rejected_prediction_tokens: int = 0
    weight_version: WeightVersion = INITIAL_WEIGHTS
    # Where the weights changed inside this choice's output (an update while it was paused in
    # place): (first token, version) from its first token on; empty when one version made it.
    weight_spans: tuple[tuple[int, WeightVersion], ...] = ()
    adapter: AdapterVersion | None = None  # the LoRA adapter it ran on (None: the model)
    # The choice's routed experts, on its last output when asked (SamplingParams
    # .return_routed_experts): [positions, moe_layers, top_k] int16 for every position the
    # model computed, the prompt's and every output token's but the last.
    routed_experts: np.ndarray | None = None
    # An embedding request's (EngineRequest.embed) final output: the final normed hidden state
    # of the prompt's last position, [hidden] float32, neither pooled further nor normalized.
    embedding: np.ndarray | None = None

    @property
    def num_tokens(self) -> int:
        return len(self.token_ids)

    def merge(self, later: RequestOutput) -> RequestOutput:
        """This output followed by a later one of the same choice (a consumer that lagged)."""
        logprobs = self.logprobs
        if logprobs is not None and later.logprobs is not None:
            logprobs = Entries.concat([logprobs, later.logprobs])
        return replace(
            later,
            token_ids=np.concatenate([self.token_ids, later.token_ids]),
            text=self.text + later.text,
            reasoning_text=self.reasoning_text + later.reasoning_text,
            num_reasoning=self.num_reasoning + later.num_reasoning,
            tool_calls=self.tool_calls + later.tool_calls,
            num_tool=self.num_tool + later.num_tool,
            logprobs=logprobs if logprobs is not None else later.logprobs,
            prompt_logprobs=self.prompt_logprobs or later.prompt_logprobs,
            error=later.error or self.error,
        )
