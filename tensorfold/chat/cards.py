"""Model cards: what a model family's replies look like, declared in model_cards/*.json.

A card says, for one family: the architectures it covers and the strings its chat template
contains (how a checkpoint is matched to it), a template that replaces the checkpoint's (if any,
in model_cards/templates/), its think markers (and the label a block opens with: Gemma 4's thought
channel), its tool-call format and markers, the names its
template gives reasoning efforts, its end tokens, and whether its engine decodes on past a stop
string's match (GLM's: to an end token or the limit, the reply's text ending at the match). The
server reads the card; it never guesses any of this from template text.

Choosing a card: `--model-card NAME`, else among the cards listing the checkpoint's
architecture, the one whose template markers all appear in the checkpoint's template, most
markers first (a card without markers is the family's fallback). No card matches: the server
runs without one (no think markers, no tools).
"""
import json
import os
import sys
from dataclasses import dataclass, field

TOOL_FORMATS = ("hermes_json", "qwen_xml", "gemma4", "glm_xml")
EFFORTS = ("none", "minimal", "low", "medium", "high", "xhigh")


class CardError(ValueError):
    """A card file that does not say what a card must, or a card name that does not exist."""


@dataclass(frozen=True)
class Markers:
    open: str
    close: str


@dataclass(frozen=True)
class ThinkMarkers(Markers):
    label: str = ""  # the text the model writes right after the opener, not reasoning (Gemma 4: "thought\n")


@dataclass(frozen=True)
class ToolCallMarkers(Markers):
    name_prefix: str  # the template's text between the opener and a tool's name


@dataclass(frozen=True)
class ModelCard:
    name: str
    architectures: tuple[str, ...]
    template_markers: tuple[str, ...] = ()
    template: str | None = None         # the replacing template's source, read from its file
    think: ThinkMarkers | None = None
    tool_format: str | None = None      # one of TOOL_FORMATS, or None: tools are refused
    tool_call: ToolCallMarkers | None = None
    efforts: dict = field(default_factory=dict)  # request effort -> the name the template hears
    default_effort: str | None = None
    end_tokens: tuple[str, ...] = ()
    decode_past_stop: bool = False      # a stop match ends the reply's text, not its decoding

    def effort_name(self, effort: str) -> str:
        """The effort name the template hears for a request's effort (itself if not mapped)."""
        return self.efforts.get(effort, effort)


def cards_dir() -> str:
    """model_cards/ beside the package (a checkout or an editable install), else the copy a wheel
    installs under sys.prefix/share/tensorfold."""
    here = os.path.join(os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))),
                        "model_cards")
    if os.path.isdir(here):
        return here
    return os.path.join(sys.prefix, "share", "tensorfold", "model_cards")


def load_cards(folder: str | None = None) -> dict[str, ModelCard]:
    folder = folder or cards_dir()
    cards = {}
    for name in sorted(os.listdir(folder)):
        if name.endswith(".json"):
            card = _read_card(folder, name)
            cards[card.name] = card
    return cards


def select_card(architecture: str, template: str | None, name: str | None = None,
                cards: dict[str, ModelCard] | None = None) -> ModelCard | None:
    cards = load_cards() if cards is None else cards
    if name is not None:
        if name not in cards:
            raise CardError(f"no model card named {name!r}; the cards are {', '.join(sorted(cards))}")
        return cards[name]
    text = template or ""
    matching = [c for c in cards.values()
                if architecture in c.architectures and all(m in text for m in c.template_markers)]
    matching.sort(key=lambda c: (-len(c.template_markers), c.name))
    return matching[0] if matching else None


def _read_card(folder: str, file: str) -> ModelCard:
    path = os.path.join(folder, file)
    with open(path, encoding="utf-8") as f:
        raw = json.load(f)
    try:
        card = ModelCard(
            name=raw["name"],
            architectures=tuple(raw["architectures"]),
            template_markers=tuple(raw.get("template_markers") or ()),
            template=_read_template(folder, raw.get("template")),
            think=ThinkMarkers(**raw["think"]) if raw.get("think") else None,
            tool_format=raw.get("tool_format"),
            tool_call=ToolCallMarkers(**raw["tool_call"]) if raw.get("tool_call") else None,
            efforts=dict(raw.get("efforts") or {}),
            default_effort=raw.get("default_effort"),
            end_tokens=tuple(raw.get("end_tokens") or ()),
            decode_past_stop=raw.get("decode_past_stop", False),
        )
    except (KeyError, TypeError) as e:
        raise CardError(f"{path}: {e}") from None
    if card.tool_format is not None and (card.tool_format not in TOOL_FORMATS or card.tool_call is None):
        raise CardError(f"{path}: tool_format must be one of {TOOL_FORMATS} with tool_call markers")
    if not isinstance(card.decode_past_stop, bool):
        raise CardError(f"{path}: decode_past_stop must be true or false")
    bad = [e for e in (*card.efforts, card.default_effort) if e is not None and e not in EFFORTS]
    if bad:
        raise CardError(f"{path}: unknown reasoning effort {bad[0]!r}")
    return card


def _read_template(folder: str, file: str | None) -> str | None:
    if not file:
        return None
    with open(os.path.join(folder, "templates", file), encoding="utf-8") as f:
        return f.read()
