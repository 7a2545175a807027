"""Prompt preparation: a validated request rendered through the chat template, tokenized and
fitted to the served window, with the reply's format and parser (Prepared).

Everything here that refuses a request does so with an ApiError before the engine sees it: no
template, a template that rejects the messages, tools for a card without a tool-call format,
prompt token ids outside the vocabulary, a prompt or max_tokens that do not fit the window
(engine/window.py's policy, the field named as the request calls it).
"""
from dataclasses import dataclass

from tensorfold.api import replies
from tensorfold.api.errors import ApiError
from tensorfold.api.images import ImageLimits, image_parts, read_images, urls_to_fetch
from tensorfold.api.request import GenerationRequest, check_prompt_ids
from tensorfold.chat.messages import render_chat
from tensorfold.chat.reply_parser import ReplyParser
from tensorfold.chat.served import ServedModel
from tensorfold.chat.template import TemplateError
from tensorfold.engine.info import EngineInfo
from tensorfold.engine.window import WindowError, reply_budget
from tensorfold.sampling.params import SamplingParams
from tensorfold.vision.placement import expand


@dataclass
class Prepared:
    """A validated request, rendered: what starting it needs."""
    greq: GenerationRequest
    fmt: replies.ReplyFormat
    prompt_ids: list[int]
    params: SamplingParams     # max_tokens set: the request's, or the default within the window
    parser: ReplyParser
    thinking: bool = False     # the prompt opened a think block
    images: tuple = ()         # the prompt's image spans (vision/placement.ImageSpan), in order


class Prompts:
    """The served model's prompts: rendering, token ids and the window, for one server."""

    def __init__(self, served: ServedModel, info: EngineInfo, model_names: tuple[str, ...],
                 default_max_tokens: int | None = None, image_limits: ImageLimits = ImageLimits()):
        self.served = served
        self.image_limits = image_limits
        self.info = info
        self.model_names = model_names
        self.default_max_tokens = default_max_tokens or info.default_max_tokens

    def prepare(self, greq: GenerationRequest, fmt_class=None, fetched: dict | None = None) -> Prepared:
        """Render and tokenize, check the window, make the reply's format and parser; `fetched`:
        the bytes of the request's http(s) image URLs (image_urls), fetched first."""
        card = self.served.card
        shown = greq.tools.shown() if greq.tools is not None else None
        if shown and (card is None or card.tool_format is None):
            raise ApiError(f"this model's card ({card.name if card else 'none'}) declares no tool-call "
                           "format, so it cannot be offered tools; start the server with --model-card NAME for "
                           "a card that does", param="tools")
        prompt_ids, thinking = self.ids(greq, shown)
        prompt_ids, images = self.place_images(greq, prompt_ids, fetched)
        params = self.fit_window(greq, len(prompt_ids))
        fmt = self.format(greq, fmt_class)
        parser = ReplyParser(card if greq.kind == "chat" else None, shown,
                             parallel_tool_calls=greq.tools.parallel if greq.tools else True,
                             thinking=thinking, call_id_prefix=f"call_{fmt.id[-12:]}")
        return Prepared(greq, fmt, prompt_ids, params, parser, thinking, images)

    def format(self, greq: GenerationRequest, fmt_class=None) -> replies.ReplyFormat:
        """The reply's format: the route's (fmt_class), else the request kind's."""
        return (fmt_class or replies.FORMATS[greq.kind])(greq.model or self.model_names[0])

    def image_urls(self, greq: GenerationRequest) -> list[str]:
        """The http(s) image URLs to fetch before prepare() (--vision with --image-urls)."""
        if self.info.vision is None or greq.kind != "chat":
            return []
        return urls_to_fetch(greq.messages, self.image_limits)

    def place_images(self, greq: GenerationRequest, prompt_ids: list[int],
                     fetched: dict | None = None) -> tuple[list[int], tuple]:
        """The prompt with each image's pad expanded to its merged patches, and the image spans
        (the request's image parts were accepted only where the engine has a tower: --vision)."""
        vision = self.info.vision
        if vision is None or greq.kind != "chat" or not image_parts(greq.messages):
            return prompt_ids, ()
        images = read_images(greq.messages, self.image_limits, vision.preprocess, fetched)
        try:
            return expand(prompt_ids, vision.pad_id, images)
        except ValueError as e:
            raise ApiError(f"the chat template did not place every image: {e}", param="messages") from None

    def ids(self, greq: GenerationRequest, tools: list[dict] | None) -> tuple[list[int], bool]:
        """The prompt's token ids, and whether it opened a think block the reply starts inside."""
        tok = self.served.tokenizer
        if greq.kind == "chat":
            if self.served.template is None:
                raise ApiError("this model has no chat template; use /v1/completions", param="messages")
            text = self.render(greq, tools)
            # The template writes its own special tokens (bos included), as transformers does.
            return tok.encode(text, add_special_tokens=False), self.served.opens_think(text)
        if greq.prompt_ids is not None:
            check_prompt_ids(greq.prompt_ids, tok.vocab_size)
            return list(greq.prompt_ids), False
        return tok.encode(greq.prompt, add_special_tokens=True), False

    def render(self, greq: GenerationRequest, tools: list[dict] | None, add_generation_prompt: bool = True) -> str:
        """A chat request's prompt text (the caller has checked there is a template)."""
        try:
            return render_chat(self.served.template, list(greq.messages), tools=tools,
                               template_kwargs=self.template_kwargs(greq),
                               add_generation_prompt=add_generation_prompt)
        except TemplateError as e:
            raise ApiError(f"the chat template rejected the request: {e.message}", param="messages") from None

    def template_kwargs(self, greq: GenerationRequest) -> dict | None:
        """chat_template_kwargs, with the effort: the request's (else the server's). "none"
        turns thinking off; another effort turns it on and reaches the template under the card's
        name for it; an explicit enable_thinking wins."""
        kwargs = dict(greq.chat_template_kwargs or {})
        effort = greq.reasoning_effort or self.served.reasoning_effort
        if effort is not None:
            kwargs.setdefault("enable_thinking", effort != "none")
            if effort != "none":
                card = self.served.card
                kwargs["reasoning_effort"] = card.effort_name(effort) if card else effort
        return kwargs or None

    def fit_window(self, greq: GenerationRequest, num_prompt: int) -> SamplingParams:
        """The request's sampling, its max_tokens within the window (the default if it set none),
        decoding past a stop match where the card's engine does (GLM's, every route)."""
        params = greq.sampling
        card = self.served.card
        if card is not None and card.decode_past_stop and params.stop and not params.decode_past_stop:
            params = SamplingParams(**{**params.__dict__, "decode_past_stop": True})
        try:
            max_tokens = reply_budget(self.info.context_length, num_prompt, params.max_tokens,
                                      self.default_max_tokens, greq.max_tokens_field)
        except WindowError as e:
            prompt_param = "messages" if greq.kind == "chat" else "prompt"
            raise ApiError(str(e), param=prompt_param if e.prompt_too_long else greq.max_tokens_field,
                           code="context_length_exceeded") from None
        if max_tokens == params.max_tokens:
            return params
        return SamplingParams(**{**params.__dict__, "max_tokens": max_tokens})
