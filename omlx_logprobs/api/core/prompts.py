"""A request's prompt as token ids: chat messages through the chat template (the earlier answers
this server sampled as their sampled ids: api/core/splice.py), completions' prompts as text or
ids (each a 400 when it cannot be read), and the tokenizer's encode with its failures as the
request's 400."""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from typing import Any

from omlx_logprobs.api.core import parts, tools
from omlx_logprobs.api.core.errors import APIError
from omlx_logprobs.api.core.heads import chained
from omlx_logprobs.api.core.images import Image, expand, placed_in, read_image, template_content
from omlx_logprobs.api.core.protocol import ChatCompletionRequest, ChatMessage, CompletionRequest
from omlx_logprobs.api.core.sampled import chat_message_key
from omlx_logprobs.api.core.served import Served
from omlx_logprobs.api.core.splice import Spliced, Turn, splice
from omlx_logprobs.api.core.splice import Tokenizer as SpliceTokenizer
from omlx_logprobs.api.core.validation import RequestLimits
from omlx_logprobs.config import Limits
from omlx_logprobs.models.loader import LoadedModel
from omlx_logprobs.models.segments import segment_encoder
from omlx_logprobs.types import ImageInput

MAX_PROMPTS = 256  # prompts in one completions request (lm-eval batches several)


def chat_prompt(
    req: ChatCompletionRequest, model: LoadedModel, checks: RequestLimits | None = None
) -> list[int]:
    text = render(req, model, tools.template_messages(req.messages), req.add_generation_prompt)
    if checks is not None:
        checks.check_text(text, "messages")
    ids = encode(model, text, "messages", special=req.add_special_tokens)
    return checks.truncated(ids, req.truncate_prompt_tokens) if checks is not None else ids


def image_chat_prompt(
    req: ChatCompletionRequest,
    served: Served,
    parts: list[tuple[str, str, str]],
    known: Mapping[int, Sequence[int]] | None = None,
) -> tuple[list[int], int, tuple[ImageInput, ...]]:
    """A chat prompt with images (`parts`: their fields and URLs, api/core/images.py): the
    template's text with an image token where each image is, through the model's processor;
    earlier answers spliced in as their sampled ids as in a text chat (`faithful_chat_prompt`),
    each image token then replaced by its image's placeholders; how many ids are sampled ones."""
    model = served.model
    _no_truncation(req)
    images, vision = read_images(model, served.limits, parts), model.vision
    assert vision is not None  # read_images refuses images to a text model
    messages = image_messages(req.messages)
    text = render(req, model, messages, req.add_generation_prompt)
    served.checks.check_text(text, "messages")
    token, wide = vision.image_token_id, vision.expansion
    if wide is None:
        spliced = _spliced(req, served, messages, text, known)
        # Only with an answer in it; its image tokens the template's, one an image (an answer
        # that holds one is not spliced): else the processor's pass over the whole text.
        if spliced is not None and spliced.ids.count(token) != len(images):
            spliced = None
    else:  # the text expanded as the processor expands it, then spliced (VisionSpec.expansion)
        mark = vision.processor.image_token
        spliced = _spliced(req, served, messages, text, known, lambda t: t.replace(mark, wide))
        if spliced is not None and any(token in spliced.ids[a:b] for a, b in spliced.spans):
            spliced = None
    if spliced is not None and not spliced.spans:
        spliced = None
    ids, inputs = expand(vision, text, images, req.add_special_tokens,
                         spliced.ids if spliced is not None else None)  # fmt: skip
    served.kept_images.keep(inputs)  # for the token routes to name by hash (api/rl/features.py)
    return ids, spliced.reused() if spliced is not None else 0, inputs


def token_images(
    req: ChatCompletionRequest, served: Served, parts: list[tuple[str, str, str]], ids: list[int]
) -> tuple[ImageInput, ...]:
    """The images of a chat request whose prompt is the client's ids (`/v1/chat/completions/
    tokens`): each image of the messages, in order, on its run of placeholders in the ids
    (expanded as the processor expands them: /tokenize's ids)."""
    _no_truncation(req)
    images, vision = read_images(served.model, served.limits, parts), served.model.vision
    assert vision is not None  # read_images refuses images to a text model
    inputs = placed_in(vision, ids, images)
    served.kept_images.keep(inputs)
    return inputs


def read_images(
    model: LoadedModel, limits: Limits, parts: list[tuple[str, str, str]]
) -> list[Image]:
    """The images of `parts` (their fields and URLs, api/core/images.py), read and checked; a
    400 for images to a text model, or more than --max-images."""
    field = parts[0][0]
    if model.vision is None:
        raise APIError(
            f"{field} is an image, and the model {model.name!r} takes no images (it reads text"
            " only)",
            param=field,
        )
    if len(parts) > limits.max_images:
        raise APIError(
            f"{len(parts)} images, more than --max-images ({limits.max_images})",
            param=parts[limits.max_images][0],
        )
    return [read_image(url, field, limits) for _, field, url in parts]


def image_messages(messages: list[ChatMessage]) -> list[dict[str, Any]]:
    """The messages as vision templates read them: an image part where each image is."""
    out = tools.template_messages(messages)
    for d, m in zip(out, messages):
        if m.images():
            d["content"] = template_content(m)
    return out


def _no_truncation(req: ChatCompletionRequest) -> None:
    if req.truncate_prompt_tokens is not None:
        raise APIError(
            "truncate_prompt_tokens cannot cut a prompt with images",
            param="truncate_prompt_tokens",
        )


def faithful_chat_prompt(
    req: ChatCompletionRequest,
    served: Served,
    known: Mapping[int, Sequence[int]] | None = None,
) -> tuple[list[int], int]:
    """The chat prompt's ids with the earlier answers this server sampled as their sampled ids
    (api/core/splice.py), and how many prompt ids those are: the ids `known` gives by message
    index (a Responses continuation's, kept with its stored response), else those the served
    model's store holds for the message's text (its adapter's, when `model` names one)."""
    messages = tools.template_messages(req.messages)
    text = render(req, served.model, messages, req.add_generation_prompt)
    served.checks.check_text(text, "messages")
    spliced = _spliced(req, served, messages, text, known)
    if spliced is None:
        ids = encode(served.model, text, "messages", special=req.add_special_tokens)
        return served.checks.truncated(ids, req.truncate_prompt_tokens), 0
    ids = served.checks.truncated(spliced.ids, req.truncate_prompt_tokens)
    return ids, spliced.reused(len(spliced.ids) - len(ids))


def _spliced(
    req: ChatCompletionRequest,
    served: Served,
    messages: list[dict[str, Any]],
    text: str,
    known: Mapping[int, Sequence[int]] | None,
    expand: Callable[[str], str] = lambda t: t,
) -> Spliced | None:
    """The ids of `text`, the template's of `messages`, with the earlier answers found spliced
    in as their sampled ids, and where those are; None when no answer is found, or the request
    or the tokenizer cannot take them (`text` is then encoded as it is). `expand`: what the
    text, and each answer's head in it, is before it is tokenized (a processor's expansion of
    its images)."""
    model = served.model
    known, scope = known or {}, served.adapter(req.model) or ""
    turns = []
    for i, m in enumerate(messages):
        if m["role"] == "assistant":
            ids = known.get(i) or served.sampled.get(scope, chat_message_key(m))
            if ids:
                turns.append(Turn(i, ids))
    segments = segment_encoder(model.tokenizer)
    if not turns or req.add_special_tokens or not segments.active:
        return None
    settings = {"tools": tools.template_tools(req.tools), "kwargs": _template_kwargs(req, True)}
    starts = chained(settings, messages)

    def head(i: int) -> str | None:
        found = served.heads.get(starts[i], lambda: _head(req, model, messages[:i]))
        return None if found is None else expand(found)

    return splice(expand(text), turns, head, _splice_tokenizer(model))


def _head(
    req: ChatCompletionRequest, model: LoadedModel, before: list[dict[str, Any]]
) -> str | None:
    """The prompt an answer was sampled after; None where the template refuses it (such a
    turn is tokenized from its text)."""
    try:
        return render(req, model, before, True, head=True)
    except APIError:
        return None


def _splice_tokenizer(model: LoadedModel) -> SpliceTokenizer:
    segments = segment_encoder(model.tokenizer)
    assert segments.split is not None
    split = segments.split

    def decode(ids: Sequence[int]) -> str | None:
        try:
            text = model.tokenizer.decode(
                list(ids), skip_special_tokens=False, clean_up_tokenization_spaces=False
            )
        except Exception:  # ids it cannot read: such an answer is tokenized from its text
            return None
        return str(text)

    return SpliceTokenizer(
        encode=lambda text: encode(model, text, "messages"),
        decode=decode,
        added=frozenset(segments.ids.values()),
        added_at=lambda text, at: split.match(text, at) is not None,
    )


def render(
    req: ChatCompletionRequest,
    model: LoadedModel,
    messages: list[dict[str, Any]],
    add_generation_prompt: bool,
    head: bool = False,
) -> str:
    """The chat template's text of `messages` with the request's tools and variables (`head`:
    the prompt an earlier answer was sampled after, a new turn, not the continuation of one)."""
    try:
        return str(
            model.tokenizer.apply_chat_template(
                parts.as_parts(messages, model.tokenizer),
                tools=tools.template_tools(req.tools),
                add_generation_prompt=add_generation_prompt,
                tokenize=False,
                **_template_kwargs(req, head),
            )
        )
    except Exception as e:  # a template error is the request's fault
        raise APIError(
            f"The chat template could not render these messages: {e}", param="messages"
        ) from None


def _template_kwargs(req: ChatCompletionRequest, head: bool = False) -> dict[str, Any]:
    """The template's variables a request sets (`head`: but continuing its last message)."""
    kwargs = dict(req.chat_template_kwargs or {})
    if req.reasoning_effort is not None:  # a template variable, as vLLM passes it
        kwargs["reasoning_effort"] = req.reasoning_effort
    if req.documents is not None:
        kwargs["documents"] = req.documents
    if req.continue_final_message and not head:
        kwargs["continue_final_message"] = True
    return kwargs


def completion_prompts(
    req: CompletionRequest, model: LoadedModel, checks: RequestLimits
) -> list[list[int]]:
    """Every accepted `prompt` form as a list of token id lists; a 400 for the rest."""
    p = req.prompt
    if isinstance(p, str):
        prompts: list[Any] = [p]
    elif p and all(isinstance(x, int) for x in p):
        prompts = [p]
    else:
        prompts = list(p)
    if not prompts:
        raise APIError("prompt must not be empty", param="prompt")
    if len(prompts) > MAX_PROMPTS:
        raise APIError(f"At most {MAX_PROMPTS} prompts are allowed.", param="prompt")
    vocab = len(model.vocab)
    out = []
    for i, x in enumerate(prompts):
        if isinstance(x, str):
            checks.check_text(x, "prompt")
            ids = encode(model, x, "prompt", special=req.add_special_tokens)
        else:
            ids = list(x)
        if not ids:
            raise APIError(f"prompt[{i}] has no tokens", param="prompt")
        if any(not 0 <= t < vocab for t in ids):
            raise APIError(f"prompt[{i}] holds an id that is not a token of this model", "prompt")
        out.append(checks.truncated(list(ids), req.truncate_prompt_tokens))
    return out


def encode(model: LoadedModel, text: str, param: str, special: bool = False) -> list[int]:
    """Token ids of text; a tokenizer that fails on it fails this request alone, as a 400. Long
    texts go by segments, whose ids are kept (models/segments.py: a resent conversation)."""
    try:
        return segment_encoder(model.tokenizer).encode(text, special)
    except Exception as e:
        raise APIError(f"The text could not be tokenized: {e}", param=param) from None
